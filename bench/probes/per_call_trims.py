"""What three per-call paths of the offload hot path cost, each beside the form it replaced, in one run.

- A `RequestView` field an offload reads for every request it looks at (`origin_input_ids`), against one still
  read through the view's `req` property (`rid`): one Python call a read against two.
- `TokenSlotAllocator.alloc_pages(1)`, the SGLang adapter's per-due-call host page at a page's stride, against
  `alloc_pages(2)`, the general path.
- `offload_batch`'s pick: indexing the batch's requests by the picked rows as a list of ints, against the
  numpy scalars of the `flatnonzero` array itself (278 of 4096 rows).

Run it with another tree first on PYTHONPATH to time that tree's kvfsm (the before of a change).

    python bench/probes/per_call_trims.py [--repeats 7] [--number 200000] [--out FILE]
Writes bench/results/quick/per_call_trims-<machine>.json (or --out): a CPU probe, never a verdict.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import write_result  # noqa: E402

import kvfsm  # noqa: E402
from kvfsm.dataplane.pools.allocator import TokenSlotAllocator  # noqa: E402
from kvfsm.integrations.sglang.objects import RequestView  # noqa: E402


class _Req:
    """Just what a view reads: the fields, and a weak reference."""

    def __init__(self) -> None:
        self.rid, self.origin_input_ids = "r", [1] * 64


def _ns(stmt, number: int, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """The median over `repeats` of the time one call of `stmt` takes, in ns."""
    return statistics.median(timeit.repeat(stmt, number=number, repeat=repeats)) / number * 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--number", type=int, default=200_000, help="calls a repeat of each single-call figure times")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    n = args.number
    req = _Req()
    view = RequestView(req)
    alloc = TokenSlotAllocator(16 * (args.repeats + 1) * 3 * n, page_size=16)
    reqs = [object() for _ in range(4096)]
    picked = np.flatnonzero(np.random.default_rng(0).random(4096) < 278 / 4096)
    as_ints = picked.tolist()

    def by_scalars() -> None:
        for i in picked:
            reqs[i]

    def by_ints() -> None:
        for i in as_ints:
            reqs[i]

    row = {
        "kvfsm": str(Path(kvfsm.__file__).parent),
        "view_field_ns": _ns(lambda: view.origin_input_ids, n, args.repeats),
        "view_field_through_req_ns": _ns(lambda: view.rid, n, args.repeats),
        "alloc_pages_1_ns": _ns(lambda: alloc.alloc_pages(1), n, args.repeats),
        "alloc_pages_2_ns": _ns(lambda: alloc.alloc_pages(2), n, args.repeats),
        "picked_rows": len(as_ints),
        "pick_by_numpy_scalars_us": _ns(by_scalars, 2000, args.repeats) / 1e3,
        "pick_by_ints_us": _ns(by_ints, 2000, args.repeats) / 1e3,
    }
    for k, v in row.items():
        print(f"{k:28s} {v:.1f}" if isinstance(v, float) else f"{k:28s} {v}")
    print("wrote", write_result("per_call_trims", {"settings": vars(args), "rows": [row]}, args.out, quick=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
