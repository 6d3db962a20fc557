"""`SwapLedger`: checked mode's block ledger (who holds each host block, which device blocks are under a copy).

Kept apart from the manager because it is pure bookkeeping over block ids: it raises `CheckedModeError`
on a reused, double-freed or foreign block and never touches tensors or the engine.

A device block may leave its request while its own copy still uses it (a swap-out reads it, a swap-in writes
it) only fenced (spec `resources.device_blocks.fence`): the fence must cover that copy, whichever its
direction, and the compute stream must have waited on it at the release. From then until the copy's
acknowledgement the block is `fenced`, and every write the engine declares into it (`device_write`) needs
that fence waited on or passed.
"""

from __future__ import annotations

from typing import Any, Optional

from kvfsm.dataplane.fences import SlotFence
from kvfsm.runtime.ledger import CheckedModeError


class SwapLedger:
    """Every host block is free or held by one request; no device block is freed, restored into or copied
    while a copy of it is in flight, except a request's blocks released fenced against its own copy (a
    swap-out or a swap-in); a restore writes only blocks the engine gave this request alone; no write reaches
    a block a swap-out still reads, or one released fenced, unless its fence was waited on or has passed."""

    def __init__(self) -> None:
        self.host_owner: dict[int, str] = {}
        self.in_flight: dict[int, tuple[str, str]] = {}  # device block -> (request key, direction), still its own
        self.handles: dict[str, Any] = {}  # request key -> the handle of its copy in flight (one at a time)
        self.fenced: dict[int, dict[str, SlotFence]] = {}  # device block released fenced -> {copying key: fence}

    def copy_started(
        self, key: str, event: str, direction: str, device_blocks: list[int], host_blocks: list[int]
    ) -> None:
        for b in device_blocks:
            if b in self.in_flight:
                other, d = self.in_flight[b]
                raise CheckedModeError(
                    key, event, b, f"device block already under an in-flight {d} copy of {other} (B2)"
                )
        if direction == "h2d":
            self.device_write(key, device_blocks, event)
        for h in host_blocks:
            owner = self.host_owner.get(h)
            if direction == "d2h" and owner is not None:
                raise CheckedModeError(key, event, h, f"host block already held by {owner} (host double alloc)")
            if direction == "h2d" and owner != key:
                raise CheckedModeError(key, event, h, f"restoring from a host block held by {owner}, not this request")
        if direction == "d2h":
            for h in host_blocks:
                self.host_owner[h] = key
        for b in device_blocks:
            self.in_flight[b] = (key, direction)

    def copy_submitted(self, key: str, handle: Any) -> None:
        """The handle of `key`'s copy, which a fenced release of its blocks must be fenced on."""
        self.handles[key] = handle

    def copy_aborted(self, key: str, direction: str, device_blocks: list[int], host_blocks: list[int]) -> None:
        for b in device_blocks:
            if self.in_flight.get(b, ("",))[0] == key:
                del self.in_flight[b]
        self.handles.pop(key, None)
        if direction == "d2h":
            for h in host_blocks:
                if self.host_owner.get(h) == key:
                    del self.host_owner[h]

    def copy_done(self, key: str, device_blocks: list[int]) -> None:
        for b in device_blocks:
            if self.in_flight.get(b, ("",))[0] == key:
                del self.in_flight[b]
            readers = self.fenced.get(b)
            if readers is not None:
                readers.pop(key, None)
                if not readers:
                    del self.fenced[b]
        self.handles.pop(key, None)

    def release_device(self, key: str, event: str, device_blocks: list[int], fence: Optional[SlotFence] = None) -> None:
        """`key` gives these device blocks back to the engine; with a `fence`, while its own copy still uses them
        (its swap-out reads them, its swap-in writes them: the fence must cover that copy either way)."""
        for b in device_blocks:
            if b not in self.in_flight:
                continue
            other, d = self.in_flight[b]
            if fence is None:
                raise CheckedModeError(
                    key, event, b, f"freeing a device block an in-flight {d} copy of {other} still uses (B2)"
                )
            if other != key:
                raise CheckedModeError(
                    key,
                    event,
                    b,
                    f"a fenced release of a device block under the {d} copy of "
                    f"{other}: only a request's own copy may be fenced (B2)",
                )
            use = "reads" if d == "d2h" else "writes"
            if not fence.covers(self.handles.get(key)):
                raise CheckedModeError(
                    key, event, b, f"a fenced release whose fence misses the {d} copy that still {use} the block (B2)"
                )
            if not (fence.waited or fence.passed()):
                raise CheckedModeError(
                    key,
                    event,
                    b,
                    "a fenced release whose fence no stream has waited on: the "
                    f"engine may rewrite the block before the {d} copy {use} it "
                    "(B2; the device_blocks fence rule)",
                )
        if fence is not None:
            for b in device_blocks:
                if self.in_flight.get(b, ("",))[0] == key:
                    del self.in_flight[b]
                    self.fenced.setdefault(b, {})[key] = fence

    def device_write(self, writer: str, device_blocks: list[int], event: str = "write") -> None:
        """`writer` is about to write these device blocks (on the compute stream): none may still be read by a
        swap-out, and none released fenced (under a swap-out or a swap-in) unless its fence was waited on or has
        passed."""
        for b in device_blocks:
            other = self.in_flight.get(b)
            if other is not None and other[1] == "d2h":
                raise CheckedModeError(
                    writer, event, b, f"writing a device block the in-flight swap-out of {other[0]} still reads (B2)"
                )
            for user, fence in self.fenced.get(b, {}).items():
                if not (fence.waited or fence.passed()):
                    raise CheckedModeError(
                        writer,
                        event,
                        b,
                        f"writing a reused device block whose fence (the copy "
                        f"of {user}) has neither passed nor been waited on (B2; "
                        "the device_blocks fence rule)",
                    )

    def free_host(self, key: str, event: str, host_blocks: list[int]) -> None:
        for h in host_blocks:
            if self.host_owner.get(h) != key:
                raise CheckedModeError(
                    key,
                    event,
                    h,
                    f"freeing a host block held by {self.host_owner.get(h)}, not this request (host double free, B10)",
                )
        for h in host_blocks:
            del self.host_owner[h]
