"""What a stored page costs the progress check's index: `put` a page against `put_many` a batch.

The serving loop's regime: the index starts full at its default limit (a million pages, as in a long-running
server, so every new page drops the oldest), and each call stores one iteration's backups, 64 pages (page 64)
or 256 (page 16) of fresh chained hashes. Both forms run interleaved on twin indexes in one process, and the
result is the median over calls, in ns a page.

    python3 bench/probes/stored_index_probe.py [--limit 1048576] [--calls 400] [--out FILE]
    python3 bench/probes/stored_index_probe.py --grow     # a fresh index filled: the slowest call per band, in ms

`--grow` fills a fresh index instead, a call at a time, and gives per band of entries (1,024-2,047, 2,048-4,095, ...) the
slowest call and the median one: the slowest is what a serving loop pays, on the scheduler thread, where its index
grows past a power of two.
Writes bench/results/quick/stored_index_probe-<machine>.json (stored_index_grow_probe-<machine>.json with --grow; or
--out): a probe, never a verdict.
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


def grow_rows(limit: int, pages: int) -> list[dict]:
    """A fresh index filled to `limit` by calls of `pages` fresh pages: per band of entries [2**k, 2**(k+1)), the
    slowest call and the median one, in ms (the slowest is a call in which the index's ring or its dict grew)."""
    index = StoredPageIndex(limit)
    bands: dict[int, list[float]] = {}
    for fresh in range(0, limit, pages):
        batch = _hashes(fresh, pages)
        t0 = time.perf_counter()
        index.put_many(batch, ["req-7"] * pages, range(pages))
        bands.setdefault(max(len(batch), fresh).bit_length() - 1, []).append((time.perf_counter() - t0) * 1e3)
    rows = [
        {
            "entries_from": 1 << k,
            "calls": len(v),
            "max_ms": round(max(v), 3),
            "median_ms": round(statistics.median(v), 3),
        }
        for k, v in sorted(bands.items())
        if 1 << k >= 1024
    ]
    for row in rows:
        print(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--limit", type=int, default=1 << 20)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--pages", type=int, nargs="+", default=[64, 256])
    ap.add_argument(
        "--grow", action="store_true", help="fill a fresh index instead: the slowest call per band of entries"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.grow:
        write_result(
            "stored_index_grow_probe",
            {"limit": args.limit, "pages_a_call": args.pages[-1], "rows": grow_rows(args.limit, args.pages[-1])},
            quick=True,
            out=args.out,
        )
        return
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
        rows.append(
            {
                "pages_a_call": pages,
                "calls": args.calls,
                **{f"{name}_ns_a_page_median": round(statistics.median(v), 1) for name, v in spent.items()},
            }
        )
        print(rows[-1])
    write_result("stored_index_probe", {"limit": args.limit, "rows": rows}, quick=True, out=args.out)


if __name__ == "__main__":
    main()
