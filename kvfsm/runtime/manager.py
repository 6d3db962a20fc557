"""DecodeOffloadManager: the seed's integration surface, with every lifecycle step a spec transition.

The engine calls `offload(req)` after a decode step, `check_progress()` every scheduler iteration, and
`finalize(req)` / `abort(req)` / `retract(req)` when a request ends. The manager decides only what the
spec cannot see (how long a chunk is, whether host memory or backup-queue room exists, which copies
completed) and turns each answer into an event of the request's generated machine.

(About 600 lines: one class, the engine's whole integration surface, single and batch paths side by side
so that a reader can check that both make the same transitions.)
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Optional, Union, cast

import numpy as np
import torch

import kvfsm.generated.decode_offload as spec_gen
from kvfsm.dataplane import CopyEngine, HostKVPool, ReqToTokenPool, TokenSlotAllocator
from kvfsm.dataplane.pools.allocator import PageSlots
from kvfsm.dataplane.pools.device_pool import DeviceKVPool
from kvfsm.dataplane.storage import StorageBackend
from kvfsm.errors import ConfigError, InvalidRequest, LifecycleError, RetractionRefused, RowInUse
from kvfsm.generated.decode_offload import DecodeOffloadMachine
from kvfsm.runtime.backup import BackupWorker, ThreadBackupWorker
from kvfsm.runtime.build import build_components, close_storage
from kvfsm.runtime.config import OffloadConfig
from kvfsm.runtime.device_table import DeviceTableSlots
from kvfsm.runtime.effects import Chunk, LiveRecord, OffloadEffects, RequestRecord, token_slice
from kvfsm.runtime.ledger import CheckedModeError, SlotLedger
from kvfsm.runtime.metrics import OffloadMetrics
from kvfsm.runtime.protocols import (
    OffloadRequest,
    PrefixCache,
    check_request_fields,
    check_request_lengths,
    describe,
    offloadable_tokens,
    raise_if_field_missing,
    raise_if_length_invalid,
    request_namespace_seed,
)
from kvfsm.runtime.tp import ProgressConsensus
from kvfsm.runtime.trace import TraceWriter

logger = logging.getLogger(__name__)
_DEBUG = logging.DEBUG

_OFFLOADABLE = spec_gen.HANDLED["offload"]
_ROW_HOLDERS = frozenset(s for s, held in spec_gen.HOLDS.items() if "table_row" in held)

IntArray = Union[np.ndarray, torch.Tensor, Sequence[int]]


def _int_array(values: IntArray, name: str, count: int) -> np.ndarray:
    """A flat int64 numpy view of an engine's batch array (CPU), checked against the batch size."""
    if type(values) is np.ndarray and values.dtype == np.int64 and values.shape == (count,):
        return values  # already what is needed (the usual case): no numpy call
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU (got {values.device}): reading it would sync the GPU")
        values = values.numpy()
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.shape[0] != count or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be {count} integers (one per request), got shape {arr.shape} {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _fire(event_each: Any, chunks: list[Chunk]) -> None:
    """A generated batch event for `chunks`, each on its request's machine (nothing when empty)."""
    if chunks:
        event_each([chunk.record.machine for chunk in chunks], chunks)


def _host_full(due: list[tuple[LiveRecord, OffloadRequest, int]]) -> None:
    """The spec's host_full for each request whose chunk found no host room."""
    DecodeOffloadMachine.host_full_each([rec.machine for rec, _, _ in due], [None] * len(due))


def _forget(records: dict[int, LiveRecord], ref: weakref.KeyedRef[int, OffloadRequest]) -> None:
    """The request object is gone (`ref.key` was its id): drop its record (and, if its lifecycle has ended,
    the record's link to its machine: machine.ctx is the record, so the pair is a reference cycle that only
    the garbage collector would free; a server's collector walking thousands of them is a pause on the hot
    path)."""
    rec: Optional[RequestRecord] = records.pop(ref.key, None)  # out of the table: no longer a LiveRecord
    if rec is not None and rec.machine is not None and rec.machine.state in spec_gen.TERMINAL:
        rec.machine = rec.chain = None  # and the record <-> last chunk cycle (Chunk)


def _unlink_released(chunks: list[Chunk]) -> None:
    """After completions: a lifecycle that just ended and whose request object is already gone (it
    finished under in-flight backups, then the engine dropped it) gives up its record <-> machine cycle."""
    for chunk in chunks:
        rec: RequestRecord = chunk.record  # the chunk is done with: its record may give up its machine
        m = rec.machine
        if m is not None and m.state in spec_gen.TERMINAL and rec.req_ref() is None:
            rec.machine = rec.chain = None  # and the record <-> last chunk cycle (Chunk)


_reservation_serials = itertools.count(1)


class Reservation(NamedTuple):
    """A chunk whose host pages are taken and whose copy waits for `submit_reserved` (reserve_offload)."""

    record: LiveRecord
    req: OffloadRequest  # held strongly: its record keeps its machine (a LiveRecord) until submitted
    tokens: int
    pages: list[int]
    inc_len: int  # the record's inc_len when reserved: a lifecycle that moved on since is not submitted
    serial: int  # unique in the process: each is submitted once, to the manager that made it


class TPMismatch(LifecycleError):
    """The TP ranks disagree on sizes (page, stride, host pool, backup queue): MIN-agreed counts would then
    free different slots on different ranks, so progress is refused and nothing changes."""


class DecodeOffloadManager:
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
        self._on_request_gone = functools.partial(_forget, self._records)
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

    def offload(self, req: OffloadRequest) -> bool:
        """Submit the request's next stride-aligned chunk; False when there is none yet or no host room.

        A request whose lifecycle ended (finished, aborted, retracted) raises EventRejected, one naming a row
        another live request holds RowInUse, one lacking a protocol field RequestFieldMissing; each changes
        nothing."""
        reservation = self.reserve_offload(req)
        return reservation is not None and self.submit_reserved((reservation,)) == 1

    def reserve_offload(self, req: OffloadRequest) -> Optional[Reservation]:
        """`offload(req)` split in two: its checks, chunk and host pages now, its copy and its machine's
        `offload` event later, in one `submit_reserved` for the reservations of a whole iteration.

        For a caller that must answer per request at once, as SGLang's `offload_kv_cache` does: the answer
        (a chunk is due and host pages hold it, or not) is the one `offload` would give, and host pages are
        taken in call order, as a loop of `offload` calls takes them. Nothing else changes until
        `submit_reserved`, so the caller must submit before any other call of this manager that concerns
        the same request (its machine has not yet seen the `offload` event). None: nothing is due, or the
        spec's `host_full` fired (no host room). Raises as `offload` does, changing nothing."""
        try:
            row = req.req_pool_idx
            if type(row) is int and 0 <= row < self._rows and req.kv_committed_len < self._due_at[row]:
                # Most calls: the live lifecycle holding this row has no whole stride of committed KV yet
                # (committed bounds what can be offloaded), so nothing to look up.
                return None
            rec = self._offloadable_record(req)
            if rec is None:
                return None
            n = self._chunk_tokens(req, rec)
        except AttributeError as exc:
            raise_if_field_missing(req, exc)
            raise
        except TypeError as exc:
            raise_if_length_invalid(req, exc)
            raise
        return self._reserve_chunk(rec, req, n)

    def reserve_due(self, req: OffloadRequest, row: int, available: int) -> Optional[Reservation]:
        """`reserve_offload(req)` for a caller that has just read the request's row and `available`, its
        offloadable length (`protocols.offloadable_tokens`), from the engine's own objects:
        the same answer and the same host pages, without reading them again through `req`. The lifecycle
        must still be req's current, offloadable one on `row` (a dict lookup and four checks); otherwise
        this is `reserve_offload(req)`. What it saves: an SGLang adapter's due call read the Req through its
        view's properties eight times (bench/probes/adapter_call_paths.py, `due`). A length that is no integer
        is a TypeError, before anything is taken."""
        available = operator.index(available)
        rec = self._records.get(id(req))
        if rec is None or rec.row != row or rec.req_ref() is not req or rec.machine.state not in _OFFLOADABLE:
            return self.reserve_offload(req)
        return self._reserve_chunk(rec, req, self._chunk_of(rec, available))

    def _reserve_chunk(self, rec: LiveRecord, req: OffloadRequest, n: int) -> Optional[Reservation]:
        """Host pages for the live lifecycle's next chunk of `n` tokens (none due: its next due point), or
        the spec's `host_full`."""
        if n <= 0:
            self._due_at[rec.row] = rec.prefill_len + rec.inc_len + self.stride
            return None
        pages = self.fx.host_pool.alloc_pages(n // self.config.page_size)
        if pages is None:
            _host_full([(rec, req, n)])
            return None
        serial = next(_reservation_serials)
        self._reserved.add(serial)
        return Reservation(rec, req, n, pages, rec.inc_len, serial)

    def submit_reserved(self, reservations: Sequence[Reservation]) -> int:
        """One copy and one batch `offload` event for reservations made by `reserve_offload`, in their order;
        returns the chunks submitted. A reservation whose lifecycle moved on since (ended, or offloaded
        through another call) gives its host pages back and is dropped, and so does a second reservation of
        one lifecycle in the batch (a caller that reserved twice before submitting: both name the same
        tokens, which one chunk copies). If the copy cannot be submitted (the copy engine raised), every
        reserved page goes back, no machine changes, and the error propagates: the chunks are due again at
        the next call, through new reservations. A reservation is submitted once, to the manager that made
        it, whatever came of it: one submitted before, twice in the batch, or another manager's is refused
        (ValueError) before anything changes, since its pages are a chunk's or the pool's again (a retry of a
        refused batch with the same list would have copied into pages the pool hands out to others)."""
        if not reservations:
            return 0
        reserved, serials = self._reserved, set()
        due, pages, stale = [], [], []
        seen: set[int] = set()
        for rec, req, tokens, chunk_pages, inc_len, serial in reservations:  # nothing changes before all pass
            if serial not in reserved or serial in serials:
                raise ValueError(
                    f"reservation {serial} of {rec.key} was submitted already (its pages are a "
                    "chunk's or the pool's again) or is another manager's: reserve again"
                )
            serials.add(serial)
            m = rec.machine
            if m is not None and m.state in _OFFLOADABLE and rec.inc_len == inc_len and id(rec) not in seen:
                seen.add(id(rec))
                due.append((rec, req, tokens))
                pages += chunk_pages
            else:
                stale += chunk_pages
        reserved -= serials  # each is submitted now, whatever comes of it
        if stale:
            self.fx.host_pool.undo_alloc(self.fx.host_pool.slots_of(stale))
        submitted = self._submit(due, pages) if due else 0
        if due:
            stride = self.stride
            self._due_at[[rec.row for rec, _, _ in due]] = [rec.prefill_len + rec.inc_len + stride for rec, _, _ in due]
        return submitted

    def due_at(self, row: int) -> int:
        """The committed length at which the live lifecycle holding `row` has its next whole stride, or -1
        (none known: look at the request). A hint for a caller's early exit, never what is copied. A row outside
        the table, which a request's own field may name, has none: -1, not an IndexError (nor, for a negative
        row, another row's hint)."""
        return int(self._due_at[row]) if 0 <= row < self._rows else -1

    def offload_batch(
        self,
        reqs: Sequence[OffloadRequest],
        req_pool_indices: Optional[IntArray] = None,
        kv_committed_lens: Optional[IntArray] = None,
    ) -> int:
        """`offload(r)` for every request of a decode batch, in one call; returns the chunks submitted.

        The transitions are the ones the loop would make, but every chunk shares one host allocation and
        one copy submission. Pass the engine's batch arrays (request-table rows and committed KV lengths,
        CPU) and only requests whose committed length reaches a stride past their offloaded prefix are
        looked at in Python: the arrays decide *which* requests are examined, never *what* is copied (that
        is read from each examined request, exactly as `offload` does). Each request object may appear
        once. A call that raises submitted nothing and fired no event (requests seen for the first time
        may have been admitted, as `offload` admits them).
        """
        count = len(reqs)
        if req_pool_indices is None or kv_committed_lens is None:
            picked: Iterable[int] = range(count)
        else:
            rows = _int_array(req_pool_indices, "req_pool_indices", count)
            committed = _int_array(kv_committed_lens, "kv_committed_lens", count)
            # row -1 reads the sentinel -1 (look at the request itself); a row past the table is an
            # IndexError of the gather (one reduction fewer than checking both bounds first)
            try:
                hints = self._due_at[rows] if rows.size and int(rows.min()) >= -1 else None
            except IndexError:
                hints = None
            if hints is None and rows.size:
                raise ValueError(f"req_pool_indices must be rows in [0, {self._rows}) or -1")
            # a few, as ints: a list of them indexes `reqs` in 4.6 us where the array's own numpy scalars took
            # 28.9 (283 of 4096, the 2-core development machine; bench/probes/per_call_trims.py)
            picked = np.flatnonzero(committed >= hints).tolist() if rows.size else ()
        # Check every picked request before anything changes, then admit, then submit. The steady state
        # (every picked request live in an offloadable state) needs one pass.
        todo: list[tuple[Optional[LiveRecord], OffloadRequest, int]] = []
        seen: set[int] = set()
        records, chunk_tokens = self._records, self._chunk_tokens
        admit = False
        new_rows: dict[int, OffloadRequest] = {}  # rows of the requests this call admits
        req: Optional[OffloadRequest] = None  # the request the except clauses below name (None: none read yet)
        try:
            for i in picked:
                req = reqs[i]
                row = req.req_pool_idx
                if row is None or row == -1 or not req.output_ids:
                    if row is None or row == -1:
                        self._reject_if_ended(req)
                    continue
                key = id(req)
                if key in seen:
                    raise ValueError(f"request {req.rid!r} appears twice in one offload_batch call")
                seen.add(key)
                rec = records.get(key)
                if rec is None or rec.row != row or rec.req_ref() is not req or rec.machine.state not in _OFFLOADABLE:
                    row = self._check_offloadable(req)
                    other = new_rows.setdefault(row, req)  # admitted below: its row must not be another's
                    if other is not req:
                        raise RowInUse(describe(req), row, f"{describe(other)} (admitted by this call)")
                    todo.append((None, req, row))  # no record yet: the row it was checked on
                    admit = True
                else:
                    todo.append((rec, req, chunk_tokens(req, rec)))
        except AttributeError as exc:
            raise_if_field_missing(req, exc)
            raise
        except TypeError as exc:
            raise_if_length_invalid(req, exc)
            raise
        if admit:
            for k, (rec, req, row) in enumerate(todo):
                if rec is None:  # checked above; the rows this loop admits are distinct (new_rows)
                    rec = self._admit(req, row)
                    todo[k] = (rec, req, chunk_tokens(req, rec))
        looked = cast("list[tuple[LiveRecord, OffloadRequest, int]]", todo)  # every entry has its record now
        due = [item for item in looked if item[2] > 0]
        submitted = self._submit(due) if due else 0
        if looked:  # every looked-at row's next due point, in one numpy call
            stride = self.stride
            self._due_at[[rec.row for rec, _, _ in looked]] = [
                rec.prefill_len + rec.inc_len + stride for rec, _, _ in looked
            ]
        return submitted

    def _offloadable_record(self, req: OffloadRequest) -> Optional[LiveRecord]:
        """The request's live lifecycle (admitting it if new); None if it holds no row or sampled nothing."""
        row = req.req_pool_idx
        if row is None or row == -1 or not req.output_ids:
            if row is None or row == -1:
                self._reject_if_ended(req)
            return None
        rec = self._records.get(id(req))
        # Fast path (every decode step): the request's current, live lifecycle.
        if rec is None or rec.row != row or rec.req_ref() is not req or rec.machine.state not in _OFFLOADABLE:
            rec = self._admit(req, self._check_offloadable(req))
        return rec

    def _reject_if_ended(self, req: OffloadRequest) -> None:
        """A request without a row whose lifecycle ended (release set its req_pool_idx to None) cannot
        offload: the spec's typed error, EventRejected, changing nothing. One never admitted just has
        nothing to offload yet."""
        rec = self._records.get(id(req))
        if rec is not None and rec.req_ref() is req and rec.machine.state not in _OFFLOADABLE:
            rec.machine.offload(None)

    def _check_offloadable(self, req: OffloadRequest) -> int:
        """The slow path of an offload (the request has no live lifecycle on the row it names): raise,
        changing nothing, unless `req` can be admitted. A lifecycle that ended gets the spec's typed error;
        a live one whose request now names another row is refused (InvalidRequest): a request keeps its row
        until it ends, and copying from either row could read another request's KV."""
        rec = self._current(req)
        if rec is not None:
            if rec.machine.state not in _OFFLOADABLE:
                rec.machine.offload(None)  # the spec's typed error for this state; nothing changes
            raise InvalidRequest(
                f"request {describe(req)} names table row {req.req_pool_idx!r} but its live "
                f"lifecycle {rec.key} holds row {rec.row}: a live request keeps its row until it "
                f"ends (retract it, then re-admit it under the new row)"
            )
        return self._check_admissible(req)

    def _chunk_tokens(self, req: OffloadRequest, rec: LiveRecord) -> int:
        """Tokens of the next chunk: whole strides of committed KV past what was offloaded."""
        return self._chunk_of(rec, offloadable_tokens(req.origin_input_ids, req.output_ids, req.kv_committed_len))

    def _chunk_of(self, rec: LiveRecord, available: int) -> int:
        """Whole strides of the first `available` tokens past what `rec` offloaded, at most the host pool:
        a larger backlog (host-full retries, re-admission) would otherwise fail to allocate forever, even
        with the pool empty; the rest follows in later chunks."""
        n = (available - rec.prefill_len - rec.inc_len) // self.stride * self.stride
        return min(n, self._max_chunk)

    def _submit(self, due: list[tuple[LiveRecord, OffloadRequest, int]], pages: Optional[list[int]] = None) -> int:
        """Host pages and one copy for the due chunks, then each request's `offload` (or `host_full`).
        `pages`: host pages already reserved for them, in order (reserve_offload)."""
        fx = self.fx
        host_pool = fx.host_pool
        ps = self.config.page_size
        full: list[tuple[LiveRecord, OffloadRequest, int]] = []
        if pages is None:
            pages = host_pool.alloc_pages(sum(n for _, _, n in due) // ps)  # chunks are whole strides: whole pages
        if pages is None:  # not all fit: allocate in call order, as a loop of offload() calls would
            fits, pages = [], []
            for item in due:
                p = host_pool.alloc_pages(item[2] // ps)
                if p is None:
                    full.append(item)
                else:
                    fits.append(item)
                    pages += p
            if not fits:
                _host_full(full)
                return 0
            due = fits
        handle = None
        try:
            device_arg, host_pages = self._copy_slots(due, pages)
            device = device_arg.slots if isinstance(device_arg, PageSlots) else device_arg
            host = host_pages.slots
            handle = fx.copy_engine.submit_d2h(fx.device_pool, device_arg, host_pool, host_pages)
            chunks, offset = [], 0
            for rec, req, n in due:
                start = rec.prefill_len + rec.inc_len
                end = offset + n
                # A chunk's tokens and host pages as tuples of ints, which the collector stops tracking at its
                # first pass: a chunk can wait for its backup for many iterations (parked behind a slow store),
                # and every full collection would walk two lists per waiting chunk. What it saves: the heap a
                # full collection walks at 4096 live, 16/16, over SGLang's pools, 144,949 -> 99,156 objects (a
                # CPU probe, docs/performance.md); on the H200 that heap was 352k objects and its full
                # collections took 97-161 ms (bench/results/sglang_adapter_gpu-2026-12-03-h200.json).
                # A chunk of one host page (every chunk when the stride is a page) keeps it as a range, which
                # the collector never tracks: a tuple is tracked until a collection passes it, so each one
                # counts towards the next young collection (tracked objects an iteration that offload_batch
                # leaves: bench/probes/tracked_per_call.py).
                first = offset // ps
                host_run = range(pages[first], pages[first] + 1) if n == ps else tuple(pages[first : end // ps])
                chunks.append(
                    Chunk(
                        rec,
                        start,
                        start + n,
                        tuple(token_slice(req, start, start + n)),
                        handle,
                        device,
                        host,
                        offset,
                        end,
                        host_run,
                    )
                )
                offset = end
            DecodeOffloadMachine.offload_each([rec.machine for rec, _, _ in due], chunks)
        except BaseException:
            # No machine took a chunk (the batch is all or nothing): the slots go back, after the copy
            # (if any) stopped writing them.
            if handle is not None:
                handle.wait()
            host_pool.undo_alloc(host_pool.slots_of(pages))
            raise
        if full:  # only once the call can no longer fail
            _host_full(full)
        # The gauge is exact after every manager call, not only after a progress check (an operator reads
        # it between the two: copies submitted here are in flight until a progress check acknowledges them).
        self.metrics.copies_in_flight = len(fx.copy_fifo)
        if logger.isEnabledFor(_DEBUG):
            for chunk in chunks:
                logger.debug("request %s offloaded tokens [%d, %d)", chunk.record.key, chunk.start, chunk.end)
        return len(due)

    def _copy_slots(
        self, due: list[tuple[LiveRecord, OffloadRequest, int]], host_pages: list[int]
    ) -> tuple[Union[torch.Tensor, PageSlots], PageSlots]:
        """(device slots, host slots) of the due chunks, in order (CPU tensors, read from the request
        table's host mirror), both as PageSlots when every chunk page starts a device page. A request's KV
        pages are whole device pages with their slots in order (the paged allocator's layout, which
        release relies on too), so a page's first slot names it: one numpy gather reads the chunk pages'
        first slots, one numpy call expands device and host pages into slots, and the copy checks both as
        page lists. A row whose chunk pages do not start on a page boundary is gathered token by token (as
        with page size 1); one whose first slots are aligned but whose other slots are out of order breaks
        the layout this method (like release) relies on, and is not detected here."""
        ps = self.config.page_size
        host_pool = self.fx.host_pool
        if self.fx.device_table is not None:  # no host mirror: the slots stay on the device, unread
            return self._device_slots(due), host_pool.page_slots(host_pages)
        if ps > 1:
            width = self._width
            positions: list[int] = []  # flat table index of each chunk page's first token
            for rec, _, n in due:
                first = rec.row * width + rec.prefill_len + rec.inc_len
                positions += range(first, first + n, ps)
            starts = self._table_flat[positions].tolist()
            if not any(s % ps for s in starts):  # the paged layout
                count = len(starts)
                starts += [p * ps for p in host_pages]
                both = np.add.outer(starts, self._page_offsets)  # device pages' slots, then host pages'
                device = PageSlots(
                    self.fx.allocator, [s // ps for s in starts[:count]], torch.from_numpy(both[:count].reshape(-1))
                )
                return device, PageSlots(host_pool.allocator, host_pages, torch.from_numpy(both[count:].reshape(-1)))
        return self._device_slots(due), host_pool.page_slots(host_pages)  # token by token

    def _device_slots(self, due: list[tuple[LiveRecord, OffloadRequest, int]]) -> torch.Tensor:
        """Device slots of every due chunk, concatenated in order: one gather from the table's host mirror
        (or, without one, on the table's device)."""
        table = self.fx.device_table
        if table is not None:
            return table.spans(
                [rec.row * self._width + rec.prefill_len + rec.inc_len for rec, _, _ in due], [n for _, _, n in due]
            )
        if len(due) == 1:
            rec, _, n = due[0]
            start = rec.prefill_len + rec.inc_len
            return self.req_to_token.host_table[rec.row, start : start + n].clone()
        width = self._width
        firsts = [rec.row * width + rec.prefill_len + rec.inc_len for rec, _, _ in due]
        lengths = [n for _, _, n in due]
        n0 = lengths[0]
        if lengths.count(n0) == len(lengths):  # the steady state: every chunk is one stride
            flat = np.add.outer(firsts, self._aranges(n0)).reshape(-1)
        else:
            lens = np.array(lengths, dtype=np.int64)
            flat = np.repeat(np.subtract(firsts, np.cumsum(lens) - lens), lens) + self._aranges(int(lens.sum()))
        return torch.from_numpy(self._table_flat[flat])  # numpy gathers a chunk list cheaper than torch

    def _aranges(self, n: int) -> np.ndarray:
        """0..n-1 (int64), cached: a stride's offsets are the same every step."""
        got = self._arange
        if got.size < n:
            got = self._arange = np.arange(max(n, 2 * got.size), dtype=np.int64)
        return got[:n]

    def check_progress(self) -> None:
        """Observe completed copies and backups (MIN-agreed across TP ranks) and feed them to the machines."""
        if not self._sizes_agree:
            raise TPMismatch(f"TP ranks disagree on (page size, stride, host slots, backup queue) = {self._sizes}")
        fx = self.fx
        n_copies = 0
        seen_done = None  # chunks of one offload call share a handle: ask it once
        for chunk in fx.copy_fifo:
            handle = chunk.handle
            if handle is not seen_done:
                if not handle.done():
                    break
                seen_done = handle
            n_copies += 1
        n_copies, n_backups = self.consensus.agree(n_copies, fx.worker.completed())
        worker = fx.worker
        try:
            # Each kind of completion as one batch event per run of equal outcomes, in FIFO order: the
            # transitions, frees and writes of a loop of single events, with each action called once.
            if n_backups:
                jobs = worker.collect_many(n_backups)
                outcomes = [job.ok for job in jobs]
                i = 0
                while i < n_backups:
                    ok, j = outcomes[i], i + 1
                    while j < n_backups and outcomes[j] == ok:
                        j += 1
                    _fire(
                        DecodeOffloadMachine.backup_done_each if ok else DecodeOffloadMachine.backup_failed_each,
                        [job.payload for job in jobs[i:j]],
                    )
                    i = j
                _unlink_released([job.payload for job in jobs])
            resubmit = min(len(fx.parked), worker.room())
            if resubmit:
                _fire(DecodeOffloadMachine.backup_resubmit_each, [fx.parked.popleft() for _ in range(resubmit)])
            if n_copies:
                chunks = [fx.copy_fifo.popleft() for _ in range(n_copies)]
                if self.ledger is not None:
                    for chunk in chunks:
                        self.ledger.copy_completed(chunk.serial, chunk.device_indices.tolist())
                room = worker.room()  # the first `room` get their backup queued, the rest are parked
                _fire(DecodeOffloadMachine.copy_done_each, chunks[:room])
                _fire(DecodeOffloadMachine.copy_parked_each, chunks[room:])
                _unlink_released(chunks)
        finally:
            fx.flush()
            worker.flush()
        self.metrics.copies_in_flight = len(fx.copy_fifo)
        self.metrics.backups_in_flight = worker.outstanding() + len(fx.parked)

    def finalize(self, req: OffloadRequest) -> None:
        """The request finished: release now, or at its last copy acknowledgement (the seed's finalize)."""
        self._end(req, "finish")

    def finalize_batch(self, reqs: Sequence[OffloadRequest]) -> None:
        """`finalize(r)` for each request of `reqs`, in order, as one batch `finish` event: the transitions, frees
        and metrics of that loop, with the releases it makes at once freed together (`release_request_each`).
        Every request is checked before any lifecycle ends, so a call that raises (a request field missing or
        invalid) ended none. A request that is not its live lifecycle's current object (never admitted, or
        admitted again since it ended) takes `finalize`'s own path, and then so does the whole call."""
        recs: list[LiveRecord] = []
        try:
            for req in reqs:
                rec = self._records.get(id(req))
                if rec is None or rec.req_ref() is not req or self._readmitted(rec, req):
                    for r in reqs:  # an admission on the way: the loop, whose checks see the ends before them
                        self._end(r, "finish")
                    return
                check_request_lengths(req)
                recs.append(rec)
        except AttributeError as exc:
            raise_if_field_missing(req, exc)
            raise
        ignored, seen = spec_gen.IGNORED["finish"], set()
        for rec in recs:  # a repeated request's later finishes are no-ops: its first left it ended
            if rec.machine.state in ignored or id(rec) in seen:
                self.metrics.ignored_duplicate_releases += 1
            seen.add(id(rec))
        DecodeOffloadMachine.finish_each([rec.machine for rec in recs], [None] * len(recs))
        if recs:
            self._due_at[[rec.row for rec in recs]] = -1  # ended: offload looks at the request itself
        if logger.isEnabledFor(_DEBUG):
            for rec in recs:
                logger.debug("request %s finish (batch): now %s", rec.key, spec_gen.STATES[rec.machine.state])

    def abort(self, req: OffloadRequest) -> None:
        self._end(req, "abort")

    def retract(self, req: OffloadRequest) -> None:
        """Under the spec's `retraction: fail_closed` policy, RetractionRefused (nothing changed) while a copy of
        this request is in flight; otherwise as finish (`retract`)."""
        if self._fail_closed:
            rec = self._current(req)
            if rec is not None and rec.machine.state == spec_gen.OFFLOADING:  # a live request a copy reads
                raise RetractionRefused(
                    f"request {rec.key} has {rec.machine.copies} device-to-host copies in flight "
                    "(policy retraction: fail_closed)"
                )
        self._end(req, "retract")

    def released_by_engine(self, req: OffloadRequest) -> None:
        """The engine released `req` itself (its slots, row and prefix lock, through its own release path:
        SGLang's scheduler does so for the requests it retracts once drain_before_retraction passed). The
        lifecycle ends with nothing freed here (`released_by_engine`). While a copy still reads the request's
        slots the spec refuses it (EventRejected, nothing changed): the engine freed them under a copy; with
        fences, after `fence_copies_in_flight` made the engine's stream wait on them, it is the spec's
        `released_by_engine_fenced` instead."""
        rec = self._records.get(id(req)) if self._fences else None
        # a lifecycle in offloading is the request's current one (it holds its row: never a re-admission)
        fenced = rec is not None and rec.req_ref() is req and rec.machine.state == spec_gen.OFFLOADING
        self._end(req, "released_by_engine_fenced" if fenced else "released_by_engine")

    def fence_copies_in_flight(self, stream: Any = None) -> int:
        """Make `stream` (default: the current one, the engine's compute stream) wait on every device-to-host
        copy in flight, without the host waiting (a CUDA wait_event each; a CPU copy engine's wait). The
        engine may then free and rewrite those copies' slots on that stream itself: what the spec's
        `released_by_engine_fenced` records. Returns the copies waited on."""
        seen: set[int] = set()
        for chunk in self.fx.copy_fifo:
            h = chunk.handle
            if id(h) not in seen:
                seen.add(id(h))
                if not h.done():
                    h.wait_stream(stream)
        self.fx.fenced_handles = seen
        return len(seen)

    def drain_before_retraction(self) -> None:
        """What the engine calls before it retracts anything (SGLang's drain_before_retraction): a progress
        check, then, under the spec's `retraction: fail_closed` policy, RetractionRefused on every TP rank alike
        (the flag is MAX-agreed, one all-reduce) while any rank tracks a device-to-host copy. Under `deferred`
        retraction is safe whatever is in flight, and only the progress check runs. Never waits for the GPU:
        copies that have not landed stay tracked (SGLang synchronises on each acknowledgement it pops)."""
        self.check_progress()
        if self._fail_closed:
            local = len(self.fx.copy_fifo)
            if self.consensus.any(local > 0):
                raise RetractionRefused(
                    f"device-to-host copies are still in flight on some rank ({local} here; "
                    "policy retraction: fail_closed)"
                )
        elif self._fences:
            self.fence_copies_in_flight()  # the engine's own release of what it retracts is then fenced

    def has_inflight_device_transfer(self) -> bool:
        """Whether a device-to-host copy may still read device slots (SGLang's gate before moving KV pages)."""
        return bool(self.fx.copy_fifo)

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

    def machine_of(self, req: OffloadRequest) -> Optional[DecodeOffloadMachine]:
        rec = self._records.get(id(req))
        return rec.machine if rec is not None and rec.req_ref() is req else None

    def idle(self) -> bool:
        """No copy, parked chunk or backup outstanding."""
        return not self.fx.copy_fifo and not self.fx.parked and self.fx.worker.outstanding() == 0

    def drain(self, max_iterations: int = 100_000) -> None:
        """Run progress checks until idle (shutdown and tests); copies and backups must be able to finish."""
        for _ in range(max_iterations):
            if self.idle():
                return
            for chunk in self.fx.copy_fifo:
                chunk.handle.wait()
            wait_idle = getattr(self.fx.worker, "wait_idle", None)
            if wait_idle is not None:
                wait_idle()
            self.check_progress()
        raise RuntimeError("manager did not drain")

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

    def live_records(self) -> list[LiveRecord]:
        return [r for r in self._records.values() if r.machine.state in _ROW_HOLDERS]

    # --- internals ---------------------------------------------------------------------------------
    def _end(self, req: OffloadRequest, event: str) -> None:
        try:
            rec = self._records.get(id(req))
            if rec is None or rec.req_ref() is not req:
                if req.req_pool_idx is None or req.req_pool_idx == -1:
                    return  # never admitted: nothing is held
                rec = self._admit(req)
            elif self._readmitted(rec, req):
                rec = self._admit(req)  # re-admitted after a retract: a new lifecycle
            else:
                check_request_lengths(req)  # an end freezes them (freeze_lengths): nothing changes before
        except AttributeError as exc:
            raise_if_field_missing(req, exc)
            raise
        m = rec.machine
        if m.state in spec_gen.IGNORED[event]:
            self.metrics.ignored_duplicate_releases += 1  # a declared no-op: the call below changes nothing
        before = m.state
        getattr(m, event)(None)
        self._due_at[rec.row] = -1  # ended (or already was): offload looks at the request itself
        if logger.isEnabledFor(_DEBUG):
            logger.debug("request %s %s: %s -> %s", rec.key, event, spec_gen.STATES[before], spec_gen.STATES[m.state])

    def _current(self, req: OffloadRequest) -> Optional[LiveRecord]:
        """The request object's current lifecycle, or None when the next call admits a new one."""
        rec = self._records.get(id(req))
        if rec is not None and rec.req_ref() is req and not self._readmitted(rec, req):
            return rec
        return None

    def _readmitted(self, rec: LiveRecord, req: OffloadRequest) -> bool:
        """Whether `req`, whose lifecycle `rec` has ended, was admitted again (it names a row it now holds)."""
        row = req.req_pool_idx
        if rec.machine.state in _OFFLOADABLE or row is None or row == -1:
            return False
        if row != rec.row:
            return True
        # Same row number: still held by the ended lifecycle (release deferred), or released and then
        # handed out again by the engine (allocated again), unless the index is merely stale (row free).
        return (
            rec.machine.state not in _ROW_HOLDERS
            and isinstance(row, int)
            and 0 <= row < self.req_to_token.rows
            and self.req_to_token.is_allocated(row)
        )

    def _check_admissible(self, req: OffloadRequest) -> int:
        """Raise, changing nothing, unless `req` can start a lifecycle: every protocol field, an allocated
        row, and no other live request object holding that row (which the new lifecycle's release would
        free under it: a DoubleFree at its own release). Returns that row."""
        check_request_fields(req)
        row = req.req_pool_idx
        if not isinstance(row, int) or not 0 <= row < self.req_to_token.rows or not self.req_to_token.is_allocated(row):
            raise InvalidRequest(
                f"request {getattr(req, 'rid', req)!r} has table row {row!r}, which is not an allocated row"
            )
        holder = self._row_holder[row]
        if holder is not None and holder.machine is not None and holder.machine.state in _ROW_HOLDERS:
            raise RowInUse(describe(req), row, holder.key)
        ps = self.config.page_size
        try:
            prefix = operator.index(req.prefix_len)  # an int, a numpy or torch integer scalar
        except TypeError:
            prefix = None
        if prefix is None or prefix < 0 or prefix % ps or prefix > len(req.origin_input_ids):
            # the spec's `create`: a matched prefix is whole pages of the prompt
            raise InvalidRequest(
                f"request {describe(req)}: prefix_len {req.prefix_len!r} must be a whole number of pages "
                f"of {ps} within its {len(req.origin_input_ids)}-token prompt"
            )
        return row

    def _admit(self, req: OffloadRequest, row: Optional[int] = None) -> LiveRecord:
        """A new lifecycle for `req`. `row`: what `_check_admissible(req)` returned just before, with nothing
        changed since (the check is not made twice); None: it is made here."""
        if row is None:
            row = self._check_admissible(req)
        key = id(req)
        try:
            ref = weakref.KeyedRef(req, self._on_request_gone, key)
        except TypeError:
            raise InvalidRequest(f"request {req.rid!r}: request objects must support weak references") from None
        namespace = request_namespace_seed(req)  # InvalidRequest before anything is recorded
        self._serial += 1
        prompt_len = len(req.origin_input_ids)
        rec = RequestRecord(
            key=f"{req.rid}#{self._serial}",
            rid=req.rid,
            req_ref=ref,
            req=req,
            row=row,
            prefix_len=int(req.prefix_len),
            prefill_len=prompt_len // self.config.page_size * self.config.page_size,
            namespace=namespace,
            lock=getattr(req, "lock", None),
        )
        if self.ledger is not None and rec.prefix_len:  # checked mode reads a device table's values (it syncs)
            lo = row * self._width
            self.ledger.prefix_locked(
                rec.key,
                self._table_flat[lo : lo + rec.prefix_len]
                if self._table_flat is not None
                else self.fx.device_table.span(row, 0, rec.prefix_len).tolist(),
            )
        rec.machine = DecodeOffloadMachine(self.fx, rec, self._observer, fences=self._fences)
        live = cast(LiveRecord, rec)  # its machine is attached: live until its lifecycle ends and it leaves the table
        self._records[key] = live
        self._row_holder[row] = live
        if logger.isEnabledFor(_DEBUG):
            logger.debug(
                "request %s admitted: table row %d, prompt %d tokens, prefix %d",
                rec.key,
                row,
                prompt_len,
                rec.prefix_len,
            )
        return live

    def _observe(self, m: DecodeOffloadMachine, event: str, src: int, dst: int, tid: int) -> None:
        if tid >= 0:
            self.coverage.add(tid)
        if self.trace is not None:
            row = spec_gen.TRANSITIONS[tid] if tid >= 0 else None
            self.trace.transition(
                m.ctx.key,
                event,
                spec_gen.STATES[src],
                spec_gen.STATES[dst],
                tid,
                dict(zip(spec_gen.COUNTERS, m.snapshot()[1:])),
                row[5] if row else (),
                row[7] if row else (),
            )
        if self.ledger is not None:
            bad = spec_gen.violated_invariants(m)
            if bad:
                raise CheckedModeError(m.ctx.key, event, None, f"spec invariants violated: {', '.join(bad)} in {m!r}")


__all__ = ["CheckedModeError", "DecodeOffloadManager", "InvalidRequest", "Reservation", "RowInUse", "TPMismatch"]
