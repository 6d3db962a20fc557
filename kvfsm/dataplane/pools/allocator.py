"""Page-aware token-slot allocator.

Slots are handed out and taken back in whole pages only. The allocator keeps a free list of page ids and
a per-page allocated-mask; every free is validated against the mask before anything changes, so a double
free (B9/B10), a free of a never-allocated slot, a repeated index in one batch (B12) or a batch that
covers part of a page (B11) is rejected as a typed error and leaves the allocator exactly as it was.

Page 0 (slots `[0, page_size)`) is reserved as padding by default, like SGLang, whose kernels write
dummy tokens to slot 0; it is never allocated and never in the free list, and `capacity` excludes it.

Bookkeeping lives on the host (a FIFO deque of free page ids and a bytearray mask, viewed as a tensor
for vectorised queries), so alloc and free cost O(pages touched), never O(pool): an offload manager
allocates and frees host pages on every chunk. Validating a free of whole pages in slot order (what
alloc hands out) is a few numpy ops over the batch and a mask lookup per page; anything else takes the
exact path (a sort) that names the error. On CUDA validation costs one device-to-host copy of the batch.

Fenced frees (kvfsm.dataplane.fences): a page freed with a fence that has not passed waits in a second
FIFO, behind every plain free page. `alloc` and `alloc_pages` never hand it out before an event query says
its fence passed; `alloc_fenced` and `alloc_pages_fenced` hand it out last, returning its fence, which the
caller's writing stream must wait on (`wait_fences`). A page they hand out keeps its fence until it passes:
freed again before that (fenced or not), it goes back to the fenced FIFO still carrying it, because a wait
orders only the stream that waited and the next writer may use another (spec: `device_slots.fence`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import (
    ConservationError,
    DoubleAlloc,
    DoubleFree,
    DuplicateIndex,
    NeverAllocated,
    OutOfRange,
    PartialPage,
)
from ..fences import SlotFence


class PageSlots:
    """Slots of whole pages with the page ids they were built from (`TokenSlotAllocator.page_slots`).

    A copy plan checks such a batch with a pass over its page list instead of re-deriving pages from
    4-8K slot indices with numpy (each numpy call costs tens of microseconds when a decode step has left
    the CPU caches cold). Only the allocator builds one, so the slots are the pages' by construction.
    """

    __slots__ = ("allocator", "pages", "_slots")

    def __init__(self, allocator: TokenSlotAllocator, pages: list[int], slots: torch.Tensor | None = None) -> None:
        self.allocator, self.pages, self._slots = allocator, pages, slots

    @property
    def slots(self) -> torch.Tensor:
        """The slot indices (int64, CPU), built from the page list on first use: a copy planned over the
        page list (dma_rows, page size 1) never needs them, and building them is a numpy and a torch call."""
        if self._slots is None:
            self._slots = torch.from_numpy(self.allocator.slots_of(self.pages))
        return self._slots

    def __len__(self) -> int:
        """The slot count, from the page list (no tensor call)."""
        return len(self.pages) * self.allocator.page_size

    def __repr__(self) -> str:
        return f"PageSlots(pages={self.pages[:8]}{'...' if len(self.pages) > 8 else ''}, slots={len(self)})"


IndexLike = torch.Tensor | PageSlots | np.ndarray | Sequence[int]


def as_index_tensor(indices: IndexLike, device: torch.device) -> torch.Tensor:
    """A flat int64 tensor on `device`; rejects floating and bool tensors, arrays and sequences (an index
    that silently truncates)."""
    if isinstance(indices, PageSlots):  # built on the CPU
        return indices.slots if device.type == "cpu" else indices.slots.to(device=device)
    if isinstance(indices, torch.Tensor):
        if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
            raise OutOfRange(f"slot indices must be an integer tensor, got {indices.dtype}")
        t = indices.reshape(-1)
    elif isinstance(indices, np.ndarray):
        if indices.dtype.kind not in "iu":
            raise OutOfRange(f"slot indices must be an integer array, got {indices.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(indices.reshape(-1), dtype=np.int64))
    else:
        items = list(indices)
        t = torch.as_tensor(items) if items else torch.empty(0, dtype=torch.int64)
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise OutOfRange(f"slot indices must be integers, got {t.dtype} values")
    return t.to(device=device, dtype=torch.int64)


def as_index_array(indices: IndexLike) -> np.ndarray:
    """A flat int64 array on the host, checked as `as_index_tensor` checks it; an int64 array is taken as it
    is, with no torch call. A release reads the request's slots from the table's host mirror as an array; freed
    through a tensor they cost three torch calls, each of which lets go of the interpreter lock: 15 ms a free
    beside a thread running Python, against 19 us for the array (bench/probes/release_path_probe.py)."""
    if isinstance(indices, np.ndarray) and indices.dtype == np.int64:
        return indices.reshape(-1)
    return as_index_tensor(indices, torch.device("cpu")).numpy()


class TokenSlotAllocator:
    """Allocates page-aligned token slots of a pool with `num_slots` slots.

    alloc(n) needs n to be a multiple of page_size and returns all n slots or None (never partial);
    free(indices) frees exactly the pages the batch covers.
    """

    fences = True  # free() and free_pages() take a SlotFence (the manager's fenced release needs one that does)

    def __init__(
        self,
        num_slots: int,
        page_size: int = 1,
        device: torch.device | str = "cpu",
        reserve_padding_page: bool = True,
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if num_slots <= 0 or num_slots % page_size:
            raise ValueError(f"num_slots ({num_slots}) must be a positive multiple of page_size ({page_size})")
        self.num_slots = int(num_slots)
        self.page_size = int(page_size)
        self.num_pages = self.num_slots // self.page_size
        self.device = torch.device(device)
        self.reserved_pages = 1 if reserve_padding_page else 0
        if self.num_pages <= self.reserved_pages:
            raise ValueError("pool too small: no allocatable page besides the padding page")
        self._offsets = torch.arange(self.page_size, dtype=torch.int64)
        self._offsets_np = self._offsets.numpy()
        self._free_pages: deque[int] = deque(range(self.reserved_pages, self.num_pages))
        self._fenced_pages: deque[int] = deque()  # free, but a copy may still read them: handed out last
        self._page_fence: dict[int, SlotFence] = {}  # each of those pages -> the fence it was freed with
        self._held_fence: dict[int, SlotFence] = {}  # allocated pages handed out fenced -> that fence, until freed
        self._allocated_bytes = bytearray(self.num_pages)  # 1 = allocated
        self._ever_bytes = bytearray(self.num_pages)
        self._allocated = torch.frombuffer(self._allocated_bytes, dtype=torch.bool)  # shares memory
        self._allocated_np = self._allocated.numpy()  # the same bytes again, for numpy

    # ---- accounting -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Slots that can ever be allocated (all slots minus the padding page)."""
        return (self.num_pages - self.reserved_pages) * self.page_size

    @property
    def free_slots(self) -> int:
        """Free slots, fenced ones included (`alloc_fenced` can hand those out; `alloc` only once passed)."""
        return (len(self._free_pages) + len(self._fenced_pages)) * self.page_size

    @property
    def free_page_count(self) -> int:
        return len(self._free_pages) + len(self._fenced_pages)

    @property
    def fenced_page_count(self) -> int:
        """Free pages whose fence had not passed when last looked at."""
        return len(self._fenced_pages)

    @property
    def allocated_slots(self) -> int:
        return (self.num_pages - self.reserved_pages - self.free_page_count) * self.page_size

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(free list, per-page allocated mask) copies: equal snapshots mean equal allocator state. The free
        list is the plain free pages, then -1, then the fenced ones."""
        free = list(self._free_pages) + ([-1] + list(self._fenced_pages) if self._fenced_pages else [])
        return torch.tensor(free, dtype=torch.int64), self._allocated.clone()

    def is_allocated(self, indices: IndexLike) -> torch.Tensor:
        """Per-slot bool: is the page holding each slot allocated right now (for invariant checks)."""
        idx = as_index_array(indices)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.num_slots):
            raise OutOfRange(f"slot index outside [0, {self.num_slots})")
        return torch.from_numpy(self._allocated_np[idx // self.page_size])

    def check_conservation(self) -> None:
        """Raise ConservationError unless free list and allocated-mask describe the same partition."""
        free = set(self._free_pages) | set(self._fenced_pages)
        n_free = len(self._free_pages) + len(self._fenced_pages)
        n_alloc = sum(self._allocated_bytes)
        if len(free) != n_free:
            raise ConservationError("free list holds a page twice")
        if n_free + n_alloc + self.reserved_pages != self.num_pages:
            raise ConservationError(
                f"free pages {n_free} + allocated {n_alloc} + reserved {self.reserved_pages} != {self.num_pages}"
            )
        if free and (min(free) < self.reserved_pages or max(free) >= self.num_pages):
            raise ConservationError("free list holds a reserved or out-of-range page")
        if any(self._allocated_bytes[p] for p in free):
            raise ConservationError("a page is both in the free list and marked allocated")
        if any(self._allocated_bytes[: self.reserved_pages]):
            raise ConservationError("the padding page is marked allocated")
        if set(self._page_fence) != set(self._fenced_pages):
            raise ConservationError("the fenced free pages and their fences disagree")
        if any(not self._allocated_bytes[p] for p in self._held_fence):
            raise ConservationError("a free page still carries the fence it was handed out with")

    # ---- alloc / free -----------------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor | None:
        """n page-aligned slot indices (int64, on the allocator's device), or None if too few free pages."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"alloc size must be a non-negative int, got {n!r}")
        if n % self.page_size:
            raise ValueError(f"alloc size {n} is not a multiple of page_size {self.page_size}")
        pages = self.alloc_pages(n // self.page_size)
        if pages is None:
            return None
        out = torch.from_numpy(self.slots_of(pages))  # numpy, then one zero-copy wrap
        return out if self.device.type == "cpu" else out.to(self.device)

    def alloc_pages(self, k: int) -> list[int] | None:
        """k whole pages as page ids (free-list order), or None if fewer are free: the form for callers
        that track pages (slot i of page p is p * page_size + i); O(k) list work, no tensors."""
        free = self._free_pages
        if type(k) is int and k == 1 and free:
            # One page: every chunk whose stride is a page, which the SGLang adapter reserves call by call. No
            # list is built and scanned: 1.66-1.69 -> 0.36-0.37 us a call on the 2-core development machine
            # (bench/probes/per_call_trims.py), 256 of them an iteration at 4096 live, 16/16.
            p = free.popleft()
            if self._allocated_bytes[p]:
                free.appendleft(p)  # nothing changed
                raise DoubleAlloc("free list hands out a page the allocated-mask already owns")
            self._allocated_bytes[p] = self._ever_bytes[p] = 1
            return [p]
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"page count must be a non-negative int, got {k!r}")
        if k > len(free) and self._fenced_pages:
            self.reclaim_fenced()
        if k > len(free):
            return None
        take = free.popleft
        pages = [take() for _ in range(k)]
        mask, ever = self._allocated_bytes, self._ever_bytes
        if any(map(mask.__getitem__, pages)):
            free.extendleft(reversed(pages))  # nothing changed
            raise DoubleAlloc("free list hands out a page the allocated-mask already owns")
        for p in pages:
            mask[p] = 1
            ever[p] = 1
        return pages

    def alloc_pages_fenced(self, k: int) -> tuple[list[int], tuple[SlotFence, ...]] | None:
        """k whole pages and the fences the caller's writing stream must wait on before writing them
        (`wait_fences`), or None if fewer than k pages are free. Plain free pages come first; fenced ones,
        oldest first, only when those run out, after an event query per fence has returned the passed ones."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"page count must be a non-negative int, got {k!r}")
        if k > len(self._free_pages) + len(self._fenced_pages):
            return None
        if k > len(self._free_pages):
            self.reclaim_fenced()
        plain = min(k, len(self._free_pages))
        fenced_q, fence_of = self._fenced_pages, self._page_fence
        reused = [fenced_q[i] for i in range(k - plain)]
        if any(map(self._allocated_bytes.__getitem__, reused)):
            raise DoubleAlloc("the fenced free list hands out a page the allocated-mask already owns")
        pages = self.alloc_pages(plain)
        assert pages is not None
        fences = {id(fence_of[p]): fence_of[p] for p in reused}
        mask, ever, held = self._allocated_bytes, self._ever_bytes, self._held_fence
        for p in reused:
            fenced_q.popleft()
            held[p] = fence_of.pop(p)
            mask[p] = 1
            ever[p] = 1
        return pages + reused, tuple(fences.values())

    def alloc_fenced(self, n: int) -> tuple[torch.Tensor, tuple[SlotFence, ...]] | None:
        """`alloc(n)` that may also hand out fenced slots, last: (slot indices, the fences to wait on)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0 or n % self.page_size:
            raise ValueError(f"alloc size must be a non-negative multiple of page_size {self.page_size}, got {n!r}")
        got = self.alloc_pages_fenced(n // self.page_size)
        if got is None:
            return None
        pages, fences = got
        out = torch.from_numpy(self.slots_of(pages))
        return (out if self.device.type == "cpu" else out.to(self.device)), fences

    def reclaim_fenced(self) -> int:
        """Move the fenced free pages whose fence has passed to the plain free list (one event query per
        distinct fence, never a synchronize); returns how many moved."""
        fenced_q, fence_of = self._fenced_pages, self._page_fence
        passed: dict[int, bool] = {}
        keep: list[int] = []
        moved: list[int] = []
        for p in fenced_q:
            f = fence_of[p]
            ok = passed.get(id(f))
            if ok is None:
                ok = passed[id(f)] = f.passed()
            (moved if ok else keep).append(p)
        if moved:
            for p in moved:
                del fence_of[p]
            fenced_q.clear()
            fenced_q.extend(keep)
            self._free_pages.extend(moved)
        return len(moved)

    def _put_free(self, pages: list[int], fence: SlotFence | None) -> None:
        """Pages just marked free: behind the plain free pages, or, fenced and not passed, in the fenced FIFO;
        a page still carrying the fence it was handed out with keeps it (joined with `fence`)."""
        if self._held_fence:  # only after alloc_fenced handed out fenced pages: a dict test otherwise
            held = self._held_fence
            carried = {p: held.pop(p) for p in pages if p in held}
            if carried:
                self._put_free_carrying(pages, fence, carried)
                return
        if fence is None or fence.passed():
            self._free_pages.extend(pages)
            return
        self._fenced_pages.extend(pages)
        for p in pages:
            self._page_fence[p] = fence

    def _put_free_carrying(self, pages: list[int], fence: SlotFence | None, carried: dict[int, SlotFence]) -> None:
        """_put_free of pages some of which carry a fence from their last hand-out: each goes back with the
        join of `fence` and its own (one join per distinct carried fence), plain once all have passed."""
        joined: dict[int, SlotFence | None] = {}
        plain: list[int] = []
        for p in pages:
            old = carried.get(p)
            key = id(old)
            if key not in joined:
                joined[key] = SlotFence.join((fence, old))
            f = joined[key]
            if f is None:
                plain.append(p)
            else:
                self._fenced_pages.append(p)
                self._page_fence[p] = f
        self._free_pages.extend(plain)

    def slots_of(self, pages: Sequence[int] | np.ndarray) -> np.ndarray:
        """The slot indices (int64, page by page, in order) of `pages`."""
        return np.add.outer(np.asarray(pages, dtype=np.int64) * self.page_size, self._offsets_np).reshape(-1)

    def page_slots(self, pages: list[int]) -> PageSlots:
        """`pages` (e.g. from alloc_pages) with their slots, in order."""
        return PageSlots(self, list(pages))

    def owns_page_list(self, pages: Sequence[int]) -> bool:
        """Whether `pages` are page ids in range, each once, each allocated now: three C-level passes over
        the list (what frees and copy checks of whole-page batches cost), no tensors."""
        if not pages:
            return True
        mask = self._allocated_bytes
        try:
            return (
                min(pages) >= self.reserved_pages
                and max(pages) < self.num_pages
                and len(set(pages)) == len(pages)
                and all(map(mask.__getitem__, pages))
            )
        except TypeError:
            raise OutOfRange(f"page ids must be integers, got {list(pages)[:8]}") from None

    def frees_newest_first(self) -> bool:
        """False: freed pages join the end of the free list and are handed out oldest first, so one free of
        several requests' pages in request order leaves the list as one free a request does (the manager's
        batched releases, OffloadEffects.release_request_each)."""
        return False

    def free_pages(self, pages: Sequence[int], fence: SlotFence | None = None) -> None:
        """Free the pages named (page ids, each once, each allocated), or raise and change nothing; with a
        `fence` (copies still reading them), they are handed out again only with it.

        The validation is three C-level passes over the list (range, distinctness, mask); a batch that
        fails any of them is re-checked slot by slot, which names the error exactly."""
        if not pages:
            return
        if not self.owns_page_list(pages):
            self._validate_free(self.slots_of(pages))
            raise AssertionError("unreachable: the exact check accepted a batch the page check rejected")
        mask = self._allocated_bytes
        for p in pages:
            mask[p] = 0
        self._put_free(list(pages), fence)

    def free(self, indices: IndexLike, fence: SlotFence | None = None) -> None:
        """Free exactly the pages covered by `indices` (whole pages, each once), or raise and change nothing;
        with a `fence`, as free_pages."""
        pages = self._validate_free(as_index_array(indices))
        mask = self._allocated_bytes
        for p in pages:
            mask[p] = 0
        self._put_free(pages, fence)

    def undo_alloc(self, indices: IndexLike) -> None:
        """Give back slots exactly as the alloc calls that returned them (in that order) found the pool:
        the pages go back to the front of the free list. For rolling back a call that cannot complete."""
        idx = as_index_array(indices)
        self._validate_free(idx)  # whole allocated pages, each once
        pages = (idx[:: self.page_size] // self.page_size).tolist()
        mask = self._allocated_bytes
        for p in pages:
            mask[p] = 0
        self._free_pages.extendleft(reversed(pages))

    def pages_of(self, idx: np.ndarray) -> list[int] | None:
        """The page ids, if `idx` (int64, flat) is whole pages, each in slot order, each page once, in
        range; None otherwise (the exact checks then decide). No sort and a handful of numpy calls (what
        a hot path pays for, more than the batch size): the fast path for what alloc hands out."""
        ps, n = self.page_size, idx.size
        if ps == 1 or n == 0 or n % ps:
            return None
        rows = idx.reshape(-1, ps)
        pages = rows[:, 0] // ps
        if not (rows == np.add.outer(pages * ps, self._offsets_np)).all():  # aligned and consecutive
            return None
        listed = pages.tolist()
        if min(listed) < 0 or max(listed) >= self.num_pages or len(set(listed)) != len(listed):
            return None
        return listed

    def owned_pages(self, idx: np.ndarray) -> list[int] | None:
        """`pages_of(idx)` when every one of those pages is allocated now, else None: the fast path of
        every check that a batch is allocated whole pages (free, copy planning, page bytes)."""
        pages = self.pages_of(idx)
        return pages if pages is not None and all(map(self._allocated_bytes.__getitem__, pages)) else None

    def _validate_free(self, arr: np.ndarray) -> list[int]:
        """The pages a free of `arr` (int64, flat) would return, or raise the exact error."""
        pages = self.owned_pages(arr)
        if pages is not None:
            return pages
        n = int(arr.size)
        if n == 0:
            return []
        ps = self.page_size
        s = np.sort(arr)
        lo, hi = int(s[0]), int(s[-1])
        if lo < 0 or hi >= self.num_slots:
            raise OutOfRange(f"slot index outside [0, {self.num_slots}): min {lo}, max {hi}")
        if n > 1:
            dup = s[1:] == s[:-1]
            if dup.any():
                raise DuplicateIndex(f"slot {int(s[1:][dup][0])} appears more than once in one free batch")
        if n % ps:
            raise PartialPage(f"free batch of {n} slots does not cover whole pages of {ps}")
        rows = s.reshape(-1, ps)
        if ps > 1 and (((rows - rows[:, :1]) != self._offsets_np).any() or (rows[:, 0] % ps != 0).any()):
            raise PartialPage(f"free batch of {n} slots does not cover whole pages of {ps}")
        pages = (rows[:, 0] // ps).tolist()
        mask = self._allocated_bytes
        bad = [p for p in pages if not mask[p]]
        if bad:
            never = [p for p in bad if not self._ever_bytes[p]]
            if never:
                raise NeverAllocated(f"page(s) {never[:8]} (slot {never[0] * ps}...) were never allocated")
            raise DoubleFree(f"page(s) {bad[:8]} (slot {bad[0] * ps}...) are already free")
        return pages
