"""What one call costs when a simulated decode step has just left the CPU caches cold (the manager's regime).

bench/manager_overhead.py times the manager right after a 20 ms simulated step. On the machines measured
here, any operation's first run after such a step costs many times its warm cost: the step evicts the
code and data it touches. This probe measures that directly, one primitive at a time: each sample
sleeps `--step-ms`, touches `--live` request-like objects (as the benchmark's step does), then times the
primitive's first run and, right after, its second (warm) run. The median over `--samples` is reported.

The primitives are the building blocks of the manager's hot path (numpy and torch calls on batch-sized
arrays, Python list, dict and object work on 64 items), so the result says which of them a budget of a
few hundred microseconds per iteration can afford.

Decision it informed: the hot path works on batch arrays and page lists with as few numpy and torch
calls as it can (each costs tens of microseconds cold), and bench/serving_loop.py measures the floor
of any manager (bench/bare_offload.py) in the same regime before a per-iteration budget is judged.
"""

from __future__ import annotations

import argparse
import array
import collections
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common
from common import write_result  # noqa: E402


class _Req:
    __slots__ = ("rid", "row", "committed", "output_ids")

    def __init__(self, i: int) -> None:
        self.rid, self.row, self.committed, self.output_ids = f"r{i}", i, 128 + i % 64, list(range(i % 64))


class _Item:
    __slots__ = ("a", "b", "c", "d")

    def __init__(self, a: int, b: int) -> None:
        self.a, self.b, self.c, self.d = a, b, None, 0


def primitives(live: int, chunks: int, page: int) -> dict[str, Callable[[], object]]:
    """name -> a zero-argument call; sizes as in the benchmark's 64/64 configuration."""
    rng = np.random.default_rng(0)
    rows = rng.permutation(live).astype(np.int64)
    due_at = np.full(live + 1, 1 << 40, dtype=np.int64)
    committed = np.arange(live, dtype=np.int64) + 128
    table = torch.arange(live * 256, dtype=torch.int64).reshape(live, 256)
    flat = table.numpy().reshape(-1)
    starts = [int(x) for x in rng.choice(live * 4, chunks, replace=False) * page]
    offsets = np.arange(page, dtype=np.int64)
    slots = np.add.outer(starts, offsets).reshape(-1)
    slots_t = torch.from_numpy(slots)
    firsts = [int(r) * 256 for r in rows[:chunks]]
    table_array = array.array("q", flat[: live * 4].tolist())
    items = [_Item(i, i * page) for i in range(chunks)]
    index = {i: items[i] for i in range(chunks)}
    ordered: collections.OrderedDict[str, int] = collections.OrderedDict()
    keys = [f"{i:064x}" for i in range(chunks)]

    def py_items() -> None:
        for k in range(chunks):
            it = index.get(k)
            it.c = it.a + it.b
            it.d += 1

    def py_objects() -> None:
        [_Item(i, i) for i in range(chunks)]

    def py_deque() -> None:
        q: collections.deque[_Item] = collections.deque()
        q.extend(items)
        while q:
            q.popleft()

    def py_ordered_dict() -> None:
        for k in keys:
            ordered[k] = 1
        while len(ordered) > 1 << 20:
            ordered.popitem(last=False)

    def memoryview_numpy() -> None:
        mv = memoryview(flat)
        out: list[int] = []
        for f in firsts:
            out += mv[f : f + page : page]

    def memoryview_array() -> None:
        mv = memoryview(table_array)
        out: list[int] = []
        for f in starts:
            out += mv[f // page : f // page + 1]

    return {
        "np_min_4096": lambda: rows.min(),
        "np_gather_4096": lambda: due_at[rows],
        "np_ge_flatnonzero_4096": lambda: np.flatnonzero(committed >= committed),
        "np_tolist_64": lambda: rows[:chunks].tolist(),
        "np_add_outer_list": lambda: np.add.outer(starts, offsets),
        "np_gather_4096_slots": lambda: flat[slots],
        "torch_from_numpy": lambda: torch.from_numpy(slots),
        "torch_numel_dtype": lambda: (slots_t.numel(), slots_t.dtype, slots_t.device),
        "torch_index_select_4096": lambda: table.view(-1).index_select(0, slots_t),
        "memoryview_numpy_64": memoryview_numpy,
        "memoryview_array_64": memoryview_array,
        "py_items_64": py_items,
        "py_objects_64": py_objects,
        "py_deque_64": py_deque,
        "py_ordered_dict_64": py_ordered_dict,
        "py_list_4096": lambda: [x + 1 for x in range(live)],
        "perf_counter_pair": lambda: None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--live", type=int, default=4096)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--samples", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    calls = primitives(args.live, args.chunks, args.page)
    reqs = [_Req(i) for i in range(args.live)]
    rows = []
    for name, call in calls.items():
        cold, warm = [], []
        for it in range(args.samples):
            time.sleep(args.step_ms / 1e3)
            for r in reqs:  # the step's result, as in manager_overhead.py
                r.committed += 1
                r.output_ids.append(it)
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            call()
            t2 = time.perf_counter()
            cold.append(t1 - t0)
            warm.append(t2 - t1)
        row = {
            "primitive": name,
            "cold_us_median": statistics.median(cold) * 1e6,
            "warm_us_median": statistics.median(warm) * 1e6,
        }
        row["cold_over_warm"] = row["cold_us_median"] / max(row["warm_us_median"], 1e-3)
        print(f"{name:26s} cold {row['cold_us_median']:8.1f} us   warm {row['warm_us_median']:7.1f} us", flush=True)
        rows.append(row)
    path = write_result(
        "cold_call_probe",
        {
            "step_ms": args.step_ms,
            "live": args.live,
            "chunks": args.chunks,
            "page": args.page,
            "samples": args.samples,
            "rows": rows,
        },
        args.out,
    )
    print(f"-> {path}")


if __name__ == "__main__":
    main()
