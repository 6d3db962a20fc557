"""Checked mode's slot ownership ledger: every device and host page is free or owned by exactly one owner.

Owners are request records (device pages), the prefix cache (the pages of a matched prefix, while some
request holds a lock on them) and chunks (host pages); in-flight copies are readers of device pages. A violation raises CheckedModeError naming the request, the event and the slot, before
the data plane is touched, so the ledger catches B1 (reuse of a live request's slot), B2 (free under
an in-flight copy), B9/B10 (double release) in the implementation, not only in the spec.

A release under a copy is legal only fenced (spec `resources.device_slots.fence`): the fence must cover
every copy that still reads the page, and a writer that declares a write (`device_write`) into such a page
must have waited on the fence since that release, unless it has passed. A page handed out with a fence keeps
it until its copies land, so a later release of that page, plain or fenced, is covered by it too, and the
next writer must wait on it again (a wait orders only the stream that made it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Optional

from kvfsm.dataplane.fences import SlotFence
from kvfsm.errors import LifecycleError

PREFIX_CACHE = "<prefix cache>"  # the owner of a matched prefix's pages


class CheckedModeError(LifecycleError):
    def __init__(self, request: str, event: str, slot: int | None, problem: str) -> None:
        self.request, self.event, self.slot, self.problem = request, event, slot, problem
        where = f" slot {slot}" if slot is not None else ""
        super().__init__(f"checked mode: request {request}, event {event!r},{where}: {problem}")


class SlotLedger:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.device_owner: dict[int, str] = {}
        self.device_readers: dict[int, set[int]] = defaultdict(set)
        self.device_released: dict[int, str] = {}  # page -> the request that released it, until claimed again
        self.host_owner: dict[int, int] = {}
        self.prefix_holders: dict[int, set[str]] = defaultdict(set)  # prefix-cache page -> requests locking it
        self.copy_handle: dict[int, Any] = {}  # in-flight chunk -> its copy's handle (what a fence must cover)
        # page released while copies still read it -> the fences covering them, each with the count of waits
        # (SlotFence.waits) a write of the page needs: one more than it had when the page was last released
        self.device_fence: dict[int, tuple[tuple[SlotFence, int], ...]] = {}

    def _pages(self, slots: Iterable[int]) -> list[int]:
        return sorted({int(s) // self.page_size for s in slots})

    def claim_device(self, owner: str, event: str, slots: Iterable[int]) -> None:
        """`owner` reads or writes these device slots: they must be its own or unowned (then they become its)."""
        for page in self._pages(slots):
            other = self.device_owner.get(page)
            if other is not None and other != owner:
                whose = "the prefix cache (a matched prefix)" if other == PREFIX_CACHE else f"live request {other}"
                raise CheckedModeError(
                    owner, event, page * self.page_size, f"device slot belongs to {whose} (premature reuse, B1)"
                )
        for page in self._pages(slots):
            self.device_owner[page] = owner
            self.device_released.pop(page, None)

    def release_device(self, owner: str, event: str, slots: Iterable[int], fence: Optional[SlotFence] = None) -> None:
        """`owner` frees these device pages; with a `fence`, while copies still read them (a fenced release)."""
        pages = self._pages(slots)
        for page in pages:
            other = self.device_owner.get(page)
            if other == PREFIX_CACHE:
                raise CheckedModeError(
                    owner,
                    event,
                    page * self.page_size,
                    "freeing a page of a matched prefix, which the prefix cache owns (B16)",
                )
            if other is not None and other != owner:
                raise CheckedModeError(
                    owner, event, page * self.page_size, f"freeing a device slot owned by request {other}"
                )
            # a copy that has landed (its handle says so, by a query) no longer reads the page, even before
            # the progress check acknowledges it
            readers = [c for c in self.device_readers.get(page, ()) if not self._landed(c)]
            covering = self._covering(page, fence)
            if readers and not covering:
                raise CheckedModeError(
                    owner, event, page * self.page_size, "freeing a device slot an in-flight copy still reads (B2)"
                )
            missed = sorted(c for c in readers if not any(f.covers(self.copy_handle.get(c)) for f in covering))
            if missed:
                raise CheckedModeError(
                    owner,
                    event,
                    page * self.page_size,
                    f"a fenced release whose fence misses copy of chunk {missed[0]}, which still reads the slot (B2)",
                )
            if self.device_released.get(page) == owner:
                raise CheckedModeError(
                    owner,
                    event,
                    page * self.page_size,
                    "device slot already released by this request (double release, B9)",
                )
        for page in pages:
            self.device_owner.pop(page, None)
            self.device_released[page] = owner
            if self.device_readers.get(page):
                self.device_fence[page] = self._needs(page, fence)

    def _covering(self, page: int, fence: Optional[SlotFence]) -> list[SlotFence]:
        """The fences a release of `page` goes back with: its own, and those of the page's last release while
        copies still read it (the allocator carries them)."""
        carried = [f for f, _ in self.device_fence.get(page, ()) if f is not fence]
        return ([fence] if fence is not None else []) + carried

    def _needs(self, page: int, fence: Optional[SlotFence]) -> tuple[tuple[SlotFence, int], ...]:
        """The waits the next write of `page` needs on each fence covering it after this release: its own
        fence once; a carried one once more than so far. 0 (none) for a fence the engine's own stream waited
        on before the engine freed the page itself (spec action record_engine_release_fenced: the engine
        writes its pages only on that stream, so every later write is ordered and no fence is carried)."""
        own = [] if fence is None else [(fence, 0 if fence.waits else 1)]
        carried = [
            (f, 0 if need == 0 else f.waits + 1) for f, need in self.device_fence.get(page, ()) if f is not fence
        ]
        return tuple(own + carried)

    def _landed(self, chunk: int) -> bool:
        handle = self.copy_handle.get(chunk)
        return handle is not None and handle.done()

    def device_write(self, writer: str, slots: Iterable[int]) -> None:
        """`writer` is about to write these device slots (the engine's KV for a new token): a page released
        fenced, whose copies still read it, must have its fences passed or waited on since that release."""
        for page in self._pages(slots):
            if any(f.waits < need and not f.passed() for f, need in self.device_fence.get(page, ())):
                raise CheckedModeError(
                    writer,
                    "write",
                    page * self.page_size,
                    "writing a reused device slot whose fence has neither passed nor been "
                    "waited on: a copy still reads it (premature reuse, B2; the device_slots "
                    "fence rule)",
                )

    def release_owned(self, owner: str, event: str, fence: Optional[SlotFence] = None) -> None:
        """The engine freed what `owner` held through its own release path: every device page the ledger
        has `owner` own leaves it, with release_device's checks (a page a copy still reads is B2 unless the
        release is fenced)."""
        pages = [page for page, who in self.device_owner.items() if who == owner]
        self.release_device(owner, event, [page * self.page_size for page in pages], fence)

    def prefix_locked(self, owner: str, slots: Iterable[int]) -> None:
        """`owner`'s matched prefix: these pages are the prefix cache's while `owner` holds its lock, so no
        release of `owner`'s (or anyone's) may free them (B16); they must not be a live request's own."""
        pages = self._pages(slots)
        for page in pages:
            other = self.device_owner.get(page)
            if other is not None and not other.startswith(PREFIX_CACHE):
                raise CheckedModeError(
                    owner,
                    "admit",
                    page * self.page_size,
                    f"matched prefix page belongs to live request {other} (premature reuse, B1)",
                )
        for page in pages:
            self.device_owner[page] = PREFIX_CACHE
            self.prefix_holders[page].add(owner)
            self.device_released.pop(page, None)

    def prefix_unlocked(self, owner: str) -> None:
        """`owner` unlocked its prefix: a page no lock holds any more may be evicted (it leaves the ledger)."""
        for page in [p for p, holders in self.prefix_holders.items() if owner in holders]:
            holders = self.prefix_holders[page]
            holders.discard(owner)
            if not holders:
                del self.prefix_holders[page]
                if self.device_owner.get(page) == PREFIX_CACHE:
                    del self.device_owner[page]

    def copy_started(
        self, owner: str, chunk: int, device_slots: Iterable[int], host_slots: Iterable[int], handle: Any = None
    ) -> None:
        device_slots = list(device_slots)
        self.claim_device(owner, "offload", device_slots)
        host_pages = self._pages(host_slots)
        for page in host_pages:
            if page in self.host_owner:
                raise CheckedModeError(
                    owner,
                    "offload",
                    page * self.page_size,
                    f"host slot already held by chunk {self.host_owner[page]} (host double alloc)",
                )
        for page in host_pages:
            self.host_owner[page] = chunk
        for page in self._pages(device_slots):
            self.device_readers[page].add(chunk)
        if handle is not None:
            self.copy_handle[chunk] = handle

    def copy_completed(self, chunk: int, device_slots: Iterable[int]) -> None:
        self.copy_handle.pop(chunk, None)
        for page in self._pages(device_slots):
            readers = self.device_readers.get(page)
            if readers is not None:
                readers.discard(chunk)
                if not readers:
                    del self.device_readers[page]
                    self.device_fence.pop(page, None)

    def free_host(self, owner: str, event: str, chunk: int, host_slots: Iterable[int]) -> None:
        pages = self._pages(host_slots)
        for page in pages:
            if self.host_owner.get(page) != chunk:
                raise CheckedModeError(
                    owner,
                    event,
                    page * self.page_size,
                    "freeing a host slot this chunk does not hold (host double free, B10)",
                )
        for page in pages:
            del self.host_owner[page]

    def host_pages(self) -> int:
        return len(self.host_owner)
