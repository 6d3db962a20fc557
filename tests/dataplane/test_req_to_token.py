"""ReqToTokenPool: row alloc/free with typed rejections and no state change."""

from __future__ import annotations

import pytest
import torch

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
