"""bench/bare_backup.py's floor does the backing-up work kvfsm does: on the same workload it stores the same
pages under the same keys at the same positions, and leaks nothing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _stored(algo: str, tmp_path: Path) -> tuple[dict[str, int], dict[str, Any]]:
    sys.path.insert(0, str(BENCH))
    try:
        import serving_loop
    finally:
        sys.path.remove(str(BENCH))
    loop = serving_loop.ServingLoop(
        algo,
        24,
        16,
        16,
        1,
        "cpu",
        "cpu",
        1.0,
        tmp_path / algo,
        0.0625,
        seed=3,
        prompt=(8, 70),
        output=(8, 60),
        store_kind="file",
        store_writers=1,
    )
    loop.run(warmup=5, iterations=60, prefill_index=0)
    teardown = loop.teardown()
    index = loop.manager.fx.stored if algo == "kvfsm" else loop.manager.stored
    return {h: index[h][1] for h in index}, teardown


def test_the_backup_floor_stores_what_kvfsm_stores(tmp_path: Path) -> None:
    kvfsm, _ = _stored("kvfsm", tmp_path)
    floor, teardown = _stored("bare-backup", tmp_path)
    assert len(kvfsm) > 50
    assert floor == kvfsm  # the same chained keys, at the same token positions
    assert teardown["device_slots_leaked"] == 0 and teardown["host_slots_leaked"] == 0
    stored = {p.name for p in (tmp_path / "bare-backup").rglob("*") if p.is_file()}
    assert len(stored) >= len(floor)  # the store holds a file a page (and its own bookkeeping)
