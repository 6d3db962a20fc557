"""The copy interface: one CopyEngine API for device <-> host KV copies, and the checks every engine runs.

A copy moves whole token rows (every plane and layer) from scattered source slots to scattered
destination slots. `submit_*` returns a CopyHandle at once; `done()` never blocks, `wait()` does.
`plan_copy` validates a copy before any byte moves; `run_plan` is the reference copy the CPU engines use.
A new copy path implements CopyEngine in its own module of this package (cpu.py, cuda.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import numpy as np
import torch

from ..errors import CopyError, DuplicateIndex, NotAllocated, OutOfRange
from ..pools.allocator import IndexLike, PageSlots, as_index_tensor
from ..pools.device_pool import DeviceKVPool
from ..pools.host_pool import HostKVPool

Direction = Literal["d2h", "h2d"]


class CopyHandle(ABC):
    """One submitted copy. Keeps what the copy reads and writes alive until its completion is observed."""

    direction: Direction
    num_tokens: int
    nbytes: int

    @abstractmethod
    def done(self) -> bool:
        """True once the copy has landed; never blocks."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the copy has landed."""

    def wait_stream(self, stream: object | None = None) -> None:
        """Order later work on `stream` after the copy. CPU handles have no streams: this waits."""
        self.wait()


class CopyEngine(ABC):
    """Device ⇄ host copies of whole token rows into and out of scattered slots."""

    # Whether its handles are fences (kvfsm.dataplane.fences): `done()` answers by a query and
    # `wait_stream(s)` orders a writer on `s` after the copy. The manager releases slots under a copy
    # fenced only over an engine that says so.
    fences: bool = False

    @abstractmethod
    def submit_d2h(
        self, device_pool: DeviceKVPool, device_indices: IndexLike, host_pool: HostKVPool, host_indices: IndexLike
    ) -> CopyHandle:
        """Offload: host[host_indices] <- device[device_indices], every plane and layer."""

    @abstractmethod
    def submit_h2d(
        self, host_pool: HostKVPool, host_indices: IndexLike, device_pool: DeviceKVPool, device_indices: IndexLike
    ) -> CopyHandle:
        """Load back: device[device_indices] <- host[host_indices], every plane and layer."""


# ---- shared validation and the reference copy -----------------------------------------------------


class CopyPlan:
    """A validated copy: the two pools and the slots, as int64 index tensors (host ones on the CPU; device
    ones on the CPU unless they were given on the GPU: an engine uploads CPU ones without blocking).

    Slots given as lists stay lists (`device_ids`, and a host `PageSlots`'s `host_pages`), and the tensors are
    built from them on first use: a backend that addresses rows from the lists ("dma_rows") never pays for
    them (a torch and a numpy call each, tens of microseconds when a forward pass has left the CPU caches
    cold: bench/results/transformers_host_time-h200.json)."""

    __slots__ = (
        "direction",
        "device_pool",
        "host_pool",
        "num_tokens",
        "host_pages",
        "device_ids",
        "_device_idx",
        "_host_idx",
        "_host_slots",
    )

    def __init__(
        self,
        direction: Direction,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        device_idx: torch.Tensor | None,
        host_idx: torch.Tensor | None,
        num_tokens: int,
        host_pages: list[int] | None = None,
        device_ids: list[int] | None = None,
        host_slots: PageSlots | None = None,
    ) -> None:
        self.direction, self.device_pool, self.host_pool = direction, device_pool, host_pool
        self.num_tokens = num_tokens  # len(host slots), counted once when planned
        self.host_pages = host_pages  # the host slots' page ids, when they came as PageSlots of this pool
        self.device_ids = device_ids  # the device slots, when they came as a list of ints
        self._device_idx, self._host_idx, self._host_slots = device_idx, host_idx, host_slots

    @property
    def device_idx(self) -> torch.Tensor:
        if self._device_idx is None:
            self._device_idx = as_index_tensor(self.device_ids or [], _CPU)
        return self._device_idx

    @device_idx.setter
    def device_idx(self, value: torch.Tensor) -> None:
        self._device_idx = value

    @property
    def host_idx(self) -> torch.Tensor:
        if self._host_idx is None:
            self._host_idx = self._host_slots.slots if self._host_slots is not None else as_index_tensor([], _CPU)
        return self._host_idx

    @host_idx.setter
    def host_idx(self, value: torch.Tensor) -> None:
        self._host_idx = value

    @property
    def device_on_cpu(self) -> bool:
        """Whether the device slots can be read on the host (a list, or a CPU tensor) without a GPU wait."""
        return self.device_ids is not None or self.device_idx.device.type == "cpu"

    @property
    def nbytes(self) -> int:
        return self.num_tokens * self.device_pool.config.bytes_per_token

    def views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(src view, src idx, dst view, dst idx) in copy direction."""
        d, h = self.device_pool.token_view(), self.host_pool.token_view()
        if self.direction == "d2h":
            return d, self.device_idx, h, self.host_idx
        return h, self.host_idx, d, self.device_idx


_CPU = torch.device("cpu")
_INTS = {int}


def plan_copy(
    direction: Direction,
    device_pool: DeviceKVPool,
    device_indices: IndexLike,
    host_pool: HostKVPool,
    host_indices: IndexLike,
) -> CopyPlan:
    """Check that the pools match and the indices are sane; raise CopyError/SlotError before any copy.

    Host indices must be distinct, in range and allocated (cheap: CPU). Device indices stay where they
    arrive: CPU indices (what the manager passes, read from the request table's host mirror) are checked
    on the CPU against the device allocator's host-side state (PageSlots) or the pool's range, and the
    engine uploads them without blocking; indices already on the GPU are counted, never read, since
    reading them would wait for the compute stream. A list of ints (an engine's block table) and host
    PageSlots are checked as lists and kept as lists (CopyPlan builds their tensors only if asked).
    """
    dc, hc = device_pool.config, host_pool.config
    # a host pool built on the device's config holds that config itself: nothing to compare
    if dc is not hc and (dc.num_planes, dc.num_layers, dc.token_shape, dc.dtype) != (
        hc.num_planes,
        hc.num_layers,
        hc.token_shape,
        hc.dtype,
    ):
        raise CopyError(f"device pool {dc} and host pool {hc} hold different KV shapes")
    # a list of Python ints is kept (copied: the caller's table may change after the submit)
    ids = device_indices[:] if type(device_indices) is list and set(map(type, device_indices)) <= _INTS else None
    dev_idx = None
    if ids is None:
        on_device = isinstance(device_indices, torch.Tensor) and device_indices.device.type != "cpu"
        if on_device and device_pool.device.type != "cpu" and device_indices.device != device_pool.device:  # type: ignore[union-attr]
            raise CopyError(f"device slots on {device_indices.device}, device pool on {device_pool.device}")  # type: ignore[union-attr]
        # CPU pools (the CPU engines) take their indices on the CPU; otherwise they stay where they are
        dev_idx = as_index_tensor(
            device_indices, device_pool.device if device_pool.device.type == "cpu" or on_device else _CPU
        )
    host_slots = host_indices if isinstance(host_indices, PageSlots) else None
    host_idx = None if host_slots is not None else as_index_tensor(host_indices, _CPU)
    # a PageSlots counts its slots from its page list (no tensor call)
    n_dev = len(device_indices) if ids is not None or isinstance(device_indices, PageSlots) else int(dev_idx.numel())  # type: ignore[union-attr]
    n_host = len(host_slots) if host_slots is not None else int(host_idx.numel())  # type: ignore[union-attr]
    if n_dev != n_host:
        raise CopyError(f"{n_dev} device slots vs {n_host} host slots")
    if n_host:
        allocator = host_pool.allocator
        if host_slots is not None and host_slots.allocator is allocator:
            owned = allocator.owns_page_list(host_slots.pages)  # the pages, checked as a list
        else:
            if host_idx is None:
                host_idx = host_slots.slots  # type: ignore[union-attr]
            owned = allocator.owned_pages(host_idx.numpy()) is not None  # whole allocated pages in slot order?
        if not owned:
            s = np.sort((host_idx if host_idx is not None else host_slots.slots).numpy())  # type: ignore[union-attr]
            if int(s[0]) < 0 or int(s[-1]) >= host_pool.size:
                raise OutOfRange(f"host slot outside [0, {host_pool.size})")
            if s.size > 1 and bool((s[1:] == s[:-1]).any()):
                raise DuplicateIndex("a host slot appears twice in one copy")
            if not bool(allocator.is_allocated(s).all()):
                raise NotAllocated("copy touches a host slot that is not allocated")
        if (
            isinstance(device_indices, PageSlots)
            and device_indices.allocator.num_slots <= device_pool.size
            and device_indices.allocator.owns_page_list(device_indices.pages)
        ):
            pass  # whole device pages the pool's allocator has handed out (and not taken back): in range
        elif ids is not None:
            if min(ids) < 0 or max(ids) >= device_pool.size:
                raise OutOfRange(f"device slot outside [0, {device_pool.size})")
        # negative slots read as huge unsigned ones: one reduction checks both bounds
        elif dev_idx.device.type == "cpu" and int(dev_idx.numpy().view(np.uint64).max()) >= device_pool.size:  # type: ignore[union-attr]
            raise OutOfRange(f"device slot outside [0, {device_pool.size})")
    pages = host_slots.pages if host_slots is not None and host_slots.allocator is host_pool.allocator else None
    return CopyPlan(direction, device_pool, host_pool, dev_idx, host_idx, n_host, pages, ids, host_slots)


def torch_copy_rows(src5: torch.Tensor, src_idx: torch.Tensor, dst5: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """dst5[:, :, dst_idx] = src5[:, :, src_idx] with index_select/index_copy_ (never `dst[idx].copy_`,
    which writes into the temporary that advanced indexing returns: B15)."""
    rows = src5.index_select(2, src_idx.to(src5.device))
    dst5.index_copy_(2, dst_idx.to(dst5.device), rows.to(dst5.device))


def run_plan(plan: CopyPlan) -> None:
    """The reference copy: `torch_copy_rows` over the two token views, or, for a device pool of separate
    per-layer buffers (no token view), the pool's own gather/scatter."""
    if not plan.num_tokens:
        return
    if not plan.device_pool.has_token_view:
        dev, host = plan.device_pool, plan.host_pool.token_view()
        di = plan.device_idx.to(dev.device)
        if plan.direction == "d2h":
            host.index_copy_(2, plan.host_idx, dev.gather_rows(di).to(host.device))
        else:
            dev.scatter_rows(di, host.index_select(2, plan.host_idx).to(dev.device))
        return
    src, si, dst, di = plan.views()
    torch_copy_rows(src, si, dst, di)
