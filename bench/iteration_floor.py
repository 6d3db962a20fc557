"""The least work one scheduler iteration of bench/manager_overhead.py's benchmark can do, timed in its cold regime.

bench/manager_overhead.py times kvfsm's manager right after a simulated 20 ms decode step. This script
times, in the same regime, a bare iteration with no kvfsm code, no checks and no lifecycle machines:
only what any offload manager must do at 4096 live requests, page 64 and stride 64:

  select   one numpy pass over the engine's batch arrays for requests with a whole stride due;
  submit   per due request: read its lengths, advance its offloaded length, queue a chunk record;
           one index tensor each for the device and host slots of all due chunks (what a copy engine
           is handed);
  progress per chunk whose copy completed: hand it to a backup thread (one wake-up); per chunk whose
           backup completed: free its host pages (one list extend).

Whatever kvfsm adds on top (spec transitions, validation, checked-mode hooks, hashing links, metrics) is
the difference between the two benchmarks. If the bare floor alone approaches the budget, the budget is
a property of the interpreter and the machine, not of kvfsm's design.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402


class Req:
    __slots__ = ("row", "prompt_len", "output_ids", "committed", "offloaded")

    def __init__(self, row: int, decoded: int) -> None:
        self.row, self.prompt_len, self.output_ids = row, 128, list(range(decoded))
        self.committed = 128 + decoded - 1
        self.offloaded = 128


def run(live: int, iterations: int, page: int, stride: int, step_s: float, step_wait: str) -> dict:
    width = 256 + iterations + stride
    table = np.arange(live * width, dtype=np.int64).reshape(live, width) * 1  # any paged layout will do
    table_flat = table.reshape(-1)
    offsets = np.arange(page, dtype=np.int64)
    reqs = [Req(i, 1 + i % stride) for i in range(live)]
    rows = np.array([r.row for r in reqs], dtype=np.int64)
    committed = np.array([r.committed for r in reqs], dtype=np.int64)
    due_at = np.array([r.offloaded + stride for r in reqs], dtype=np.int64)
    free_pages = collections.deque(range(1, live * 64))
    copies: collections.deque = collections.deque()
    backups_todo: collections.deque = collections.deque()
    backups_done: collections.deque = collections.deque()
    wake = threading.Condition()

    def backup_thread() -> None:
        while True:
            with wake:
                while not backups_todo:
                    wake.wait()
                while backups_todo:
                    backups_done.append(backups_todo.popleft())

    threading.Thread(target=backup_thread, daemon=True).start()
    times, chunks_per = [], []
    for it in range(iterations):
        if step_wait == "spin":
            until = time.perf_counter() + step_s
            while time.perf_counter() < until:
                pass
        else:
            time.sleep(step_s)
        for r in reqs:  # the step's result (not timed)
            r.committed += 1
            r.output_ids.append(it)
        committed += 1
        t0 = time.perf_counter()
        # select
        picked = np.flatnonzero(committed >= due_at[rows])
        # submit
        due, positions, host = [], [], []
        for i in picked:
            r = reqs[i]
            start = r.offloaded
            n = (min(r.prompt_len + len(r.output_ids) - 1, r.committed) - start) // stride * stride
            if n <= 0:
                continue
            first = r.row * width + start
            positions += range(first, first + n, page)
            pages = [free_pages.popleft() for _ in range(n // page)]
            host += pages
            r.offloaded = start + n
            due.append((r, start, n, pages))
        if due:
            starts = np.add.outer(positions, offsets).reshape(-1)
            device_idx = torch.from_numpy(table_flat[starts])
            host_idx = torch.from_numpy(np.add.outer([p * page for p in host], offsets).reshape(-1))
            due_at[[r.row for r, _, _, _ in due]] = [r.offloaded + stride for r, _, _, _ in due]
            copies.extend((r, start, n, pages, device_idx, host_idx) for r, start, n, pages in due)
        # progress: last iteration's copies completed (they ran during the step); backups that finished
        n_backups = len(backups_done)
        for _ in range(n_backups):
            pages = backups_done.popleft()[3]
            free_pages.extend(pages)
        done = [copies.popleft() for _ in range(len(copies) - len(due))]
        if done:
            backups_todo.extend(done)
            with wake:
                wake.notify()
        times.append(time.perf_counter() - t0)
        chunks_per.append(len(due))
    times, chunks_per = times[2:], chunks_per[2:]  # the first iterations fill the pipeline
    return {
        "live_requests": live,
        "page_size": page,
        "stride": stride,
        "step_wait": step_wait,
        "iterations": len(times),
        "chunks_per_iteration_mean": sum(chunks_per) / len(chunks_per),
        "floor_us_per_iteration_mean": statistics.fmean(times) * 1e6,
        "floor_us_per_iteration_median": statistics.median(times) * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--live", type=int, default=4096)
    ap.add_argument("--iterations", type=int, default=62)
    ap.add_argument("--configs", nargs="+", default=["64/64", "16/64", "16/16"])
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--step-waits", nargs="+", choices=["sleep", "spin"], default=["sleep", "spin"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for cfg in args.configs:
        page, stride = (int(x) for x in cfg.split("/"))
        for wait in args.step_waits:
            row = run(args.live, args.iterations, page, stride, args.step_ms / 1e3, wait)
            print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
            rows.append(row)
    print(f"-> {write_result('iteration_floor', {'runs': rows, 'step_ms': args.step_ms}, args.out)}")


if __name__ == "__main__":
    main()
