"""What a stored page costs the progress check's index: `put` a page against `put_many` a batch.

The serving loop's regime: the index starts full at its default limit (a million pages, as in a long-running
server, so every new page drops the oldest), and each call stores one iteration's backups, 64 pages (page 64)
or 256 (page 16) of fresh chained hashes. Both forms run interleaved on twin indexes in one process, and the
result is the median over calls, in ns a page.

    python3 bench/probes/stored_index_probe.py [--limit 1048576] [--calls 400] [--out FILE]
Writes bench/results/quick/stored_index_probe-<machine>.json (or --out): a probe, never a verdict.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common
from common import write_result  # noqa: E402

from kvfsm.runtime.stored_index import StoredPageIndex  # noqa: E402


def _hashes(start: int, n: int) -> list[str]:
    return [hashlib.sha256(i.to_bytes(8, "little")).hexdigest() for i in range(start, start + n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--limit", type=int, default=1 << 20)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--pages", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    prefill = _hashes(0, args.limit)
    twins = {"put": StoredPageIndex(args.limit), "put_many": StoredPageIndex(args.limit)}
    for index in twins.values():
        index.put_many(prefill, ["prefill"] * len(prefill), range(len(prefill)))
    rows = []
    fresh = args.limit
    for pages in args.pages:
        spent: dict[str, list[float]] = {name: [] for name in twins}
        for _ in range(args.calls):
            batch = _hashes(fresh, pages)
            fresh += pages
            owners = ["req-7"] * pages
            positions = list(range(0, pages * 16, 16))
            t0 = time.perf_counter()
            put = twins["put"].put
            for h, o, p in zip(batch, owners, positions):
                put(h, o, p)
            t1 = time.perf_counter()
            twins["put_many"].put_many(batch, owners, positions)
            t2 = time.perf_counter()
            spent["put"].append((t1 - t0) / pages * 1e9)
            spent["put_many"].append((t2 - t1) / pages * 1e9)
        assert list(twins["put"]) == list(twins["put_many"])  # the same entries, oldest first
        rows.append({"pages_a_call": pages, "calls": args.calls,
                     **{f"{name}_ns_a_page_median": round(statistics.median(v), 1) for name, v in spent.items()}})
        print(rows[-1])
    write_result("stored_index_probe", {"limit": args.limit, "rows": rows}, quick=True, out=args.out)


if __name__ == "__main__":
    main()
