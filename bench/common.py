"""Helpers every benchmark shares: where results go, which machine produced them, and what one full
collection of the heap costs.

`result_path` is the one answer to "where does a run's JSON go": a recorded run writes
bench/results/<name>-<machine>.json (committed); a quick run (`--quick`, "checks the script, not the
numbers") writes bench/results/quick/<name>-quick-<machine>.json, which git ignores, so a quick run
never overwrites a recorded result. `--out` overrides both. Quick JSON carries `"quick": true`, and
bench/plots.py refuses to render it into docs/.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import os
import platform
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
# Which threads a cProfile table covers. From Python 3.12 cProfile runs on sys.monitoring, whose events fire in
# every thread: a profile taken around the scheduler's calls then also holds what the backup worker and the
# store's threads ran meanwhile (hashing, file writes), which is not the scheduler thread's time.
PROFILED_THREADS = (
    "every thread (Python >= 3.12: cProfile runs on sys.monitoring)"
    if sys.version_info >= (3, 12)
    else "the profiling thread only"
)
QUICK = RESULTS / "quick"  # git-ignored: quick runs and their plots


def machine() -> dict[str, Any]:
    """Identify the machine a result came from (CPU model, cores, GPU when present)."""
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
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


def machine_tag() -> str:
    """The machine part of a result file's name: the GPU's name, or `cpu`."""
    return machine().get("gpu", "cpu").replace(" ", "-").lower()


def result_path(name: str, tag: str | None = None, *, quick: bool = False, out: str | Path | None = None) -> Path:
    """Where a run's JSON goes: `out` when given, else bench/results/quick/<name>-quick-<tag>.json for a
    quick run, else bench/results/<name>-<tag>.json (tag: `machine_tag()` unless a script names its own)."""
    if out:
        return Path(out)
    tag = tag or machine_tag()
    return QUICK / f"{name}-quick-{tag}.json" if quick else RESULTS / f"{name}-{tag}.json"


def write_result(
    name: str, payload: dict[str, Any], out: str | Path | None = None, *, quick: bool = False, tag: str | None = None
) -> Path:
    """Write `payload` plus machine info, a UTC timestamp and the quick flag as JSON; return the path."""
    path = result_path(name, tag, quick=quick, out=out)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "machine": machine(),
        "quick": bool(quick),
        "utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **payload,
    }
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


def target(name: str, value: float | None, limit: float, *, at_least: bool = False) -> dict[str, Any]:
    """One entry of a verdict JSON's `targets` list: the figure, its limit and whether it is met. A limit is a
    ceiling (met when value <= limit), or with `at_least` a floor, and then the name ends in "(at least)"."""
    if at_least and not name.endswith("(at least)"):
        raise ValueError(f"a floor's name ends in '(at least)': {name!r}")
    met = value is not None and (value >= limit if at_least else value <= limit)
    return {"name": name, "value": value, "limit": limit, "met": met}


def full_collection_ms(repeats: int, pick: Callable[[list[float]], float] = min) -> float:
    """A full collection of the heap as it stands, timed `repeats` times: `pick` of the times (the fastest by
    default), in ms."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect(2)
        times.append((time.perf_counter() - t0) * 1e3)
    return pick(times)
