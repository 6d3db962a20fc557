"""ReqToTokenPool: row alloc/free with typed rejections and no state change."""

from __future__ import annotations

import pytest
import torch
from copy_spy import Copy, CopySpy

from kvfsm.dataplane import DoubleFree, NeverAllocated, NotAllocated, OutOfRange, ReqToTokenPool


def state(p: ReqToTokenPool) -> tuple[int, list[bool], list[int]]:
    return p.free_rows, list(p._allocated), list(p._free)


def test_alloc_until_full_then_none() -> None:
    p = ReqToTokenPool(3, 16)
    rows = [p.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2]  # type: ignore[type-var]
    before = state(p)
    assert p.alloc() is None
    assert state(p) == before
    p.check_conservation()


def test_free_rejections_change_nothing() -> None:
    p = ReqToTokenPool(4, 16)
    r = p.alloc()
    assert r is not None
    p.free(r)
    for bad, exc in ((r, DoubleFree), (3, NeverAllocated), (4, OutOfRange), (-1, OutOfRange), ("0", OutOfRange)):
        before = state(p)
        with pytest.raises(exc):
            p.free(bad)  # type: ignore[arg-type]
        assert state(p) == before
        p.check_conservation()


def test_write_and_read_slots() -> None:
    p = ReqToTokenPool(2, 8)
    r = p.alloc()
    assert r is not None
    p.write(r, 2, torch.tensor([10, 11, 12]))
    assert p.read(r, 2, 5).tolist() == [10, 11, 12]
    assert p.req_to_token.dtype == torch.int64 and p.req_to_token.shape == (2, 8)
    with pytest.raises(OutOfRange):
        p.write(r, 6, torch.tensor([1, 2, 3]))
    with pytest.raises(NotAllocated):
        p.read(1 - r, 0, 1)


def test_a_cpu_table_write_is_one_host_copy_and_pins_nothing() -> None:
    """The CPU twin of the pinned upload (tests/gpu/test_device_placement_gpu.py): on a CPU table the host mirror
    is the table, so a write is one copy from the caller's memory, and nothing is page-locked (that is for
    uploads, and the host's scarce kind)."""
    table = ReqToTokenPool(2, 16)
    row = table.alloc()
    assert row is not None
    with CopySpy() as spy:
        table.write(row, 0, torch.arange(100, 104))
    assert spy.copies == [Copy("cpu", False, "cpu", False)]
    assert table.read(row, 0, 4).tolist() == [100, 101, 102, 103]
