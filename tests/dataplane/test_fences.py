"""Fenced frees in TokenSlotAllocator (kvfsm.dataplane.fences): slots released while a copy still reads them.

The CPU twin of a fence is the deferred CPU engine's handle: its copy runs when completed, reading the
slot as it is then, so a writer that does not wait really corrupts the copy here. GPU twin:
tests/gpu/test_fences_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from kvfsm.dataplane import DeferredCpuCopyEngine, DoubleFree, KVCacheConfig, SlotFence, TokenSlotAllocator, wait_fences
from kvfsm.dataplane.copy.coalescing import CoalescingCopyEngine

from .helpers import bits, make_device_pool, make_host_pool


class FakeCopy:
    """A copy handle whose landing the test decides; counts queries and refuses a host wait."""

    def __init__(self) -> None:
        self.landed, self.queries, self.waited_on = False, 0, []

    def done(self) -> bool:
        self.queries += 1
        return self.landed

    def wait(self) -> None:
        raise AssertionError("a fence is never waited on by the host")

    def wait_stream(self, stream: object | None = None) -> None:
        self.waited_on.append(stream)


def _alloc(a: TokenSlotAllocator, pages: int) -> list[int]:
    got = a.alloc_pages(pages)
    assert got is not None
    return got


def test_fenced_pages_come_back_last_and_plain_alloc_never_takes_them_before_they_pass() -> None:
    a = TokenSlotAllocator(8 * 4, 4)  # 7 allocatable pages
    copy = FakeCopy()
    mine = _alloc(a, 3)
    a.free_pages(mine, SlotFence([copy]))
    assert a.fenced_page_count == 3 and a.free_page_count == 7 and a.free_slots == 28
    a.check_conservation()
    got = a.alloc_pages(4)  # the plain free pages: enough without the fenced ones
    assert got is not None and not set(got) & set(mine)
    assert a.alloc_pages(1) is None  # only fenced pages left, and their copy has not landed
    assert a.alloc(4) is None and a.free_page_count == 3  # nothing changed
    copy.landed = True
    assert a.alloc_pages(2) == mine[:2]  # reclaimed by a query once passed, oldest first
    assert a.fenced_page_count == 0 and a.free_page_count == 1
    a.check_conservation()


def test_alloc_fenced_hands_out_plain_pages_first_then_fenced_ones_with_their_fences() -> None:
    a = TokenSlotAllocator(8 * 2, 2)
    c1, c2 = FakeCopy(), FakeCopy()
    first, second = _alloc(a, 2), _alloc(a, 2)
    f1, f2 = SlotFence([c1]), SlotFence([c2, c2])  # one handle twice is one copy
    a.free_pages(first, f1)
    a.free_pages(second, f2)
    assert len(f2) == 1
    got = a.alloc_pages_fenced(3)  # 3 plain pages are free: no fence needed
    assert got is not None and got[1] == () and not set(got[0]) & set(first + second)
    got = a.alloc_pages_fenced(3)  # the fenced ones, oldest first, with both fences once each
    assert got is not None
    pages, fences = got
    assert pages == first + second[:1] and set(map(id, fences)) == {id(f1), id(f2)}
    assert a.alloc_pages_fenced(2) is None and a.free_page_count == 1  # too few: nothing changed
    a.check_conservation()


def test_alloc_fenced_drops_passed_fences_by_query_and_returns_only_pending_ones() -> None:
    a = TokenSlotAllocator(6 * 1, 1)
    landed, pending = FakeCopy(), FakeCopy()
    p1, p2 = _alloc(a, 2), _alloc(a, 3)
    a.free_pages(p1, SlotFence([landed]))
    a.free_pages(p2, SlotFence([pending]))
    landed.landed = True
    queried = landed.queries, pending.queries
    slots, fences = a.alloc_fenced(3)  # type: ignore[misc]
    assert (landed.queries, pending.queries) == (queried[0] + 1, queried[1] + 1)  # one query per fence
    assert [len(f) for f in fences] == [1] and fences[0].passed() is False
    assert slots.tolist() == p1 + p2[:1]  # the passed pages went to the plain list first
    assert pending.waited_on == []  # the allocator never waits


def test_a_fence_that_passed_before_the_free_costs_nothing_later() -> None:
    a = TokenSlotAllocator(4 * 2, 2)
    copy = FakeCopy()
    copy.landed = True
    pages = _alloc(a, 2)
    a.free_pages(pages, SlotFence([copy]))
    assert a.fenced_page_count == 0 and a.alloc_pages(3) is not None


def test_a_fenced_free_is_validated_like_a_plain_one_and_a_rejected_free_changes_nothing() -> None:
    a = TokenSlotAllocator(8 * 2, 2)
    pages = _alloc(a, 2)
    fence = SlotFence([FakeCopy()])
    a.free_pages(pages, fence)
    before = a.snapshot()
    with pytest.raises(DoubleFree):
        a.free_pages(pages, fence)
    with pytest.raises(DoubleFree):
        a.free(torch.tensor([pages[0] * 2, pages[0] * 2 + 1]))
    after = a.snapshot()
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    a.check_conservation()


def test_a_page_handed_out_fenced_keeps_its_fence_through_a_plain_free_until_it_passes() -> None:
    """A wait orders only the stream that made it: a reused page freed again (plainly) before its old copy
    lands goes back still fenced, so plain alloc skips it and alloc_fenced returns the fence again. This is
    what the CUDA production configuration hit (the CPU twin's wait lands the copy, so there it has passed)."""
    a = TokenSlotAllocator(4 * 2, 2)  # 3 allocatable pages
    old = FakeCopy()
    fence = SlotFence([old])
    page = _alloc(a, 1)
    a.free_pages(page, fence)
    got = a.alloc_pages_fenced(3)
    assert got is not None and got[0][-1] == page[0] and got[1] == (fence,)
    wait_fences(got[1], stream="compute")
    a.free_pages(got[0])  # plainly: the new owner had no copy of its own
    assert a.fenced_page_count == 1 and a._page_fence[page[0]] is fence
    a.check_conservation()
    assert a.alloc_pages(3) is None  # the plain path never takes it before the old copy lands
    again = a.alloc_pages_fenced(3)
    assert again is not None and again[1] == (fence,)  # the next writer must wait too
    old.landed = True
    a.free_pages(again[0])
    assert a.fenced_page_count == 0 and not a._held_fence  # passed: dropped by a query
    a.check_conservation()


def test_a_fenced_free_of_a_page_still_carrying_a_fence_joins_both_and_a_wait_counts_on_each() -> None:
    a = TokenSlotAllocator(4 * 2, 2)
    first, second = FakeCopy(), FakeCopy()
    f1, f2 = SlotFence([first]), SlotFence([second])
    pages = _alloc(a, 2)
    a.free_pages(pages[:1], f1)
    got = a.alloc_pages_fenced(2)  # the plain free page, then the fenced one
    assert got is not None and got[1] == (f1,)
    reused = got[0][-1]
    wait_fences(got[1])
    assert f1.waits == 1
    a.free_pages([reused], f2)  # the new owner's own copy reads it as well
    joined = a._page_fence[reused]
    assert joined is not f1 and joined is not f2 and joined.covers(first) and joined.covers(second)
    a.free_pages(got[0][:-1])
    a.free_pages(pages[1:])
    again = a.alloc_pages_fenced(3)
    assert again is not None and again[1] == (joined,)
    wait_fences(again[1], stream="s")
    assert (f1.waits, f2.waits) == (2, 1) and first.waited_on[-1] == second.waited_on[-1] == "s"
    first.landed = True
    assert SlotFence.join([f1, f2]) is f2 and SlotFence.join([f1, None]) is None
    second.landed = True
    assert joined.passed()


def test_conservation_sees_a_fenced_page_without_its_fence() -> None:
    from kvfsm.dataplane import ConservationError

    a = TokenSlotAllocator(4 * 2, 2)
    a.free_pages(_alloc(a, 1), SlotFence([FakeCopy()]))
    a._page_fence.clear()
    with pytest.raises(ConservationError, match="fences disagree"):
        a.check_conservation()


def test_wait_fences_makes_the_stream_wait_only_on_fences_still_pending() -> None:
    landed, pending = FakeCopy(), FakeCopy()
    landed.landed = True
    f_landed, f_pending = SlotFence([landed]), SlotFence([pending])
    wait_fences([f_landed, f_pending], stream="s1")
    assert landed.waited_on == [] and pending.waited_on == ["s1"]
    assert f_pending.waited and not f_landed.waited and f_landed.passed()


@pytest.mark.parametrize("coalesced", [False, True])
@pytest.mark.parametrize("writer_waits", [True, False])
def test_reused_slot_written_after_waiting_on_its_fence_leaves_the_copy_intact(
    coalesced: bool, writer_waits: bool
) -> None:
    """The CPU twin end to end: a slot under a deferred copy is freed fenced, handed out again by
    alloc_fenced, and written. Waiting on the fence first keeps the copy's bytes; skipping the wait makes
    the copy read the new writer's data (the corruption SGLang's reverted mid-decode free produced)."""
    kv = KVCacheConfig.tiny("mha")
    dev, host = make_device_pool(kv, 32, seed=3), make_host_pool(kv, 16, 4)
    a = TokenSlotAllocator(32, 4)
    deferred = DeferredCpuCopyEngine()
    engine = CoalescingCopyEngine(deferred) if coalesced else deferred
    slots = a.alloc(8)
    host_slots = host.alloc(8)
    assert slots is not None and host_slots is not None
    want = dev.token_view()[:, :, slots].clone()
    handle = engine.submit_d2h(dev, slots, host, host_slots)
    a.free(slots, SlotFence([handle]))
    while a.alloc_pages(1) is not None:  # the engine takes every plain page first
        pass
    got = a.alloc_fenced(8)
    assert got is not None
    reused, fences = got
    assert sorted(reused.tolist()) == sorted(slots.tolist()) and len(fences) == 1
    if writer_waits:
        wait_fences(fences)  # CPU twin: the copy runs now, before the write
    dev.token_view()[:, :, reused] = 0.0  # the next request's KV
    deferred.complete_all()
    assert handle.done()
    intact = torch.equal(bits(host.token_view()[:, :, host_slots]), bits(want))
    assert intact is writer_waits
