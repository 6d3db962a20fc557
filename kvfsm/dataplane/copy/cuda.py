"""CUDA copy engine (copies on dedicated streams, completion observed through one event) and its backend policy.

Ordering: each submit records an event on the caller's (compute) stream and makes every stream the copy
uses wait on it (directly, or through an event recorded after that wait), so a copy never reads KV the
compute stream has not finished writing. Completion: the handle holds ONE event, recorded on a "done"
stream after it has waited on the last work of every other stream the copy used; done() is
`event.query()` and never blocks the host. Lifetime: index tensors, staging buffers, pinned index copies,
the flat copy arrays handed to the driver and the events stay referenced by the handle until its
completion has been observed, and device tensors read or written on a stream other than the one that
allocated them are marked with record_stream, so the caching allocators cannot hand their memory to
anyone while the copy runs.

Backends (measured on an H200 with Llama-3-8B KV, 1 GiB per copy, random host pages; ratios are GB/s over
the same run's contiguous pinned copy: bench/results/offload_bandwidth-h200.json and
bench/results/dma_batch_probe-h200.{json,log} from bench/probes/dma_batch_probe.py):
- "triton": one kernel gathers device rows and writes them straight into scattered pinned host slots
  through unified addressing (and the reverse for load-back). No staging, no host-side work. SM stores
  over PCIe: offload 0.93-0.947 and load-back 0.90-0.925 at every page size.
- "dma": the staged pipeline (pipeline.py): a kernel gathers rows into a staging buffer laid out like the
  host pool, and the GPU's copy engines move each run of consecutive host slots, with one batched driver
  call per chunk and copy stream. Probe: offload 0.963-0.978 with 1 MiB+ copies (page_first, page >= 16)
  but only 0.78-0.82 with 64 KiB copies (page 1: DMA engines are slow on short copies, and the driver
  spends ~1.3 us of CPU per copy); load-back 0.95-0.96 at page 1 and 0.97-0.99 at pages 16/64.
- "hybrid" (experiment for offload at page 1, where neither path meets 0.97): `hybrid_fraction` of the
  tokens (the shortest host runs) go through the direct kernel while the rest runs through the staged
  pipeline concurrently (pipeline.py). Works for load-back too (bench/offload_bandwidth.py times both).
- "torch": fallback and baseline. Offload gathers into a contiguous device buffer, copies it into a
  contiguous pinned buffer with one `copy_(non_blocking=True)`, and scatters into the host slots on the
  CPU when done() first sees the event complete (a CPU memcpy at a few GB/s). Load-back gathers on the
  CPU into pinned memory at submit, then copies and scatters on the device.
- "dma_rows": every token row (one per plane, layer and slot) is one 1-D copy straight between the two
  pools, all in one batched driver call (dma.row_copies): no staging buffer, no kernel, no index upload,
  so the host's whole submit is a few events and one driver call. Only for big rows, where one DMA copy
  each is efficient: a pool whose slot is a whole engine block (transformers' paged cache, 512 KiB
  blocks) is the case it exists for.
"auto" (default) takes "dma_rows" for rows of >= rows_min_row_bytes when the copy has at most
rows_max_copies of them (and its device indices are on the CPU); otherwise it chooses per copy, by
direction and the mean size of one DMA copy (tokens per run of consecutive host slots x bytes per token
within one row: x64 KiB for page_first, x2 KiB for layer_first with Llama-3-8B): "dma" when the copy moves >= dma_min_bytes_d2h (offload, 2 GiB: below
it the pipeline's planning costs the scheduler more than the kernel's link efficiency) / dma_min_bytes
(load-back, 16 MiB) and the mean copy is >= dma_min_copy_bytes_d2h / dma_min_copy_bytes_h2d, else
"triton" (or "hybrid" for offload when auto_hybrid_fraction is set), else "torch" when Triton is missing.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ..errors import CopyError
from ..pools.allocator import IndexLike
from ..pools.device_pool import DeviceKVPool, resolve_device
from ..pools.host_pool import HostKVPool
from . import dma
from .base import CopyEngine, CopyHandle, CopyPlan, plan_copy
from .pipeline import CudaOps, PipelineSettings, launch_pipeline
from .staging import PinnedIndexStaging
from .triton_kernels import HAVE_TRITON, KernelConfig, default_config, kv_layer_rows_copy, kv_rows_copy

Backend = Literal["auto", "triton", "torch", "dma", "hybrid", "dma_rows"]
BACKENDS = ("auto", "triton", "torch", "dma", "hybrid", "dma_rows")
MiB, KiB = 2**20, 2**10

# ---- policy (pure; tested on CPU) -----------------------------------------------------------------


@dataclass(frozen=True)
class AutoPolicy:
    """Thresholds of backend="auto". Defaults from the H200 probe (bench/results/dma_batch_probe-h200.log):

    - offload: pure batched DMA of scattered 2 MiB copies reached 0.96-0.98 of the contiguous D2H ceiling,
      128 KiB copies 0.70-0.86 and 64 KiB 0.68-0.77; the pipeline reached 0.963-0.968 at page 16 (1 MiB
      copies) and 0.978 at page 64, against 0.93-0.94 for the direct Triton kernel at every page size.
      The crossover lies between 128 KiB and 1 MiB: d2h_min_copy_bytes = 512 KiB (page_first pages >= 8
      for Llama-3-8B; layer_first rows are 2 KiB per token, so pages >= 256).
    - load-back: the pipeline with host-ordered 64 KiB copies (page 1, page_first) reached 0.949-0.962,
      against 0.909 for the direct kernel; with 32 KiB copies (layer_first, page 16) the engine reached
      0.984 behind compute against 0.926 for the kernel (offload_bandwidth-h200.json):
      h2d_min_copy_bytes = 16 KiB.
    - min_bytes: below 16 MiB the fixed costs of the pipeline (staging, several launches, a driver call
      per chunk) are not worth it; one direct kernel launch is simplest and fast enough.
    - d2h_min_bytes: offload is submitted from the scheduler thread behind a decode step, where the
      pipeline's planning is host time the scheduler pays while the direct kernel's lower link efficiency
      costs nothing it waits for. In the serving loop on the H200 (4096 live, 32 MiB per submit) the
      pipeline took 1.9 ms of host time per submit (bench/results/serving_loop-h200-before-policy.json),
      the direct kernel 0.4-0.7 ms (1024 live there; 4096 live in serving_loop-h200.json). At full model
      size (2048 tokens of Llama-3-8B at 32 layers, 256 MiB) the pipeline's submit took 2.5-4.3 ms of host
      time and the kernel's 0.44-0.71 ms (bench/results/submit_cost-2026-12-03-h200.json; through this
      policy, 0.30-0.42 ms in submit_cost-h200.json): the kernel's 3-4 points of link efficiency are about
      0.2 ms of copy time that nothing waits for, off the scheduler.
      Offload takes the pipeline only from 2 GiB per copy, over 40 ms of link time, twice a decode step:
      there the link, not the scheduler, bounds how fast offload keeps up, and its last points count.
    - no_triton_min_copy_bytes: without Triton the alternative is the torch path (host scatter on the CPU,
      0.06-0.2 of the ceiling), so the pipeline (torch gathers, batched DMA) wins for copies >= 16 KiB.
    - hybrid_fraction: when set, offloads below the DMA threshold use "hybrid" instead of "triton".
    - dma_floor_copy_bytes / dma_max_small_copies: a copy that would need more than dma_max_small_copies
      DMA copies averaging under dma_floor_copy_bytes takes the direct path even when "dma"/"hybrid" is
      forced. The pipeline is useless there (0.09-0.13 of the ceiling for 2 KiB copies), and on the H200
      with the CUDA 13.0 driver batched load-backs of 2 KiB copies crashed inside cuMemcpyBatchAsync:
      ~500K copies (layer_first, page 1, 1 GiB) and, intermittently, 24576 (a 48 MiB GPU test)
      (bench/results/dma_crash-h200.log). The few hundred tiny copies of the small-KV GPU tests, which
      exercise the pipeline, never did; 1024 keeps those and nothing like what crashed.
    - rows_min_row_bytes / rows_max_copies: "dma_rows" (one DMA copy per token row, no kernel) for rows of
      256 KiB and more, at most 1024 of them per copy. Scattered 2 MiB DMA copies reached 0.96-0.98 of the
      ceiling and 128 KiB ones 0.70-0.86 (the probe above), so from 256 KiB the link efficiency is near the
      kernel's, and the host pays about 1.3 us per copy in the driver instead of a kernel launch and an
      index upload. No pool of token rows comes near (Llama-3-8B: 2 KiB); transformers' 512 KiB blocks do.
    """

    d2h_min_copy_bytes: int = 512 * KiB
    h2d_min_copy_bytes: int = 16 * KiB
    min_bytes: int = 16 * MiB
    d2h_min_bytes: int = 2 * 1024 * MiB
    no_triton_min_copy_bytes: int = 16 * KiB
    hybrid_fraction: float | None = None
    dma_floor_copy_bytes: int = 16 * KiB
    dma_max_small_copies: int = 1024
    rows_min_row_bytes: int = 256 * KiB
    rows_max_copies: int = 1024

    def min_bytes_for(self, direction: str) -> int:
        """The smallest copy the pipeline takes in this direction (with Triton there)."""
        return self.d2h_min_bytes if direction == "d2h" else self.min_bytes


def choose_backend(
    backend: str,
    direction: str,
    nbytes: int,
    mean_copy: float,
    have_triton: bool,
    policy: AutoPolicy = AutoPolicy(),
    row_bytes: int = 0,
    rows: int = 0,
) -> str:
    """The backend that carries one copy of `nbytes` whose DMA copies would average `mean_copy` bytes and
    that moves `rows` token rows of `row_bytes` each (0 when the rows cannot be addressed from the CPU: see
    AutoPolicy). A forced backend is returned as is, except that a copy made of very many tiny DMA copies
    (dma_floor_copy_bytes, dma_max_small_copies) never takes the pipeline."""
    if (
        backend in ("dma", "hybrid")
        and 0 < mean_copy < policy.dma_floor_copy_bytes
        and nbytes / mean_copy > policy.dma_max_small_copies
    ):
        return "triton" if have_triton else "torch"
    if backend == "dma_rows":  # forced, still never more copies than the cap (tiny batched copies crashed)
        return backend if 0 < rows <= policy.rows_max_copies else ("triton" if have_triton else "torch")
    if backend != "auto":
        return backend
    if row_bytes >= policy.rows_min_row_bytes and 0 < rows <= policy.rows_max_copies:
        return "dma_rows"
    if nbytes <= 0:
        return "triton" if have_triton else "torch"
    if not have_triton:
        return "dma" if mean_copy >= policy.no_triton_min_copy_bytes else "torch"
    threshold = policy.d2h_min_copy_bytes if direction == "d2h" else policy.h2d_min_copy_bytes
    if nbytes >= policy.min_bytes_for(direction) and mean_copy >= threshold:
        return "dma"
    if direction == "d2h" and policy.hybrid_fraction and nbytes >= policy.d2h_min_bytes:
        return "hybrid"
    return "triton"


def mean_copy_bytes(host: HostKVPool, host_idx: torch.Tensor | np.ndarray, pages: list[int] | None = None) -> float:
    """Mean bytes of one DMA copy for these host slots: tokens per run of consecutive slots (batch order,
    a lower bound of the staged order's) times the bytes of one token within one row (page_first: all
    layers of a plane; layer_first: one layer). With the slots' page ids (whole pages, each in slot
    order) the runs are counted over the page list, without touching the slots."""
    if pages is not None:
        if not pages:
            return 0.0
        runs = 1 + sum(b != a + 1 for a, b in zip(pages, pages[1:]))
        tokens = len(pages) / runs * host.page_size
    else:
        tokens = dma.mean_run_tokens(host_idx.numpy() if isinstance(host_idx, torch.Tensor) else np.asarray(host_idx))
    return tokens * dma.geometry(host, 1).unit


# ---- the engine ---------------------------------------------------------------------------------------


class CudaCopyHandle(CopyHandle):
    """Event-backed handle; runs the (torch backend's) host-side finish once, on first observed completion."""

    def __init__(
        self,
        plan: CopyPlan,
        event: torch.cuda.Event,
        keepalive: list[object],
        finalize: Callable[[], None] | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.direction, self.num_tokens, self.nbytes = plan.direction, plan.num_tokens, plan.nbytes
        self.event = event
        self.stream = stream  # the stream `event` was recorded on, when the copy ran on the caller's stream
        self._keepalive: list[object] | None = keepalive
        self._finalize = finalize
        self._lock = threading.Lock()
        self.backend = ""  # which path carried the copy (set by the engine)
        self.info: dict[str, Any] = {}  # submit-side details (CPU times, chunks, copies), set by the engine

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
        if self.stream is None or not s == self.stream:  # the stream the copy ran on is ordered after it already
            s.wait_event(self.event)


class CudaCopyEngine(CopyEngine):
    """Device ⇄ pinned-host copies on dedicated CUDA streams.

    Streams: `stream` (the single-kernel paths, and copy stream 0 of the pipeline), `kernel_stream`
    (the pipeline's gathers/scatters and index preparation), further copy streams, `direct_stream` (the
    direct kernel's head and hybrid share inside the pipeline).

    Staged pipeline parameters, per direction (defaults from bench/probes/dma_batch_probe.py on the H200):
    offload 64 MiB chunks on 1 copy stream (0.978 at page 64, 0.963 at page 16; more streams did not
    help), load-back 256 MiB chunks split over 2 copy streams (0.981-0.982 at pages 16/64; at page 1 big
    chunks lost only because the first chunk's CPU submit was exposed, which the ramp removes). Chunks
    ramp up from dma_first_chunk_bytes (and, for load-back, down to dma_h2d_last_chunk_bytes at the end,
    so the last scatter is short). dma_chunk_bytes, when given, sets both directions' chunk size.
    dma_head_bytes: the direct kernel's head for copies >= dma_head_min_bytes, taken only when the caller's
    stream is idle at submit (0 turns it off). Then a 64 MiB head keeps the link busy while the CPU plans
    (~0.5-1 ms per GiB on the H200's host), worth ~3-6% end to end; behind a decode step's compute (how a
    serving engine submits) planning is hidden anyway and a head would only move 6% of the bytes at the
    kernel's lower efficiency: there the pipeline without a head reached 0.98-0.998 of the ceiling at pages
    16/64, with one 0.96-0.99 (bench/results/offload_bandwidth-h200.json, "behind_compute").
    host_order: stage in host-slot order (else batch order). triton_host_order: the direct backend
    also walks host slots in ascending order (one index permutation on the device; experiment).

    compute_stream: the stream whose work a copy is ordered after (where the caller writes KV), bound once,
    so that a caller need not make it current around every submit (a stream context costs the host two
    stream switches per copy); None: the current stream at each submit. on_compute_stream: the single-stream
    backends (dma_rows, triton, torch) run the copy on that stream itself instead of `stream`, so no
    ordering event is recorded or waited on, and a wait of that stream on the copy (a fence, a restore) is
    free. For callers whose compute stream waits on every copy at once anyway (transformers' swaps: the
    fenced release and the restore both do), where a separate stream overlaps nothing; the staged
    pipeline keeps its own streams.
    """

    fences = True  # a handle's event is recorded after every stream the copy used; wait_stream is a wait_event

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        backend: Backend = "auto",
        kernel_config: KernelConfig | None = None,
        *,
        dma_chunk_bytes: int | None = None,
        dma_d2h_chunk_bytes: int = 64 * MiB,
        dma_d2h_streams: int = 1,
        dma_h2d_chunk_bytes: int = 256 * MiB,
        dma_h2d_streams: int = 2,
        dma_first_chunk_bytes: int = 8 * MiB,
        dma_h2d_last_chunk_bytes: int = 8 * MiB,
        dma_head_bytes: int = 64 * MiB,
        dma_head_min_bytes: int = 256 * MiB,
        host_order: bool = True,
        triton_host_order: bool = False,
        hybrid_fraction: float = 0.5,
        dma_min_copy_bytes_d2h: int = AutoPolicy.d2h_min_copy_bytes,
        dma_min_copy_bytes_h2d: int = AutoPolicy.h2d_min_copy_bytes,
        dma_min_bytes: int = AutoPolicy.min_bytes,
        dma_min_bytes_d2h: int = AutoPolicy.d2h_min_bytes,
        auto_hybrid_fraction: float | None = None,
        compute_stream: torch.cuda.Stream | None = None,
        on_compute_stream: bool = False,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaCopyEngine needs CUDA; use CpuCopyEngine on this machine")
        self.device = resolve_device("cuda" if device is None else device)
        if self.device.type != "cuda":
            raise ValueError(f"not a CUDA device: {self.device}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}")
        if backend in ("triton", "hybrid") and not HAVE_TRITON:
            raise RuntimeError(f"backend={backend!r} but triton does not import")
        if not 0.0 <= hybrid_fraction <= 1.0:
            raise ValueError(f"hybrid_fraction must be in [0, 1], got {hybrid_fraction}")
        if min(dma_d2h_streams, dma_h2d_streams) < 1:
            raise ValueError("at least one copy stream per direction")
        self.backend: Backend = backend
        self.kernel_config = kernel_config
        if compute_stream is not None and compute_stream.device != self.device:
            raise ValueError(f"compute stream on {compute_stream.device}, engine on {self.device}")
        self.compute_stream = compute_stream
        self.on_compute_stream = bool(on_compute_stream)
        if dma_chunk_bytes is not None:
            dma_d2h_chunk_bytes = dma_h2d_chunk_bytes = dma_chunk_bytes
        common: dict[str, Any] = dict(
            first_chunk_bytes=dma_first_chunk_bytes,
            head_bytes=dma_head_bytes,
            head_min_bytes=dma_head_min_bytes,
            host_order=host_order,
            kernel_config=kernel_config,
        )
        self.settings = {
            "d2h": PipelineSettings(chunk_bytes=dma_d2h_chunk_bytes, streams=dma_d2h_streams, **common),
            "h2d": PipelineSettings(
                chunk_bytes=dma_h2d_chunk_bytes,
                streams=dma_h2d_streams,
                last_chunk_bytes=dma_h2d_last_chunk_bytes,
                **common,
            ),
        }
        self.hybrid_fraction = hybrid_fraction
        self.triton_host_order = triton_host_order
        self.policy = AutoPolicy(
            dma_min_copy_bytes_d2h,
            dma_min_copy_bytes_h2d,
            dma_min_bytes,
            dma_min_bytes_d2h,
            hybrid_fraction=auto_hybrid_fraction,
        )
        self.stream = torch.cuda.Stream(device=self.device)  # single-kernel paths; copy stream 0
        # gathers/scatters of the pipeline, at high priority: when the direct kernel (head, hybrid share) fills
        # the SMs with long-running PCIe blocks, the block scheduler still lets the short gathers in first,
        # so the DMA engines are never left waiting for staged data
        self.kernel_stream = torch.cuda.Stream(device=self.device, priority=-1)
        self.direct_stream = torch.cuda.Stream(device=self.device)  # the direct kernel inside the pipeline
        n_copy = max(dma_d2h_streams, dma_h2d_streams)
        self.copy_streams = [self.stream] + [torch.cuda.Stream(device=self.device) for _ in range(n_copy - 1)]
        streams = {"kern": self.kernel_stream, "direct": self.direct_stream}
        streams.update({f"copy{i}": s for i, s in enumerate(self.copy_streams)})
        # index uploads: pinned staging reused by event query (an upload from pageable memory would wait)
        self._staging = PinnedIndexStaging()
        self._ops = CudaOps(self.device, streams, self._staging)
        self._geometries: dict[
            int, tuple[weakref.ReferenceType[Any], weakref.ReferenceType[torch.Tensor], dma.RowGeometry]
        ] = {}  # id(pool) -> (pool, its buffer, geometry)

    def caller_stream(self) -> torch.cuda.Stream:
        """The stream a copy is ordered after: `compute_stream` when bound, else the current stream."""
        return self.compute_stream if self.compute_stream is not None else torch.cuda.current_stream(self.device)

    def submit_d2h(
        self, device_pool: DeviceKVPool, device_indices: IndexLike, host_pool: HostKVPool, host_indices: IndexLike
    ) -> CudaCopyHandle:
        t0 = time.perf_counter()
        return self._launch(plan_copy("d2h", device_pool, device_indices, host_pool, host_indices), t0)

    def submit_h2d(
        self, host_pool: HostKVPool, host_indices: IndexLike, device_pool: DeviceKVPool, device_indices: IndexLike
    ) -> CudaCopyHandle:
        t0 = time.perf_counter()
        return self._launch(plan_copy("h2d", device_pool, device_indices, host_pool, host_indices), t0)

    def choose_backend(self, plan: CopyPlan) -> str:
        """The backend for one copy (see the module docstring and AutoPolicy). A pool of separate per-layer
        buffers (LayerBufferKVPool) has no token view for the staged pipeline: it takes the direct kernel
        (one launch over its pointer table), or the torch path when Triton is missing or asked for."""
        if not plan.device_pool.has_token_view:
            return "torch" if self.backend == "torch" or not HAVE_TRITON else "triton"
        if self.backend in ("auto", "dma_rows"):
            c = plan.device_pool.config
            # rows are addressed on the CPU: device indices already on the GPU cannot be read (0 rows)
            rows = plan.num_tokens * c.num_planes * c.num_layers if plan.device_on_cpu else 0
            chosen = choose_backend(
                self.backend,
                plan.direction,
                plan.nbytes,
                0.0,
                HAVE_TRITON,
                self.policy,
                row_bytes=c.row_bytes,
                rows=rows,
            )
            if chosen == "dma_rows" or self.backend == "dma_rows":
                return chosen
        if plan.num_tokens == 0:
            return "triton" if HAVE_TRITON and self.backend != "torch" else "torch"
        if self.backend == "auto" and HAVE_TRITON and plan.nbytes < self.policy.min_bytes_for(plan.direction):
            return "triton"  # below min_bytes "auto" takes the kernel whatever the copy sizes (AutoPolicy)
        mean = (
            mean_copy_bytes(plan.host_pool, plan.host_idx, plan.host_pages)
            if self.backend in ("auto", "dma", "hybrid")
            else 0.0
        )
        return choose_backend(self.backend, plan.direction, plan.nbytes, mean, HAVE_TRITON, self.policy)

    def pipeline_settings(self, direction: str, backend: str) -> PipelineSettings:
        st = self.settings[direction]
        if backend == "hybrid":
            frac = (
                self.policy.hybrid_fraction
                if self.backend == "auto" and self.policy.hybrid_fraction
                else self.hybrid_fraction
            )
            return dataclasses.replace(st, direct_fraction=frac)
        return st

    def _launch(self, plan: CopyPlan, t0: float | None = None) -> CudaCopyHandle:
        t0 = time.perf_counter() if t0 is None else t0
        if plan.device_pool.device != self.device:
            raise CopyError(f"device pool is on {plan.device_pool.device}, engine on {self.device}")
        if not plan.host_pool.pinned:
            raise CopyError("the CUDA engine needs a pinned host pool (HostKVPool(pin_memory=True))")
        backend = self.choose_backend(plan)
        keep: list[object] = [plan]
        finalize: Callable[[], None] | None = None
        info: dict[str, Any] = {"validate_ms": (time.perf_counter() - t0) * 1e3}
        if backend == "dma_rows":
            return self._launch_rows(plan, info, t0)
        layered = not plan.device_pool.has_token_view  # LayerBufferKVPool: a pointer table, no 5-D view
        dev_view = None if layered else plan.device_pool.token_view()
        host_view = plan.host_pool.token_view()
        with torch.cuda.device(self.device):
            if backend in ("dma", "hybrid"):  # its own streams, ordered after the caller's (the current one here)
                with torch.cuda.stream(self.compute_stream) if self.compute_stream is not None else nullcontext():
                    done, pinfo = launch_pipeline(
                        self._ops, plan, self.pipeline_settings(plan.direction, backend), keep, direct_ok=HAVE_TRITON
                    )
                info.update(pinfo)
                handle = CudaCopyHandle(plan, done, keep, None)
                handle.backend = backend
                info["submit_ms"] = (time.perf_counter() - t0) * 1e3
                handle.info = info
                return handle
            caller = self.caller_stream()
            copy_stream = caller if self.on_compute_stream else self.stream
            ready = self._ready_event(caller, copy_stream)
            host_np = plan.host_idx.numpy()
            order = None
            if backend == "triton" and self.triton_host_order and plan.num_tokens > 1:
                order = dma.order_by_host(host_np)
                host_np = host_np[order]
            with torch.cuda.stream(copy_stream):
                # One upload (through pinned staging, before the wait: it overlaps the decode step) carries
                # what the kernel needs that lives on the CPU; its staging region is released by `done`.
                dev_idx = plan.device_idx
                on_cpu = dev_idx.device.type == "cpu"
                if on_cpu:
                    dev_np = dev_idx.numpy() if order is None else dev_idx.numpy()[order]
                parts = ([dev_np] if on_cpu else []) + ([host_np] if backend == "triton" and plan.num_tokens else [])
                if not on_cpu and order is not None:
                    parts.append(order)
                up = None
                if parts:
                    up = self._staging.upload_here(parts[0] if len(parts) == 1 else np.concatenate(parts), self.device)
                n = plan.num_tokens
                at = 0
                if on_cpu:
                    assert up is not None  # parts holds the device indices
                    dev_idx, at = up[:n], n
                elif copy_stream is not caller:
                    dev_idx.record_stream(copy_stream)  # made on the compute stream, read on ours
                host_idx_dev = None
                if backend == "triton" and n:
                    assert up is not None  # parts holds the host indices
                    host_idx_dev, at = up[at : at + n], at + n
                if ready is not None:
                    copy_stream.wait_event(ready)  # the KV (and device indices) the caller's stream writes
                if not on_cpu and order is not None:
                    assert up is not None  # parts holds the order
                    dev_idx = dev_idx.index_select(0, up[at : at + n])
                keep += [ready, dev_idx, host_idx_dev, up]
                if plan.num_tokens == 0:
                    pass
                elif backend == "triton":
                    assert host_idx_dev is not None  # uploaded above for a triton copy of any tokens
                    cfg = self.kernel_config or default_config(plan.host_pool.layout)
                    info["pre_launch_ms"] = (time.perf_counter() - t0) * 1e3
                    if layered:
                        pool = plan.device_pool
                        kv_layer_rows_copy(
                            pool.layer_pointers(),  # type: ignore[attr-defined]
                            pool.token_stride,  # type: ignore[attr-defined]
                            dev_idx,
                            host_view,
                            host_idx_dev,
                            plan.direction == "d2h",
                            cfg,
                        )
                    else:
                        assert dev_view is not None  # a pool with a token view (not layered)
                        if plan.direction == "d2h":
                            kv_rows_copy(dev_view, dev_idx, host_view, host_idx_dev, cfg)
                        else:
                            kv_rows_copy(host_view, host_idx_dev, dev_view, dev_idx, cfg)
                    info["launched_ms"] = (time.perf_counter() - t0) * 1e3
                elif plan.direction == "d2h":
                    staging = plan.device_pool.gather_rows(dev_idx)
                    pinned = torch.empty(staging.shape, dtype=staging.dtype, pin_memory=True)
                    pinned.copy_(staging, non_blocking=True)
                    keep += [staging, pinned]
                    host_idx_cpu = plan.host_idx

                    def finalize() -> None:
                        host_view.index_copy_(2, host_idx_cpu, pinned)

                else:
                    c = plan.host_pool.config
                    pinned = torch.empty(
                        (c.num_planes, c.num_layers, plan.num_tokens, *c.token_shape), dtype=c.dtype, pin_memory=True
                    )
                    torch.index_select(host_view, 2, plan.host_idx, out=pinned)
                    staging = pinned.to(self.device, non_blocking=True)
                    plan.device_pool.scatter_rows(dev_idx, staging)
                    keep += [staging, pinned]
                done = torch.cuda.Event()
                done.record(copy_stream)
                if up is not None:
                    self._staging.mark(done)
        handle = CudaCopyHandle(plan, done, keep, finalize, copy_stream if copy_stream is caller else None)
        handle.backend = backend
        info["submit_ms"] = (time.perf_counter() - t0) * 1e3
        handle.info = info
        return handle

    def _row_geometry(self, pool: DeviceKVPool | HostKVPool) -> dma.RowGeometry:
        """The pool's RowGeometry, kept while the tensor its view derives from is the same object (a host
        pool's kv_buffer, a device pool's storage). What it saves: the view (a torch call for a host pool)
        and its addressing on every copy, about 40 us of a swap's submit inside transformers' serving loop
        on the H200 (dma.row_copies in bench/results/transformers_host_time-h200.json). The tensor is held
        weakly, as is the pool (another pool that reuses a dead one's id never takes its geometry): a pool
        that is gone leaves no memory behind here."""
        buf = pool.kv_buffer if isinstance(pool, HostKVPool) else pool.token_view()
        hit = self._geometries.get(id(pool))
        if hit is not None and hit[0]() is pool and hit[1]() is buf:
            return hit[2]
        geometry = dma.RowGeometry.of(pool.token_view())
        self._geometries[id(pool)] = (weakref.ref(pool), weakref.ref(buf), geometry)
        return geometry

    @staticmethod
    def _ready_event(caller: torch.cuda.Stream, copy_stream: torch.cuda.Stream) -> torch.cuda.Event | None:
        """An event after the caller's queued work, for a copy stream to wait on; None when the copy runs on
        the caller's stream itself (on_compute_stream), which orders it for free."""
        if copy_stream is caller:
            return None
        ready = torch.cuda.Event()
        ready.record(caller)
        return ready

    def _launch_rows(self, plan: CopyPlan, info: dict[str, Any], t0: float) -> CudaCopyHandle:
        """ "dma_rows": one batched driver call of every token row, ordered after the caller's stream.
        What it saves: the Triton path's index upload and kernel launch. Measured on the H200 inside
        transformers' serving loop (bench/results/transformers_host_time-h200.json against
        transformers_host_time-before-dma_rows-h200.json): a swap-out's submit 0.58 -> 0.34 ms, a
        restore's 0.54 -> 0.24 ms. The rows are addressed from the plan's lists when it kept them (a block
        table and host page ids: no tensor is built for this copy at all)."""
        dev, host = self._row_geometry(plan.device_pool), self._row_geometry(plan.host_pool)
        d = plan.device_ids if plan.device_ids is not None else plan.device_idx.tolist()
        h = (
            plan.host_pages if plan.host_pages is not None and plan.host_pool.page_size == 1 else plan.host_idx.tolist()
        )  # page size 1: the page ids are the slots
        flat = dma.row_copies(dev, d, host, h) if plan.direction == "d2h" else dma.row_copies(host, h, dev, d)
        info["rows_ms"] = (time.perf_counter() - t0) * 1e3
        caller = self.caller_stream()
        copy_stream = caller if self.on_compute_stream else self.stream
        ready = self._ready_event(caller, copy_stream)
        if ready is not None:
            copy_stream.wait_event(ready)
        info["driver_calls"] = self._ops.driver.run_batch_buffers(
            flat.dst, flat.src, flat.size, copy_stream.cuda_stream
        )
        info["copies"] = flat.count
        done = torch.cuda.Event()
        done.record(copy_stream)
        handle = CudaCopyHandle(plan, done, [plan, ready, flat], None, copy_stream if copy_stream is caller else None)
        handle.backend = "dma_rows"
        info["submit_ms"] = (time.perf_counter() - t0) * 1e3
        handle.info = info
        return handle
