"""TokenSlotAllocator: page-aligned alloc, exact frees, typed rejections that change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvfsm.dataplane import (
    ConservationError,
    DoubleAlloc,
    DoubleFree,
    DuplicateIndex,
    NeverAllocated,
    OutOfRange,
    PartialPage,
    SlotError,
    TokenSlotAllocator,
)
from kvfsm.dataplane.pools.allocator import as_index_array


def snap(a: TokenSlotAllocator) -> tuple[list[int], list[bool], int]:
    free, mask = a.snapshot()
    return free.tolist(), mask.tolist(), a.free_slots


def assert_rejected(a: TokenSlotAllocator, exc: type[Exception], indices: object) -> None:
    before = snap(a)
    with pytest.raises(exc):
        a.free(indices)  # type: ignore[arg-type]
    assert snap(a) == before
    a.check_conservation()


def test_alloc_is_page_aligned_and_counts() -> None:
    a = TokenSlotAllocator(64, page_size=4)
    assert a.capacity == 60 and a.free_slots == 60  # page 0 is padding
    x = a.alloc(12)
    assert x is not None and x.dtype == torch.int64 and x.numel() == 12
    assert bool((x.view(-1, 4)[:, 0] % 4 == 0).all())
    assert bool(((x.view(-1, 4) - x.view(-1, 4)[:, :1]) == torch.arange(4)).all())
    assert 0 not in x.tolist()
    assert a.free_slots == 48 and a.allocated_slots == 12
    a.check_conservation()
    a.free(x)
    assert a.free_slots == 60 and a.allocated_slots == 0
    a.check_conservation()


def test_alloc_size_must_be_page_multiple() -> None:
    a = TokenSlotAllocator(32, page_size=8)
    before = snap(a)
    with pytest.raises(ValueError):
        a.alloc(3)
    with pytest.raises(ValueError):
        a.alloc(-8)
    assert snap(a) == before
    assert a.alloc(0) is not None and a.alloc(0).numel() == 0  # type: ignore[union-attr]


def test_alloc_never_partial() -> None:
    a = TokenSlotAllocator(32, page_size=4)  # 7 allocatable pages
    x = a.alloc(24)
    assert x is not None
    before = snap(a)
    assert a.alloc(8) is None
    assert snap(a) == before
    assert a.alloc(4) is not None and a.alloc(4) is None


def test_without_padding_page() -> None:
    a = TokenSlotAllocator(8, page_size=4, reserve_padding_page=False)
    x = a.alloc(8)
    assert x is not None and sorted(x.tolist()) == list(range(8))


def test_free_out_of_order_pages_and_shuffled_indices() -> None:
    a = TokenSlotAllocator(64, page_size=4)
    x = a.alloc(16)
    assert x is not None
    a.free(x[torch.randperm(16)])
    assert a.free_slots == 60
    a.check_conservation()


def test_double_free_rejected_whole_batch() -> None:
    a = TokenSlotAllocator(64, page_size=4)
    x, y = a.alloc(8), a.alloc(8)
    assert x is not None and y is not None
    a.free(x[:4])
    assert_rejected(a, DoubleFree, x[:4])
    assert_rejected(a, DoubleFree, torch.cat([y, x[:4]]))  # valid pages in the batch are not freed either
    assert a.is_allocated(y).all()


def test_never_allocated_rejected() -> None:
    a = TokenSlotAllocator(64, page_size=4)
    a.alloc(8)
    assert_rejected(a, NeverAllocated, torch.arange(40, 44))
    assert_rejected(a, NeverAllocated, torch.arange(0, 4))  # the padding page


def test_duplicate_index_rejected() -> None:
    a = TokenSlotAllocator(64, page_size=1)
    x = a.alloc(4)
    assert x is not None
    assert_rejected(a, DuplicateIndex, torch.tensor([x[0], x[1], x[0]]))
    b = TokenSlotAllocator(64, page_size=4)
    y = b.alloc(8)
    assert y is not None
    assert_rejected(b, DuplicateIndex, torch.cat([y[:4], y[:4]]))


def test_partial_page_rejected() -> None:
    a = TokenSlotAllocator(64, page_size=4)
    x = a.alloc(8)
    assert x is not None
    assert_rejected(a, PartialPage, x[:3])
    assert_rejected(a, PartialPage, x[2:6])  # right length, straddles two pages (B11)
    assert_rejected(a, PartialPage, torch.cat([x[:2], x[4:6]]))


def test_out_of_range_and_bad_dtype_rejected() -> None:
    a = TokenSlotAllocator(16, page_size=4)
    a.alloc(4)
    assert_rejected(a, OutOfRange, torch.arange(16, 20))
    assert_rejected(a, OutOfRange, torch.tensor([-4, -3, -2, -1]))
    assert_rejected(a, OutOfRange, torch.tensor([4.0, 5.0, 6.0, 7.0]))


def test_errors_are_slot_errors() -> None:
    for e in (DoubleFree, NeverAllocated, DuplicateIndex, PartialPage, OutOfRange, DoubleAlloc):
        assert issubclass(e, SlotError)


def test_conservation_detects_tampering_and_double_alloc_rejected() -> None:
    a = TokenSlotAllocator(32, page_size=4)
    x = a.alloc(4)
    assert x is not None
    page = x[:1] // 4
    a._free_pages.appendleft(int(page))  # corrupt: an owned page back in the free list
    with pytest.raises(ConservationError):
        a.check_conservation()
    before = snap(a)
    with pytest.raises(DoubleAlloc):
        a.alloc(4)
    assert snap(a) == before
    for k in (1, 2):  # by page id: one page (its own path) and several, the free list left as it was
        with pytest.raises(DoubleAlloc):
            a.alloc_pages(k)
        assert snap(a) == before


def test_empty_free_is_noop() -> None:
    a = TokenSlotAllocator(16, page_size=4)
    before = snap(a)
    a.free(torch.empty(0, dtype=torch.int64))
    a.free([])
    assert snap(a) == before


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6), st.integers(0, 10**6)), max_size=40),
)
def test_random_sequences_match_a_model(page_size: int, ops: list[tuple[bool, int, int]]) -> None:
    """Against a set model: allocations never overlap, frees are exact, counts always conserve."""
    a = TokenSlotAllocator(16 * page_size, page_size=page_size)
    owned: list[torch.Tensor] = []
    model_free = a.capacity
    for is_alloc, pages, pick in ops:
        if is_alloc or not owned:
            x = a.alloc(pages * page_size)
            if pages * page_size > model_free:
                assert x is None
            else:
                assert x is not None and x.numel() == pages * page_size
                live = torch.cat(owned) if owned else torch.empty(0, dtype=torch.int64)
                assert not bool(torch.isin(x, live).any())
                if x.numel():
                    owned.append(x)
                model_free -= x.numel()
        else:
            x = owned.pop(pick % len(owned))
            a.free(x)
            model_free += x.numel()
            with pytest.raises(DoubleFree):
                a.free(x)
        assert a.free_slots == model_free
        a.check_conservation()


def test_undo_alloc_restores_the_free_list_exactly() -> None:
    a = TokenSlotAllocator(64, page_size=4)
    a.alloc(8)  # pages the undo must not touch
    before = [t.tolist() for t in a.snapshot()]
    x, y = a.alloc(4), a.alloc(8)
    a.undo_alloc(torch.cat([x, y]))
    assert [t.tolist() for t in a.snapshot()] == before
    with pytest.raises(DoubleFree):
        a.undo_alloc(x)  # already given back: rejected, nothing changes
    assert [t.tolist() for t in a.snapshot()] == before


def test_page_api_matches_slots_and_rejects_like_free() -> None:
    a = TokenSlotAllocator(64, page_size=4)
    pages = a.alloc_pages(3)
    assert pages is not None and len(pages) == 3 and a.free_slots == a.capacity - 12
    assert a.slots_of(pages).tolist() == [p * 4 + i for p in pages for i in range(4)]
    assert a.alloc_pages(100) is None
    before = snap(a)
    # each rejection names the same typed error the slot path raises, and changes nothing
    for bad, exc in [
        ([pages[0], pages[0]], DuplicateIndex),
        ([0], NeverAllocated),
        ([15], NeverAllocated),
        ([16], OutOfRange),
        ([-1], OutOfRange),
        ([pages[0], 14], NeverAllocated),
    ]:
        with pytest.raises(exc):
            a.free_pages(bad)
        assert snap(a) == before
    for bad in ([float(pages[0])], [pages[0], "x"]):
        with pytest.raises(OutOfRange):
            a.free_pages(bad)  # type: ignore[list-item]
        assert snap(a) == before
    with pytest.raises(ValueError):
        a.alloc_pages(1.5)  # type: ignore[arg-type]
    a.free_pages(pages[:2])
    with pytest.raises(DoubleFree):
        a.free_pages(pages[1:])  # pages[1] already free: the whole batch is refused
    a.free_pages(pages[2:])
    assert a.free_slots == a.capacity
    a.check_conservation()


def test_whole_page_fast_path_falls_back_to_the_exact_checks() -> None:
    """Batches that look like whole pages in order but are not valid go through the sorting path."""
    a = TokenSlotAllocator(64, page_size=4)
    x = a.alloc(8)
    assert x is not None and a.pages_of(x.numpy()) is not None
    assert a.pages_of(torch.cat([x[:4], x[:4]]).numpy()) is None  # a page twice
    assert a.pages_of((x + 1).numpy()) is None  # not page aligned
    assert_rejected(a, DuplicateIndex, torch.cat([x[:4], x[:4]]))
    assert_rejected(a, PartialPage, x[:6])
    a.free(x[:4])
    assert_rejected(a, DoubleFree, x)  # whole pages in order, one already free
    a.free(x[4:].flip(0))  # whole pages, shuffled within the page: the exact path accepts it
    assert a.free_slots == a.capacity


def test_counts_and_page_methods_do_not_collide() -> None:
    a = TokenSlotAllocator(32, page_size=4)
    pages = a.alloc_pages(2)
    assert pages is not None and a.free_page_count == 5 and a.free_slots == 20
    a.free_pages(pages)
    assert a.free_page_count == 7


def test_an_int64_array_is_taken_as_it_is_and_any_other_index_is_checked() -> None:
    """as_index_array: an int64 array (what a release reads from the table's host mirror) flattened, no copy;
    anything else through as_index_tensor's checks. free gives the same answers either way."""
    a = TokenSlotAllocator(64, page_size=4)
    x = a.alloc(8)
    assert x is not None
    arr = x.numpy().copy()
    assert np.shares_memory(as_index_array(arr), arr) and as_index_array(arr.reshape(2, 4)).shape == (8,)
    assert as_index_array(arr.astype(np.int32)).dtype == np.int64 and as_index_array([3, 1]).tolist() == [3, 1]
    with pytest.raises(OutOfRange):
        as_index_array(arr.astype(np.float64))
    assert_rejected(a, OutOfRange, arr.astype(np.float64))
    assert_rejected(a, OutOfRange, np.arange(60, 68, dtype=np.int64))
    assert_rejected(a, PartialPage, arr[:6])
    assert_rejected(a, NeverAllocated, np.arange(40, 44, dtype=np.int64))
    a.free(arr.reshape(2, 4))
    assert a.free_slots == a.capacity
    assert_rejected(a, DoubleFree, arr)
    y = a.alloc(4)
    assert y is not None
    assert a.is_allocated(y.numpy()).all() and not a.is_allocated(arr[4:]).any()
    a.undo_alloc(y.numpy())
    assert a.free_slots == a.capacity
    a.check_conservation()
