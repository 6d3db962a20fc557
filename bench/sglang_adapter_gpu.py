"""The scheduler thread's time through each door, on SGLang's own objects on the GPU, in one run.

Three managers run the same serving workload over SGLang 0.5.23's `ReqToTokenPool`, `MHATokenToKVPool`
(Llama-3-8B rows: 8 KV heads of 128, bf16, `--layers` of them) and paged allocator, all on the H200:

- `adapter`: kvfsm's drop-in `DecodeKVCacheOffloadManager`, called as SGLang's scheduler calls it: one
  `check_offload_progress()` per iteration, then `offload_kv_cache(req)` for every request of the decode
  batch, and `finalize_release_on_finish(req)` for a finished request whose call returned False;
- `batch`: kvfsm's own batch API on the same adapter's manager (the same pools, copy engine and store):
  `offload_batch(views, rows, committed)`, `finalize_batch(views)` for the finished requests, `check_progress()`;
- `bare`: the floor of any manager on this layout: due requests picked from the batch arrays (numpy), their
  slots gathered on the device in one gather, host pages, ONE copy through the same `CudaCopyEngine`, host
  pages freed on completion, finished requests released once their copies landed. No lifecycle, checks,
  hashes or storage.

Each iteration, as SGLang's decode event loop runs it (`--order sglang`, the default): the scheduler thread makes
the progress check; the engine gives every live request a slot for the token being decoded (a new page from
SGLang's allocator at a page boundary, written to `req_to_token` on the GPU) and queues the decode step's
matmuls on the compute stream (`--step-ms`, calibrated); it waits for the previous step's results; then the
scheduler thread makes the offload and finish calls for them, inside the allocator's free group as SGLang's
`process_batch_result_decode` makes them (a free there goes back at the group's end; opening and closing the
group is SGLang's, untimed). Finished requests leave and new ones are admitted
in their place (random prompt and output lengths, so due points are spread as in serving). The check and the
calls are timed, under `torch.cuda.set_sync_debug_mode("error")` (a call that waited for the GPU would end the
run). `--order compact` makes the calls back to back before the wait (ORDERS). The garbage collector stays on
(start-up objects frozen, as servers do); its pauses inside the timed calls are recorded.

Every run's JSON carries `targets`, each `{name, value, limit, met}`. `--repeats N` runs each configuration's
modes N times, in alternating order, and the targets read the runs' medians (`combined`). `--quick` checks the
script (CPU allowed: a sleeping step, CPU pools), never a figure; its results go to bench/results/quick/.

    tests/upstream/run_on_device.sh sets up the device; then: python3 bench/sglang_adapter_gpu.py [--quick]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests" / "upstream"))

# The stand-ins for what sglang reaches for that exists only as CUDA builds (tests/upstream/cuda_only: torchvision,
# and on a GPU machine without them its kernel packages) go in before anything imports sglang.
from cuda_only import install as _install_cuda_only  # noqa: E402

_install_cuda_only()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.runtime_context import get_context, get_parallel  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

import harness  # noqa: E402
from common import full_collection_ms, target, write_result  # noqa: E402
from serving_loop import ComputeStep, GcPauses, stats  # noqa: E402
from stall_stacks import StallSampler  # noqa: E402

from kvfsm.dataplane import CpuCopyEngine  # noqa: E402
from kvfsm.integrations.sglang import DecodeKVCacheOffloadManager  # noqa: E402
from kvfsm.runtime.device_table import DeviceTableSlots  # noqa: E402

PROMPT, OUTPUT = (32, 256), (64, 512)  # uniform lengths, as bench/serving_loop.py
MODES = ("adapter", "batch", "bare")
# Where each iteration's calls sit around the engine's wait for the decode step. `sglang`: as SGLang 0.5.23's decode
# event loops (disaggregation/decode.py, event_loop_normal_disagg_decode and _overlap_): the progress check first
# (process_decode_queue), then the batch is launched, then the scheduler waits for a step's results and makes the
# offload and finish calls (process_batch_result); every door in that order. `compact`: the calls back to back, then
# the wait, the adapter checking first and the batch door and the floor last (every run before the first in
# SGLang's order, 2026-12-06): the backup worker the adapter's check wakes then runs beside its offload calls, the
# batch door's beside the wait.
ORDERS = ("sglang", "compact")


@contextmanager
def server_config(page: int, stride: int, host_gb: float, store: str, store_process: int = 0) -> Iterator[None]:
    """The server config the adapter reads: page size, HiCache file store, a host pool of `host_gb`; with
    `store_process` n >= 1, kvfsm's `kvfsm_store_process` (the store in n child processes over a shared host pool,
    the writes sharded by key)."""
    extra: dict[str, Any] = {"file_storage_path": store}
    if store_process:
        extra["kvfsm_store_process"] = True if store_process == 1 else store_process
    override = get_context().override_server_args(
        page_size=page,
        tp_size=1,
        hicache_storage_backend="file",
        hicache_io_backend="direct",
        hicache_mem_layout="page_first",
        hicache_size=host_gb,
        served_model_name="bench",
        hicache_storage_backend_extra_config=json.dumps(extra),
    )
    override.install()
    get_parallel().override_permanently(tp_rank=0, pp_rank=0, attn_dcp_rank=0)
    old = os.environ.get(harness.STRIDE_ENV)
    os.environ[harness.STRIDE_ENV] = str(stride)
    try:
        yield
    finally:
        os.environ.pop(harness.STRIDE_ENV, None)
        if old is not None:
            os.environ[harness.STRIDE_ENV] = old
        override.restore()


class Bare:
    """The floor on SGLang's layout (see the module docstring); the adapter's host pool and copy engine."""

    def __init__(self, adapter: DecodeKVCacheOffloadManager, r2t: Any, allocator: Any) -> None:
        m = adapter.manager
        self.page, self.stride = m.config.page_size, m.stride
        self.device_pool, self.host_pool, self.engine = m.fx.device_pool, m.host_pool, m.fx.copy_engine
        self.table = DeviceTableSlots(r2t.req_to_token, self.page)
        self.r2t, self.allocator = r2t, allocator
        rows = r2t.req_to_token.shape[0]
        self.start = np.full(rows, -1, dtype=np.int64)  # per row: offloaded length (-1: a new request)
        self.due = np.zeros(rows, dtype=np.int64)
        self.width = self.table.width
        self.inflight: deque[tuple[int, Any, list[int]]] = deque()
        self.finished: deque[tuple[int, Any]] = deque()
        self.serial = 0

    def offload_batch(self, reqs: list[Any], rows: np.ndarray, committed: np.ndarray) -> int:
        ps, stride = self.page, self.stride
        firsts, lengths = [], []
        for i in np.flatnonzero(committed >= self.due[rows]).tolist():
            req, row = reqs[i], int(rows[i])
            start = int(self.start[row])
            if start < 0:
                start = len(req.origin_input_ids) // ps * ps
            n = (min(int(committed[i]), len(req.origin_input_ids) + len(req.output_ids) - 1) - start) // stride * stride
            if n > 0:
                firsts.append(row * self.width + start)
                lengths.append(n)
                start += n
            self.start[row], self.due[row] = start, start + stride
        if not firsts:
            return 0
        pages = self.host_pool.alloc_pages(sum(lengths) // ps)
        if pages is None:
            return 0
        device = self.table.spans(firsts, lengths)
        handle = self.engine.submit_d2h(self.device_pool, device, self.host_pool, self.host_pool.page_slots(pages))
        self.serial += 1
        self.inflight.append((self.serial, handle, pages))
        return len(firsts)

    def finalize(self, req: Any) -> None:
        self.finished.append((self.serial, req))

    def check_progress(self) -> None:
        while self.inflight and self.inflight[0][1].done():
            self.host_pool.free_pages(self.inflight.popleft()[2])
        landed = self.inflight[0][0] - 1 if self.inflight else self.serial
        while self.finished and self.finished[0][0] <= landed:
            req = self.finished.popleft()[1]
            row = req.kv.req_pool_idx
            end = -(-req.kv.kv_allocated_len // self.page) * self.page
            # the pages by id, as kvfsm's release on this allocator frees them (AllocatorView.free_page_ids): the floor
            # takes the cheapest free there is
            self.allocator.free_page_ids(self.table.page_ids(row, 0, end))
            self.r2t.free(req)
            self.start[row], self.due[row] = -1, 0

    def idle(self) -> bool:
        return not self.inflight and not self.finished


class _NoOp:
    def offload_kv_cache(self, req: Any) -> bool:
        return False


# The manager's counters (OffloadMetrics) whose change over an iteration says how much work its calls did: pages
# the store reported stored, chunks parked behind a full backup queue, requests released (at once or at their last
# copy's acknowledgement), host-full retries
WORK_COUNTERS = ("stored_pages", "parked_chunks", "releases", "deferred_releases", "host_full_retries")


def tail_of(per_iter: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the slowest iterations' time goes: the iterations at or past the p99 of the calls' time, split into
    the collector's pauses inside the calls, the rest of the scheduler thread's own CPU time, and the time it was
    off the CPU (waiting for the interpreter lock, a lock of its own or the kernel), beside the CPU time the
    process's other threads ran meanwhile (the store's writers above all). Each is a mean over those iterations,
    with every iteration's median beside it; `p99_without_gc_ms` is the p99 once the collector's pauses inside
    the calls are taken out: what a runtime with no collections in its calls would leave. What those iterations
    did, beside a typical one: the progress check's and the offload calls' times, the chunks accepted, and how
    far the manager's work counters moved (WORK_COUNTERS)."""
    totals = [r["total_ms"] for r in per_iter]
    cut = stats(totals)["p99"]
    top = [r for r in per_iter if r["total_ms"] >= cut]

    def split(r: dict[str, Any]) -> tuple[float, float, float]:
        # the three parts add up to the iteration's time (a thread's CPU clock may read a little past the wall
        # clock, and a collection preempted midway holds less CPU than its pause)
        total = r["total_ms"]
        collected = min(r["gc_ms"], total)
        own = max(min(r["own_cpu_ms"], total) - collected, 0.0)
        return collected, own, total - collected - own

    def parts(rows: list[dict[str, Any]], pick: Callable[[list[float]], float]) -> dict[str, float]:
        splits = [split(r) for r in rows]
        return {
            "total_ms": pick([r["total_ms"] for r in rows]),
            "gc_ms": pick([g for g, _, _ in splits]),
            "own_cpu_without_gc_ms": pick([o for _, o, _ in splits]),
            "off_cpu_ms": pick([w for _, _, w in splits]),
            # of the thread's own CPU, the part in the kernel (page faults, system calls, a driver's ioctls)
            "own_kernel_ms": pick([r.get("own_kernel_ms", 0.0) for r in rows]),
            "others_cpu_ms": pick([r["others_cpu_ms"] for r in rows]),
        }

    def work(rows: list[dict[str, Any]], pick: Callable[[list[float]], float]) -> dict[str, float]:
        return {
            k: pick([r[k] for r in rows]) for k in ("check_ms", "offload_ms", "chunks", *WORK_COUNTERS) if k in rows[0]
        }

    return {
        "p99_ms": cut,
        "iterations": len(top),
        "slowest_mean": parts(top, statistics.fmean),
        "all_median": parts(per_iter, statistics.median),
        "p99_without_gc_ms": stats([r["total_ms"] - r["gc_ms"] for r in per_iter])["p99"],
        # what those iterations did, beside a typical one: which call, and how much of the manager's work
        "slowest_work_mean": work(top, statistics.fmean),
        "all_work_median": work(per_iter, statistics.median),
    }


def census() -> dict[str, Any]:
    """What a full collection walks now (start-up objects frozen): by the module of each object's type, and
    the types that hold the most (which of kvfsm's objects per request or per chunk the heap is made of).
    `full_collection_ms` is what one full collection of that heap costs here (the median of three, timed
    before the census lists the heap): the floor's row says what the engine's own heap costs the collector,
    whatever brings the collection on; the managers' rows, what their objects add to it."""
    full_ms = full_collection_ms(3, statistics.median)
    by: dict[str, int] = {}
    types: collections.Counter[str] = collections.Counter()
    objs = gc.get_objects()
    for o in objs:
        t = type(o)
        mod = (t.__module__ or "").split(".")[0]
        key = mod if mod in ("kvfsm", "generated", "sglang", "torch", "numpy") else "builtins/other"
        by[key] = by.get(key, 0) + 1
        types[f"{t.__module__}.{t.__qualname__}"] += 1
    return {
        "tracked": len(objs),
        "full_collection_ms": full_ms,
        "by_module": by,
        "by_type": dict(types.most_common(12)),
    }


class Loop:
    """One manager (`mode`) in the serving loop over freshly built SGLang pools."""

    def __init__(self, mode: str, live: int, page: int, stride: int, args: argparse.Namespace, store: str) -> None:
        self.mode, self.live_target, self.page = mode, live, page
        self.order = getattr(args, "order", "sglang")  # ORDERS
        self.grouped = not getattr(args, "no_free_group", False)  # the calls inside the allocator's free group
        self.stall_ms: Optional[float] = getattr(args, "stall_ms", None)  # StallSampler's threshold (None: off)
        self.rng = random.Random(args.seed)
        dev = args.device
        self.cuda = dev == "cuda"
        per_req = -(-(PROMPT[1] + OUTPUT[1] + 2 * page) // page) * page
        rows = live + live // 4 + 8  # deferred releases hold rows until their copies land
        tokens = rows * per_req
        self.r2t = ReqToTokenPool(size=rows, max_context_len=per_req, device=dev, enable_memory_saver=False)
        self.kv = MHATokenToKVPool(
            size=tokens,
            page_size=page,
            dtype=torch.bfloat16,
            head_num=args.kv_heads,
            head_dim=args.head_dim,
            layer_num=args.layers,
            device=dev,
            enable_memory_saver=False,
        )
        self.allocator = PagedTokenToKVPoolAllocator(tokens, page, torch.bfloat16, dev, self.kv, need_sort=False)
        tree = RadixCache(
            CacheInitParams(
                disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.allocator, page_size=page
            )
        )
        with (
            harness.on_device(dev),
            server_config(page, stride, args.host_gb, store, getattr(args, "store_process", 0)),
        ):
            self.adapter = DecodeKVCacheOffloadManager(
                req_to_token_pool=self.r2t,
                token_to_kv_pool_allocator=self.allocator,
                tp_group=harness._tp_group_world1(),
                tree_cache=tree,
            )
        if not self.cuda:  # --quick on a CPU: the same calls over CPU copies
            self.adapter.manager.fx.copy_engine = CpuCopyEngine()
        self.manager = self.adapter.manager
        self.bare = Bare(self.adapter, self.r2t, self.allocator) if mode == "bare" else None
        self.live: list[Req] = []
        self.serial = 0
        self.step = ComputeStep(dev, args.step_ms)  # the decode step's matmuls on the compute stream

    # --- the engine (never timed) ---------------------------------------------------------------------
    def _pages(self, n: int) -> torch.Tensor:
        got = self.allocator.alloc(-(-n // self.page) * self.page)
        if got is None:
            raise RuntimeError("device pool exhausted: size the benchmark's pool larger")
        return got

    def admit(self) -> bool:
        if self.r2t.available_size() == 0:
            return False
        rng = self.rng
        self.serial += 1
        prompt = [rng.randrange(128_000) for _ in range(rng.randint(*PROMPT))]
        req = Req(f"r{self.serial}", "", prompt, SamplingParams(max_new_tokens=rng.randint(*OUTPUT)))
        self.r2t.alloc([req])
        slots = self._pages(len(prompt) + 1)
        row = req.kv.req_pool_idx
        self.r2t.write((row, slice(0, slots.numel())), slots.to(torch.int32))
        req.kv.kv_allocated_len, req.kv.kv_committed_len = slots.numel(), len(prompt)
        req.output_ids.append(rng.randrange(128_000))
        if self.mode == "batch":  # what the adapter's calls do on first sight: kvfsm may release it by its row
            self.adapter._views.pin(req)
        self.live.append(req)
        return True

    def grow(self) -> None:
        for req in self.live:
            pos = req.kv.kv_committed_len
            if pos >= req.kv.kv_allocated_len:
                slots = self._pages(1)
                self.r2t.write((req.kv.req_pool_idx, slice(pos, pos + slots.numel())), slots.to(torch.int32))
                req.kv.kv_allocated_len = pos + slots.numel()

    # --- the manager calls (timed) --------------------------------------------------------------------
    def check(self) -> None:
        """The iteration's progress check, where SGLang makes it: first, in `process_decode_queue`."""
        if self.mode == "adapter":
            self.adapter.check_offload_progress()
        elif self.mode == "batch":
            self.manager.check_progress()
        else:
            assert self.bare is not None
            self.bare.check_progress()

    def offload(self, ended: list[Req], batch_args: Optional[tuple[Any, ...]] = None) -> int:
        """The offload and finish calls for the batch whose results just came back (SGLang's
        `process_batch_result`); returns the chunks accepted. `batch_args`: `_batch_args(ended)`, built before
        the timing starts (the batch door and the floor)."""
        live, mode = self.live, self.mode
        if mode == "adapter":
            mgr = self.adapter
            chunks = 0
            for req in live:
                ok = mgr.offload_kv_cache(req)
                chunks += ok
                if not ok and req.finished_reason is not None:
                    mgr.finalize_release_on_finish(req)
            return chunks
        rows, committed, views, done = batch_args if batch_args is not None else self._batch_args(ended)
        if mode == "batch":
            m = self.manager
            chunks = m.offload_batch(views, rows, committed)
            if hasattr(m, "finalize_batch"):
                m.finalize_batch(done)
            else:  # a tree from before finalize_batch (bench/ab_trees.py --base)
                for v in done:
                    m.finalize(v)
            return chunks
        bare = self.bare
        assert bare is not None
        chunks = bare.offload_batch(live, rows, committed)
        for req in ended:
            bare.finalize(req)
        return chunks

    def _batch_args(self, ended: list[Req]) -> tuple[Any, ...]:
        """What an engine hands a batch API, built outside the timed calls: the batch's rows and committed lengths
        (SGLang keeps them as tensors), and, for kvfsm's batch door, the Reqs as kvfsm's requests."""
        live = self.live
        rows = np.fromiter((r.kv.req_pool_idx for r in live), dtype=np.int64, count=len(live))
        committed = np.fromiter((r.kv.kv_committed_len for r in live), dtype=np.int64, count=len(live))
        if self.mode != "batch":
            return rows, committed, [], []
        view = self.adapter._views.view
        return rows, committed, [view(r) for r in live], [view(r) for r in ended]

    def calls(self, ended: list[Req]) -> tuple[float, float, int]:
        """The iteration's manager calls back to back (the `compact` order): the adapter checks first, as SGLang
        does; the batch door and the floor offload first and check last. Returns (seconds in the progress
        check, seconds in the offload and finish calls, chunks accepted)."""
        if self.mode == "adapter":
            t0 = time.perf_counter()
            self.check()
            took_check = time.perf_counter() - t0
            with self.free_group():
                t1 = time.perf_counter()
                chunks = self.offload(ended)
                took_offload = time.perf_counter() - t1
            return took_check, took_offload, chunks
        args = self._batch_args(ended)
        with self.free_group():
            t0 = time.perf_counter()
            chunks = self.offload(ended, args)
            took_offload = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.check()
        return time.perf_counter() - t1, took_offload, chunks

    def free_group(self) -> AbstractContextManager[None]:
        """The allocator's free group around the offload and finish calls, as SGLang opens it (`harness.free_group`;
        none with --no-free-group). Opening and closing it is SGLang's own work, the same in every mode, so it
        stays outside the timed calls."""
        return harness.free_group(self.allocator, self.grouped)

    def run(self, warmup: int, iterations: int) -> dict[str, Any]:
        while len(self.live) < self.live_target and self.admit():
            pass
        gc.collect()
        gc.freeze()
        per_iter: list[dict[str, float]] = []
        prev = None
        # CPU time inside this iteration's timed calls: the scheduler's thread's own, and the process's other
        # threads' (the store's writers, torch's and the driver's), in ms (tail_of reads them)
        cpu = {"own": 0.0, "own_kernel": 0.0, "others": 0.0}
        sampler = None if self.stall_ms is None else StallSampler(self.stall_ms)
        sampling = False  # the timed iterations only
        with GcPauses() as gcp, sampler if sampler is not None else nullcontext():

            def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any, float, Optional[int]]:
                """fn(*args) as the scheduler makes it: (seconds, result, ms of collections inside, GC-tracked
                objects it left allocated (gen0's count; None where a collection reset it))."""
                n_gc = len(gcp.pauses)
                if self.cuda:
                    torch.cuda.set_sync_debug_mode("error")
                young = gc.get_count()[0]
                try:
                    process0, own0 = time.process_time(), time.thread_time()
                    kernel0 = resource.getrusage(resource.RUSAGE_THREAD).ru_stime
                    t0 = time.perf_counter()
                    with sampler.call() if sampler is not None and sampling else nullcontext():
                        got = fn(*args)
                    took = time.perf_counter() - t0
                    kernel = resource.getrusage(resource.RUSAGE_THREAD).ru_stime - kernel0
                    own, process = time.thread_time() - own0, time.process_time() - process0
                    cpu["own"] += own * 1e3
                    cpu["own_kernel"] += kernel * 1e3
                    cpu["others"] += max(process - own, 0.0) * 1e3
                finally:
                    if self.cuda:
                        torch.cuda.set_sync_debug_mode(0)
                tracked = gc.get_count()[0] - young if len(gcp.pauses) == n_gc else None
                return took, got, sum(ms for _, ms in gcp.pauses[n_gc:]), tracked

            metrics = self.manager.metrics  # the floor changes none of these
            for it in range(warmup + iterations):
                sampling = it >= warmup
                cpu["own"] = cpu["own_kernel"] = cpu["others"] = 0.0
                before = [getattr(metrics, name) for name in WORK_COUNTERS]
                if self.order == "sglang":  # process_decode_queue: the progress check, before the batch runs
                    check, _, gc_check, tracked_check = timed(self.check)
                self.grow()
                ev = self.step.enqueue()
                if self.order == "sglang":  # process_batch_result: the engine waits for the last step's results
                    if prev is not None or not self.cuda:
                        self.step.wait(prev)
                for req in self.live:  # the step computed this token's KV; the next token is sampled
                    req.kv.kv_committed_len += 1
                    req.output_ids.append(self.rng.randrange(128_000))
                ended = [r for r in self.live if len(r.output_ids) >= r.sampling_params.max_new_tokens]
                for req in ended:
                    req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
                if self.order == "sglang":
                    args = None if self.mode == "adapter" else self._batch_args(ended)
                    with self.free_group():
                        offload, chunks, gc_offload, tracked = timed(self.offload, ended, args)
                    gc_ms = gc_check + gc_offload
                    tracked = None if tracked is None or tracked_check is None else tracked + tracked_check
                else:
                    _, (check, offload, chunks), gc_ms, tracked = timed(self.calls, ended)
                if it >= warmup:
                    per_iter.append(
                        {
                            "total_ms": (check + offload) * 1e3,
                            "check_ms": check * 1e3,
                            "offload_ms": offload * 1e3,
                            "chunks": chunks,
                            "tracked": tracked,
                            "gc_ms": gc_ms,
                            "own_cpu_ms": cpu["own"],
                            "own_kernel_ms": cpu["own_kernel"],
                            "others_cpu_ms": cpu["others"],
                            **{
                                name: getattr(metrics, name) - was
                                for name, was in zip(WORK_COUNTERS, before, strict=True)
                            },
                        }
                    )
                if ended:
                    gone = set(map(id, ended))
                    self.live = [r for r in self.live if id(r) not in gone]
                del ended
                while len(self.live) < self.live_target and self.admit():
                    pass
                if self.order == "compact" and (prev is not None or not self.cuda):
                    self.step.wait(prev)
                prev = ev
        heap = census()
        gc.unfreeze()
        if self.cuda:
            torch.cuda.synchronize()
        out = {
            "mode": self.mode,
            "iterations": len(per_iter),
            "matmuls_per_step": self.step.matmuls,
            "total_ms": stats([r["total_ms"] for r in per_iter]),
            "check_ms": stats([r["check_ms"] for r in per_iter]),
            "offload_ms": stats([r["offload_ms"] for r in per_iter]),
            # GC-tracked objects the calls left allocated (net): what brings the next collection on
            "tracked_per_iteration": statistics.fmean(
                [r["tracked"] for r in per_iter if r["tracked"] is not None] or [0]
            ),
            "gc_pauses": {
                "count": len(gcp.pauses),
                "max_ms": max((ms for _, ms in gcp.pauses), default=0.0),
                "full": sum(1 for g, _ in gcp.pauses if g == 2),
            },
            "chunks_per_iteration": statistics.fmean(r["chunks"] for r in per_iter),
            "gc_in_calls_max_ms": max(r["gc_ms"] for r in per_iter),
            "tail": tail_of(per_iter),
        }
        out["heap"] = heap
        if sampler is not None:
            out["stalls"] = sampler.report()
        if self.mode == "adapter":
            out["no_chunk_due_call_ns"] = self._quiet_call_ns()
            out["sglang_call_floor_ms"] = self._call_floor_ms()
        return out

    def _call_floor_ms(self) -> float:
        """What SGLang's call pattern costs any drop-in per iteration on this host: the adapter loop above
        over the live requests, calling a method that does nothing (the limit of the per-request door)."""
        f = _NoOp().offload_kv_cache
        t0 = time.perf_counter()
        for _ in range(20):
            for req in self.live:
                ok = f(req)
                if not ok and req.finished_reason is not None:
                    pass
        return (time.perf_counter() - t0) * 1e3 / 20

    def _quiet_call_ns(self) -> Optional[float]:
        """The cost of one `offload_kv_cache` call with no chunk due: every live request whose view is in
        the adapter's quiet set, called 20 times over (no decode in between, so none becomes due)."""
        quiet = getattr(self.adapter._views, "quiet", None)  # None: an adapter without the early exit
        if quiet is None:
            return None
        reqs = [r for r in self.live if r in quiet and r.kv.kv_committed_len < quiet[r].due]
        if not reqs:
            return None
        call = self.adapter.offload_kv_cache
        t0 = time.perf_counter()
        for _ in range(20):
            for r in reqs:
                call(r)
        return (time.perf_counter() - t0) * 1e9 / (20 * len(reqs))

    def close(self) -> None:
        for req in self.live:
            req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
            if self.mode == "adapter":
                self.adapter.finalize_release_on_finish(req)
            elif self.mode == "batch":
                self.manager.finalize(self.adapter._views.view(req))
            else:
                self.bare.finalize(req)  # type: ignore[union-attr]
        self.live.clear()
        if self.bare is not None:
            for _ in range(100_000):
                self.bare.check_progress()
                if self.bare.idle():
                    break
                time.sleep(0.001)
        self.adapter.release_host_resources()


SHM = "/dev/shm" if Path("/dev/shm").is_dir() else None  # where the verdict's store lives (no disk under it)


def probe_loop(mode: str, live: int, page: int, device: str, store: str, order: str = "sglang") -> Loop:
    """The loop for the development probes (bench/probes/): on a CPU, one narrow head and no decode step (what
    they count is the calls' own work); on a GPU, the verdict's workload: Llama-3-8B rows, the 20 ms step and
    its 8 GB host pool (put `store` under SHM, as the verdict does). `order`: ORDERS."""
    cpu = device == "cpu"
    args = argparse.Namespace(
        seed=0,
        device=device,
        kv_heads=1 if cpu else 8,
        head_dim=8 if cpu else 128,
        layers=2,
        host_gb=0.5 if cpu else 8.0,
        step_ms=0.0 if cpu else 20.0,
        store_root=None,
        order=order,
    )
    return Loop(mode, live, page, page, args, store)


def run_marked(
    loop: Loop, warmup: int, iterations: int, timed: list[bool], on_timed: Optional[Callable[[], None]] = None
) -> None:
    """`loop.run(warmup, iterations)` with `timed[0]` true only inside the manager calls of the timed iterations
    (never in set-up, warm-up or teardown); `on_timed` runs as each timed iteration's calls begin (its progress
    check, which every order makes once an iteration)."""
    check, offload, seen = loop.check, loop.offload, [0]

    def marked_check() -> None:
        seen[0] += 1
        timed[0] = seen[0] > warmup
        if timed[0] and on_timed is not None:
            on_timed()
        try:
            check()
        finally:
            timed[0] = False

    def marked_offload(ended: list[Req], batch_args: Optional[tuple[Any, ...]] = None) -> int:
        timed[0] = seen[0] > warmup if loop.order == "sglang" or loop.mode == "adapter" else seen[0] >= warmup
        try:
            return offload(ended, batch_args)
        finally:
            timed[0] = False

    loop.check, loop.offload = marked_check, marked_offload  # type: ignore[method-assign]
    loop.run(warmup, iterations)


def run_one(mode: str, live: int, page: int, stride: int, args: argparse.Namespace) -> dict[str, Any]:
    store = tempfile.mkdtemp(prefix=f"kvfsm-adapter-{mode}-", dir=args.store_root)
    loop = None
    try:
        loop = Loop(mode, live, page, stride, args, store)
        row = {"mode": mode, "live": live, "page": page, "stride": stride, "layers": args.layers}
        row.update(loop.run(args.warmup, args.iterations))
        loop.close()
        return row
    finally:
        del loop
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        shutil.rmtree(store, ignore_errors=True)


def combined(runs: list[dict[str, Any]]) -> dict[str, float]:
    """One mode's per-iteration times over its repeated runs of a configuration: the median of the runs' medians,
    means and p99s, and the largest max (one run's figures as they are)."""
    t = [r["total_ms"] for r in runs]
    return {
        "median": statistics.median(x["median"] for x in t),
        "mean": statistics.median(x["mean"] for x in t),
        "p99": statistics.median(x["p99"] for x in t),
        "max": max(x["max"] for x in t),
    }


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (live, page): the adapter against kvfsm's own batch path in the same run, and both against the
    floor (reported, the serving loop's verdict holds the floor targets). With `--repeats`, over each mode's
    runs of the configuration (`combined`)."""
    out = []
    groups: dict[tuple[int, int, int, str], list[dict[str, Any]]] = {}  # (live, page, stride, mode) -> its runs
    for r in rows:
        groups.setdefault((r["live"], r["page"], r["stride"], r["mode"]), []).append(r)
    for (live, page, stride, mode), adapter in groups.items():
        if mode != "adapter":
            continue
        batch = groups.get((live, page, stride, "batch"))
        at = f"{live} live {page}/{stride}" + (f", {len(adapter)} runs" if len(adapter) > 1 else "")
        t = combined(adapter)
        if batch:
            b = combined(batch)
            out.append(target(f"adapter median / batch median, {at}", t["median"] / b["median"], 1.3))
            out.append(target(f"adapter mean / batch mean, {at}", t["mean"] / b["mean"], 1.3))
        out.append(target(f"adapter p99 / its median, {at}", t["p99"] / t["median"], 2.0))
        out.append(target(f"adapter max ms (GC on), {at}", t["max"], 10.0))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--live", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--pages", nargs="+", default=["64/64", "16/16"], help="page/stride pairs")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=80, help="untimed iterations first (the first chunks are due)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=8, help="Llama-3-8B's 8 KV heads of 128 (fewer: a CPU probe)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--host-gb", type=float, default=8.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--store-root", default=SHM)
    ap.add_argument(
        "--store-process",
        type=int,
        nargs="?",
        const=1,
        default=0,
        metavar="N",
        help="kvfsm_store_process: the adapter's file store in a child process over a shared host pool "
        "(N of them: the writes sharded by key)",
    )
    ap.add_argument(
        "--order",
        default="sglang",
        choices=ORDERS,
        help="where the calls sit around the wait for the decode step (ORDERS: sglang's event loop, or "
        "compact, the order of every run before the first in SGLang's order)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each configuration's modes, in alternating order (adapter, batch, bare, then the "
        "reverse): runs on one host differ by about 30%%, and the targets then read the runs' medians",
    )
    ap.add_argument(
        "--no-free-group",
        action="store_true",
        help="make the offload and finish calls with no free group open, every free going back at once (SGLang "
        "opens one around them: the default)",
    )
    ap.add_argument(
        "--stall-ms",
        type=float,
        default=None,
        help="sample the scheduler thread's stack in every timed call that runs past this many ms (stall_stacks: "
        "each row's `stalls` says where the slow calls spend their time, line by line)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="16 live, 64/64, 30 iterations: checks the script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.live, args.pages, args.iterations, args.warmup, args.host_gb = [16], ["16/16"], 30, 10, 0.05
        args.step_ms = min(args.step_ms, 2.0)
    quick = args.quick or args.device == "cpu"  # a CPU run checks the script, never a figure
    rows: list[dict[str, Any]] = []
    payload: dict[str, Any] = {}
    for live in args.live:
        for pair in args.pages:
            page, stride = (int(x) for x in pair.split("/"))
            for mode, repeat in [
                (m, k) for k in range(args.repeats) for m in (args.modes if k % 2 == 0 else args.modes[::-1])
            ]:
                row = run_one(mode, live, page, stride, args)
                row["repeat"] = repeat
                rows.append(row)
                t = row["total_ms"]
                print(
                    f"{mode:8s} live={live} {page}/{stride}: median {t['median']:.3f} ms mean {t['mean']:.3f} "
                    f"p99 {t['p99']:.3f} max {t['max']:.3f}; chunks/it {row['chunks_per_iteration']:.1f}; "
                    f"gc in calls max {row['gc_in_calls_max_ms']:.2f} ms"
                    + (
                        f"; SGLang's call floor {row['sglang_call_floor_ms']:.3f} ms"
                        if row["mode"] == "adapter"
                        else ""
                    )
                    + (
                        f"; no-chunk-due call {row['no_chunk_due_call_ns']:.0f} ns"
                        if row.get("no_chunk_due_call_ns")
                        else ""
                    ),
                    flush=True,
                )
                slow = row["tail"]["slowest_mean"]
                print(
                    f"         slowest {row['tail']['iterations']} (>= p99): {slow['total_ms']:.2f} ms = gc "
                    f"{slow['gc_ms']:.2f} + own cpu {slow['own_cpu_without_gc_ms']:.2f} (kernel {slow['own_kernel_ms']:.2f}) + off cpu "
                    f"{slow['off_cpu_ms']:.2f}; other threads' cpu {slow['others_cpu_ms']:.2f} ms; p99 without gc "
                    f"{row['tail']['p99_without_gc_ms']:.2f} ms; their work "
                    + ", ".join(f"{k} {v:.1f}" for k, v in row["tail"]["slowest_work_mean"].items())
                    + "; a median iteration's "
                    + ", ".join(f"{k} {v:.1f}" for k, v in row["tail"]["all_work_median"].items())
                    + f"; a full collection of the heap at the end {row['heap']['full_collection_ms']:.2f} ms "
                    f"({row['heap']['tracked']} tracked)",
                    flush=True,
                )
                if "stalls" in row:
                    st = row["stalls"]
                    print(
                        f"         calls past {st['after_ms']:g} ms: {st['slow_calls']}, {st['samples']} samples "
                        f"({st['in_collection']} in a collection); most sampled: "
                        + " | ".join(f"{e['count']}x " + " <- ".join(e["stack"][:3]) for e in st["top"][:3]),
                        flush=True,
                    )
                payload.update(
                    settings={k: v for k, v in vars(args).items() if k != "out"}, rows=rows, targets=targets(rows)
                )
                path = write_result(
                    "sglang_adapter_gpu", payload, args.out, quick=quick, tag=None if not quick else args.device
                )
    for t in payload.get("targets", []):
        print(t)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
