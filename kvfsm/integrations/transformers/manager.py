"""`KvfsmOffloadingManager`: the drop-in for transformers' OffloadingManager whose swaps run through
spec/cb_swap.yaml (one `CbSwapMachine` per swapped request).

It keeps transformers' victim choice and requeue logic, turns the engine's frees and cancellations of a
swapped request into that request's machine events, and acknowledges landed copies; the actions the
machine runs live in effects.py. About 400 lines: `offload_requests` and `restore_scheduled_requests`
follow transformers' own methods line for line, so that they can be compared with them.

With fences (the spec's `fences` param, SwapConfig.fenced) a victim's device blocks go back to the engine
inside its `preempt`, fenced: the compute stream waits on the copy's event and the host does not, and the
copy is acknowledged by a later progress check. Without, the manager waits on the host for the copy. A
request the engine ends under its swap-in gives its blocks back fenced against that swap-in (with fences)
or at its acknowledgement (without); its host blocks, which the swap-in reads, only at the acknowledgement.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from typing import Any, Optional

import torch

from kvfsm.dataplane import HostKVPool
from kvfsm.errors import LifecycleError
from kvfsm.generated import cb_swap as spec_gen
from kvfsm.generated.cb_swap import CbSwapMachine
from kvfsm.runtime.ledger import CheckedModeError

from .compat import FULL_ATTENTION, OffloadingManager, RequestStatus
from .config import SwapConfig, SwapMetrics, _fenced, _size_host_pool
from .effects import SwapCopy, SwapEffects, SwapRecord, _engine_for
from .ledger import SwapLedger
from .pool import PagedCachePool

_serials = itertools.count(1)
# The states of a swapped request waiting to be rescheduled: its KV is (or is being copied) in host blocks and no
# swap-in has started. `restore` takes it from `swapped`; from the other two, after its swap-out is acknowledged
# (spec/cb_swap.yaml; test_awaiting_restore_is_swapped_and_what_swap_out_done_takes_there checks it against the spec).
_AWAITING_RESTORE = frozenset({spec_gen.SWAPPING_OUT, spec_gen.SWAPPING_OUT_FENCED, spec_gen.SWAPPED})


class KvfsmOffloadingManager(OffloadingManager):
    """Drop-in for transformers' OffloadingManager whose swaps run through spec/cb_swap.yaml.

    The victim choice (`offload_requests`) and the requeue of victims are transformers' own logic; what
    differs is how blocks move and when they are freed: each victim's swap-out is a `preempt` of its
    machine, its device blocks return to the engine fenced in that `preempt` (with fences) or at
    `swap_out_done` (without), each restore is a `restore` and its host blocks return at `swap_in_done`, and
    the engine's frees and cancellations of a request that has a machine become its `finish` / `cancel`
    events.
    """

    def __init__(
        self,
        cache: Any,
        scheduler: Any,
        compute_stream: Any,
        config: Optional[SwapConfig] = None,
        cpu_offload_space_gib: Optional[float] = None,
    ) -> None:  # no super().__init__: it pins its own pool
        self.config = config = config or SwapConfig()
        if list(cache.cache_allocators) != [FULL_ATTENTION]:
            raise NotImplementedError(
                "kvfsm's transformers integration supports models whose layers all use full "
                f"attention (one cache allocator); this cache has {list(cache.cache_allocators)}"
            )
        self.cache, self.scheduler = cache, scheduler
        self._compute_stream = compute_stream
        self._cpu_pool = None  # transformers' own pool: unused
        self._cpu_views: dict[str, torch.Tensor] = {}
        self._request_id_to_cpu_blocks: dict[str, dict[str, list[int]]] = {}
        self.allocator = cache.cache_allocators[FULL_ATTENTION]
        self.device_pool = PagedCachePool(self.allocator)
        num_host = _size_host_pool(config, self.device_pool, cpu_offload_space_gib)
        self.host_pool = HostKVPool(self.device_pool.config, num_host, page_size=1, pin_memory=config.pin_memory)
        self.engine = _engine_for(config, self.device_pool.device, self.compute_stream)
        # an engine bound to the compute stream orders its copies after it: no stream context per submit
        self._stream_bound = (
            self.compute_stream is None or getattr(self.engine, "compute_stream", None) is self.compute_stream
        )
        self.fenced = _fenced(config, self.engine)
        self._fences = 1 if self.fenced else 0  # the spec's `fences` param of every machine
        self.checked = bool(config.checked)
        self.ledger: Optional[SwapLedger] = SwapLedger() if self.checked else None
        self.fx = SwapEffects(self)
        self.metrics = SwapMetrics()
        self.coverage: set[int] = set()
        self.live: dict[str, SwapRecord] = {}  # request id -> record of its live machine (at most one)
        self.in_flight: dict[str, SwapRecord] = {}  # record key -> record with a copy in flight (submission order)
        self.awaiting_restore = 0  # machines in _AWAITING_RESTORE, counted from their transitions (_observe)
        self._cancelling: set[str] = set()
        if self.device_pool.device.type == "cuda":
            self.warm_up()
        # The engine's frees and cancellations of requests with a machine go through that machine.
        self._orig_free_blocks = cache.free_blocks
        self._orig_clear_cancelled = scheduler.clear_cancelled_requests
        cache.free_blocks = self._engine_frees
        scheduler.clear_cancelled_requests = self._engine_clears_cancelled
        if self.ledger is not None:
            self._check_engine_writes(cache)

    def warm_up(self) -> None:
        """Swap the engine's trash blocks 0 and 1 (never allocated, no forward has run yet) out and back in
        unchanged, so the copy path is ready before the first real swap (the driver's batched copy for whole
        blocks; a Triton kernel, which specialises a count of 1, hence two blocks, for smaller ones)."""
        n = min(2, self.host_pool.capacity)
        pages = self.host_pool.alloc_pages(n)
        if pages is None:
            return
        host, blocks = self.host_pool.page_slots(pages), list(range(n))
        # The engine zeroed its cache (block 0 is the read trash its padding tokens read) on the stream current
        # when it built it, which the compute stream is not ordered after: a copy read before the fill lands
        # writes stale bytes back over it (seen under GPU contention as wrong tokens with CUDA graphs).
        if self.device_pool.device.type == "cuda":
            torch.cuda.synchronize(self.device_pool.device)
        try:
            with self.stream_ctx():
                self.engine.submit_d2h(self.device_pool, blocks, self.host_pool, host).wait()
                self.engine.submit_h2d(self.host_pool, host, self.device_pool, blocks).wait()
        finally:
            self.host_pool.free_pages(pages)

    # --- plumbing ----------------------------------------------------------------------------------
    @property
    def compute_stream(self) -> Any:
        """The stream the engine writes its KV blocks on (None: the current stream, or no streams on the CPU)."""
        return self._compute_stream if self.device_pool.device.type == "cuda" else None

    def stream_ctx(self) -> Any:
        """The engine's compute stream as the current stream (copies are ordered after its kernels)."""
        if self._compute_stream is not None and self.device_pool.device.type == "cuda":
            return torch.cuda.stream(self._compute_stream)
        return contextlib.nullcontext()

    def submit(self, submit: Any, *args: Any) -> Any:
        """`submit(*args)` (a copy engine's submit_d2h / submit_h2d) ordered after the compute stream: as is
        when the engine is bound to it, else inside `stream_ctx` (an engine the user passed)."""
        if self._stream_bound:
            return submit(*args)
        with self.stream_ctx():
            return submit(*args)

    def engine_free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        """The engine's own PagedAttentionCache.free_blocks (not routed through any machine)."""
        self._orig_free_blocks(request_id, no_cache)

    def _observe(self, m: CbSwapMachine, event: str, src: int, dst: int, tid: int) -> None:
        if tid < 0:
            self.metrics.ignored_ends += 1
        else:
            self.coverage.add(tid)
            if (src in _AWAITING_RESTORE) != (dst in _AWAITING_RESTORE):
                self.awaiting_restore += 1 if dst in _AWAITING_RESTORE else -1
        if self.checked:
            bad = spec_gen.violated_invariants(m)
            if bad:
                raise CheckedModeError(m.ctx.key, event, None, f"spec invariants violated: {', '.join(bad)} in {m!r}")

    def _record(self, state: Any) -> SwapRecord:
        rid = state.request_id
        rec = self.live.get(rid)
        if rec is not None:
            if rec.state_ref() is not state:
                raise LifecycleError(f"request id {rid!r} names two live requests ({rec.key} and a new one)")
            return rec
        rec = SwapRecord(key=f"{rid}#{next(_serials)}", rid=rid, state_ref=weakref.ref(state))
        rec.machine = CbSwapMachine(self.fx, rec, self._observe, fences=self._fences)
        self.live[rid] = rec
        return rec

    def _retire(self, rec: SwapRecord) -> None:
        if rec.machine is not None and rec.machine.state == spec_gen.RELEASED and self.live.get(rec.rid) is rec:
            del self.live[rec.rid]

    def _ack(self, rec: SwapRecord) -> None:
        c = rec.copy
        assert c is not None
        if self.ledger is not None:
            self.ledger.copy_done(rec.key, c.device_blocks)
        rec.copy = None
        self.in_flight.pop(rec.key, None)
        m = rec.machine
        assert m is not None
        if c.direction == "d2h":
            m.swap_out_done(c)
            self.metrics.swap_outs_done += 1
        else:
            m.swap_in_done(c)
            self.metrics.swap_ins_done += 1
        self._retire(rec)

    def poll(self, wait: bool = False) -> int:
        """Acknowledge every copy that has landed (all of them, waiting, when `wait`); returns how many."""
        if not self.in_flight:
            return 0
        n = 0
        for rec in list(self.in_flight.values()):
            c = rec.copy
            if c is None or c.handle is None:
                continue
            if wait:
                c.handle.wait()
            if c.handle.done():
                self._ack(rec)
                n += 1
        return n

    # --- swap-out: transformers' victim choice, kvfsm's copies -------------------------------------
    def _swap_out(self, state: Any) -> bool:
        """Preempt one victim: True when it is swapped (its KV in host blocks), False when soft reset."""
        rec = self._record(state)
        m = rec.machine
        assert m is not None
        if m.state == spec_gen.SWAPPING_IN and rec.copy is not None and rec.copy.handle is not None:
            # Chosen again before its swap-in was seen landed (async batching schedules the next batch while the
            # one that restored it still runs): the spec preempts only `resident`, so wait for that copy here.
            rec.copy.handle.wait()
            self._ack(rec)
            self.metrics.preempt_waits += 1
        table = list(self.allocator.block_table.get(state.request_id, []))
        rec.no_cache = True  # a victim's blocks go straight back to the pool (as transformers does)
        # host blocks as page ids (page size 1): the copy plan and the free check them as a list, not a tensor
        pages = self.host_pool.alloc_pages(len(table)) if table else None
        if pages is None:
            m.soft_reset()
            self._retire(rec)
            return False
        try:
            m.preempt(SwapCopy("d2h", table, self.host_pool.page_slots(pages)))
        except BaseException:
            self.host_pool.free_pages(pages)
            raise
        assert rec.copy is not None and rec.copy.handle is not None
        if m.state == spec_gen.SWAPPING_OUT:
            # Deferred: the engine needs the blocks back now (it re-plans the batch at once): wait for the copy.
            rec.copy.handle.wait()
            self._ack(rec)
        elif self.device_pool.device.type != "cuda" and rec.copy.handle.done():
            # fenced, the blocks are back already. A CPU engine's copy may have landed at submit: ack it now.
            # On the GPU it is queued behind the compute stream's work: a later poll acknowledges it (an event
            # query now would find it pending).
            self._ack(rec)
        return True

    def offload_requests(self) -> bool:
        """transformers' OffloadingManager.offload_requests (same victims, same requeue), with each victim's
        swap-out run through its machine."""
        t0 = time.perf_counter()
        self.metrics.offload_calls += 1
        try:
            self.poll()
            scheduler = self.scheduler
            starved = scheduler.starved_requests
            cached_blocks_evicted = self.cache.evict_cached_blocks()
            if not starved:
                return cached_blocks_evicted
            list_blocks_needed = [
                {
                    name: allocator.needs_new_blocks(state.request_id, state.current_len(), request_len)
                    for name, allocator in self.cache.cache_allocators.items()
                }
                for state, request_len in scheduler.starved_requests
            ]
            num_active = len(scheduler.active_requests)
            offloaded: list[Any] = []
            swapped: set[str] = set()
            while starved and num_active - len(offloaded) > 1:
                if self.cache.count_storable_requests(list_blocks_needed) == len(starved):
                    break
                state, _ = starved.pop()
                list_blocks_needed.pop()
                offloaded.append(state)
                if self._swap_out(state):
                    swapped.add(state.request_id)
            if not offloaded:
                return cached_blocks_evicted
            offloaded.reverse()
            for state in offloaded:
                request_id = state.request_id
                if request_id in swapped:
                    state.is_cpu_offloaded = True
                    state.allocated_blocks = 0
                    if state._status == RequestStatus.DECODING:
                        # async batching: a token still in flight in batch N is discarded; roll back to the last
                        # known one (transformers' own rule)
                        if state.position_offset == len(state.initial_tokens) + len(state.generated_tokens):
                            state.position_offset -= 1
                            last_true_token = (state.generated_tokens or state.initial_tokens)[-1]
                            state.remaining_prefill_tokens = [last_true_token]
                        else:
                            state.remaining_prefill_tokens = state.tokens_to_process[:]
                    state._status = RequestStatus.PENDING
                    new_state = state
                else:
                    new_state = state.create_equivalent_initial_request()
                    state._status = RequestStatus.FINISHED
                # transformers calls scheduler.finish_request here; its free is a no-op (the machine released
                # the blocks), and for a swapped request it would read as a `finish` of a waiting request.
                scheduler.active_requests.pop(request_id, None)
                scheduler.add_waiting_request(new_state)
            scheduler.block_new_requests = True
            return True
        finally:
            self.metrics.time_offload_s += time.perf_counter() - t0

    # --- swap-in -----------------------------------------------------------------------------------
    def restore_scheduled_requests(self, requests_in_batch: list[Any]) -> None:
        """Submit the swap-in of every swapped request the scheduler just put in the batch (it has
        already allocated fresh device blocks for them).

        The engine calls this before every forward, and most batches restore nothing. While no machine awaits
        a restore, a call returns at once, without the scan of the batch the engine's own manager makes on
        every call (not yet measured on the H200). Otherwise a call that finds nothing to restore is one pass
        over the batch. Neither polls nor times: acks wait for the next call that restores or offloads, or for
        an engine free, each of which polls first. Checked mode always scans, and checks the count of
        machines awaiting a restore against their states."""
        self.metrics.restore_calls += 1
        if not self.awaiting_restore and not self.checked:
            return
        swapped = [f for f in requests_in_batch if f.state.is_cpu_offloaded]
        if self.checked:
            self._check_awaiting_restore()
        if not swapped:
            return
        t0 = time.perf_counter()
        try:
            self.poll()
            for future_state in swapped:
                state = future_state.state
                rec = self.live.get(state.request_id)
                if rec is None or rec.state_ref() is not state or rec.host_blocks is None:
                    raise LifecycleError(
                        f"request {state.request_id!r} is marked offloaded but kvfsm holds no swap of it"
                    )
                if rec.copy is not None and rec.copy.direction == "d2h" and rec.copy.handle is not None:
                    # Rescheduled before its fenced swap-out was seen landed: the swap-in reads the host
                    # blocks that copy writes, so wait for it here (the spec restores only `swapped`).
                    rec.copy.handle.wait()
                    self._ack(rec)
                    self.metrics.restore_waits += 1
                assert state is not None  # the identity check above narrowed it to what state_ref() returns
                gpu_blocks = list(self.allocator.block_table.get(state.request_id, []))
                n = min(len(rec.host_blocks), len(gpu_blocks))
                assert rec.machine is not None
                host = (
                    rec.host_blocks
                    if n == len(rec.host_blocks.pages)
                    else self.host_pool.page_slots(rec.host_blocks.pages[:n])
                )
                copy = SwapCopy("h2d", gpu_blocks[:n], host)
                copy.valid_tokens = min(int(state.position_offset), n * self.device_pool.tokens_per_block)
                rec.machine.restore(copy)
                state.is_cpu_offloaded = False
                if self.cache.use_prefix_sharing:  # transformers' own rule: restored blocks get hashed next update
                    for name, allocator in self.cache.cache_allocators.items():
                        restored_blocks = state.position_offset // allocator.tokens_per_page
                        if restored_blocks:
                            future_state.complete_blocks[name] = (
                                future_state.complete_blocks.get(name, 0) + restored_blocks
                            )
            if self.device_pool.device.type != "cuda":
                self.poll()  # a CPU engine's copy may have landed at submit: acknowledged now (on the GPU it has not)
        finally:
            self.metrics.time_restore_s += time.perf_counter() - t0

    def _check_awaiting_restore(self) -> None:
        """Checked mode: `awaiting_restore` (which lets a call skip its scan) is the number of machines in
        `_AWAITING_RESTORE` (a request marked offloaded with no such machine is refused by the scan)."""
        actual = sum(1 for r in self.live.values() if r.machine is not None and r.machine.state in _AWAITING_RESTORE)
        if actual != self.awaiting_restore:
            raise CheckedModeError(
                "manager",
                "restore",
                None,
                f"awaiting_restore is {self.awaiting_restore}, but "
                f"{actual} machines await a restore: a call could skip a swapped request",
            )

    def _check_engine_writes(self, cache: Any) -> None:
        """Checked mode: wrap, on the instance, the three calls through which the engine names the blocks its
        next kernels write (the forward's write indices or block table, and block forks), so the ledger sees
        every write of a device block before it is enqueued (a fenced block needs its fence waited on)."""
        ledger = self.ledger
        assert ledger is not None
        extend, fill, fork = cache.extend_read_and_write_indices, cache.fill_block_table, cache.perform_cache_copy

        def written(request_id: str, past_length: int, query_length: int) -> None:
            if query_length > 0:
                ps = self.device_pool.tokens_per_block
                table = self.allocator.block_table.get(request_id, [])
                ledger.device_write(request_id, table[past_length // ps : (past_length + query_length - 1) // ps + 1])

        def extend_read_and_write_indices(
            request_id: str, past_length: int, query_length: int, read_index: Any, write_index: Any
        ) -> None:
            written(request_id, past_length, query_length)
            extend(request_id, past_length, query_length, read_index, write_index)

        def fill_block_table(request_id: str, past_length: int, query_length: int, block_table: Any) -> None:
            written(request_id, past_length, query_length)
            fill(request_id, past_length, query_length, block_table)

        def perform_cache_copy(copy_src_and_dst: dict[str, tuple[list[int], list[int]]]) -> None:
            ledger.device_write("block fork", list(copy_src_and_dst.get(FULL_ATTENTION, ([], []))[1]))
            fork(copy_src_and_dst)

        cache.extend_read_and_write_indices = extend_read_and_write_indices
        cache.fill_block_table = fill_block_table
        cache.perform_cache_copy = perform_cache_copy

    def check_restore_target(self, rec: SwapRecord, blocks: list[int]) -> None:
        """Checked mode: the blocks a restore writes belong to this request alone (else it overwrites another
        request's live KV, B1)."""
        mine = set(self.allocator.block_table.get(rec.rid, []))
        led = self.allocator.ledger
        for b in blocks:
            if b not in mine:
                raise CheckedModeError(
                    rec.key, "restore", b, "restoring into a device block the engine did not give this request"
                )
            if b in led.shared_ref_counts or b in led.cached_blocks:
                raise CheckedModeError(rec.key, "restore", b, "restoring into a shared or cached device block (B1)")
        for rid, table in self.allocator.block_table.items():
            if rid != rec.rid and mine.intersection(table).intersection(blocks):
                b = sorted(mine.intersection(table).intersection(blocks))[0]
                raise CheckedModeError(rec.key, "restore", b, f"device block also in the table of request {rid} (B1)")

    # --- the engine's frees and cancellations ------------------------------------------------------
    def _engine_frees(self, request_id: str, no_cache: bool = False) -> None:
        """PagedAttentionCache.free_blocks as the engine calls it: a request with a live machine is ended
        through it (finish, or cancel inside clear_cancelled_requests)."""
        if request_id not in self.live:
            return self._orig_free_blocks(request_id, no_cache)
        self.poll()
        rec = self.live.get(request_id)
        if rec is None:
            return self._orig_free_blocks(request_id, no_cache)
        m = rec.machine
        assert m is not None
        rec.no_cache = no_cache
        if request_id in self._cancelling:
            m.cancel()
            self.metrics.cancels += 1
        else:
            m.finish()
            self.metrics.finishes += 1
        self._retire(rec)

    def _engine_clears_cancelled(self) -> list[Any]:
        with self.scheduler._cancellation_lock:
            self._cancelling = set(self.scheduler._requests_to_cancel)
        try:
            return self._orig_clear_cancelled()
        finally:
            self._cancelling = set()

    def free_request_cpu_cache(self, state: Any) -> None:
        """Called by the engine for each cancelled request (and for waiting ones when it fails them all)."""
        rec = self.live.get(state.request_id)
        if rec is not None and rec.state_ref() is state:
            assert rec.machine is not None
            rec.no_cache = False
            rec.machine.cancel()
            self.metrics.cancels += 1
            self._retire(rec)
        state.is_cpu_offloaded = False

    def free_all_waiting_cpu_caches(self) -> None:
        for state in list(self.scheduler.waiting_requests.values()):
            self.free_request_cpu_cache(state)

    def reset(self) -> None:
        """A new session: end every live machine, wait for every copy, and check nothing is left."""
        self.poll(wait=True)
        for rec in list(self.live.values()):
            assert rec.machine is not None
            state = rec.state_ref()
            rec.no_cache = False
            rec.machine.cancel()
            self.metrics.cancels += 1
            self._retire(rec)
            if state is not None:
                state.is_cpu_offloaded = False
        self.poll(wait=True)

    # --- inspection ----------------------------------------------------------------------------------
    def leaks(self) -> list[str]:
        """What is still held: live machines not resident, copies in flight, host blocks, ledger entries."""
        out = [
            f"{r.key} in {spec_gen.STATES[r.machine.state]}"
            for r in self.live.values()
            if r.machine is not None and r.machine.state != spec_gen.RESIDENT
        ]
        out += [f"copy of {k} in flight" for k in self.in_flight]
        used = self.host_pool.capacity - self.host_pool.free_slots
        if used:
            out.append(f"{used} host blocks allocated")
        if self.ledger is not None:
            if self.ledger.host_owner:
                out.append(f"ledger: {len(self.ledger.host_owner)} host blocks owned")
            if self.ledger.in_flight or self.ledger.fenced:
                out.append(f"ledger: {len(self.ledger.in_flight) + len(self.ledger.fenced)} device blocks under copies")
        return out
