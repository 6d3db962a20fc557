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
- "dma" (opt-in, or "auto" with prefer_dma=True): a device kernel gathers rows into a staging buffer
  laid out like the host pool while the GPU's copy engines move each run of consecutive host slots with
  one strided (2-D) copy, chunk by chunk (see dma.py). Measured on the H200 (bench/results/
  offload_bandwidth-h200.json) it is no faster than the Triton kernel even with 64-token pages (2-D
  DMA rows of 128 KiB ran at 0.74-0.89 of the contiguous ceiling) and far slower for short runs (one
  driver call per run), so it is not the default.
"auto" (default): "triton" when it imports, else "torch"; with prefer_dma, "dma" for copies whose host
runs are wide (>= dma_min_run_bytes per row) and few (<= dma_max_runs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Literal

import torch

from .allocator import IndexLike
from . import dma
from .copy_engine import CopyEngine, CopyHandle, CopyPlan, plan_copy
from .device_pool import DeviceKVPool, resolve_device
from .errors import CopyError
from .host_pool import HostKVPool
from .triton_kernels import HAVE_TRITON, KernelConfig, default_config, kv_rows_copy

Backend = Literal["auto", "triton", "torch", "dma"]


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
        self.backend = ""  # which path carried the copy (set by the engine)

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
    """Device ⇄ pinned-host copies on dedicated CUDA streams (one for DMA, one for kernels)."""

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        backend: Backend = "auto",
        kernel_config: KernelConfig | None = None,
        dma_min_run_bytes: int = 32 * 1024,
        dma_max_runs: int = 2048,
        dma_chunk_bytes: int = 64 * 2**20,
        prefer_dma: bool = False,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaCopyEngine needs CUDA; use CpuCopyEngine on this machine")
        self.device = resolve_device("cuda" if device is None else device)
        if self.device.type != "cuda":
            raise ValueError(f"not a CUDA device: {self.device}")
        if backend == "triton" and not HAVE_TRITON:
            raise RuntimeError("backend='triton' but triton does not import")
        if backend not in ("auto", "triton", "torch", "dma"):
            raise ValueError(f"unknown backend {backend!r}")
        self.backend: Backend = backend
        self.kernel_config = kernel_config
        self.dma_min_run_bytes = dma_min_run_bytes
        self.dma_max_runs = dma_max_runs
        self.dma_chunk_bytes = dma_chunk_bytes
        self.prefer_dma = prefer_dma
        self.stream = torch.cuda.Stream(device=self.device)  # copies (DMA) and the single-kernel paths
        self.kernel_stream = torch.cuda.Stream(device=self.device)  # gathers/scatters of the dma path

    def submit_d2h(
        self, device_pool: DeviceKVPool, device_indices: IndexLike, host_pool: HostKVPool, host_indices: IndexLike
    ) -> CudaCopyHandle:
        return self._launch(plan_copy("d2h", device_pool, device_indices, host_pool, host_indices))

    def submit_h2d(
        self, host_pool: HostKVPool, host_indices: IndexLike, device_pool: DeviceKVPool, device_indices: IndexLike
    ) -> CudaCopyHandle:
        return self._launch(plan_copy("h2d", device_pool, device_indices, host_pool, host_indices))

    def choose_backend(self, plan: CopyPlan) -> tuple[str, list[dma.Run] | None]:
        """The backend for one copy: "dma" when the host runs are wide and few, else the kernel."""
        if plan.num_tokens and (self.backend == "dma" or (self.backend == "auto" and self.prefer_dma)):
            runs = dma.host_runs(plan.host_idx)
            geo = dma.geometry(plan.host_pool, plan.num_tokens)
            if self.backend == "dma" or dma.dma_worthwhile(runs, geo, self.dma_min_run_bytes, self.dma_max_runs):
                return "dma", runs
        if self.backend in ("triton", "torch"):
            return self.backend, None
        return ("triton" if HAVE_TRITON else "torch"), None

    def _launch(self, plan: CopyPlan) -> CudaCopyHandle:
        if plan.device_pool.device != self.device:
            raise CopyError(f"device pool is on {plan.device_pool.device}, engine on {self.device}")
        if not plan.host_pool.pinned:
            raise CopyError("the CUDA engine needs a pinned host pool (HostKVPool(pin_memory=True))")
        backend, runs = self.choose_backend(plan)
        keep: list[object] = [plan]
        finalize: Callable[[], None] | None = None
        dev_view, host_view = plan.device_pool.token_view(), plan.host_pool.token_view()
        with torch.cuda.device(self.device):
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            if backend == "dma":
                done = self._launch_dma(plan, runs or [], dev_view, ready, keep)
                handle = CudaCopyHandle(plan, done, keep, None)
                handle.backend = backend
                return handle
            host_idx_pinned = plan.host_idx.pin_memory()  # an H2D from pageable memory could synchronise
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
                elif backend == "triton":
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
        handle = CudaCopyHandle(plan, done, keep, finalize)
        handle.backend = backend
        return handle

    def _rows(self, src5: torch.Tensor, src_idx: torch.Tensor, dst5: torch.Tensor, dst_idx: torch.Tensor, layout: str) -> None:
        """Device-to-device row gather/scatter on the current stream (Triton when present)."""
        if HAVE_TRITON:
            kv_rows_copy(src5, src_idx, dst5, dst_idx, self.kernel_config or default_config(layout))
        else:
            dst5.index_copy_(2, dst_idx, src5.index_select(2, src_idx))

    def _launch_dma(
        self, plan: CopyPlan, runs: list[dma.Run], dev_view: torch.Tensor, ready: torch.cuda.Event, keep: list[object]
    ) -> torch.cuda.Event:
        """Pipelined: kernel gathers chunk k into staging while the DMA engines move chunk k-1 (d2h), or
        DMA fills chunk k while the kernel scatters chunk k-1 (h2d)."""
        n, host = plan.num_tokens, plan.host_pool
        geo = dma.geometry(host, n)
        chunks = dma.chunk_runs(runs, host.config.bytes_per_token, self.dma_chunk_bytes)
        drv = dma.CudaDriver.get()
        copy_s, kern_s = self.stream, self.kernel_stream
        first = kern_s if plan.direction == "d2h" else copy_s  # the stream that touches staging first
        with torch.cuda.stream(first):
            first.wait_event(ready)
            dev_idx = plan.device_idx.to(self.device, non_blocking=True)
            staging = torch.empty(geo.stage_shape, dtype=host.dtype, device=self.device)
            pos = torch.arange(n, dtype=torch.int64, device=self.device)
            allocated = torch.cuda.Event()
            allocated.record(first)
        other = copy_s if first is kern_s else kern_s
        other.wait_event(allocated)
        for t in (staging, pos, dev_idx):
            t.record_stream(other)
        if dev_idx is plan.device_idx:
            dev_idx.record_stream(first)
        keep += [staging, pos, dev_idx]
        sview = geo.stage_view(staging)
        host_base, stage_base = host.kv_buffer.data_ptr(), staging.data_ptr()
        for a, b, chunk in chunks:
            copies = dma.plan_copies(geo, chunk, host_base, stage_base, plan.direction)
            ev = torch.cuda.Event()
            if plan.direction == "d2h":
                with torch.cuda.stream(kern_s):
                    self._rows(dev_view, dev_idx[a:b], sview, pos[a:b], host.layout)
                    ev.record(kern_s)
                copy_s.wait_event(ev)
                drv.run(copies, copy_s.cuda_stream)
            else:
                drv.run(copies, copy_s.cuda_stream)
                ev.record(copy_s)
                kern_s.wait_event(ev)
                with torch.cuda.stream(kern_s):
                    self._rows(sview, pos[a:b], dev_view, dev_idx[a:b], host.layout)
            keep.append(ev)
        last = copy_s if plan.direction == "d2h" else kern_s
        done = torch.cuda.Event()
        done.record(last)
        return done
