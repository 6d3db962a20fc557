"""How many collector-tracked objects each manager call leaves behind: what brings the next collection on.

CPython starts a young-generation collection once the tracked objects allocated and not yet freed since the
last one pass 700, every tenth of those also collects the middle generation, and objects that live through
both are walked again by every full collection. So what a call leaves behind, not what it allocates and
frees again, sets how often the scheduler thread pays for a collection. bench/sglang_adapter_gpu.py's loop
(one mode, one configuration) runs with the collector paused around each timed call only, and the count of
gen0 (`gc.get_count()[0]`) after the call less before it is that call's net.

    python3 bench/probes/tracked_per_call.py [--mode batch] [--live 4096] [--page 16] [--out FILE]
Writes bench/results/quick/tracked_per_call-<machine>.json (or --out).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

import sglang_adapter_gpu as bench  # noqa: E402
from common import write_result  # noqa: E402

CALLS = {
    "adapter": ("adapter", ("offload_kv_cache", "check_offload_progress", "finalize_release_on_finish")),
    "batch": ("manager", ("offload_batch", "check_progress", "finalize")),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="batch", choices=sorted(CALLS))
    ap.add_argument("--live", type=int, default=4096)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    store = tempfile.mkdtemp(prefix="kvfsm-tracked-")
    counts: dict[str, list[int]] = {}  # per call name: its net count in each timed iteration
    timed = [False]  # only the timed iterations' calls count (not set-up, warm-up or teardown)
    try:
        loop = bench.probe_loop(args.mode, args.live, args.page, args.device, store)
        owner_name, names = CALLS[args.mode]
        owner = getattr(loop, owner_name)
        for name in names:
            setattr(owner, name, _counted(getattr(owner, name), counts.setdefault(name, []), timed))

        def new_iteration() -> None:
            for seen in counts.values():
                seen.append(0)

        bench.run_marked(loop, args.warmup, args.iterations, timed, new_iteration)
        loop.close()
    finally:
        shutil.rmtree(store, ignore_errors=True)
    per_iteration = {}
    for name, seen in counts.items():
        per_iteration[name] = {
            "net_tracked_per_iteration_mean": round(statistics.fmean(seen), 1),
            "median": statistics.median(seen),
        }
        print(f"{name:28s} {per_iteration[name]}")
    print(
        "wrote",
        write_result(
            "tracked_per_call", {"settings": vars(args), "per_iteration": per_iteration}, args.out, quick=True
        ),
    )
    return 0


def _counted(call: Callable[..., Any], into: list[int], timed: list[bool]) -> Callable[..., Any]:
    """`call` with the collector paused around it; in a timed iteration its net adds to that iteration's."""

    def counted(*a: Any, **k: Any) -> Any:
        was = gc.isenabled()
        gc.disable()
        before = gc.get_count()[0]
        try:
            return call(*a, **k)
        finally:
            if timed[0]:
                into[-1] += gc.get_count()[0] - before
            if was:
                gc.enable()

    return counted


if __name__ == "__main__":
    raise SystemExit(main())
