"""Copy engines: one interface for device ⇄ host KV copies, and the CPU implementations.

A copy moves whole token rows (every plane and layer) from scattered source slots to scattered
destination slots. `submit_*` returns a CopyHandle at once; `done()` never blocks, `wait()` does.

CPU engines (same interface as the CUDA one, for CI and model checking):
- CpuCopyEngine: copies during submit; handles are born done.
- ThreadCpuCopyEngine: copies on one worker thread, in submission order; done() polls.
- DeferredCpuCopyEngine: copies only when the test says so (complete(handle), complete_next(),
  complete_all()), reading the source *then*. A device slot freed and rewritten before completion
  therefore really corrupts the copy, which is how tests catch B2 (free while a copy still reads).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import count
from typing import Literal

import numpy as np
import torch

from ..pools.allocator import IndexLike, PageSlots, as_index_tensor
from ..pools.device_pool import DeviceKVPool
from ..errors import CopyError, DuplicateIndex, NotAllocated, OutOfRange
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


@dataclass
class CopyPlan:
    """A validated copy: the two `(P, L, S, H, D)` views and int64 indices (host ones on the CPU; device
    ones on the CPU unless they were given on the GPU: an engine uploads CPU ones without blocking)."""

    direction: Direction
    device_pool: DeviceKVPool
    host_pool: HostKVPool
    device_idx: torch.Tensor
    host_idx: torch.Tensor
    num_tokens: int  # len(host_idx), counted once when planned
    host_pages: list[int] | None = None  # the host slots' page ids, when they came as PageSlots of this pool

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
    reading them would wait for the compute stream.
    """
    dc, hc = device_pool.config, host_pool.config
    if (dc.num_planes, dc.num_layers, dc.token_shape, dc.dtype) != (hc.num_planes, hc.num_layers, hc.token_shape, hc.dtype):
        raise CopyError(f"device pool {dc} and host pool {hc} hold different KV shapes")
    on_device = isinstance(device_indices, torch.Tensor) and device_indices.device.type != "cpu"
    if on_device and device_pool.device.type != "cpu" and device_indices.device != device_pool.device:  # type: ignore[union-attr]
        raise CopyError(f"device slots on {device_indices.device}, device pool on {device_pool.device}")  # type: ignore[union-attr]
    # CPU pools (the CPU engines) take their indices on the CPU; otherwise they stay where they are
    dev_idx = as_index_tensor(device_indices, device_pool.device if device_pool.device.type == "cpu" or on_device
                              else _CPU)
    host_idx = as_index_tensor(host_indices, _CPU)
    # a PageSlots counts its slots from its page list (no tensor call)
    n_dev = len(device_indices) if isinstance(device_indices, PageSlots) else int(dev_idx.numel())
    n_host = len(host_indices) if isinstance(host_indices, PageSlots) else int(host_idx.numel())
    if n_dev != n_host:
        raise CopyError(f"{n_dev} device slots vs {n_host} host slots")
    if n_host:
        allocator = host_pool.allocator
        if isinstance(host_indices, PageSlots) and host_indices.allocator is allocator:
            owned = allocator.owns_page_list(host_indices.pages)  # the pages, checked as a list
        else:
            owned = allocator.owned_pages(host_idx.numpy()) is not None  # whole allocated pages in slot order?
        if not owned:
            s = np.sort(host_idx.numpy())  # one sort gives range and duplicates
            if int(s[0]) < 0 or int(s[-1]) >= host_pool.size:
                raise OutOfRange(f"host slot outside [0, {host_pool.size})")
            if s.size > 1 and bool((s[1:] == s[:-1]).any()):
                raise DuplicateIndex("a host slot appears twice in one copy")
            if not bool(allocator.is_allocated(s).all()):
                raise NotAllocated("copy touches a host slot that is not allocated")
        if isinstance(device_indices, PageSlots) and device_indices.allocator.num_slots <= device_pool.size and \
                device_indices.allocator.owns_page_list(device_indices.pages):
            pass  # whole device pages the pool's allocator has handed out (and not taken back): in range
        # negative slots read as huge unsigned ones: one reduction checks both bounds
        elif dev_idx.device.type == "cpu" and int(dev_idx.numpy().view(np.uint64).max()) >= device_pool.size:
            raise OutOfRange(f"device slot outside [0, {device_pool.size})")
    pages = host_indices.pages if isinstance(host_indices, PageSlots) and host_indices.allocator is host_pool.allocator \
        else None
    return CopyPlan(direction, device_pool, host_pool, dev_idx, host_idx, n_host, pages)


def torch_copy_rows(src5: torch.Tensor, src_idx: torch.Tensor, dst5: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """dst5[:, :, dst_idx] = src5[:, :, src_idx] with index_select/index_copy_ (never `dst[idx].copy_`,
    which writes into the temporary that advanced indexing returns: B15)."""
    rows = src5.index_select(2, src_idx.to(src5.device))
    dst5.index_copy_(2, dst_idx.to(dst5.device), rows.to(dst5.device))


def run_plan(plan: CopyPlan) -> None:
    src, si, dst, di = plan.views()
    if plan.num_tokens:
        torch_copy_rows(src, si, dst, di)


# ---- CPU engines ----------------------------------------------------------------------------------


class _DoneHandle(CopyHandle):
    def __init__(self, plan: CopyPlan) -> None:
        self.direction, self.num_tokens, self.nbytes = plan.direction, plan.num_tokens, plan.nbytes

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class CpuCopyEngine(CopyEngine):
    """Synchronous: the copy has happened when submit returns."""

    def submit_d2h(self, device_pool, device_indices, host_pool, host_indices) -> CopyHandle:  # type: ignore[no-untyped-def]
        plan = plan_copy("d2h", device_pool, device_indices, host_pool, host_indices)
        run_plan(plan)
        return _DoneHandle(plan)

    def submit_h2d(self, host_pool, host_indices, device_pool, device_indices) -> CopyHandle:  # type: ignore[no-untyped-def]
        plan = plan_copy("h2d", device_pool, device_indices, host_pool, host_indices)
        run_plan(plan)
        return _DoneHandle(plan)


class _FutureHandle(CopyHandle):
    def __init__(self, plan: CopyPlan, future: Future[None]) -> None:
        self.direction, self.num_tokens, self.nbytes = plan.direction, plan.num_tokens, plan.nbytes
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.result()


class ThreadCpuCopyEngine(CopyEngine):
    """Asynchronous on one worker thread (FIFO), like a copy stream; a copy reads its source when it runs."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfsm-copy")

    def _submit(self, plan: CopyPlan) -> CopyHandle:
        plan.device_idx, plan.host_idx = plan.device_idx.clone(), plan.host_idx.clone()
        return _FutureHandle(plan, self._pool.submit(run_plan, plan))

    def submit_d2h(self, device_pool, device_indices, host_pool, host_indices) -> CopyHandle:  # type: ignore[no-untyped-def]
        return self._submit(plan_copy("d2h", device_pool, device_indices, host_pool, host_indices))

    def submit_h2d(self, host_pool, host_indices, device_pool, device_indices) -> CopyHandle:  # type: ignore[no-untyped-def]
        return self._submit(plan_copy("h2d", device_pool, device_indices, host_pool, host_indices))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> ThreadCpuCopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DeferredHandle(CopyHandle):
    """A copy that happens when its engine is told to complete it (wait() completes it too)."""

    def __init__(self, engine: DeferredCpuCopyEngine, plan: CopyPlan, seq: int) -> None:
        self.direction, self.num_tokens, self.nbytes = plan.direction, plan.num_tokens, plan.nbytes
        self.seq = seq
        self._engine = engine
        self._plan: CopyPlan | None = plan

    def done(self) -> bool:
        return self._plan is None

    def wait(self) -> None:
        self._engine.complete(self)

    def __repr__(self) -> str:
        return f"DeferredHandle(#{self.seq} {self.direction} {self.num_tokens} tokens, done={self.done()})"


class DeferredCpuCopyEngine(CopyEngine):
    """Copies are recorded at submit and performed at complete(): the test controls completion order."""

    def __init__(self) -> None:
        self._pending: OrderedDict[int, DeferredHandle] = OrderedDict()
        self._seq = count()
        self._lock = threading.Lock()

    def _submit(self, plan: CopyPlan) -> DeferredHandle:
        plan.device_idx, plan.host_idx = plan.device_idx.clone(), plan.host_idx.clone()
        with self._lock:
            handle = DeferredHandle(self, plan, next(self._seq))
            self._pending[handle.seq] = handle
        return handle

    def submit_d2h(self, device_pool, device_indices, host_pool, host_indices) -> DeferredHandle:  # type: ignore[no-untyped-def]
        return self._submit(plan_copy("d2h", device_pool, device_indices, host_pool, host_indices))

    def submit_h2d(self, host_pool, host_indices, device_pool, device_indices) -> DeferredHandle:  # type: ignore[no-untyped-def]
        return self._submit(plan_copy("h2d", device_pool, device_indices, host_pool, host_indices))

    @property
    def pending(self) -> list[DeferredHandle]:
        """Handles not yet completed, oldest first."""
        with self._lock:
            return list(self._pending.values())

    def complete(self, handle: DeferredHandle) -> bool:
        """Perform the copy now, reading the source as it is now. False if it was already completed."""
        with self._lock:
            plan = handle._plan
            if plan is None:
                return False
            if self._pending.get(handle.seq) is not handle:
                raise CopyError(f"{handle!r} was not submitted to this engine")
            run_plan(plan)  # marked done only once the copy has really happened
            del self._pending[handle.seq]
            handle._plan = None
        return True

    def complete_next(self) -> DeferredHandle | None:
        """Complete the oldest pending copy; None when nothing is pending."""
        with self._lock:
            if not self._pending:
                return None
            handle = next(iter(self._pending.values()))
        self.complete(handle)
        return handle

    def complete_all(self) -> int:
        n = 0
        while self.complete_next() is not None:
            n += 1
        return n
