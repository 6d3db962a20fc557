"""Helpers every benchmark shares: where results go and which machine produced them."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """Identify the machine a result came from (CPU model, cores, GPU when present)."""
    info: dict[str, Any] = {"hostname": socket.gethostname(), "platform": platform.platform(),
                            "python": platform.python_version(), "cpu_count": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def write_result(name: str, payload: dict[str, Any], out: str | Path | None = None) -> Path:
    """Write `payload` plus machine info and a UTC timestamp as JSON; return the path."""
    tag = machine().get("gpu", "cpu").replace(" ", "-").lower()
    path = Path(out) if out else RESULTS / f"{name}-{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "machine": machine(),
           "utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **payload}
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path
