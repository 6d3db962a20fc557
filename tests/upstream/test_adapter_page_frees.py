"""A release on a table with no host mirror hands SGLang's paged allocator page ids (`AllocatorView.free_page_ids`)
instead of slots: the same pages come back as `free_segment` of their slots gives back, and only where that is
what the allocator's `free_segment` does. Whole lifecycles through this path are compared with upstream in
tests/upstream/test_differential.py (`test_adapter_reading_slots_on_the_device_matches_upstream`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import harness
from scenarios import SCENARIOS

from kvfsm.integrations.sglang.objects import AllocatorView


def _paged() -> tuple[Any, Any]:
    sc = next(s for s in SCENARIOS if s.page_size > 1 and s.pool == "mha")
    _, kv, allocator = harness.build_pools(sc)
    return kv, allocator


def _free_pages(allocator: Any) -> list[int]:
    staged = allocator.release_pages
    return sorted(allocator.free_pages.tolist() + ([] if staged is None else staged.tolist()))


def test_page_ids_free_what_free_segment_of_their_slots_frees() -> None:
    (kv, by_slots), (_, by_ids) = _paged(), _paged()
    ps = int(by_slots.page_size)
    view = AllocatorView(by_ids, int(kv.size))
    assert view.frees_page_ids
    for n in (1, 3, 7):
        slots, again = by_slots.alloc(n * ps), by_ids.alloc(n * ps)
        assert slots is not None and again is not None and torch.equal(slots, again)
        by_slots.free_segment(slots, start_pos=0)
        view.free_page_ids(again[::ps] // ps)
        assert _free_pages(by_ids) == _free_pages(by_slots)
        assert by_ids.free_pages.dtype == by_slots.free_pages.dtype == torch.int64


def test_only_the_paged_allocators_own_free_segment_takes_page_ids() -> None:
    kv, allocator = _paged()
    allocator.debug_mode = True  # SGLANG_DEBUG_MEMORY_POOL: free_segment's own checks must run
    assert not AllocatorView(allocator, int(kv.size)).frees_page_ids

    class Interleaved(type(allocator)):  # type: ignore[misc]
        def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:  # another page layout
            raise AssertionError("not called")

    _, other = _paged()
    other.__class__ = Interleaved
    assert not AllocatorView(other, int(kv.size)).frees_page_ids
    # an allocator with no free_segment at all, and the paged one with no debug_mode to say its checks are off
    assert not AllocatorView(SimpleNamespace(page_size=16, debug_mode=False), 64).frees_page_ids
    _, unsaid = _paged()
    del unsaid.debug_mode
    assert not hasattr(unsaid, "debug_mode") and not AllocatorView(unsaid, int(kv.size)).frees_page_ids


class _Fence:
    """A fence whose copies have or have not passed; counts the waits made on it."""

    def __init__(self, passed: bool) -> None:
        self._passed, self.waits = passed, 0

    def passed(self) -> bool:
        return self._passed

    def wait(self) -> None:
        self.waits += 1


def test_a_free_by_page_id_waits_on_its_fence_only_while_its_copies_run() -> None:
    kv, allocator = _paged()
    ps = int(allocator.page_size)
    view = AllocatorView(allocator, int(kv.size))
    for passed in (False, True):
        slots = allocator.alloc(2 * ps)
        fence = _Fence(passed)
        view.free_page_ids(slots[::ps] // ps, fence)  # type: ignore[arg-type]
        assert fence.waits == (0 if passed else 1)


def test_without_sglangs_paged_allocator_nothing_takes_page_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """An SGLang whose paged allocator cannot be imported gives no allocator the page-id path, not even one
    with no `free_segment` of its own."""
    import kvfsm.integrations.sglang.objects as objects

    monkeypatch.setattr(objects, "_paged_free_segment", lambda: None)
    bare = SimpleNamespace(page_size=16, debug_mode=False)
    assert not AllocatorView(bare, 64).frees_page_ids
    kv, allocator = _paged()
    assert not AllocatorView(allocator, int(kv.size)).frees_page_ids


@pytest.mark.parametrize("path", ["page_ids", "slots"])
def test_a_free_inside_sglangs_free_group_comes_back_at_its_end(path: str) -> None:
    """SGLang makes the offload manager's calls inside the allocator's free group (`process_batch_result_decode`):
    kvfsm's frees, by page id or by slots, go through the group, so their pages come back at its end, as
    SGLang's own frees in that group do, and a tensor reused after the call frees nothing else."""
    kv, allocator = _paged()
    ps = int(allocator.page_size)
    view = AllocatorView(allocator, int(kv.size))
    slots = allocator.alloc(3 * ps)
    assert slots is not None
    pages, before = (slots[::ps] // ps).tolist(), _free_pages(allocator)
    allocator.free_group_begin()
    if path == "page_ids":
        ids = slots[::ps] // ps
        view.free_page_ids(ids)
        ids.fill_(0)  # the caller's tensor, reused before the group ends
    else:
        view.free(slots)
        slots.fill_(0)
    assert _free_pages(allocator) == before  # nothing back before the group's end
    allocator.free_group_end()
    assert _free_pages(allocator) == sorted(before + pages)


@pytest.mark.parametrize("need_sort", [False, True], ids=["unsorted", "need-sort"])
@pytest.mark.parametrize("grouped", [False, True], ids=["at-once", "free-group"])
def test_one_free_laid_out_as_frees_newest_first_says_leaves_the_free_list_of_one_free_a_request(
    grouped: bool, need_sort: bool
) -> None:
    """kvfsm frees the pages of several releases in one call (OffloadEffects.release_request_each), in request order
    or, where the allocator hands out the newest free first, the reverse: SGLang's free list is then exactly, in
    order, what one `free_page_ids` a request leaves, inside a free group and outside one."""
    (kv, one_by_one), (_, batched) = _paged(), _paged()
    view = AllocatorView(batched, int(kv.size))
    ps = int(batched.page_size)
    for allocator in (one_by_one, batched):
        allocator.need_sort = need_sort
    assert view.frees_newest_first() == (not need_sort)  # no group open yet
    spans = []
    for n in (2, 1, 3):
        slots, again = one_by_one.alloc(n * ps), batched.alloc(n * ps)
        assert slots is not None and again is not None and torch.equal(slots, again)
        spans.append(slots[::ps] // ps)
    if grouped:
        one_by_one.free_group_begin()
        batched.free_group_begin()
    newest_first = view.frees_newest_first()
    assert newest_first == (not grouped and not need_sort)
    for ids in spans:
        one_by_one.free_page_ids(ids)
    view.free_page_ids(torch.cat(spans[::-1] if newest_first else spans))
    if grouped:
        one_by_one.free_group_end()
        batched.free_group_end()
    assert batched.free_pages.tolist() == one_by_one.free_pages.tolist()
    assert [t.tolist() for t in batched.staged_pages] == [t.tolist() for t in one_by_one.staged_pages] or need_sort
    assert _free_pages(batched) == _free_pages(one_by_one)


def test_the_token_allocator_appends_its_frees_and_an_unknown_one_has_no_free_order() -> None:
    """SGLang's token allocator (page size 1) appends freed slots to its free list: one free of several requests'
    slots in request order leaves it as one free a request does. An allocator of another class has no order
    kvfsm knows (None), so its releases are freed one at a time."""
    sc = next(s for s in SCENARIOS if s.page_size == 1 and s.pool == "mha")
    (_, kv, one_by_one), (_, _, batched) = harness.build_pools(sc), harness.build_pools(sc)
    one_by_one.need_sort = batched.need_sort = False
    view = AllocatorView(batched, int(kv.size))
    assert view.frees_newest_first() is False
    spans = [one_by_one.alloc(n) for n in (2, 1, 3)]
    again = [batched.alloc(n) for n in (2, 1, 3)]
    assert all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(spans, again))
    for slots in spans:
        one_by_one.free(slots)
    view.free(torch.cat(again))
    assert batched.free_pages.tolist() == one_by_one.free_pages.tolist()

    class Other(type(batched)):  # type: ignore[misc]
        pass

    class PagedTokenToKVPoolAllocator(type(batched)):  # type: ignore[misc]  # SGLang's name, not SGLang's class
        pass

    for cls in (Other, PagedTokenToKVPoolAllocator):
        batched.__class__ = cls
        assert AllocatorView(batched, int(kv.size)).frees_newest_first() is None
