"""DecodeOffloadManager: the seed's integration surface, with every lifecycle step a spec transition.

The engine calls `offload(req)` after a decode step, `check_progress()` every scheduler iteration, and
`finalize(req)` / `abort(req)` / `retract(req)` when a request ends. The manager decides only what the
spec cannot see (how long a chunk is, whether host memory or backup-queue room exists, which copies
completed) and turns each answer into an event of the request's generated machine.

The class is put together from one concern a module: the record table (lifecycles.py), the offload doors
(offloading.py), the progress check (progress.py) and the ends (ending.py); this module builds the state they
share and owns the host pool, the store and the worker.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np

import kvfsm.generated.decode_offload as spec_gen
from kvfsm.dataplane import CopyEngine, HostKVPool, ReqToTokenPool, TokenSlotAllocator
from kvfsm.dataplane.pools.device_pool import DeviceKVPool
from kvfsm.dataplane.storage import StorageBackend
from kvfsm.errors import ConfigError, InvalidRequest, LifecycleError
from kvfsm.runtime.backup import BackupWorker, ThreadBackupWorker
from kvfsm.runtime.build import build_components, close_storage
from kvfsm.runtime.config import OffloadConfig
from kvfsm.runtime.device_table import DeviceTableSlots
from kvfsm.runtime.effects import LiveRecord, OffloadEffects, RequestRecord
from kvfsm.runtime.ending import Ending
from kvfsm.runtime.ledger import SlotLedger
from kvfsm.runtime.lifecycles import forget_record
from kvfsm.runtime.metrics import OffloadMetrics
from kvfsm.runtime.offloading import Offloading
from kvfsm.runtime.protocols import PrefixCache
from kvfsm.runtime.tp import ProgressConsensus
from kvfsm.runtime.trace import TraceWriter


class DecodeOffloadManager(Offloading, Ending):
    """One generated DecodeOffloadMachine per request object, driving real pools, copies and storage."""

    def __init__(
        self,
        config: OffloadConfig,
        *,
        device_pool: DeviceKVPool,
        allocator: TokenSlotAllocator,
        req_to_token: ReqToTokenPool,
        prefix_cache: PrefixCache,
        host_pool: Optional[HostKVPool] = None,
        copy_engine: Optional[CopyEngine] = None,
        storage: Optional[StorageBackend] = None,
        backup_worker: Optional[BackupWorker] = None,
        tp_group: Any = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        if allocator.page_size != config.page_size:
            raise InvalidRequest(f"allocator page size {allocator.page_size} != config.page_size {config.page_size}")
        if config.fenced_release and not getattr(allocator, "fences", False):
            raise ConfigError(
                "fenced_release",
                f"the allocator {type(allocator).__name__} takes no fences "
                "(its `fences` is false): its slots cannot be released fenced",
            )
        # the spec's `fences` param of every machine: release under a copy fenced (state fenced) or deferred
        self._fences = 1 if config.fenced_release else 0
        self.config = config
        self.stride = config.stride
        # the spec's `retraction` policy (its choices are OffloadConfig.retraction's: tests/runtime/test_retraction.py)
        self._fail_closed = config.retraction == "fail_closed"
        self.req_to_token = req_to_token
        # Every ConfigError (stride vs host pool, CUDA, storage) is raised here, before anything is allocated.
        parts = build_components(
            config,
            device_pool=device_pool,
            host_pool=host_pool,
            copy_engine=copy_engine,
            storage=storage,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        host_pool, copy_engine, storage = parts.host_pool, parts.copy_engine, parts.storage
        self._owned_storage = storage if parts.owns_storage else None  # closed by close()
        self.metrics = OffloadMetrics()
        self.ledger = SlotLedger(config.page_size) if config.checked else None
        self.fx = OffloadEffects(
            page_size=config.page_size,
            device_pool=device_pool,
            allocator=allocator,
            req_to_token=req_to_token,
            prefix_cache=prefix_cache,
            host_pool=host_pool,
            copy_engine=copy_engine,
            storage=storage,
            worker=backup_worker
            or ThreadBackupWorker(config.backup_queue_size or max(1, host_pool.capacity // self.stride)),
            metrics=self.metrics,
            ledger=self.ledger,
            stored_index_pages=config.stored_index_pages,
        )
        self.consensus = ProgressConsensus(tp_group)
        self._sizes = (config.page_size, self.stride, self.fx.host_pool.capacity, self.fx.worker.capacity)
        self._sizes_agree = self.consensus.check_same(*self._sizes)
        self.trace = TraceWriter(config.trace_path, spec_gen.SPEC_SHA256) if config.trace_path else None
        self.coverage: set[int] = set()  # transition ids taken (checked mode or tracing)
        # Machines report each transition only where someone listens (checked mode, trace): the hot
        # path's bookkeeping (the row hint, ignored releases) is kept by the manager's own calls.
        self._observer = self._observe if (self.ledger is not None or self.trace is not None) else None
        self._records: dict[int, LiveRecord] = {}  # id(request object) -> its current lifecycle
        # Every record's weak-reference callback, one object for the manager: the reference carries the key
        # (weakref.KeyedRef). A partial per record kept two tracked objects a request alive (the partial and
        # its arguments tuple: 4,090 of each at 4096 live in the heap census of bench/sglang_adapter_gpu.py).
        self._on_request_gone = functools.partial(forget_record, self._records)
        # Per table row: the record of the lifecycle admitted last on it (stale once that one released the
        # row). Admission refuses a row whose record still holds it for another request object (RowInUse).
        self._row_holder: list[Optional[RequestRecord]] = [None] * req_to_token.rows
        self._serial = 0
        # Serials of the reservations made here and not yet submitted: a submitted one's pages belong to its
        # chunk (or went back to the pool), so a second submit of it is refused before anything changes, as is
        # another manager's (serials are counted for the process).
        self._reserved: set[int] = set()
        self._max_chunk = self.fx.host_pool.capacity // self.stride * self.stride
        # Per table row: the committed length at which the live, offloadable lifecycle holding it has its
        # next whole stride (next chunk start + stride), or -1 (look at the request itself). A hint
        # (offload's early exit, offload_batch's pre-selection) that never decides what is copied; kept
        # by offload, offload_batch and _end.
        self._due_at = np.full(req_to_token.rows + 1, -1, dtype=np.int64)  # [-1]: sentinel for row -1
        self._rows = req_to_token.rows
        # Slots are read from the request table's host mirror only (a view), wherever the table itself
        # lives: no call of this manager reads GPU memory, so none waits for the decode step. A table with
        # no mirror (host_table None: SGLang's req_to_token on the GPU) is read on its device instead,
        # as device tensors the manager never looks into (device_table.py).
        table = req_to_token.host_table
        self.fx.device_table = (
            None if table is not None else DeviceTableSlots(req_to_token.req_to_token, config.page_size)
        )
        self._table_flat = None if table is None else table.numpy().reshape(-1)
        self._width = int((table if table is not None else req_to_token.req_to_token).shape[1])
        self._page_offsets = np.arange(config.page_size, dtype=np.int64)
        self._arange = np.arange(max(self.stride, 1), dtype=np.int64)

    # --- the integration surface -------------------------------------------------------------------
    @property
    def host_pool(self) -> HostKVPool:
        return self.fx.host_pool

    def release_host_resources(self) -> None:
        """Give the host pool's pinned memory back now (SGLang's shutdown hook); the manager must be idle
        (drain() first) and is unusable for offloading afterwards. A store that registered the pool with its
        transport (Mooncake) unregisters it first."""
        if not self.idle():
            raise LifecycleError(
                f"release_host_resources while {len(self.fx.copy_fifo)} copies, {len(self.fx.parked)} "
                f"parked chunks and {self.fx.worker.outstanding()} backups use host memory: drain() first"
            )
        unregister = getattr(self.fx.storage, "unregister_host_pool", None)
        if unregister is not None and not self.fx.host_pool.released:
            unregister(self.fx.host_pool)
        self.fx.host_pool.release()

    def close(self) -> None:
        """Stop the backup worker, close the trace and the store the manager built (drain() first to finish
        what is in flight)."""
        self.fx.worker.close()
        # Let go of the TP process group: the manager's own reference cycles would keep it until a GC, and a
        # gloo group still referenced while the interpreter exits is a known way to abort the process
        # (std::terminate in gloo's threads; one such abort of bench/tp_nccl.py's rank 1 was seen in CI).
        # A closed manager agrees on nothing any more.
        self.consensus = ProgressConsensus(None)
        if self.trace is not None:
            self.trace.close()
        if self._owned_storage is not None:
            close_storage(self._owned_storage)
            self._owned_storage = None


__all__ = ["DecodeOffloadManager"]
