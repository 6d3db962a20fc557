"""The spec's actions: `SwapEffects` implements `kvfsm.generated.cb_swap.CbSwapEffects` (the bytes a transition
moves), over the per-request records it acts on (`SwapCopy`, `SwapRecord`) and the copy engine it moves
them with (`_engine_for`).

Everything that copies KV or frees blocks on a transition of a request's `CbSwapMachine` lives here; the
manager (manager.py) decides when those transitions happen.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from kvfsm.dataplane import CopyEngine, CopyHandle, CpuCopyEngine, HostKVPool
from kvfsm.dataplane.fences import SlotFence
from kvfsm.dataplane.pools.allocator import PageSlots
from kvfsm.generated.cb_swap import CbSwapMachine
from kvfsm.runtime.ledger import CheckedModeError

from .config import SwapConfig, SwapMetrics
from .ledger import SwapLedger
from .pool import PagedCachePool


@dataclass(eq=False)
class SwapCopy:
    """One swap copy: the request's device blocks and the host blocks, paired by position."""

    direction: str  # "d2h" (swap-out) or "h2d" (swap-in)
    device_blocks: list[int]
    host_blocks: PageSlots  # host pages of one block each (page size 1: page id = slot id)
    handle: Optional[CopyHandle] = None
    submitted_at: float = 0.0
    valid_tokens: Optional[int] = None  # swap-in: tokens of KV the request has (the rest of its last block is free)
    fence: Optional[SlotFence] = None  # what the device blocks went back with, released fenced under this copy


@dataclass(eq=False)
class SwapRecord:
    """The integration's bookkeeping for one request's swap lifecycle (its machine's `ctx`)."""

    key: str
    rid: str
    state_ref: weakref.ReferenceType[Any]
    machine: Optional[CbSwapMachine] = None
    host_blocks: Optional[PageSlots] = None  # held from the swap-out until the swap-in lands
    copy: Optional[SwapCopy] = None  # the copy in flight
    parked_table: Optional[list[int]] = None  # device blocks taken from the engine while release is deferred
    no_cache: bool = False  # how the engine asked for the device blocks to be freed
    expected: Optional[torch.Tensor] = None  # checked mode: the KV read at swap-out (on the device until its ack)
    swaps: int = 0

    def __repr__(self) -> str:
        return self.key


class SwapOwner(Protocol):
    """What the effects use of the manager that owns them (`KvfsmOffloadingManager`): its pools, engine, ledger
    and metrics, and the engine-facing calls. Named here, so that the manager imports the effects and the effects
    import nothing of the manager."""

    allocator: Any  # transformers' block allocator of the full-attention group (its block_table)
    device_pool: PagedCachePool
    host_pool: HostKVPool
    engine: CopyEngine
    checked: bool
    ledger: Optional[SwapLedger]
    metrics: SwapMetrics
    in_flight: dict[str, SwapRecord]

    @property
    def compute_stream(self) -> Any: ...

    def stream_ctx(self) -> Any: ...

    def submit(self, submit: Callable[..., CopyHandle], *args: Any) -> CopyHandle: ...

    def engine_free_blocks(self, request_id: str, no_cache: bool = False) -> None: ...

    def check_restore_target(self, rec: SwapRecord, blocks: list[int]) -> None: ...


class SwapEffects:
    """Implements `kvfsm.generated.cb_swap.CbSwapEffects` over the engine's cache, a HostKVPool and a CopyEngine."""

    def __init__(self, owner: SwapOwner) -> None:
        self.o = owner

    def start_swap_out(self, m: CbSwapMachine, c: SwapCopy) -> None:
        o, rec = self.o, m.ctx
        host = c.host_blocks.pages
        if o.ledger is not None:
            o.ledger.copy_started(rec.key, "preempt", "d2h", c.device_blocks, host)
        try:
            if o.checked:  # a snapshot on the device, on the stream the copy is ordered after: no host wait
                with o.stream_ctx():
                    rec.expected = o.device_pool.blocks(c.device_blocks)
            c.submitted_at = time.perf_counter()
            c.handle = o.submit(o.engine.submit_d2h, o.device_pool, c.device_blocks, o.host_pool, c.host_blocks)
            if o.ledger is not None:
                o.ledger.copy_submitted(rec.key, c.handle)
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
        if self.o.checked:  # the device blocks are still the request's: compare with them too
            self._verify_landed(m.ctx, c, self.o.device_pool.blocks(c.device_blocks).to("cpu"))

    def verify_landed_swap_out(self, m: CbSwapMachine, c: SwapCopy) -> None:
        if self.o.checked:  # the device blocks went back fenced: only the snapshot still holds what was copied
            self._verify_landed(m.ctx, c, None)

    def _verify_landed(self, rec: SwapRecord, c: SwapCopy, device: Optional[torch.Tensor]) -> None:
        """The landed host blocks equal the submit-time snapshot (and `device`, when given). The snapshot is
        complete: it was ordered before the copy, whose completion was observed."""
        o = self.o
        host = o.device_pool.host_blocks(o.host_pool, c.host_blocks.slots)
        rec.expected = expected = rec.expected.to("cpu") if rec.expected is not None else None
        if not (expected is not None and torch.equal(host, expected) and (device is None or torch.equal(host, device))):
            raise CheckedModeError(
                rec.key,
                "swap_out_done",
                c.device_blocks[0] if c.device_blocks else None,
                "the host blocks differ from the device blocks they were copied from: "
                "the swap-out moved nothing or the wrong rows (B15)",
            )
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

    def release_device_blocks_fenced(self, m: CbSwapMachine, arg: Any) -> None:
        """Fenced against the request's copy in flight, whichever its direction: the swap-out submitted in this
        `preempt` reads the blocks; a swap-in under which the request ends writes them (write after write)."""
        o, rec = self.o, m.ctx
        c = rec.copy
        assert c is not None and c.handle is not None
        fence = SlotFence([c.handle])
        # The engine writes KV blocks only on its compute stream: once that stream waits on the copy's event,
        # every later write of these blocks is ordered after the copy (the host never waits; a CPU handle has
        # no stream, and the wait completes its copy).
        fence.wait(o.compute_stream)
        if o.ledger is not None:
            event = "preempt" if c.direction == "d2h" else "end"
            o.ledger.release_device(rec.key, event, list(o.allocator.block_table.get(rec.rid, [])), fence)
        o.engine_free_blocks(rec.rid, rec.no_cache)
        c.fence = fence
        if c.direction == "d2h":
            o.metrics.fenced_releases += 1
        else:
            o.metrics.fenced_ends += 1

    def defer_host_release(self, m: CbSwapMachine, arg: Any) -> None:
        self.o.metrics.deferred_releases += 1

    def start_swap_in(self, m: CbSwapMachine, c: SwapCopy) -> None:
        o, rec = self.o, m.ctx
        host = c.host_blocks.pages
        if o.ledger is not None:
            o.check_restore_target(rec, c.device_blocks)
            o.ledger.copy_started(rec.key, "restore", "h2d", c.device_blocks, host)
        try:
            c.submitted_at = time.perf_counter()
            c.handle = o.submit(o.engine.submit_h2d, o.host_pool, c.host_blocks, o.device_pool, c.device_blocks)
            if o.device_pool.device.type == "cuda":
                c.handle.wait_stream(o.compute_stream)  # the compute stream's next forward reads what the copy wrote
            if o.ledger is not None:
                o.ledger.copy_submitted(rec.key, c.handle)
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
        host = o.device_pool.tokens(o.device_pool.host_blocks(o.host_pool, c.host_blocks.slots), valid)
        expected = o.device_pool.tokens(rec.expected[:, :, :n], valid) if rec.expected is not None else None
        if not (torch.equal(device, host) and expected is not None and torch.equal(device, expected)):
            raise CheckedModeError(
                rec.key,
                "swap_in_done",
                c.device_blocks[0] if c.device_blocks else None,
                "the restored device blocks differ from the KV swapped out: the swap-in "
                "moved nothing or the wrong rows (B15)",
            )
        o.metrics.verified_copies += 1

    def free_host_blocks(self, m: CbSwapMachine, arg: Any) -> None:
        o, rec = self.o, m.ctx
        blocks = rec.host_blocks
        if blocks is None:
            raise CheckedModeError(rec.key, "free_host_blocks", None, "no host blocks to free (B10)")
        if o.ledger is not None:
            o.ledger.free_host(rec.key, "free_host_blocks", blocks.pages)
        o.host_pool.free_pages(blocks.pages)
        rec.host_blocks, rec.expected = None, None


def _engine_for(config: SwapConfig, device: torch.device, compute_stream: Any = None) -> CopyEngine:
    """The copy engine SwapConfig.copy_engine names; a CUDA one is bound to the engine's compute stream
    (its copies are ordered after that stream with no stream context around each submit)."""
    choice = config.copy_engine
    if isinstance(choice, CopyEngine):
        return choice
    if choice == "cpu" or (choice == "auto" and device.type != "cuda"):
        return CpuCopyEngine()
    if choice in ("cuda", "auto"):
        from kvfsm.dataplane import CudaCopyEngine

        return CudaCopyEngine(device, compute_stream=compute_stream, on_compute_stream=config.copy_on_compute_stream)
    raise ValueError(f"copy_engine must be 'auto', 'cpu', 'cuda' or a CopyEngine, got {choice!r}")
