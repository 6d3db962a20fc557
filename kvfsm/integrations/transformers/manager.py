"""kvfsm as the KV offloading manager of Hugging Face transformers' continuous batching.

transformers' `generate_batch` (a `ContinuousBatchingManager`) schedules requests over a paged KV cache;
under cache pressure its `OffloadingManager` evicts requests ("victims"), copies their blocks to a pinned
CPU pool and copies them back when they are rescheduled. `install(model_or_manager)` replaces that
manager, per batch processor, with `KvfsmOffloadingManager`: the victim choice and the requeue logic
stay transformers' own, and every swap-out, swap-in, free and cancellation of a request's blocks is an
event of its `CbSwapMachine`, generated from spec/cb_swap.yaml, whose actions (`SwapEffects`) move the
bytes with kvfsm's data plane:

- the engine's cache tensor is viewed, without a copy, as a kvfsm `DeviceKVPool` whose slots are the
  engine's blocks (`PagedCachePool`); host blocks live in a kvfsm `HostKVPool` (pinned under CUDA);
- copies go through a kvfsm `CopyEngine` (`CudaCopyEngine` on a CUDA cache, `CpuCopyEngine` on the CPU),
  whose row copies use index_select/index_copy_ (never `dst[idx].copy_`, which moved nothing: B15);
- a victim's device blocks go back to the engine only once its swap-out has been acknowledged (B2);
  a request finished or cancelled while a copy is in flight has its release deferred to the ack;
- checked mode (`SwapConfig(checked=True)`) verifies the spec's invariants after every transition, keeps a
  block ledger (no block reused under a copy, no host block freed twice or by another request) and
  compares every landed copy with its source and every restore with the KV read at swap-out (B15).

The engine reaches this module through four seams, all on its own objects (no class or module is patched):
`ContinuousBatchProcessor.offloading_manager` (replaced), `PagedAttentionCache.free_blocks` and
`Scheduler.clear_cancelled_requests` (wrapped on the instance, so a swapped request's free and
cancellation reach its machine), and `ContinuousBatchingManager._create_batch_processor` (wrapped on the
instance, to install the manager on each new batch processor). Supported: one process (no tensor
parallelism) and models whose layers all use full attention (one cache allocator), e.g. Llama.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import warnings
import weakref
from dataclasses import dataclass, field, fields
from typing import Any, Iterator, Optional, Union

import torch

try:
    import transformers
    from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION
    from transformers.generation.continuous_batching.continuous_api import (
        ContinuousBatchingManager,
        ContinuousBatchProcessor,
    )
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager
    from transformers.generation.continuous_batching.requests import RequestStatus
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvfsm.integrations.transformers needs Hugging Face transformers with continuous batching "
        "(pip install 'kvfsm[transformers]')"
    ) from exc

from generated import cb_swap as spec_gen
from generated.cb_swap import CbSwapMachine
from kvfsm.dataplane import CopyEngine, CopyHandle, CpuCopyEngine, HostKVPool, KVCacheConfig
from kvfsm.dataplane.pools.device_pool import DeviceKVPool, resolve_device
from kvfsm.errors import LifecycleError
from kvfsm.runtime.ledger import CheckedModeError

TESTED_VERSIONS = (">=5.24", "<5.25")  # the range of kvfsm[transformers]; others get a warning at install
_TESTED_MIN, _TESTED_MAX = (5, 24), (5, 25)

_serials = itertools.count(1)


def _version_tuple(version: str) -> tuple[int, int]:
    parts = (version.split("+")[0].split(".") + ["0", "0"])[:2]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


def transformers_version_tested(version: Optional[str] = None) -> bool:
    """True when `version` (default: the installed one) is inside TESTED_VERSIONS."""
    v = _version_tuple(version or transformers.__version__)
    return _TESTED_MIN <= v < _TESTED_MAX


# ---- configuration and metrics --------------------------------------------------------------------


@dataclass
class SwapConfig:
    """How kvfsm runs the engine's swaps.

    Host pool size: `host_blocks` wins, then `host_bytes`, then the engine's own `cpu_offload_space`
    (GiB) when it is positive, else 1 GiB. `copy_engine`: "auto" (CUDA engine for a CUDA cache, CPU
    engine otherwise), "cpu", "cuda", or a CopyEngine instance.
    """

    host_blocks: Optional[int] = None
    host_bytes: Optional[int] = None
    copy_engine: Union[str, CopyEngine] = "auto"
    checked: bool = False
    pin_memory: Optional[bool] = None  # None: pinned when CUDA is available


@dataclass
class SwapMetrics:
    """Counts and times of one KvfsmOffloadingManager (add them with `+`)."""

    preempts: int = 0  # swap-outs submitted
    soft_resets: int = 0  # victims the host pool could not hold (re-prefilled by the engine)
    swap_outs_done: int = 0
    restores: int = 0  # swap-ins submitted
    swap_ins_done: int = 0
    finishes: int = 0  # swapped-at-least-once requests that finished
    cancels: int = 0  # cancel events (client cancellation, engine failure or reset)
    deferred_releases: int = 0  # ends while a copy was in flight (release at its ack)
    ignored_ends: int = 0  # declared no-op finish/cancel calls
    blocks_out: int = 0
    blocks_in: int = 0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    verified_copies: int = 0  # checked mode: landed copies compared with their source
    host_blocks_peak: int = 0
    offload_calls: int = 0
    restore_calls: int = 0
    time_offload_s: float = 0.0  # host wall time inside offload_requests (victim choice, swap-outs)
    time_restore_s: float = 0.0  # host wall time inside restore_scheduled_requests (swap-in submission)

    def __add__(self, other: "SwapMetrics") -> "SwapMetrics":
        out = SwapMetrics()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(out, f.name, max(a, b) if f.name == "host_blocks_peak" else a + b)
        return out

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# ---- the engine's paged cache as a kvfsm device pool ----------------------------------------------


class PagedCachePool(DeviceKVPool):
    """The engine's full-attention paged cache, viewed (not copied) as a kvfsm DeviceKVPool.

    The engine keeps one flat byte tensor; block b holds, for each of its L layers, the K then the V of
    `page_size` tokens: `(blocks, L, 2, page_size, H, D)`. Permuted, that is kvfsm's
    `(planes=2, layers=L, slots=blocks, page_size*H, D)`: one kvfsm slot is one engine block, and slot
    ids are the engine's block ids (its two trash sectors included, never allocated).
    """

    def __init__(self, allocator: Any) -> None:  # wraps the engine's memory: no DeviceKVPool.__init__
        layers, ps = int(allocator.pages_per_block), int(allocator.tokens_per_page)
        heads, head_dim = int(allocator.num_key_value_heads), int(allocator.head_dim)
        dtype = allocator.cache_dtype
        self.config = KVCacheConfig(num_layers=layers, kv_heads=ps * heads, head_dim=head_dim, attention="mha",
                                    dtype=dtype)
        flat = allocator._copy_view  # [blocks, bytes_per_block] uint8 view of the whole cache tensor
        if flat.shape[1] != self.config.bytes_per_token:
            raise ValueError(f"engine block of {flat.shape[1]} bytes does not match {self.config}")
        blocks = int(flat.shape[0])
        self.size = blocks
        self.device = resolve_device(flat.device)
        self.storage = flat.view(dtype).view(blocks, layers, 2, ps * heads, head_dim).permute(2, 1, 0, 3, 4)
        self.block_bytes = int(flat.shape[1])
        self.tokens_per_block, self.kv_heads = ps, heads

    def blocks(self, block_ids: list[int]) -> torch.Tensor:
        """`(2, L, n, page_size*H, D)` copy of these blocks' KV (for checks)."""
        idx = torch.as_tensor(block_ids, dtype=torch.int64, device=self.device)
        return self.storage.index_select(2, idx)

    def tokens(self, blocks_kv: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The first `num_tokens` token rows `(2, L, num_tokens, H, D)` of a `blocks()` result."""
        p, layers, n, _, d = blocks_kv.shape
        rows = blocks_kv.reshape(p, layers, n * self.tokens_per_block, self.kv_heads, d)
        return rows[:, :, :num_tokens]


# ---- checked mode's block ledger ------------------------------------------------------------------


class SwapLedger:
    """Every host block is free or held by one request; no device block is freed, restored into or copied
    while a copy of it is in flight; a restore writes only blocks the engine gave this request alone."""

    def __init__(self) -> None:
        self.host_owner: dict[int, str] = {}
        self.in_flight: dict[int, tuple[str, str]] = {}  # device block -> (request key, direction)

    def copy_started(self, key: str, event: str, direction: str, device_blocks: list[int],
                     host_blocks: list[int]) -> None:
        for b in device_blocks:
            if b in self.in_flight:
                other, d = self.in_flight[b]
                raise CheckedModeError(key, event, b, f"device block already under an in-flight {d} copy of {other} (B2)")
        for h in host_blocks:
            owner = self.host_owner.get(h)
            if direction == "d2h" and owner is not None:
                raise CheckedModeError(key, event, h, f"host block already held by {owner} (host double alloc)")
            if direction == "h2d" and owner != key:
                raise CheckedModeError(key, event, h, f"restoring from a host block held by {owner}, not this request")
        if direction == "d2h":
            for h in host_blocks:
                self.host_owner[h] = key
        for b in device_blocks:
            self.in_flight[b] = (key, direction)

    def copy_aborted(self, key: str, direction: str, device_blocks: list[int], host_blocks: list[int]) -> None:
        for b in device_blocks:
            self.in_flight.pop(b, None)
        if direction == "d2h":
            for h in host_blocks:
                if self.host_owner.get(h) == key:
                    del self.host_owner[h]

    def copy_done(self, device_blocks: list[int]) -> None:
        for b in device_blocks:
            self.in_flight.pop(b, None)

    def release_device(self, key: str, event: str, device_blocks: list[int]) -> None:
        for b in device_blocks:
            if b in self.in_flight:
                other, d = self.in_flight[b]
                raise CheckedModeError(key, event, b, f"freeing a device block an in-flight {d} copy of {other} still uses (B2)")

    def free_host(self, key: str, event: str, host_blocks: list[int]) -> None:
        for h in host_blocks:
            if self.host_owner.get(h) != key:
                raise CheckedModeError(key, event, h, f"freeing a host block held by {self.host_owner.get(h)}, "
                                                      "not this request (host double free, B10)")
        for h in host_blocks:
            del self.host_owner[h]


# ---- per-request bookkeeping and the spec's actions -----------------------------------------------


@dataclass(eq=False)
class SwapCopy:
    """One swap copy: the request's device blocks and the host blocks, paired by position."""

    direction: str  # "d2h" (swap-out) or "h2d" (swap-in)
    device_blocks: list[int]
    host_blocks: torch.Tensor  # int64, CPU
    handle: Optional[CopyHandle] = None
    submitted_at: float = 0.0
    valid_tokens: Optional[int] = None  # swap-in: tokens of KV the request has (the rest of its last block is free)


@dataclass(eq=False)
class SwapRecord:
    """The integration's bookkeeping for one request's swap lifecycle (its machine's `ctx`)."""

    key: str
    rid: str
    state_ref: "weakref.ReferenceType[Any]"
    machine: Optional[CbSwapMachine] = None
    host_blocks: Optional[torch.Tensor] = None  # held from the swap-out until the swap-in lands
    copy: Optional[SwapCopy] = None  # the copy in flight
    parked_table: Optional[list[int]] = None  # device blocks taken from the engine while release is deferred
    no_cache: bool = False  # how the engine asked for the device blocks to be freed
    expected: Optional[torch.Tensor] = None  # checked mode: the KV read at swap-out (CPU)
    swaps: int = 0

    def __repr__(self) -> str:
        return self.key


class SwapEffects:
    """Implements `generated.cb_swap.CbSwapEffects` over the engine's cache, a HostKVPool and a CopyEngine."""

    def __init__(self, owner: "KvfsmOffloadingManager") -> None:
        self.o = owner

    def start_swap_out(self, m: CbSwapMachine, c: SwapCopy) -> None:
        o, rec = self.o, m.ctx
        host = c.host_blocks.tolist()
        if o.ledger is not None:
            o.ledger.copy_started(rec.key, "preempt", "d2h", c.device_blocks, host)
        try:
            with o.stream_ctx():
                if o.checked:
                    rec.expected = o.device_pool.blocks(c.device_blocks).to("cpu")
                c.submitted_at = time.perf_counter()
                c.handle = o.engine.submit_d2h(o.device_pool, c.device_blocks, o.host_pool, c.host_blocks)
        except BaseException:
            if o.ledger is not None:
                o.ledger.copy_aborted(rec.key, "d2h", c.device_blocks, host)
            rec.expected = None
            raise
        rec.host_blocks, rec.copy = c.host_blocks, c
        rec.swaps += 1
        o.in_flight[rec.key] = rec
        n = len(c.device_blocks)
        o.metrics.preempts += 1
        o.metrics.blocks_out += n
        o.metrics.bytes_d2h += n * o.device_pool.block_bytes
        used = o.host_pool.capacity - o.host_pool.free_slots
        o.metrics.host_blocks_peak = max(o.metrics.host_blocks_peak, used)

    def count_soft_reset(self, m: CbSwapMachine, arg: Any) -> None:
        self.o.metrics.soft_resets += 1

    def verify_swap_out(self, m: CbSwapMachine, c: SwapCopy) -> None:
        o, rec = self.o, m.ctx
        if not o.checked:
            return
        host = o.host_pool.token_view().index_select(2, c.host_blocks)
        device = o.device_pool.blocks(c.device_blocks).to("cpu")
        if not (torch.equal(host, device) and rec.expected is not None and torch.equal(host, rec.expected)):
            raise CheckedModeError(rec.key, "swap_out_done", c.device_blocks[0] if c.device_blocks else None,
                                   "the host blocks differ from the device blocks they were copied from: "
                                   "the swap-out moved nothing or the wrong rows (B15)")
        o.metrics.verified_copies += 1

    def release_device_blocks(self, m: CbSwapMachine, arg: Any) -> None:
        o, rec = self.o, m.ctx
        if rec.parked_table is not None:
            blocks, name = rec.parked_table, f"__kvfsm_deferred__{rec.key}"
        else:
            blocks, name = list(o.allocator.block_table.get(rec.rid, [])), rec.rid
        if o.ledger is not None:
            o.ledger.release_device(rec.key, "release", blocks)
        if rec.parked_table is not None:
            o.allocator.block_table[name] = blocks  # back under a private name, for the engine's own free
            rec.parked_table = None
        o.engine_free_blocks(name, rec.no_cache)

    def defer_release(self, m: CbSwapMachine, arg: Any) -> None:
        o, rec = self.o, m.ctx
        rec.parked_table = o.allocator.block_table.pop(rec.rid, [])
        o.metrics.deferred_releases += 1

    def start_swap_in(self, m: CbSwapMachine, c: SwapCopy) -> None:
        o, rec = self.o, m.ctx
        host = c.host_blocks.tolist()
        if o.ledger is not None:
            o.check_restore_target(rec, c.device_blocks)
            o.ledger.copy_started(rec.key, "restore", "h2d", c.device_blocks, host)
        try:
            with o.stream_ctx():
                c.submitted_at = time.perf_counter()
                c.handle = o.engine.submit_h2d(o.host_pool, c.host_blocks, o.device_pool, c.device_blocks)
                if o.device_pool.device.type == "cuda":
                    c.handle.wait_stream(None)  # the compute stream's next forward reads what the copy wrote
        except BaseException:
            if o.ledger is not None:
                o.ledger.copy_aborted(rec.key, "h2d", c.device_blocks, host)
            raise
        rec.copy = c
        o.in_flight[rec.key] = rec
        n = len(c.device_blocks)
        o.metrics.restores += 1
        o.metrics.blocks_in += n
        o.metrics.bytes_h2d += n * o.device_pool.block_bytes

    def verify_swap_in(self, m: CbSwapMachine, c: SwapCopy) -> None:
        o, rec = self.o, m.ctx
        if not o.checked:
            return
        n = len(c.device_blocks)
        # Only the request's tokens: by the ack, the batch that restored it may have written its next token
        # into the free tail of its last block.
        valid = n * o.device_pool.tokens_per_block if c.valid_tokens is None else c.valid_tokens
        device = o.device_pool.tokens(o.device_pool.blocks(c.device_blocks).to("cpu"), valid)
        host = o.device_pool.tokens(o.host_pool.token_view().index_select(2, c.host_blocks), valid)
        expected = o.device_pool.tokens(rec.expected[:, :, :n], valid) if rec.expected is not None else None
        if not (torch.equal(device, host) and expected is not None and torch.equal(device, expected)):
            raise CheckedModeError(rec.key, "swap_in_done", c.device_blocks[0] if c.device_blocks else None,
                                   "the restored device blocks differ from the KV swapped out: the swap-in "
                                   "moved nothing or the wrong rows (B15)")
        o.metrics.verified_copies += 1

    def free_host_blocks(self, m: CbSwapMachine, arg: Any) -> None:
        o, rec = self.o, m.ctx
        blocks = rec.host_blocks
        if blocks is None:
            raise CheckedModeError(rec.key, "free_host_blocks", None, "no host blocks to free (B10)")
        if o.ledger is not None:
            o.ledger.free_host(rec.key, "free_host_blocks", blocks.tolist())
        o.host_pool.free(blocks)
        rec.host_blocks, rec.expected = None, None


# ---- the offloading manager -----------------------------------------------------------------------


def _engine_for(config: SwapConfig, device: torch.device) -> CopyEngine:
    choice = config.copy_engine
    if isinstance(choice, CopyEngine):
        return choice
    if choice == "cpu" or (choice == "auto" and device.type != "cuda"):
        return CpuCopyEngine()
    if choice in ("cuda", "auto"):
        from kvfsm.dataplane import CudaCopyEngine

        return CudaCopyEngine(device)
    raise ValueError(f"copy_engine must be 'auto', 'cpu', 'cuda' or a CopyEngine, got {choice!r}")


class KvfsmOffloadingManager(OffloadingManager):
    """Drop-in for transformers' OffloadingManager whose swaps run through spec/cb_swap.yaml.

    The victim choice (`offload_requests`) and the requeue of victims are transformers' own logic; what
    differs is how blocks move and when they are freed: each victim's swap-out is a `preempt` of its
    machine, its device blocks return to the engine only at `swap_out_done`, each restore is a `restore`
    and its host blocks return at `swap_in_done`, and the engine's frees and cancellations of a request
    that has a machine become its `finish` / `cancel` events.
    """

    def __init__(self, cache: Any, scheduler: Any, compute_stream: Any, config: Optional[SwapConfig] = None,
                 cpu_offload_space_gib: Optional[float] = None) -> None:  # no super().__init__: it pins its own pool
        self.config = config = config or SwapConfig()
        if list(cache.cache_allocators) != [FULL_ATTENTION]:
            raise NotImplementedError("kvfsm's transformers integration supports models whose layers all use full "
                                      f"attention (one cache allocator); this cache has {list(cache.cache_allocators)}")
        self.cache, self.scheduler = cache, scheduler
        self._compute_stream = compute_stream
        self._cpu_pool = None  # transformers' own pool: unused
        self._cpu_views: dict[str, torch.Tensor] = {}
        self._request_id_to_cpu_blocks: dict[str, dict[str, list[int]]] = {}
        self.allocator = cache.cache_allocators[FULL_ATTENTION]
        self.device_pool = PagedCachePool(self.allocator)
        num_host = _size_host_pool(config, self.device_pool, cpu_offload_space_gib)
        self.host_pool = HostKVPool(self.device_pool.config, num_host, page_size=1, pin_memory=config.pin_memory)
        self.engine = _engine_for(config, self.device_pool.device)
        self.checked = bool(config.checked)
        self.ledger: Optional[SwapLedger] = SwapLedger() if self.checked else None
        self.fx = SwapEffects(self)
        self.metrics = SwapMetrics()
        self.coverage: set[int] = set()
        self.live: dict[str, SwapRecord] = {}  # request id -> record of its live machine (at most one)
        self.in_flight: dict[str, SwapRecord] = {}  # record key -> record with a copy in flight (submission order)
        self._cancelling: set[str] = set()
        if self.device_pool.device.type == "cuda":
            self.warm_up()
        # The engine's frees and cancellations of requests with a machine go through that machine.
        self._orig_free_blocks = cache.free_blocks
        self._orig_clear_cancelled = scheduler.clear_cancelled_requests
        cache.free_blocks = self._engine_frees
        scheduler.clear_cancelled_requests = self._engine_clears_cancelled

    def warm_up(self) -> None:
        """Swap the engine's trash blocks 0 and 1 (never allocated, no forward has run yet) out and back in
        unchanged, so the copy kernels are compiled before the first real swap (Triton specialises a count
        of 1, hence two blocks)."""
        n = min(2, self.host_pool.capacity)
        host = self.host_pool.alloc(n)
        if host is None:
            return
        blocks = list(range(n))
        try:
            with self.stream_ctx():
                self.engine.submit_d2h(self.device_pool, blocks, self.host_pool, host).wait()
                self.engine.submit_h2d(self.host_pool, host, self.device_pool, blocks).wait()
        finally:
            self.host_pool.free(host)

    # --- plumbing ----------------------------------------------------------------------------------
    def stream_ctx(self) -> Any:
        """The engine's compute stream as the current stream (copies are ordered after its kernels)."""
        if self._compute_stream is not None and self.device_pool.device.type == "cuda":
            return torch.cuda.stream(self._compute_stream)
        return contextlib.nullcontext()

    def engine_free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        """The engine's own PagedAttentionCache.free_blocks (not routed through any machine)."""
        self._orig_free_blocks(request_id, no_cache)

    def _observe(self, m: CbSwapMachine, event: str, src: int, dst: int, tid: int) -> None:
        if tid < 0:
            self.metrics.ignored_ends += 1
        else:
            self.coverage.add(tid)
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
        rec.machine = CbSwapMachine(self.fx, rec, self._observe)
        self.live[rid] = rec
        return rec

    def _retire(self, rec: SwapRecord) -> None:
        if rec.machine is not None and rec.machine.state == spec_gen.RELEASED and self.live.get(rec.rid) is rec:
            del self.live[rec.rid]

    def _ack(self, rec: SwapRecord) -> None:
        c = rec.copy
        assert c is not None
        if self.ledger is not None:
            self.ledger.copy_done(c.device_blocks)
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
        table = list(self.allocator.block_table.get(state.request_id, []))
        rec.no_cache = True  # a victim's blocks go straight back to the pool (as transformers does)
        host = self.host_pool.alloc(len(table)) if table else None
        if host is None:
            m.soft_reset()
            self._retire(rec)
            return False
        try:
            m.preempt(SwapCopy("d2h", table, host))
        except BaseException:
            self.host_pool.free(host)
            raise
        # The engine needs the blocks back now (it re-plans the batch at once): wait for the copy's ack.
        assert rec.copy is not None and rec.copy.handle is not None
        rec.copy.handle.wait()
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
                {name: allocator.needs_new_blocks(state.request_id, state.current_len(), request_len)
                 for name, allocator in self.cache.cache_allocators.items()}
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
        already allocated fresh device blocks for them)."""
        t0 = time.perf_counter()
        self.metrics.restore_calls += 1
        try:
            self.poll()
            for future_state in requests_in_batch:
                state = future_state.state
                if not state.is_cpu_offloaded:
                    continue
                rec = self.live.get(state.request_id)
                if rec is None or rec.state_ref() is not state or rec.host_blocks is None:
                    raise LifecycleError(f"request {state.request_id!r} is marked offloaded but kvfsm holds no swap of it")
                gpu_blocks = list(self.allocator.block_table.get(state.request_id, []))
                n = min(int(rec.host_blocks.numel()), len(gpu_blocks))
                assert rec.machine is not None
                copy = SwapCopy("h2d", gpu_blocks[:n], rec.host_blocks[:n])
                copy.valid_tokens = min(int(state.position_offset), n * self.device_pool.tokens_per_block)
                rec.machine.restore(copy)
                state.is_cpu_offloaded = False
                if self.cache.use_prefix_sharing:  # transformers' own rule: restored blocks get hashed next update
                    for name, allocator in self.cache.cache_allocators.items():
                        restored_blocks = state.position_offset // allocator.tokens_per_page
                        if restored_blocks:
                            future_state.complete_blocks[name] = future_state.complete_blocks.get(name, 0) + restored_blocks
            self.poll()
        finally:
            self.metrics.time_restore_s += time.perf_counter() - t0

    def check_restore_target(self, rec: SwapRecord, blocks: list[int]) -> None:
        """Checked mode: the blocks a restore writes belong to this request alone (else it overwrites another
        request's live KV, B1)."""
        mine = set(self.allocator.block_table.get(rec.rid, []))
        led = self.allocator.ledger
        for b in blocks:
            if b not in mine:
                raise CheckedModeError(rec.key, "restore", b, "restoring into a device block the engine did not give this request")
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
        out = [f"{r.key} in {spec_gen.STATES[r.machine.state]}" for r in self.live.values()
               if r.machine is not None and r.machine.state != spec_gen.RESIDENT]
        out += [f"copy of {k} in flight" for k in self.in_flight]
        used = self.host_pool.capacity - self.host_pool.free_slots
        if used:
            out.append(f"{used} host blocks allocated")
        if self.ledger is not None:
            if self.ledger.host_owner:
                out.append(f"ledger: {len(self.ledger.host_owner)} host blocks owned")
            if self.ledger.in_flight:
                out.append(f"ledger: {len(self.ledger.in_flight)} device blocks under copies")
        return out


def _size_host_pool(config: SwapConfig, device_pool: PagedCachePool, space_gib: Optional[float]) -> int:
    if config.host_blocks is not None:
        return int(config.host_blocks)
    if config.host_bytes is not None:
        nbytes = int(config.host_bytes)
    elif space_gib:
        nbytes = int(float(space_gib) * 2**30)
    else:
        nbytes = 2**30
    n = nbytes // device_pool.block_bytes
    if n < 1:
        raise ValueError(f"host pool of {nbytes} bytes holds no block of {device_pool.block_bytes} bytes")
    return n


# ---- installation ---------------------------------------------------------------------------------


@dataclass
class SwapInstallation:
    """What `install` returns: the config and every KvfsmOffloadingManager it has put in place."""

    config: SwapConfig
    managers: list[KvfsmOffloadingManager] = field(default_factory=list)
    _undo: list[Any] = field(default_factory=list, repr=False)

    @property
    def metrics(self) -> SwapMetrics:
        total = SwapMetrics()
        for m in self.managers:
            total = total + m.metrics
        return total

    @property
    def coverage(self) -> set[int]:
        out: set[int] = set()
        for m in self.managers:
            out |= m.coverage
        return out

    def leaks(self) -> list[str]:
        return [x for m in self.managers for x in m.leaks()]

    def uninstall(self) -> None:
        """Stop installing on new batch processors (managers already in place stay)."""
        while self._undo:
            self._undo.pop()()


def _install_on_manager(manager: Any, inst: SwapInstallation) -> None:
    if getattr(manager, "_kvfsm_installation", None) is not None:
        return
    original = manager._create_batch_processor

    def create_batch_processor() -> Any:
        existing = getattr(manager, "batch_processor", None)
        if isinstance(existing, ContinuousBatchProcessor) and isinstance(existing.offloading_manager,
                                                                          KvfsmOffloadingManager):
            return original()  # reset and reuse: our manager's reset() runs inside
        cb_config = manager.continuous_batching_config
        space = cb_config.cpu_offload_space
        cb_config.cpu_offload_space = 0.0  # transformers' own manager must not pin a pool of its own
        try:
            processor = original()
        finally:
            cb_config.cpu_offload_space = space
        if processor.distributed_helper.tp_size > 1:
            raise NotImplementedError("kvfsm's transformers integration runs in one process (no tensor parallelism)")
        kv = KvfsmOffloadingManager(processor.cache, processor.scheduler,
                                    processor.inputs_and_outputs.compute_stream, inst.config, space)
        processor.offloading_manager = kv
        inst.managers.append(kv)
        return processor

    manager._create_batch_processor = create_batch_processor
    manager._kvfsm_installation = inst

    def undo() -> None:
        if manager.__dict__.get("_create_batch_processor") is create_batch_processor:
            del manager._create_batch_processor
        manager._kvfsm_installation = None

    inst._undo.append(undo)


def install(target: Any, config: Optional[SwapConfig] = None) -> SwapInstallation:
    """Run the KV offloading of `target`'s continuous batching through kvfsm.

    `target`: a model (every manager its `generate_batch` / `init_continuous_batching` creates from now
    on) or a `ContinuousBatchingManager` (before its batch processor exists, i.e. before warmup/start).
    """
    if not transformers_version_tested():
        warnings.warn(f"kvfsm.integrations.transformers is tested with transformers {','.join(TESTED_VERSIONS)}; "
                      f"this is {transformers.__version__}", RuntimeWarning, stacklevel=2)
    inst = SwapInstallation(config or SwapConfig())
    if isinstance(target, ContinuousBatchingManager):
        if target.batch_processor is not None and not isinstance(target.batch_processor.offloading_manager,
                                                                 KvfsmOffloadingManager):
            raise RuntimeError("install() on a manager whose batch processor already exists: install before warmup/start")
        _install_on_manager(target, inst)
        return inst
    if not callable(getattr(target, "init_continuous_batching", None)):
        raise TypeError(f"install() needs a transformers model or ContinuousBatchingManager, got {type(target).__name__}")
    model = target
    original = model.init_continuous_batching

    def init_continuous_batching(*args: Any, **kwargs: Any) -> Any:
        manager = original(*args, **kwargs)
        _install_on_manager(manager, inst)
        return manager

    model.init_continuous_batching = init_continuous_batching
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if isinstance(cached, ContinuousBatchingManager):
        _install_on_manager(cached, inst)

    def undo() -> None:
        if model.__dict__.get("init_continuous_batching") is init_continuous_batching:
            del model.init_continuous_batching

    inst._undo.append(undo)
    return inst


@contextlib.contextmanager
def installed(target: Any, config: Optional[SwapConfig] = None) -> Iterator[SwapInstallation]:
    """`install` for the duration of a with-block."""
    inst = install(target, config)
    try:
        yield inst
    finally:
        inst.uninstall()


__all__ = [
    "KvfsmOffloadingManager",
    "PagedCachePool",
    "SwapConfig",
    "SwapInstallation",
    "SwapLedger",
    "SwapMetrics",
    "TESTED_VERSIONS",
    "install",
    "installed",
    "transformers_version_tested",
]
