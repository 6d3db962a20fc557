"""Page-aware token-slot allocator.

Slots are handed out and taken back in whole pages only. The allocator keeps a free list of page ids and
a per-page allocated-mask; every free is validated against the mask before anything changes, so a double
free (B9/B10), a free of a never-allocated slot, a repeated index in one batch (B12) or a batch that
covers part of a page (B11) is rejected as a typed error and leaves the allocator exactly as it was.

Page 0 (slots `[0, page_size)`) is reserved as padding by default, like SGLang, whose kernels write
dummy tokens to slot 0; it is never allocated and never in the free list, and `capacity` excludes it.

Hot paths are a handful of torch ops over the indices (sort, compare, gather, cat); no per-slot Python.
On CUDA the validation of a free costs one host synchronisation (one `.tolist()` of four flags).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .device_pool import resolve_device
from .errors import (
    ConservationError,
    DoubleAlloc,
    DoubleFree,
    DuplicateIndex,
    NeverAllocated,
    OutOfRange,
    PartialPage,
)

IndexLike = torch.Tensor | Sequence[int]


def as_index_tensor(indices: IndexLike, device: torch.device) -> torch.Tensor:
    """A flat int64 tensor on `device`; rejects floating/bool tensors (an index that silently truncates)."""
    if isinstance(indices, torch.Tensor):
        if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
            raise OutOfRange(f"slot indices must be an integer tensor, got {indices.dtype}")
        t = indices.reshape(-1)
    else:
        t = torch.as_tensor(list(indices), dtype=torch.int64)
    return t.to(device=device, dtype=torch.int64)


class TokenSlotAllocator:
    """Allocates page-aligned token slots of a pool with `num_slots` slots.

    alloc(n) needs n to be a multiple of page_size and returns all n slots or None (never partial);
    free(indices) frees exactly the pages the batch covers.
    """

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
        self.device = resolve_device(device)
        self.reserved_pages = 1 if reserve_padding_page else 0
        if self.num_pages <= self.reserved_pages:
            raise ValueError("pool too small: no allocatable page besides the padding page")
        self._offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        self._free_pages = torch.arange(self.reserved_pages, self.num_pages, dtype=torch.int64, device=self.device)
        self._allocated = torch.zeros(self.num_pages, dtype=torch.bool, device=self.device)
        self._ever_allocated = torch.zeros(self.num_pages, dtype=torch.bool, device=self.device)

    # ---- accounting -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Slots that can ever be allocated (all slots minus the padding page)."""
        return (self.num_pages - self.reserved_pages) * self.page_size

    @property
    def free_slots(self) -> int:
        return int(self._free_pages.numel()) * self.page_size

    @property
    def free_pages(self) -> int:
        return int(self._free_pages.numel())

    @property
    def allocated_slots(self) -> int:
        return int(self._allocated.sum().item()) * self.page_size

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(free list, per-page allocated mask) copies: equal snapshots mean equal allocator state."""
        return self._free_pages.clone(), self._allocated.clone()

    def is_allocated(self, indices: IndexLike) -> torch.Tensor:
        """Per-slot bool: is the page holding each slot allocated right now (for invariant checks)."""
        idx = as_index_tensor(indices, self.device)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_slots):
            raise OutOfRange(f"slot index outside [0, {self.num_slots})")
        return self._allocated[idx // self.page_size]

    def check_conservation(self) -> None:
        """Raise ConservationError unless free list and allocated-mask describe the same partition."""
        free = self._free_pages
        n_free = int(free.numel())
        n_alloc = int(self._allocated.sum().item())
        if n_free + n_alloc + self.reserved_pages != self.num_pages:
            raise ConservationError(
                f"free pages {n_free} + allocated {n_alloc} + reserved {self.reserved_pages} != {self.num_pages}"
            )
        if n_free:
            if int(free.min()) < self.reserved_pages or int(free.max()) >= self.num_pages:
                raise ConservationError("free list holds a reserved or out-of-range page")
            if int(torch.unique(free).numel()) != n_free:
                raise ConservationError("free list holds a page twice")
            if bool(self._allocated[free].any()):
                raise ConservationError("a page is both in the free list and marked allocated")
        if self.reserved_pages and bool(self._allocated[: self.reserved_pages].any()):
            raise ConservationError("the padding page is marked allocated")

    # ---- alloc / free -----------------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor | None:
        """n page-aligned slot indices (int64, on the allocator's device), or None if too few free pages."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"alloc size must be a non-negative int, got {n!r}")
        if n % self.page_size:
            raise ValueError(f"alloc size {n} is not a multiple of page_size {self.page_size}")
        k = n // self.page_size
        if k > self._free_pages.numel():
            return None
        pages = self._free_pages[:k]
        if k and bool(self._allocated[pages].any()):
            raise DoubleAlloc("free list hands out a page the allocated-mask already owns")
        self._free_pages = self._free_pages[k:]
        self._allocated[pages] = True
        self._ever_allocated[pages] = True
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)

    def free(self, indices: IndexLike) -> None:
        """Free exactly the pages covered by `indices` (whole pages, each once), or raise and change nothing."""
        pages = self._validate_free(as_index_tensor(indices, self.device))
        if pages is None:
            return
        self._allocated[pages] = False
        self._free_pages = torch.cat([self._free_pages, pages])

    def _validate_free(self, idx: torch.Tensor) -> torch.Tensor | None:
        n = int(idx.numel())
        if n == 0:
            return None
        ps = self.page_size
        s = torch.sort(idx).values
        flags = [(s[0] < 0) | (s[-1] >= self.num_slots)]
        flags.append((s[1:] == s[:-1]).any() if n > 1 else torch.zeros((), dtype=torch.bool, device=idx.device))
        whole = n % ps == 0
        if whole:
            rows = s.view(-1, ps)
            flags.append(((rows - rows[:, :1]) != self._offsets).any() | (rows[:, 0] % ps != 0).any())
            pages = torch.div(rows[:, 0], ps, rounding_mode="floor").clamp_(0, self.num_pages - 1)
            flags.append(~self._allocated[pages].all())
        oob, dup, *rest = torch.stack(flags).tolist()
        if oob:
            raise OutOfRange(f"slot index outside [0, {self.num_slots}): min {int(s[0])}, max {int(s[-1])}")
        if dup:
            first = int(s[1:][s[1:] == s[:-1]][0])
            raise DuplicateIndex(f"slot {first} appears more than once in one free batch")
        if not whole or rest[0]:
            raise PartialPage(f"free batch of {n} slots does not cover whole pages of {ps}")
        if rest[1]:
            bad = pages[~self._allocated[pages]]
            never = bad[~self._ever_allocated[bad]]
            if never.numel():
                raise NeverAllocated(f"page(s) {never[:8].tolist()} (slot {int(never[0]) * ps}...) were never allocated")
            raise DoubleFree(f"page(s) {bad[:8].tolist()} (slot {int(bad[0]) * ps}...) are already free")
        return pages
