"""The staged copy pipeline behind CudaCopyEngine's "dma" and "hybrid" backends.

Why: copies driven by SM loads/stores over PCIe top out a few percent below what the GPU's DMA engines
reach for the same bytes (smaller transactions), while the DMA engines cannot gather scattered rows
cheaply. So a kernel gathers rows into a device staging buffer laid out like the host pool (in host-slot
order, so neighbouring host slots become one copy), and the copy engines move each run of consecutive
host slots as 1-D copies, enqueued with ONE cuMemcpyBatchAsync per chunk and copy stream
(CudaDriver.run_batch; dma plans the copy lists). Load-back runs the same path backwards.

Chunks pipeline: the gather of chunk k overlaps the DMA of chunk k-1 (offload); the DMA of chunk k overlaps
the scatter of chunk k-1 (load-back). Chunks ramp up from `first_chunk_bytes`, so the first DMA starts
after little work (and, for load-back, down to `last_chunk_bytes`, so the last scatter is short). For big
copies submitted while the caller's stream is idle, a "head" (the first `head_bytes`, batch order) goes
through the direct kernel before any planning, so the link is busy while the CPU plans. Hybrid: `direct_fraction` of the tokens (the shortest host runs:
DMA engines are slowest on short copies, the kernel does not care) go through the direct kernel on its own
stream, concurrently with the staged rest: each path alone is latency bound, together they may fill the link.

Streams, by name: "kern" (gathers/scatters, index preparation), "copy<i>" (batched DMA), "direct" (the
direct kernel). Each waits on an event recorded on the caller's stream (directly, or through an event
recorded after that wait) before it touches KV, and the one completion event is recorded on a "done"
stream after it has waited on the last work of every other stream used. launch_pipeline enqueues through
StreamOps: CudaOps on CUDA, a simulator in the CPU tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from . import dma
from .base import CopyPlan
from .cuda_driver import CudaDriver
from .staging import PinnedIndexStaging
from .triton_kernels import HAVE_TRITON, KernelConfig, default_config, kv_rows_copy

# ---- settings ---------------------------------------------------------------------------------------


def head_tokens(n: int, bytes_per_token: int, head_bytes: int, min_total_bytes: int) -> int:
    """Tokens the direct kernel carries before the pipeline is planned: head_bytes worth, only for copies
    of at least min_total_bytes (smaller ones plan fast enough), and never the whole copy."""
    if head_bytes <= 0 or n * bytes_per_token < max(min_total_bytes, 1):
        return 0
    return max(0, min(n // 2, head_bytes // max(1, bytes_per_token)))


@dataclass(frozen=True)
class PipelineSettings:
    """One direction's staged-pipeline parameters (see CudaCopyEngine)."""

    chunk_bytes: int
    first_chunk_bytes: int
    streams: int
    last_chunk_bytes: int = 0  # ramp down at the end (load-back: the last scatter is exposed)
    direct_fraction: float = 0.0  # hybrid: share of all tokens the direct kernel carries
    head_bytes: int = 0
    head_min_bytes: int = 0
    host_order: bool = True
    kernel_config: KernelConfig | None = None  # the direct kernel's; gathers use default_config(layout)
    max_copies_per_call: int = 16384  # longer lists go in several driver calls (the probe tested 32768 in one)


# ---- stream operations: CUDA, or a CPU simulation (tests) ------------------------------------------


class StreamOps(Protocol):
    """What the pipeline does on streams, named "kern" (gathers/scatters, index preparation), "copy<i>"
    (batched DMA) and "direct" (the direct kernel). Real: CudaOps. Tests: a CPU simulator that runs the
    enqueued work in random orders allowed by the events."""

    def ready(self) -> Any: ...  # an event recorded on the caller's current stream
    def caller_idle(self) -> bool: ...  # the caller's stream has no unfinished work (never blocks)
    def record(self, s: str) -> Any: ...
    def wait(self, s: str, event: Any) -> None: ...
    def upload(self, s: str, arr: np.ndarray, keep: list[object]) -> torch.Tensor: ...  # int64 -> device
    def empty(self, s: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...
    def arange(self, s: str, n: int) -> torch.Tensor: ...
    def index_select(self, s: str, t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor: ...
    def rows(
        self, s: str, src5: torch.Tensor, sidx: torch.Tensor, dst5: torch.Tensor, didx: torch.Tensor, cfg: KernelConfig
    ) -> None: ...  # dst5[:, :, didx] = src5[:, :, sidx]
    def batch(self, s: str, flat: dma.FlatCopies) -> int: ...  # returns driver calls made
    def record_stream(self, t: torch.Tensor, s: str) -> None: ...


class CudaOps:
    """StreamOps on CUDA streams; batched DMA through CudaDriver.run_batch (one call per list)."""

    def __init__(
        self, device: torch.device, streams: dict[str, torch.cuda.Stream], staging: PinnedIndexStaging | None = None
    ) -> None:
        self.device = device
        self.streams = streams
        self.staging = staging or PinnedIndexStaging()
        self._driver: CudaDriver | None = None

    @property
    def driver(self) -> CudaDriver:
        if self._driver is None:
            self._driver = CudaDriver.get()
        return self._driver

    def caller_idle(self) -> bool:
        return torch.cuda.current_stream(self.device).query()

    def ready(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def record(self, s: str) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self.streams[s])
        return ev

    def wait(self, s: str, event: torch.cuda.Event) -> None:
        self.streams[s].wait_event(event)

    def upload(self, s: str, arr: np.ndarray, keep: list[object]) -> torch.Tensor:
        # through pinned staging (an upload from pageable memory waits for the stream); staging keeps the
        # pinned region until the copy has passed, the caller keeps the result
        return self.staging.upload(np.asarray(arr, dtype=np.int64), self.device, self.streams[s])

    def empty(self, s: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with torch.cuda.stream(self.streams[s]):
            return torch.empty(shape, dtype=dtype, device=self.device)

    def arange(self, s: str, n: int) -> torch.Tensor:
        with torch.cuda.stream(self.streams[s]):
            return torch.arange(n, dtype=torch.int64, device=self.device)

    def index_select(self, s: str, t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        with torch.cuda.stream(self.streams[s]):
            return t.index_select(0, idx)

    def rows(
        self, s: str, src5: torch.Tensor, sidx: torch.Tensor, dst5: torch.Tensor, didx: torch.Tensor, cfg: KernelConfig
    ) -> None:
        with torch.cuda.stream(self.streams[s]):
            if HAVE_TRITON:
                kv_rows_copy(src5, sidx, dst5, didx, cfg)
            else:
                dst5.index_copy_(2, didx, src5.index_select(2, sidx))

    def batch(self, s: str, flat: dma.FlatCopies) -> int:
        return self.driver.run_batch(flat.dst, flat.src, flat.size, self.streams[s].cuda_stream)

    def record_stream(self, t: torch.Tensor, s: str) -> None:
        t.record_stream(self.streams[s])


# ---- the launch ------------------------------------------------------------------------------------


def launch_pipeline(
    ops: StreamOps, plan: CopyPlan, st: PipelineSettings, keep: list[object], direct_ok: bool = True
) -> tuple[Any, dict[str, Any]]:
    """Enqueue one copy through the staged pipeline (plus the direct kernel for the head / hybrid share);
    returns (the one completion event, info). Everything the GPU touches is appended to `keep`."""
    t0 = time.perf_counter()
    n, host, d2h = plan.num_tokens, plan.host_pool, plan.direction == "d2h"
    bpt, layout = host.config.bytes_per_token, host.layout
    dev_view, host_view = plan.device_pool.token_view(), host.token_view()
    dev_idx = plan.device_idx  # on the device (made on the caller's stream), or on the CPU (uploaded here)
    dev_np = dev_idx.numpy() if dev_idx.device.type == "cpu" else None
    if dev_np is None and not dev_idx.is_contiguous():  # the kernels read flat arrays (copied on the caller's stream)
        dev_idx = dev_idx.contiguous()
        keep.append(dev_idx)
    host_np = plan.host_idx.numpy()
    gather_cfg = default_config(layout)
    direct_cfg = st.kernel_config or default_config(layout)
    info: dict[str, Any] = {"tokens": n}
    ready = ops.ready()
    keep.append(ready)
    finals: dict[str, Any] = {}  # stream -> it has been used (its last work is waited on before done)

    def direct(s: str, didx: torch.Tensor, hidx: torch.Tensor) -> None:
        if d2h:
            ops.rows(s, dev_view, didx, host_view, hidx, direct_cfg)
        else:
            ops.rows(s, host_view, hidx, dev_view, didx, direct_cfg)

    # 1) head: the first tokens in batch order straight through the direct kernel, before any planning
    # Only on an idle GPU: behind compute, planning is hidden anyway and the head would only move bytes at
    # the kernel's lower efficiency.
    head = head_tokens(n, bpt, st.head_bytes, st.head_min_bytes) if direct_ok and ops.caller_idle() else 0
    if head:
        head_dev = ops.upload("direct", dev_np[:head], keep) if dev_np is not None else dev_idx[:head]
        head_host = ops.upload("direct", host_np[:head], keep)
        keep += [head_dev, head_host]
        ops.wait("direct", ready)
        if dev_np is None:
            ops.record_stream(dev_idx, "direct")
        direct("direct", head_dev, head_host)
        finals["direct"] = True
    info["first_enqueued_ms"] = (time.perf_counter() - t0) * 1e3 if head else None

    # 2) plan the rest: host order, hybrid share (shortest host runs), runs of the staged part
    want_direct = int(round(st.direct_fraction * n)) - head if direct_ok else 0
    pp = dma.plan_pipeline(host_np, head=head, direct_tokens=max(0, want_direct), host_order=st.host_order)
    ns, nd = pp.n_staged, pp.n_direct
    info.update(
        head_tokens=head,
        direct_tokens=nd,
        staged_tokens=ns,
        chunks=0,
        copies=0,
        batch_calls=0,
        planned_ms=(time.perf_counter() - t0) * 1e3,
    )
    # 3) index tensors on the kernel stream: permuted device slots (+ host slots of the hybrid share)
    if ns or nd:
        if dev_np is not None:  # CPU slots: permuted here, uploaded with the hybrid share's host slots
            up = dev_np[pp.perm] if nd == 0 else np.concatenate([dev_np[pp.perm], host_np[pp.perm[ns:]]])
            idx = ops.upload("kern", up, keep)
            ops.wait("kern", ready)
            dev_perm = idx[: ns + nd]
        else:  # device slots: permuted on the device, after the caller's stream made them
            up = pp.perm if nd == 0 else np.concatenate([pp.perm, host_np[pp.perm[ns:]]])
            idx = ops.upload("kern", up, keep)
            ops.wait("kern", ready)
            ops.record_stream(dev_idx, "kern")
            dev_perm = ops.index_select("kern", dev_idx, idx[: ns + nd])
        keep += [idx, dev_perm]
        finals["kern"] = True
    if ns:
        geo = dma.geometry(host, ns)
        staging = ops.empty("kern", geo.stage_shape, host.dtype)
        pos = ops.arange("kern", ns)
        keep += [staging, pos]
        sview = geo.stage_view(staging)
    prepared = ops.record("kern")
    keep.append(prepared)

    # 4) hybrid share on the direct stream, concurrent with the pipeline
    if nd:
        ops.wait("direct", prepared)
        ops.record_stream(idx, "direct")
        ops.record_stream(dev_perm, "direct")
        direct("direct", dev_perm[ns:], idx[ns + nd :])
        finals["direct"] = True

    # 5) chunks through staging: one batched DMA call per chunk and copy stream
    if ns:
        host_base, stage_base = host.kv_buffer.data_ptr(), staging.data_ptr()
        bounds = dma.chunk_bounds(ns, bpt, st.chunk_bytes, st.first_chunk_bytes, st.last_chunk_bytes)
        copy_streams = [f"copy{i}" for i in range(max(1, st.streams))]
        waited: set[str] = set()
        for a, b in zip(bounds[:-1], bounds[1:]):
            if d2h:  # the gather first: it runs while the CPU plans this chunk's copies
                ops.rows("kern", dev_view, dev_perm[a:b], sview, pos[a:b], gather_cfg)
                gathered = ops.record("kern")
                keep.append(gathered)
            flat = dma.flat_plan(geo, dma.clip_runs(pp.runs, a, b), host_base, stage_base, plan.direction)
            parts = dma.split_by_bytes(flat, len(copy_streams))
            keep.append(parts)  # the driver reads the arrays during the call; kept until completion anyway
            info["chunks"] += 1
            info["copies"] += flat.count
            if d2h:
                for s, part in zip(copy_streams, parts):
                    ops.wait(s, gathered)
                    for piece in dma.split_by_count(part, st.max_copies_per_call):
                        info["batch_calls"] += ops.batch(s, piece)
                    finals[s] = True
            else:
                landed = []
                for s, part in zip(copy_streams, parts):
                    if s not in waited:  # staging and indices are ready (and the caller's event passed)
                        ops.wait(s, prepared)
                        waited.add(s)
                    for piece in dma.split_by_count(part, st.max_copies_per_call):
                        info["batch_calls"] += ops.batch(s, piece)
                    landed.append(ops.record(s))
                    finals[s] = True
                keep += landed
                for ev in landed:
                    ops.wait("kern", ev)
                ops.rows("kern", sview, pos[a:b], dev_view, dev_perm[a:b], gather_cfg)
            if info["chunks"] == 1 and info["first_enqueued_ms"] is None:
                info["first_enqueued_ms"] = (time.perf_counter() - t0) * 1e3
        for s in copy_streams:
            if s in finals:
                ops.record_stream(staging, s)

    # 6) one completion event, after every stream's work
    if ns:
        done_stream = "copy0" if d2h else "kern"
    else:
        done_stream = "direct" if "direct" in finals else "kern"
    for s in finals:
        if s != done_stream:
            ev = ops.record(s)
            keep.append(ev)
            ops.wait(done_stream, ev)
    done = ops.record(done_stream)
    info["streams"] = sorted(finals)
    info["plan_and_enqueue_ms"] = (time.perf_counter() - t0) * 1e3
    return done, info
