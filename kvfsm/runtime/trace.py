"""The transition trace: one JSON line per accepted event, the input of `kvfsm replay` and audits."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any, Optional


class TraceWriter:
    def __init__(self, path: str | Path, spec_sha256: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: Optional[IO[str]] = self.path.open("w", buffering=1 << 16)
        self.write({"kind": "header", "spec_sha256": spec_sha256})

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def transition(
        self,
        request: str,
        event: str,
        src: str,
        dst: str,
        tid: int,
        counters: dict[str, int],
        acquired: tuple[str, ...],
        released: tuple[str, ...],
    ) -> None:
        self.write(
            {
                "t": time.time(),
                "req": request,
                "event": event,
                "from": src,
                "to": dst,
                "transition": tid,
                "counters": counters,
                "acquired": list(acquired),
                "released": list(released),
            }
        )

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
