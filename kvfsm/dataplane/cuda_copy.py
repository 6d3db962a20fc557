"""CUDA copy engine: copies on a dedicated stream, completion observed through events.

Ordering: each submit records an event on the caller's (compute) stream and makes the copy stream wait
on it, so a copy never reads KV the compute stream has not finished writing. Completion: the handle
holds an event recorded after the copy; done() is `event.query()` and never blocks the host. Lifetime:
the index tensors, staging buffers and everything else the copy touches stay referenced by the handle
until its completion has been observed (and device tensors made on the compute stream are marked with
record_stream), so the caching allocators cannot hand their memory to anyone while the copy runs.

Backends:
- "triton": one kernel gathers device rows and writes them straight into scattered pinned host slots
  through unified addressing (and the reverse for load-back). No staging, no host-side work.
- "torch": fallback and baseline. Offload gathers into a contiguous device buffer, copies it into a
  contiguous pinned buffer with one `copy_(non_blocking=True)`, and scatters into the host slots on the
  CPU when done() first sees the event complete. That host scatter runs at a few GB/s (a CPU memcpy
  through index_copy_), far below PCIe, which is why it is only the fallback. Load-back gathers on the
  CPU into pinned memory at submit, then copies and scatters on the device.
"auto" picks triton when it imports.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Literal

import torch

from .allocator import IndexLike
from .copy_engine import CopyEngine, CopyHandle, CopyPlan, plan_copy
from .device_pool import DeviceKVPool
from .errors import CopyError
from .host_pool import HostKVPool
from .triton_kernels import HAVE_TRITON, KernelConfig, default_config, kv_rows_copy

Backend = Literal["auto", "triton", "torch"]


class CudaCopyHandle(CopyHandle):
    """Event-backed handle; runs the (torch backend's) host-side finish once, on first observed completion."""

    def __init__(
        self,
        plan: CopyPlan,
        event: torch.cuda.Event,
        keepalive: list[object],
        finalize: Callable[[], None] | None = None,
    ) -> None:
        self.direction, self.num_tokens, self.nbytes = plan.direction, plan.num_tokens, plan.nbytes
        self.event = event
        self._keepalive: list[object] | None = keepalive
        self._finalize = finalize
        self._lock = threading.Lock()

    def _finish(self) -> None:
        with self._lock:
            if self._keepalive is None:
                return
            if self._finalize is not None:
                self._finalize()
                self._finalize = None
            self._keepalive = None  # only now may the indices and buffers be released

    def done(self) -> bool:
        if self._keepalive is None:
            return True
        if not self.event.query():
            return False
        self._finish()
        return True

    def wait(self) -> None:
        if self._keepalive is not None:
            self.event.synchronize()
            self._finish()

    def wait_stream(self, stream: object | None = None) -> None:
        """Make `stream` (default: the current stream) wait for the device side of the copy, without
        blocking the host. For a torch-backend offload the host scatter still needs done()/wait()."""
        s = stream if isinstance(stream, torch.cuda.Stream) else torch.cuda.current_stream()
        s.wait_event(self.event)


class CudaCopyEngine(CopyEngine):
    """Device ⇄ pinned-host copies on one dedicated CUDA stream."""

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        backend: Backend = "auto",
        kernel_config: KernelConfig | None = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaCopyEngine needs CUDA; use CpuCopyEngine on this machine")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"not a CUDA device: {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if backend == "auto":
            backend = "triton" if HAVE_TRITON else "torch"
        if backend == "triton" and not HAVE_TRITON:
            raise RuntimeError("backend='triton' but triton does not import")
        self.backend: Literal["triton", "torch"] = backend  # type: ignore[assignment]
        self.kernel_config = kernel_config
        self.stream = torch.cuda.Stream(device=self.device)

    def submit_d2h(
        self, device_pool: DeviceKVPool, device_indices: IndexLike, host_pool: HostKVPool, host_indices: IndexLike
    ) -> CudaCopyHandle:
        return self._launch(plan_copy("d2h", device_pool, device_indices, host_pool, host_indices))

    def submit_h2d(
        self, host_pool: HostKVPool, host_indices: IndexLike, device_pool: DeviceKVPool, device_indices: IndexLike
    ) -> CudaCopyHandle:
        return self._launch(plan_copy("h2d", device_pool, device_indices, host_pool, host_indices))

    def _launch(self, plan: CopyPlan) -> CudaCopyHandle:
        if plan.device_pool.device != self.device:
            raise CopyError(f"device pool is on {plan.device_pool.device}, engine on {self.device}")
        if not plan.host_pool.pinned:
            raise CopyError("the CUDA engine needs a pinned host pool (HostKVPool(pin_memory=True))")
        keep: list[object] = [plan]
        finalize: Callable[[], None] | None = None
        host_idx_pinned = plan.host_idx.pin_memory()  # a host copy; an H2D from pageable memory could sync
        dev_view, host_view = plan.device_pool.token_view(), plan.host_pool.token_view()
        with torch.cuda.device(self.device):
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                dev_idx = plan.device_idx
                if dev_idx.device == self.device:
                    dev_idx.record_stream(self.stream)  # made on the compute stream, read on ours
                else:
                    dev_idx = dev_idx.to(self.device, non_blocking=True)
                keep += [dev_idx, host_idx_pinned]
                if plan.num_tokens == 0:
                    pass
                elif self.backend == "triton":
                    host_idx_dev = host_idx_pinned.to(self.device, non_blocking=True)
                    keep.append(host_idx_dev)
                    cfg = self.kernel_config or default_config(plan.host_pool.layout)
                    if plan.direction == "d2h":
                        kv_rows_copy(dev_view, dev_idx, host_view, host_idx_dev, cfg)
                    else:
                        kv_rows_copy(host_view, host_idx_dev, dev_view, dev_idx, cfg)
                elif plan.direction == "d2h":
                    staging = dev_view.index_select(2, dev_idx)
                    pinned = torch.empty(staging.shape, dtype=staging.dtype, pin_memory=True)
                    pinned.copy_(staging, non_blocking=True)
                    keep += [staging, pinned]
                    host_idx = plan.host_idx

                    def finalize() -> None:
                        host_view.index_copy_(2, host_idx, pinned)

                else:
                    c = plan.host_pool.config
                    pinned = torch.empty(
                        (c.num_planes, c.num_layers, plan.num_tokens, *c.token_shape), dtype=c.dtype, pin_memory=True
                    )
                    torch.index_select(host_view, 2, plan.host_idx, out=pinned)
                    staging = pinned.to(self.device, non_blocking=True)
                    dev_view.index_copy_(2, dev_idx, staging)
                    keep += [staging, pinned]
                done = torch.cuda.Event()
                done.record(self.stream)
        return CudaCopyHandle(plan, done, keep, finalize)
