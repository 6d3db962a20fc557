"""Fences of device slots released while a copy still reads them (spec: `resources.device_slots.fence`), or,
in the swap lifecycle, still writes them (a swap-in: spec/cb_swap.yaml `resources.device_blocks.fence`).

A fenced release hands a request's device slots back at once, each tagged with a `SlotFence`: the copies
that still read it. The allocator hands such a slot out again only together with its fence, after every
free slot without one (`TokenSlotAllocator.alloc_fenced`), and whoever writes the slot first makes its
stream wait on the fence (`wait_fences`): on the GPU a `wait_event`, so the host never waits. A fence that
has passed is found by an event query (`CopyHandle.done`), never a synchronize, and is then dropped.

A slot handed out with a fence that has not passed keeps it: freed again before its copies land, fenced
or not, it goes back to the allocator still carrying that fence (joined with the new one, `SlotFence.join`).
A wait orders only the stream that waited; the allocator cannot know which stream writes a slot next, so
its next writer must wait again. On the CUDA engine this is the case a plain release of a reused slot hits
while the old copy still runs (the CPU twin's wait completes the copy, so there the fence has passed).

This is stream-ordered reuse, as PyTorch's caching allocator honours `record_stream` and TensorRT-LLM
fences reused blocks. The CPU twin is the deferred CPU engine: its copy runs when completed, reading the
slot as it is then, and waiting on its handle completes it, so a writer that skips the wait really
corrupts the copy in tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Fenceable(Protocol):
    """What a fence is made of: a copy's handle (kvfsm.dataplane.copy.CopyHandle has both methods)."""

    def done(self) -> bool: ...

    def wait_stream(self, stream: object | None = None) -> None: ...


class SlotFence:
    """The copies that still read (an offload) or write (a load-back) a set of released slots: passed once
    all have landed; its next writer's wait orders the write after their reads and writes alike.

    `waited` records that some writer's stream was made to wait on it, and `waits` how many times (checked
    mode's ledger accepts a write into a slot whose fence has passed or was waited on since the slot's
    last release). A fence joined from others (`join`) waits through them, so each counts its waits."""

    __slots__ = ("_handles", "_parts", "waited", "waits")

    def __init__(self, handles: Iterable[Fenceable], parts: tuple[SlotFence, ...] = ()) -> None:
        self._handles: tuple[Fenceable, ...] = tuple({id(h): h for h in handles}.values())
        self._parts = parts
        self.waited = False
        self.waits = 0

    @classmethod
    def join(cls, fences: Iterable[SlotFence | None]) -> SlotFence | None:
        """One fence for a slot that must wait on all of `fences` (None and passed ones are dropped): the
        one left, itself, or a fence whose wait waits on each part; None when all have passed."""
        leaves: dict[int, SlotFence] = {}
        for f in fences:
            if f is not None and not f.passed():
                for leaf in f._parts or (f,):
                    leaves[id(leaf)] = leaf
        if len(leaves) <= 1:
            return next(iter(leaves.values()), None)
        parts = tuple(leaves.values())
        return cls((h for part in parts for h in part._handles), parts)

    def passed(self) -> bool:
        """Whether every copy has landed: one event query per copy not yet seen landed; never blocks. A
        passed fence forgets its copies (their buffers are no longer kept alive through it)."""
        if self._handles and all(h.done() for h in self._handles):
            self._handles = self._parts = ()
        return not self._handles

    def covers(self, handle: Fenceable | None) -> bool:
        """Whether `handle`'s copy is one this fence waits for, or has landed (a query)."""
        return handle is not None and (any(h is handle for h in self._handles) or handle.done())

    def wait(self, stream: object | None = None) -> None:
        """Order later work on `stream` (default: the current one) after the copies, without the host waiting
        on the GPU (a CPU handle has no stream: there the wait completes the copy)."""
        if self._parts:
            for part in self._parts:
                if not part.passed():
                    part.wait(stream)
        else:
            for h in self._handles:
                h.wait_stream(stream)
        self.waited = True
        self.waits += 1

    def mark_waited(self) -> None:
        """Record a wait made on these copies' handles directly (`DecodeOffloadManager.fence_copies_in_flight`)."""
        self.waited = True
        self.waits += 1

    def __len__(self) -> int:
        return len(self._handles)

    def __repr__(self) -> str:
        return f"SlotFence({len(self._handles)} copies{', waited' if self.waited else ''})"


def wait_fences(fences: Iterable[SlotFence], stream: object | None = None) -> None:
    """Make `stream` wait on the fences of the slots it is about to write (what `alloc_fenced` returned);
    fences that have passed cost one query each and no wait."""
    for f in fences:
        if not f.passed():
            f.wait(stream)
