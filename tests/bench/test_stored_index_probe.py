"""bench/probes/stored_index_probe.py --grow: a fresh index filled to its limit, one band of entries per power of
two from 1,024, each with its calls counted and its slowest call no faster than its median."""

from __future__ import annotations


def test_grow_covers_every_band_up_to_the_limit(import_probe) -> None:
    probe = import_probe("stored_index_probe")
    rows = probe.grow_rows(limit=8192, pages=64)
    assert [r["entries_from"] for r in rows] == [1024, 2048, 4096]
    assert [r["calls"] for r in rows] == [16, 32, 64]  # 64 pages a call: a band of 2**k entries takes 2**k / 64
    assert all(r["max_ms"] >= r["median_ms"] > 0 for r in rows)
