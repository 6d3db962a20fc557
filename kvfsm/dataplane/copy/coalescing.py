"""Offloads gathered into one copy, for callers that submit one small copy per request.

SGLang's scheduler calls `offload_kv_cache(req)` once per request of a decode batch, so at a stride
boundary every request has a chunk due at once: about a thousand submissions of a page or two each, and
over per-layer buffers each one is a gather per (plane, layer). `CoalescingCopyEngine` checks every
submission when it is made (`plan_copy`: typed errors, and nothing is queued by a refused one), but runs the
queued offloads as one copy of the engine it wraps. That copy is made at the first `done()` or `wait()` of
any of them, or at `flush()`. The manager's next progress check is the first `done()`. Until then a queued
copy reads as in flight, and to the lifecycle it is: its device slots stay held and its host slots
allocated.

What it saves (bench/vs_sglang.py, CPU pools, 1024 requests, page 16): per burst, 1,024 copies of eight
per-buffer gathers each become one copy of eight gathers.
"""

from __future__ import annotations

import threading

import torch

from ..pools.allocator import IndexLike
from ..pools.device_pool import DeviceKVPool
from ..pools.host_pool import HostKVPool
from .base import CopyEngine, CopyHandle, CopyPlan, plan_copy


class CoalescedHandle(CopyHandle):
    """One queued offload; after the flush, a view of the merged copy's handle."""

    def __init__(self, engine: CoalescingCopyEngine, plan: CopyPlan) -> None:
        self.direction, self.num_tokens, self.nbytes = plan.direction, plan.num_tokens, plan.nbytes
        self.plan: CopyPlan | None = plan
        self.inner: CopyHandle | None = None
        self._engine = engine

    def _submitted(self) -> CopyHandle:
        if self.inner is None:
            self._engine.flush()
        assert self.inner is not None
        return self.inner

    def done(self) -> bool:
        """Submits the queued copies if this one is still queued, then asks the merged copy (never blocks)."""
        return self._submitted().done()

    def wait(self) -> None:
        self._submitted().wait()

    def wait_stream(self, stream: object | None = None) -> None:
        self._submitted().wait_stream(stream)


class CoalescingCopyEngine(CopyEngine):
    """Wraps `inner`: offloads are checked at submit and queued, then run as one `inner.submit_d2h` per
    pair of pools, in submission order. A load-back first flushes the queue (copies stay in FIFO order)."""

    def __init__(self, inner: CopyEngine) -> None:
        self.inner = inner
        self._queue: list[CoalescedHandle] = []
        self._lock = threading.Lock()

    @property
    def fences(self) -> bool:  # type: ignore[override]
        """The inner engine's: waiting on a queued copy's handle submits the queue first."""
        return bool(getattr(self.inner, "fences", False))

    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit_d2h(
        self, device_pool: DeviceKVPool, device_indices: IndexLike, host_pool: HostKVPool, host_indices: IndexLike
    ) -> CopyHandle:
        handle = CoalescedHandle(self, plan_copy("d2h", device_pool, device_indices, host_pool, host_indices))
        with self._lock:
            self._queue.append(handle)
        return handle

    def submit_h2d(
        self, host_pool: HostKVPool, host_indices: IndexLike, device_pool: DeviceKVPool, device_indices: IndexLike
    ) -> CopyHandle:
        self.flush()
        return self.inner.submit_h2d(host_pool, host_indices, device_pool, device_indices)

    def flush(self) -> None:
        """Submit every queued offload: one inner copy per (device pool, host pool), in queue order. If the
        inner engine raises, the copies it did not take stay queued (their handles raise again at the next
        done()), and the error propagates."""
        with self._lock:
            groups: dict[tuple[int, int], list[CoalescedHandle]] = {}
            for h in self._queue:
                assert h.plan is not None
                groups.setdefault((id(h.plan.device_pool), id(h.plan.host_pool)), []).append(h)
            for handles in groups.values():
                plans = [h.plan for h in handles if h.plan is not None]
                first = plans[0]
                if len(plans) == 1:
                    dev, host = first.device_idx, first.host_idx
                else:
                    dev = torch.cat([p.device_idx for p in plans])
                    host = torch.cat([p.host_idx for p in plans])
                merged = self.inner.submit_d2h(first.device_pool, dev, first.host_pool, host)
                for h in handles:
                    h.inner, h.plan = merged, None
                taken = set(map(id, handles))
                self._queue = [h for h in self._queue if id(h) not in taken]

    def close(self) -> None:
        self.flush()
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
