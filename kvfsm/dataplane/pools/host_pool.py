"""Host (CPU) KV pool: the L2 tier the decode side offloads into.

Pinned when CUDA is present, so copies to and from it are real DMA and device kernels can address it
through unified virtual addressing; plain memory otherwise. Slots are managed by a TokenSlotAllocator
without a padding page, so alloc is page-granular and all-or-nothing, and every free is checked against
an allocated-mask (B10: double free rejected, with no state change).

Layouts (as in SGLang HiCache):
  MHA  layer_first `(2, L, size, H, D)`   page_first `(2, size, L, H, D)`
  MLA  layer_first `(L, size, 1, D)`      page_first `(size, L, 1, D)`
`token_view()` presents each as `(planes, L, size, H, D)`, which is what the copy engines index.

Pages serialised for storage use one canonical byte order, `(planes, L, page_size, H, D)`, whatever the
layout, so a page written from one layout reads back into the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from ..errors import HostMemoryError, NotAllocated, PartialPage
from .allocator import IndexLike, PageSlots, TokenSlotAllocator, as_index_tensor
from .config import KVCacheConfig
from .device_pool import DeviceKVPool
from .shared_memory import attach_buffer, shared_buffer

Layout = Literal["layer_first", "page_first"]
LAYOUTS: tuple[Layout, ...] = ("layer_first", "page_first")


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where there is no such file."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class HostKVPool:
    """Page-granular host KV storage with an allocated-mask."""

    def __init__(
        self,
        config: KVCacheConfig,
        num_slots: int,
        page_size: int = 1,
        layout: Layout = "layer_first",
        pin_memory: bool | None = None,
        headroom_bytes: int = 0,
        *,
        shared: bool = False,
        attach_fd: int | None = None,
    ) -> None:
        """shared: the buffer lives in an anonymous memory file that another process can map (`share_fd`), so
        a store process reads its pages in place (ProcessStorage). attach_fd: map such a buffer, handed over
        from the process that made it: no allocation and no pinning, and every page counts as allocated (the
        owner allocates and checks; this side only reads). The descriptor is this pool's from here."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if page_size <= 0 or num_slots < page_size:
            raise ValueError(f"host pool needs at least one page: num_slots={num_slots}, page_size={page_size}")
        num_slots -= num_slots % page_size
        self.config = config
        self.size = int(num_slots)
        self.page_size = int(page_size)
        self.layout: Layout = layout
        requested = self.size * config.bytes_per_token
        self.share_fd: int | None = None  # the memory file another process maps (shared=True)
        if attach_fd is not None:
            self.pinned = False
            self.kv_buffer = attach_buffer(attach_fd, requested).view(config.dtype).view(self._shape())
            self.allocator = TokenSlotAllocator(self.size, self.page_size, "cpu", reserve_padding_page=False)
            self.allocator.alloc_pages(self.size // self.page_size)  # the owner allocates; here every page is readable
            return
        available = available_host_memory()
        if available is not None and requested + headroom_bytes > available:
            raise HostMemoryError(requested + headroom_bytes, available)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.pinned = bool(pin_memory)
        if self.pinned and not torch.cuda.is_available():
            # Checked here rather than left to torch, whose error depends on its build: a CPU build names CUDA, a CUDA
            # build on a host without a driver names only the driver. The type is the one torch raises.
            raise RuntimeError(
                "pin_memory=True needs CUDA: the host pool is "
                + ("page-locked with cudaHostRegister" if shared else "a pinned tensor, which CUDA page-locks")
                + ", and CUDA is not available"
            )
        if shared:
            buf, self.share_fd = shared_buffer(requested, self.pinned)
            self.kv_buffer = buf.view(config.dtype).view(self._shape())
        else:
            self.kv_buffer = torch.empty(self._shape(), dtype=config.dtype, pin_memory=self.pinned)
        self.allocator = TokenSlotAllocator(self.size, self.page_size, "cpu", reserve_padding_page=False)

    @classmethod
    def for_device_pool(
        cls,
        device_pool: DeviceKVPool,
        page_size: int = 1,
        ratio: float | None = 2.0,
        size_bytes: int | None = None,
        layout: Layout = "layer_first",
        pin_memory: bool | None = None,
        *,
        shared: bool = False,
    ) -> HostKVPool:
        """Size by `size_bytes` when given (it wins, as in SGLang), else by `ratio` x the device pool's slots."""
        cfg = device_pool.config
        if size_bytes is not None:
            num_slots = int(size_bytes) // cfg.bytes_per_token
        elif ratio is not None and ratio > 0:
            num_slots = int(device_pool.size * ratio)
        else:
            raise ValueError("give a positive ratio or size_bytes")
        return cls(cfg, num_slots, page_size, layout, pin_memory, shared=shared)

    def _shape(self) -> tuple[int, ...]:
        c = self.config
        if c.is_mla:
            inner = (c.num_layers, self.size) if self.layout == "layer_first" else (self.size, c.num_layers)
            return (*inner, 1, c.head_dim)
        inner = (c.num_layers, self.size) if self.layout == "layer_first" else (self.size, c.num_layers)
        return (2, *inner, c.kv_heads, c.head_dim)

    # ---- views and sizes --------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.config.dtype

    @property
    def nbytes(self) -> int:
        return self.kv_buffer.numel() * self.kv_buffer.element_size()

    @property
    def page_nbytes(self) -> int:
        return self.page_size * self.config.bytes_per_token

    def token_view(self) -> torch.Tensor:
        """`(planes, L, size, H, D)` view of kv_buffer (a permuted, non-contiguous view for page_first)."""
        b = self.kv_buffer
        if self.config.is_mla:
            b = b.unsqueeze(0)
        return b if self.layout == "layer_first" else b.transpose(1, 2)

    # ---- allocation (delegated; see TokenSlotAllocator for the rejections) ------------------------
    @property
    def free_slots(self) -> int:
        return self.allocator.free_slots

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def alloc(self, n: int) -> torch.Tensor | None:
        """n host slot indices (int64, CPU), whole pages, or None when too few pages are free."""
        if self.released:
            raise RuntimeError("host pool released (release()): it holds no memory any more")
        return self.allocator.alloc(n)

    @property
    def released(self) -> bool:
        return self.kv_buffer.numel() == 0 and self.size > 0

    def release(self) -> None:
        """Give the (pinned) buffer back now, at shutdown, rather than when the last reference goes; only a pool
        no slot of which is allocated may be released."""
        if self.free_slots != self.capacity:
            raise RuntimeError(f"host pool release with {self.capacity - self.free_slots} slots still allocated")
        self.kv_buffer = torch.empty(0, dtype=self.config.dtype)

    def free(self, indices: IndexLike) -> None:
        self.allocator.free(indices)

    def alloc_pages(self, k: int) -> list[int] | None:
        """k whole host pages as page ids, or None when too few are free (see TokenSlotAllocator)."""
        return self.allocator.alloc_pages(k)

    def free_pages(self, pages: Sequence[int]) -> None:
        self.allocator.free_pages(pages)

    def page_slots(self, pages: list[int]) -> PageSlots:
        """Host pages with their slots (see TokenSlotAllocator.page_slots): what the copy engine checks cheaply."""
        return self.allocator.page_slots(pages)

    def slots_of(self, pages: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Host slot indices (int64, CPU) of whole pages, page by page."""
        return torch.from_numpy(self.allocator.slots_of(pages))

    def undo_alloc(self, indices: IndexLike) -> None:
        """Roll back allocations (see TokenSlotAllocator.undo_alloc)."""
        self.allocator.undo_alloc(indices)

    def check_conservation(self) -> None:
        self.allocator.check_conservation()

    # ---- whole pages as bytes (for storage) -------------------------------------------------------
    def _page_index(self, indices: IndexLike) -> torch.Tensor:
        if (
            isinstance(indices, PageSlots)
            and indices.allocator is self.allocator
            and indices.pages
            and self.allocator.owns_page_list(indices.pages)
        ):
            return indices.slots  # checked as a page list; anything else takes the checks below
        idx = as_index_tensor(indices, torch.device("cpu"))
        if self.allocator.owned_pages(idx.numpy()) is not None:  # whole allocated pages in order: the usual case
            return idx
        ps = self.page_size
        if idx.numel() == 0 or idx.numel() % ps:
            raise PartialPage(f"{idx.numel()} host slots are not whole pages of {ps}")
        rows = idx.view(-1, ps)
        if bool(((rows - rows[:, :1]) != torch.arange(ps)).any() | (rows[:, 0] % ps != 0).any()):
            raise PartialPage("each run of page_size host indices must be one whole page, in order")
        if not bool(self.allocator.is_allocated(rows[:, 0]).all()):
            raise NotAllocated("page bytes requested for a host page that is not allocated")
        return idx

    def pages_of(self, host_indices: IndexLike) -> list[int]:
        """The page ids of `host_indices`, in order: whole pages, allocated now (PartialPage, NotAllocated)."""
        idx = self._page_index(host_indices)
        if isinstance(host_indices, PageSlots) and host_indices.allocator is self.allocator:
            return host_indices.pages
        return (idx[:: self.page_size] // self.page_size).tolist()  # type: ignore[no-any-return]

    def get_pages_bytes(self, host_indices: IndexLike, out: np.ndarray | None = None) -> torch.Tensor:
        """`[pages, page_nbytes]` uint8, one row per page in the order given (canonical byte order: planes,
        layers, then the page's tokens). `out`: a flat uint8 buffer of at least that many bytes to gather
        into (ProcessStorage's shared staging, which then needs no copy of its own); the result is its head.

        One numpy copy per page out of the pool's (P, L, pages, page, H, D) view. What it saves
        (bench/probes/page_bytes_probe.py -> bench/results/page_bytes_probe-h200.json, 32 MiB of
        Llama-3-8B rows, one thread, H200 host): a torch index_select of the strided token view plus a
        permute took 32-41 ms, this 6.7-12.6 ms (3.3-5x). The backup worker calls this
        for every batch of chunks it writes, on a thread that shares the interpreter with the scheduler."""
        pages = self.pages_of(host_indices)
        c, ps = self.config, self.page_size
        word = {2: torch.int16, 4: torch.int32}[c.element_size]
        view = self.token_view().view(word).numpy()  # (P, L, size, H, D), strided, no copy
        view = view.reshape(c.num_planes, c.num_layers, self.size // ps, ps, *c.token_shape)
        shape = (len(pages), c.num_planes, c.num_layers, ps, *c.token_shape)
        if out is None:
            dst = np.empty(shape, dtype=view.dtype)
        elif out.dtype != np.uint8 or out.ndim != 1 or out.nbytes < len(pages) * self.page_nbytes:
            raise ValueError(
                f"out must be a flat uint8 array of at least {len(pages) * self.page_nbytes} bytes, "
                f"got {out.dtype} {out.shape}"
            )
        else:
            dst = out[: len(pages) * self.page_nbytes].view(view.dtype).reshape(shape)
        for j, page in enumerate(pages):
            dst[j] = view[:, :, page]
        return torch.from_numpy(dst.view(np.uint8).reshape(len(pages), self.page_nbytes))

    def set_pages_bytes(self, host_indices: IndexLike, data: torch.Tensor) -> None:
        """Write `[pages, page_nbytes]` uint8 (as returned by get_pages_bytes) into the given pages."""
        idx = self._page_index(host_indices)
        c, ps = self.config, self.page_size
        k = idx.numel() // ps
        if data.dtype != torch.uint8 or data.numel() != k * self.page_nbytes:
            raise ValueError(f"expected {k} x {self.page_nbytes} uint8 bytes, got {tuple(data.shape)} {data.dtype}")
        es = c.element_size
        x = data.detach().to("cpu").contiguous().view(k, c.num_planes, c.num_layers, ps, c.kv_heads, c.head_dim * es)
        x = x.view(c.dtype).permute(1, 2, 0, 3, 4, 5).reshape(c.num_planes, c.num_layers, k * ps, *c.token_shape)
        self.token_view().index_copy_(2, idx, x)

    def get_page_bytes(self, host_indices_of_one_page: IndexLike) -> torch.Tensor:
        """One page as a flat uint8 tensor of page_nbytes."""
        out = self.get_pages_bytes(host_indices_of_one_page)
        if out.shape[0] != 1:
            raise PartialPage(f"expected the indices of one page, got {out.shape[0]} pages")
        return out[0]

    def set_page_bytes(self, host_indices_of_one_page: IndexLike, data: torch.Tensor) -> None:
        idx = as_index_tensor(host_indices_of_one_page, torch.device("cpu"))
        if idx.numel() != self.page_size:
            raise PartialPage(f"expected the {self.page_size} indices of one page, got {idx.numel()}")
        self.set_pages_bytes(idx, data.reshape(1, -1))
