"""What starting a store process costs: forked by the fork server, or as its own interpreter.

`ProcessStorage(FileStorage)` is built and closed `--starts` times each way, in alternating order: through
kvfsm.dataplane.storage.fork_server (the default), and with the server switched off (`fork_server.AVAILABLE`
false: `python -c` imports torch and the data plane in every store process). Per start: wall time until the
store answers, and the CPU of this process plus its reaped children (the server's own start is paid once and
counted in the first forked start; a forked store process is reaped by the kernel, so its few milliseconds of
CPU are not in the figure, its wall time is).

    python3 bench/probes/fork_server_probe.py [--starts 8] [--out FILE]
Writes bench/results/quick/fork_server_probe-<machine>.json (or --out).
"""

from __future__ import annotations

import argparse
import functools
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

from common import write_result  # noqa: E402

from kvfsm.dataplane import FileStorage  # noqa: E402
from kvfsm.dataplane.storage import ProcessStorage, fork_server  # noqa: E402


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _start(directory: str, forked: bool) -> tuple[float, float]:
    fork_server.AVAILABLE = forked and fork_server.SUPPORTED
    t0, c0 = time.perf_counter(), _cpu()
    store = ProcessStorage(functools.partial(FileStorage, directory, model_name="m"))
    wall = time.perf_counter() - t0
    store.close()
    return wall, _cpu() - c0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--starts", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    directory = tempfile.mkdtemp(prefix="kvfsm-fork-probe-")
    runs: dict[str, list[tuple[float, float]]] = {"forked": [], "own_interpreter": []}
    try:
        for i in range(args.starts):
            for way in ("forked", "own_interpreter") if i % 2 == 0 else ("own_interpreter", "forked"):
                runs[way].append(_start(directory, way == "forked"))
    finally:
        fork_server.AVAILABLE = fork_server.SUPPORTED
        shutil.rmtree(directory, ignore_errors=True)
    result = {
        way: {
            "starts": len(r),
            "wall_ms_median": round(statistics.median(w for w, _ in r) * 1e3, 1),
            "cpu_ms_median": round(statistics.median(c for _, c in r) * 1e3, 1),
            "first_wall_ms": round(r[0][0] * 1e3, 1),
        }
        for way, r in runs.items()
    }
    result["supported"] = fork_server.SUPPORTED
    for way, r in result.items():
        print(f"{way:16s} {r}")
    print("wrote", write_result("fork_server_probe", {"settings": vars(args), "starts": result}, args.out, quick=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
