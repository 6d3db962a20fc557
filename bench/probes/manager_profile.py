"""Where an iteration of bench/manager_overhead.py spends its time: phase timers and a cProfile table.

A development aid beside the benchmark (its numbers are not results): it runs the benchmark's batched
steady state and prints the mean time of each manager phase (`_submit` includes the CPU copy itself,
which the benchmark subtracts) and the functions with the most own time.

Decision it informed: which phases of an iteration to batch (the generated `<event>_each` batch events,
one host allocation and one copy per offload_batch call).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common
import manager_overhead as bench  # noqa: E402

from kvfsm.generated.decode_offload import DecodeOffloadMachine  # noqa: E402
from kvfsm.runtime import effects, manager  # noqa: E402

PHASES = [
    (manager.DecodeOffloadManager, ("offload_batch", "_submit", "_copy_slots", "check_progress")),
    (DecodeOffloadMachine, ("offload_each", "copy_done_each", "backup_done_each")),
    (
        effects.OffloadEffects,
        (
            "start_copy_each",
            "hash_chunk_each",
            "submit_backup_each",
            "mark_stored_each",
            "free_host_chunk_each",
            "flush",
        ),
    ),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--live", type=int, default=4096)
    ap.add_argument("--config", default="64/64", help="page/stride")
    ap.add_argument("--iterations", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    page, stride = (int(x) for x in args.config.split("/"))
    spent: dict[str, float] = defaultdict(float)
    profile = cProfile.Profile()
    calls = {"n": 0}

    def timed(cls: type, name: str) -> None:
        fn = getattr(cls, name)

        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0

        setattr(cls, name, wrapper)

    for cls, names in PHASES:
        for name in names:
            timed(cls, name)
    outer = manager.DecodeOffloadManager.offload_batch

    def profiled(self, *a):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:  # the admitting call: neither timed nor profiled
            try:
                return outer(self, *a)
            finally:
                spent.clear()
        profile.enable()
        try:
            return outer(self, *a)
        finally:
            profile.disable()

    manager.DecodeOffloadManager.offload_batch = profiled
    progress = manager.DecodeOffloadManager.check_progress

    def profiled_progress(self):  # type: ignore[no-untyped-def]
        if calls["n"] < 2:
            return progress(self)
        profile.enable()
        try:
            return progress(self)
        finally:
            profile.disable()

    manager.DecodeOffloadManager.check_progress = profiled_progress
    row = bench.run(args.live, args.iterations + 1, page, stride, context=256, mode="batch", step_s=0.02)
    n = args.iterations
    print(
        f"mean us/iteration (profiled run; the benchmark's own figure is lower): "
        f"{row['manager_us_per_iteration_mean']:.0f}, chunks/iteration {row['chunks_per_iteration_mean']:.0f}"
    )
    for name, secs in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<16} {secs / n * 1e6:9.1f} us/iteration")
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
