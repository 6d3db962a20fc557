"""Liveness of the page allocator (device pool and host pool alike): it serves every request it can cover and
refuses only when it cannot.

A refusal that is not forced looks, in production, like a spurious out-of-slots or host-full, retried
forever. Safety (no page handed out twice, fences carried) is tested elsewhere; here random interleavings of
plain and fenced allocations, plain and fenced frees and fences passing check the other direction:
`alloc_pages(k)` succeeds whenever k pages are free without a fence or behind a fence that has passed, and
`alloc_pages_fenced(k)` whenever k pages are free at all.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfsm.dataplane import TokenSlotAllocator
from kvfsm.dataplane.fences import SlotFence

PAGES = 12


class Copy:
    """A copy's handle as a fence sees it: done once the test says it landed."""

    def __init__(self) -> None:
        self.landed = False

    def done(self) -> bool:
        return self.landed

    def wait_stream(self, stream: object | None = None) -> None:
        pass


class AllocatorLiveness(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = TokenSlotAllocator((PAGES + 1) * 2, 2)  # page 0 is the allocator's own
        self.held: list[int] = []
        self.copies: list[Copy] = []

    def _free_without_wait(self) -> int:
        """Pages free with no fence, or behind a fence that has passed."""
        a = self.alloc
        passed = sum(1 for p in a._fenced_pages if a._page_fence[p].passed())
        return a.free_page_count - a.fenced_page_count + passed

    def _free_at_all(self) -> int:
        return self.alloc.free_page_count  # fenced ones included

    @rule(k=st.integers(0, PAGES + 1))
    def alloc_plain(self, k: int) -> None:
        can = self._free_without_wait() >= k
        got = self.alloc.alloc_pages(k)
        assert (got is not None) == can, (
            f"alloc_pages({k}) {'refused' if got is None else 'served'} with "
            f"{self._free_without_wait()} pages free without a wait"
        )
        if got is not None:
            self.held += got

    @rule(k=st.integers(0, PAGES + 1))
    def alloc_fenced(self, k: int) -> None:
        can = self._free_at_all() >= k
        got = self.alloc.alloc_pages_fenced(k)
        assert (got is not None) == can, (
            f"alloc_pages_fenced({k}) {'refused' if got is None else 'served'} with {self._free_at_all()} pages free"
        )
        if got is not None:
            self.held += got[0]

    @precondition(lambda self: self.held)
    @rule(n=st.integers(1, 4), fenced=st.booleans())
    def free(self, n: int, fenced: bool) -> None:
        pages, self.held = self.held[:n], self.held[n:]
        fence = None
        if fenced:
            copy = Copy()
            self.copies.append(copy)
            fence = SlotFence([copy])
        self.alloc.free_pages(pages, fence=fence)

    @precondition(lambda self: any(not c.landed for c in self.copies))
    @rule(i=st.integers(0, 100))
    def land(self, i: int) -> None:
        waiting = [c for c in self.copies if not c.landed]
        waiting[i % len(waiting)].landed = True

    @invariant()
    def conserved(self) -> None:
        assert len(self.held) + self._free_at_all() == PAGES
        self.alloc.check_conservation()


TestAllocatorLiveness = AllocatorLiveness.TestCase
