"""Typed errors of the data plane.

Every rejection is raised *before* any state is touched, so a caller (or a model checker) that catches
one of these can rely on the pool being exactly as it was before the call.
"""

from __future__ import annotations


class SlotError(Exception):
    """Base of every rejected slot/row operation (allocator, host pool, req→token table)."""


class OutOfRange(SlotError):
    """An index (slot or row) outside the pool, or not an integer index tensor."""


class DuplicateIndex(SlotError):
    """One free batch names the same index twice (catches B12)."""


class PartialPage(SlotError):
    """A free/alloc batch that does not cover whole pages (catches B11)."""


class NotAllocated(SlotError):
    """Free of a slot that is currently free; see the two concrete cases below."""


class DoubleFree(NotAllocated):
    """Free of a slot that was allocated once and has already been freed (catches B9/B10)."""


class NeverAllocated(NotAllocated):
    """Free of a slot that no alloc() ever returned (includes the reserved padding page)."""


class DoubleAlloc(SlotError):
    """alloc() would hand out a slot that the allocated-mask says is already owned (corrupt free list)."""


class HostMemoryError(MemoryError):
    """The requested host pool does not fit in the RAM the kernel reports as available."""

    def __init__(self, requested_bytes: int, available_bytes: int) -> None:
        self.requested_bytes = int(requested_bytes)
        self.available_bytes = int(available_bytes)
        super().__init__(
            f"host KV pool needs {self.requested_bytes} bytes "
            f"({self.requested_bytes / 2**30:.2f} GiB) but only {self.available_bytes} bytes "
            f"({self.available_bytes / 2**30:.2f} GiB) are available (MemAvailable)"
        )


class CopyError(Exception):
    """A copy request that cannot be carried out (mismatched pools, lengths or devices)."""


class ConservationError(RuntimeError):
    """A pool's free list and its allocated-mask disagree: a bug in the pool itself, never a caller's."""
