"""A small scheduler over real pools, used by scenario tests, the stateful suite and the explorer.

It does what an engine does around the manager (admit, decode, speculative over-allocation, finish,
abort, retract) and writes deterministic KV content f(request, position) into every slot it fills, so
any page read back from host memory or storage can be checked against the request that wrote it
(cross-pollinated KV, B1/B2/B15, is then visible as a wrong value).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from kvfsm.dataplane import (
    DeferredCpuCopyEngine,
    HostKVPool,
    KVCacheConfig,
    ReqToTokenPool,
    SlotFence,
    TokenSlotAllocator,
    page_hashes,
    wait_fences,
)
from kvfsm.dataplane.pools.device_pool import DeviceKVPool
from kvfsm.dataplane.pools.host_pool import Layout
from kvfsm.dataplane.storage import FaultyStorage, MemoryStorage
from kvfsm.engine.scheduler import EngineRequest, grow_slots
from kvfsm.runtime import DecodeOffloadManager, OffloadConfig, SimplePrefixCache, SteppedBackupWorker

_serials = itertools.count(1)


class SimRequest(EngineRequest):
    """An engine request that also carries a serial: the writer's identity in the KV content f(serial, pos)."""

    def __init__(self, rid: str, prompt: list[int], prefix_len: int = 0) -> None:
        super().__init__(rid, prompt, prefix_len=prefix_len)
        self.serial = next(_serials)

    def __repr__(self) -> str:
        return f"SimRequest({self.rid!r}#{self.serial})"


SCRATCH_WRITER = "<scratch writer>"  # reuse_fenced's writer; its KV is kv_value(0, i), a serial no request has


def kv_value(serial: int, position: int) -> float:
    """f(request, position), exact in float32 (below 2**24) for any serial: writers 4096 serials apart
    share values, far more than ever live at once; positions must stay below 4095."""
    return float((serial % 4096) * 4096 + position + 1)


@dataclass
class SimEngine:
    page_size: int = 2
    stride: int = 0
    device_slots: int = 32
    host_slots: int = 16
    rows: int = 4
    max_context: int = 64
    backup_queue: int = 2
    checked: bool = True
    fail_writes: set[str] = field(default_factory=set)
    trace_path: Optional[str] = None
    num_layers: int = 2
    kv_heads: int = 1
    head_dim: int = 2
    host_layout: Layout = "layer_first"
    stored_index_pages: int = 1 << 20
    retraction: str = "deferred"  # the spec's retraction policy
    table_device: str = "cpu"  # "meta": a request table nobody can read (the manager must use its host mirror)
    fenced: bool = False  # the spec's `fences` param: release under a copy fenced; the writer waits on fences
    skip_fence_wait: bool = False  # a fault: the writer of a reused slot does not wait on its fence
    stream_ordered: bool = False  # a wait orders the writer after the copy and lands nothing (the GPU's case)

    def __post_init__(self) -> None:
        self.kv = KVCacheConfig(
            num_layers=self.num_layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            attention="mha",
            dtype=torch.float32,
        )
        self.device_pool = DeviceKVPool.create(self.kv, self.device_slots)
        self.allocator = TokenSlotAllocator(self.device_slots, self.page_size)
        self.req_to_token = ReqToTokenPool(self.rows, self.max_context, self.table_device)
        self.protected = SimplePrefixCache(self.allocator)  # holds each matched prefix's pages while locked
        self.host_pool = HostKVPool(self.kv, self.host_slots, self.page_size, layout=self.host_layout)
        self.copies = DeferredCpuCopyEngine(stream_ordered=self.stream_ordered)
        self.worker = SteppedBackupWorker(self.backup_queue)
        self.store: Optional[MemoryStorage] = MemoryStorage()
        self.storage = self.make_storage()
        self.config = OffloadConfig(
            page_size=self.page_size,
            offload_stride=self.stride,
            host_pool_ratio=1.0,
            copy_backend="deferred",
            storage_backend="none",
            checked=self.checked,
            backup_queue_size=self.backup_queue,
            trace_path=self.trace_path,
            stored_index_pages=self.stored_index_pages,
            retraction=self.retraction,
            fenced_release=self.fenced,
        )
        self.manager = DecodeOffloadManager(
            self.config,
            device_pool=self.device_pool,
            allocator=self.allocator,
            req_to_token=self.req_to_token,
            prefix_cache=self.protected,
            host_pool=self.host_pool,
            copy_engine=self.copies,
            storage=self.storage,
            backup_worker=self.worker,
            **self.manager_options(),
        )
        self.live: list[SimRequest] = []

    def make_storage(self) -> Any:
        """The manager's storage: the in-memory store behind a fault injector (subclasses plug in others)."""
        assert self.store is not None  # a subclass that drops the in-memory store plugs in its own storage
        return FaultyStorage(self.store, fail_writes=lambda k: k in self.fail_writes)

    def manager_options(self) -> dict[str, Any]:
        """Extra DecodeOffloadManager arguments (a TP group, say)."""
        return {}

    # --- engine actions ----------------------------------------------------------------------------
    def _write_kv(self, req: SimRequest, start: int, end: int) -> None:
        slots = self.req_to_token.read_host(req.row, start, end)
        if self.manager.ledger is not None:  # checked mode: a reused slot's fence passed or was waited on
            self.manager.ledger.device_write(req.rid, slots.tolist())
        values = torch.tensor([kv_value(req.serial, p) for p in range(start, end)], dtype=torch.float32)
        self.device_pool.token_view()[:, :, slots] = values.view(1, 1, -1, 1, 1)

    def _grow(self, req: SimRequest, length: int) -> bool:
        """Make sure positions [0, length) have slots (whole pages)."""
        return grow_slots(self.allocator, self.req_to_token, req, length, self._wait if self.fenced else None)

    def _wait(self, fences: tuple[SlotFence, ...]) -> None:
        """The writer's stream waits on the fences of the slots it got (CPU twin: their copies complete now,
        or, stream_ordered, read their source now and stay in flight)."""
        if not self.skip_fence_wait:
            wait_fences(fences)

    def admit(
        self, rid: str, prompt_len: int, prefix_len: int = 0, req: Optional[SimRequest] = None
    ) -> Optional[SimRequest]:
        """Prefill a request (or re-admit a retracted one); None when there is no row or no room. Its prefix
        (whole pages: `prefix_len` rounded down) is matched in the prefix cache, which holds its pages while
        the request's lock is held."""
        req = req or SimRequest(rid, [1000 + i for i in range(prompt_len)], prefix_len)
        row = self.req_to_token.alloc()
        if row is None:
            return None
        req.req_pool_idx, req.kv_allocated_len, req.kv_committed_len = row, 0, 0
        if not self._grow(req, len(req.origin_input_ids) + len(req.output_ids)):
            self.req_to_token.free(row)
            req.req_pool_idx = None
            return None
        req.kv_committed_len = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
        self._write_kv(req, 0, req.kv_committed_len)
        if not req.output_ids:
            req.output_ids.append(7)
        self.protected.lock_prompt_prefix(req, self.req_to_token)
        req.done = False
        self.live.append(req)
        return req

    def decode(self, req: SimRequest, speculative: int = 0) -> bool:
        """One decode step: the last sampled token's KV is computed, a new token is sampled."""
        pos = req.kv_committed_len
        if not self._grow(req, pos + 1 + speculative):
            return False
        self._write_kv(req, pos, pos + 1)
        req.kv_committed_len = pos + 1
        req.output_ids.append(7 + len(req.output_ids) % 5)
        return True

    def end(self, req: SimRequest, how: str = "finish") -> None:
        req.done = True
        self.live.remove(req)
        {"finish": self.manager.finalize, "abort": self.manager.abort, "retract": self.manager.retract}[how](req)

    def release_itself(self, req: SimRequest) -> None:
        """The engine's own release (SGLang's scheduler releases the requests it retracts this way): the
        request's own pages [prefix_len, allocated), its row and its prefix lock go back through the engine's
        objects, then the manager is told (`released_by_engine`), which frees nothing. With fences the request
        may have copies in flight: the engine's stream first waits on every copy in flight (what SGLang's
        drain_before_retraction does then; in this CPU twin the wait completes them)."""
        if self.fenced:
            self.manager.fence_copies_in_flight()
        req.done = True
        self.live.remove(req)
        ps = self.page_size
        end = -(-max(req.kv_allocated_len, req.kv_committed_len) // ps) * ps
        starts = self.req_to_token.read_host(req.row, req.prefix_len, end)[::ps]
        slots = ((starts - starts % ps).unsqueeze(1) + torch.arange(ps)).reshape(-1)
        if len(slots):
            self.allocator.free(slots)
        self.req_to_token.free(req.row)
        lock, req.lock = req.lock, None
        self.protected.unlock(lock)
        req.req_pool_idx = None
        self.manager.released_by_engine(req)

    def reuse_fenced(self) -> int:
        """Another user of the device pool (a prefill the manager does not track) takes every free page,
        fenced ones last, waits on their fences (`_wait`), writes its own KV into them and frees them: the
        write of a reused slot that a fenced release allows. Returns the slots it wrote (0: nothing free)."""
        got = self.allocator.alloc_fenced(self.allocator.free_slots)
        if got is None or not len(got[0]):
            return 0
        slots, fences = got
        if fences:
            self._wait(fences)
        led = self.manager.ledger
        if led is not None:  # the scratch writer owns the pages while it writes them, then releases them
            led.claim_device(SCRATCH_WRITER, "reuse", slots.tolist())
            led.device_write(SCRATCH_WRITER, slots.tolist())
        self.device_pool.token_view()[:, :, slots] = torch.tensor(
            [kv_value(0, p) for p in range(len(slots))], dtype=torch.float32
        ).view(1, 1, -1, 1, 1)
        if led is not None:
            led.release_device(SCRATCH_WRITER, "reuse", slots.tolist())
        self.allocator.free(slots)
        return len(slots)

    def settle(self, max_rounds: int = 100) -> None:
        """Let every copy land and every backup run until the manager is idle (the copy engine and the
        backup worker here are stepped by the caller)."""
        for _ in range(max_rounds):
            if self.manager.idle():
                return
            self.copies.complete_all()
            self.worker.run_all()
            self.manager.check_progress()
        raise AssertionError("manager did not become idle")

    # --- checks --------------------------------------------------------------------------------------
    def host_page_ok(self, chunk) -> bool:
        """The chunk's host pages hold f(writer, position) for every position they cover."""
        got = self.host_pool.token_view()[0, 0, chunk.host_indices, 0, 0]
        want = torch.tensor([kv_value(chunk.record.req_ref().serial, p) for p in range(chunk.start, chunk.end)])
        return bool(torch.equal(got, want))

    def check_teardown(self) -> None:
        """Every pool back to full and no prefix locked (B3, B5, B8, B16)."""
        assert not self.live
        assert self.manager.idle()
        assert self.allocator.free_slots == self.allocator.capacity, (
            self.allocator.free_slots,
            self.allocator.capacity,
        )
        assert self.host_pool.free_slots == self.host_pool.capacity
        assert self.req_to_token.free_rows == self.rows
        assert self.protected.size == 0 and not self.protected.locked_pages()
        self.allocator.check_conservation()
        self.host_pool.check_conservation()
        self.req_to_token.check_conservation()


def prompt_hashes(req: SimRequest, page_size: int) -> list[str]:
    n = len(req.origin_input_ids) // page_size * page_size
    return page_hashes(req.origin_input_ids[:n], page_size) if n else []
