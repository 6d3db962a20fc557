"""The spec's actions, one method each, calling the data plane: spec line -> generated branch -> here.

Nothing in this module decides *when* something happens (that is the generated machine's job); each
method only does what its action's `doc` in spec/decode_offload.yaml says, touching exactly the
resources the action declares.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from kvfsm.dataplane import CopyEngine, CopyHandle, HostKVPool, PageRun, ReqToTokenPool, TokenSlotAllocator
from kvfsm.dataplane.fences import SlotFence
from kvfsm.dataplane.pools.device_pool import DeviceKVPool
from kvfsm.dataplane.storage import StorageBackend
from kvfsm.dataplane.storage.base import store_host_pages
from kvfsm.errors import LifecycleError
from kvfsm.generated.decode_offload import DecodeOffloadEffectsEach, DecodeOffloadMachine
from kvfsm.runtime.backup import BackupWorker, Job
from kvfsm.runtime.device_table import DeviceTableSlots
from kvfsm.runtime.ledger import SlotLedger
from kvfsm.runtime.metrics import OffloadMetrics
from kvfsm.runtime.protocols import OffloadRequest, PrefixCache
from kvfsm.runtime.stored_index import StoredPageIndex

logger = logging.getLogger(__name__)
_serials = itertools.count(1)
FAILURE_LOG_INTERVAL_S = 10.0  # backup failures are logged at most this often (a dead store fails every chunk)


def token_slice(req: OffloadRequest, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + outputs without building the whole list (hot path)."""
    prompt = req.origin_input_ids
    n = len(prompt)
    if start >= n:  # a decode chunk: a list's slice is already a new list (no second copy)
        part = req.output_ids[start - n : end - n]
    elif end <= n:
        part = prompt[start:end]
    else:
        return list(prompt[start:]) + list(req.output_ids[: end - n])
    return part if type(part) is list else list(part)


@dataclass(eq=False)
class RequestRecord:
    """The manager's bookkeeping for one lifecycle of one request object (its machine's `ctx`)."""

    key: str
    rid: str
    req_ref: weakref.ReferenceType[OffloadRequest]
    req: Optional[Any]  # strong until release: release must read the request's lengths
    row: int
    prefix_len: int  # positions [0, prefix_len) are the prefix cache's pages (whole pages), locked by `lock`
    prefill_len: int  # page-aligned prompt prefix, stored by the prefill side
    namespace: Optional[str] = None  # the chain's seed from the request's extra_key and cache_salt (None: plain)
    lock: Any = None  # the prefix cache's lock on [0, prefix_len), unlocked at release (None: nothing to unlock)
    inc_len: int = 0  # tokens after the prefix already submitted for offload
    chain: Optional[PageRun] = None  # the last run of the request's page-hash chain (hashed lazily)
    stored_pages: int = 0
    failed_backups: int = 0
    end_lengths: Optional[tuple[int, int]] = None  # (committed, allocated) when the engine ended it
    # attached by admission (LiveRecord from then); None again once an ended lifecycle drops it (reference cycle)
    machine: Optional[DecodeOffloadMachine] = None

    @property
    def last_hash(self) -> Optional[str]:
        """The page hash the next chunk chains on (hashes the chain up to here if nothing has yet; the
        namespace seed, or None, before the first page)."""
        return self.namespace if self.chain is None else self.chain.last_hash

    def __repr__(self) -> str:
        return self.key


if TYPE_CHECKING:

    class LiveRecord(RequestRecord):
        """A RequestRecord whose machine is attached: from the end of its admission until it has left the
        manager's table and its lifecycle ended (then `forget_record` or `_unlink_released` may drop the machine to
        break the record <-> machine cycle). The manager's table, the chunks in flight and the per-step
        paths hold records as this type, so they read `machine` without a check. A type only: at run time
        it is RequestRecord itself (no conversion, no per-record cost)."""

        machine: DecodeOffloadMachine
else:
    LiveRecord = RequestRecord


class Chunk(PageRun, Job):
    """One stride-aligned run of a request's KV, from its copy until its backup completes.

    The chunks of one offload call share one copy `handle` and one pair of slot tensors; a chunk's
    slots are positions [lo, hi) of them, sliced only when asked for (slicing costs more than the rest
    of a chunk's bookkeeping). Its host pages are kept as page ids: what the pool frees.

    A chunk is also the run of whole pages it adds to its request's hash chain (a PageRun): `hash_chunk`
    links it behind the request's last run, and its digests are computed on first use, by the backup
    worker's write. One object a chunk, not two: a chunk waiting for its backup is walked by every full
    collection (27,446 PageRun beside 22,893 Chunk at 4096 live, 16/16, in the CPU heap census of
    bench/sglang_adapter_gpu.py). As with any run, its tokens are dropped once it is hashed. Linked, it is
    its record's `chain` while it is the last run: a record <-> chunk cycle, broken where the record <->
    machine one is (`forget_record` in lifecycles.py, `_unlink_released` in progress.py). And a chunk is its own backup job (Job):
    `submit_backup` gives it its store's writes, and the worker records its outcome on it."""

    __slots__ = (
        "record",
        "start",
        "end",
        "handle",
        "serial",
        "host_pages",
        "_device",
        "_host",
        "lo",
        "hi",
        "write",
        "write_many",
        "results",
        "error",
    )

    def __init__(
        self,
        record: LiveRecord,
        start: int,
        end: int,
        tokens: Sequence[int],
        handle: CopyHandle,
        device: torch.Tensor,
        host: torch.Tensor,
        lo: int,
        hi: int,
        host_pages: Sequence[int],
    ) -> None:
        # PageRun's fields without its __init__ (the namespace was checked once, at admission); page_size 0:
        # not linked into the chain yet
        self.tokens, self.page_size, self.prior, self.namespace, self._hashes = tokens, 0, None, None, None
        self.record, self.start, self.end, self.handle = record, start, end, handle
        self._device, self._host, self.lo, self.hi = device, host, lo, hi
        self.host_pages = host_pages
        self.serial = next(_serials)
        # no backup has run
        self.results, self.error = (), None

    @property
    def payload(self) -> Chunk:
        """What the store's write is called with: the chunk itself."""
        return self

    def link(self, prior: PageRun | str | None, page_size: int, namespace: str | None) -> None:
        """Join the request's hash chain behind `prior` (hash_chunk): O(1), nothing hashed yet."""
        self.prior, self.namespace, self.page_size = prior, namespace, page_size

    @property
    def hashes(self) -> list[str]:
        """The chunk's page hashes ([] until `hash_chunk` linked it into its request's chain)."""
        return super().hashes if self.page_size else []

    def digests(self) -> tuple[str, ...]:
        """`hashes` as the tuple the run keeps, not a new list."""
        return self._hashed() if self.page_size else ()

    @property
    def device_indices(self) -> torch.Tensor:
        """Device slots the copy reads (on the device pool's device)."""
        return self._device[self.lo : self.hi]

    @property
    def host_indices(self) -> torch.Tensor:
        """Host slots the copy writes (CPU)."""
        return self._host[self.lo : self.hi]

    def __repr__(self) -> str:
        return f"Chunk(#{self.serial} {self.record.key} [{self.start}, {self.end}))"


Items = list[tuple[DecodeOffloadMachine, Any]]


class OffloadEffects(DecodeOffloadEffectsEach):
    """Implements `kvfsm.generated.decode_offload.DecodeOffloadEffects` over real pools, copies and storage.

    The actions a scheduler iteration takes for dozens of chunks are written once, in their batch form
    (`<action>_each`, what the machines' batch events call); the single form is the batch of one."""

    def __init__(
        self,
        *,
        page_size: int,
        device_pool: DeviceKVPool,
        allocator: TokenSlotAllocator,
        req_to_token: ReqToTokenPool,
        prefix_cache: PrefixCache,
        host_pool: HostKVPool,
        copy_engine: CopyEngine,
        storage: Optional[StorageBackend],
        worker: BackupWorker,
        metrics: OffloadMetrics,
        ledger: Optional[SlotLedger],
        stored_index_pages: int = 1 << 20,
    ) -> None:
        self.page_size = page_size
        self.device_pool, self.allocator, self.req_to_token = device_pool, allocator, req_to_token
        self.prefix_cache, self.host_pool, self.copy_engine = prefix_cache, host_pool, copy_engine
        self.storage, self.worker, self.metrics, self.ledger = storage, worker, metrics, ledger
        self.copy_fifo: collections.deque[Chunk] = collections.deque()  # submission order = completion order
        # (serial of the FIFO's first chunk, of its last, each offload call's handle with the records its chunks
        # copy): `copies_reading`'s index, valid while the FIFO holds the same first and last chunk
        self._fifo_index: Optional[tuple[int, int, list[tuple[CopyHandle, set[RequestRecord]]]]] = None
        self.parked: collections.deque[Chunk] = collections.deque()
        # page hash -> (request key, position) of the newest stored pages (bounded: oldest dropped first)
        self.stored = StoredPageIndex(stored_index_pages)
        self._host_to_free: list[int] = []  # pages freed by free_host_chunk, returned to the pool in flush()
        self._offsets = torch.arange(page_size, dtype=torch.int64)
        self._offsets_np = self._offsets.numpy()
        table = req_to_token.host_table
        self._table = None if table is None else table.numpy()  # a view of the host mirror
        self.device_table: Optional[DeviceTableSlots] = None  # set by the manager when there is no mirror
        # An engine allocator that frees whole pages by id as its slot free would (`frees_page_ids`: SGLang's paged
        # allocator, through the adapter's AllocatorView): without a mirror, a release then hands it the page ids
        # and never expands them into slots for the allocator to divide back
        self._frees_page_ids = bool(getattr(allocator, "frees_page_ids", False))
        self._bytes_per_token = host_pool.config.bytes_per_token
        self._failures_logged_at = -FAILURE_LOG_INTERVAL_S  # time.monotonic() of the last failure WARNING
        self._failures_unlogged = 0  # failures since then
        # id() of the copy handles the engine's stream was last made to wait on (fence_copies_in_flight)
        self.fenced_handles: set[int] = set()

    # --- create ------------------------------------------------------------------------------------
    def seed_hash_chain(self, m: DecodeOffloadMachine, arg: Any) -> None:
        rec: RequestRecord = m.ctx
        if rec.prefill_len:
            assert rec.req is not None  # held from creation to release
            rec.chain = PageRun(
                list(rec.req.origin_input_ids[: rec.prefill_len]), self.page_size, namespace=rec.namespace
            )

    # --- offload -----------------------------------------------------------------------------------
    def start_copy(self, m: DecodeOffloadMachine, chunk: Chunk) -> None:
        self.start_copy_each([(m, chunk)])

    def start_copy_each(self, items: Items) -> None:
        ledger = self.ledger
        total = 0
        for _, chunk in items:
            rec = chunk.record
            if ledger is not None:
                ledger.copy_started(
                    rec.key, chunk.serial, chunk.device_indices.tolist(), chunk.host_indices.tolist(), chunk.handle
                )
            self.copy_fifo.append(chunk)
            n = chunk.end - chunk.start
            rec.inc_len += n
            total += n
        metrics = self.metrics
        metrics.chunks += len(items)
        metrics.offloaded_tokens += total
        metrics.offloaded_bytes += total * self._bytes_per_token

    def count_host_full(self, m: DecodeOffloadMachine, arg: Any) -> None:
        self.metrics.host_full_retries += 1

    # --- copy acknowledgements ---------------------------------------------------------------------
    def hash_chunk(self, m: DecodeOffloadMachine, chunk: Chunk) -> None:
        self.hash_chunk_each([(m, chunk)])

    def hash_chunk_each(self, items: Items) -> None:
        # Linking only: the digests are computed when first asked for, by the backup worker's write
        # (off the scheduler thread) or by whoever reads them first; the chain fixes what they are.
        ps = self.page_size
        for _, chunk in items:
            rec = chunk.record
            chunk.link(rec.chain, ps, rec.namespace)
            rec.chain = chunk

    def submit_backup(self, m: DecodeOffloadMachine, chunk: Chunk) -> None:
        self.submit_backup_each([(m, chunk)])

    def submit_backup_each(self, items: Items) -> None:
        write, write_many = self._write_backup, self._write_backups
        jobs: list[Job] = []
        for _, chunk in items:
            chunk.write, chunk.write_many, chunk.results, chunk.error = write, write_many, (), None
            jobs.append(chunk)
        self.worker.submit_many(jobs)

    def _write_backup(self, chunk: Chunk) -> list[bool]:
        """A chunk's storage write, per-page success; runs on the backup worker's thread."""
        return self._write_backups([chunk])[0]

    def _write_backups(self, chunks: list[Chunk]) -> list[list[bool]]:
        """Several chunks' storage writes in one store call (the worker batches what it finds queued);
        per chunk, per-page success. Hashing happens here, on the worker's thread."""
        storage, host_pool = self.storage, self.host_pool
        keys = [h for chunk in chunks for h in chunk.hashes]
        if storage is None:
            ok = [False] * len(keys)
        else:
            ok = store_host_pages(
                storage, keys, host_pool, host_pool.page_slots([p for chunk in chunks for p in chunk.host_pages])
            )
            if len(ok) != len(keys):
                raise ValueError(f"storage answered {len(ok)} results for {len(keys)} pages")
        out, at = [], 0
        for chunk in chunks:
            n = (chunk.end - chunk.start) // self.page_size
            out.append(ok[at : at + n])
            at += n
        return out

    def park_chunk(self, m: DecodeOffloadMachine, chunk: Chunk) -> None:
        self.park_chunk_each([(m, chunk)])

    def park_chunk_each(self, items: Items) -> None:
        self.parked.extend(chunk for _, chunk in items)
        self.metrics.parked_chunks += len(items)

    # --- backups -----------------------------------------------------------------------------------
    def mark_stored(self, m: DecodeOffloadMachine, chunk: Chunk) -> None:
        self.mark_stored_each([(m, chunk)])

    def mark_stored_each(self, items: Items) -> None:
        # one put_many for the batch's pages, not a put a page (what it saves: StoredPageIndex.put_many)
        ps = self.page_size
        hashes: list[str] = []
        owners: list[str] = []
        positions: list[int] = []
        for _, chunk in items:
            rec = chunk.record
            digests = chunk.digests()
            n = len(digests)
            hashes += digests
            owners += [rec.key] * n
            positions += range(chunk.start, chunk.start + n * ps, ps)
            rec.stored_pages += n
        self.stored.put_many(hashes, owners, positions)
        self.metrics.stored_pages += len(hashes)

    def count_backup_failure(self, m: DecodeOffloadMachine, chunk: Chunk) -> None:
        self.count_backup_failure_each([(m, chunk)])

    def count_backup_failure_each(self, items: Items) -> None:
        for _, chunk in items:
            chunk.record.failed_backups += 1
        self.metrics.backup_failures += len(items)
        if self.storage is not None:  # without a store every backup fails: said once, when the manager was built
            self._log_failures(items)

    def _log_failures(self, items: Items) -> None:
        """One WARNING for the first failure, then at most one per FAILURE_LOG_INTERVAL_S with the count
        since the last: the first says what failed and why, the rest that it goes on."""
        self._failures_unlogged += len(items)
        now = time.monotonic()
        if now - self._failures_logged_at < FAILURE_LOG_INTERVAL_S:
            return
        chunk = items[0][1]
        if chunk.error is not None:
            why = f"the store raised {chunk.error!r}"
        elif chunk.results:
            why = f"the store refused {chunk.results.count(False)} of {len(chunk.results)} pages"
        else:
            why = "the store reported no result"
        logger.warning(
            "%d backup(s) failed since the last report (e.g. %r: %s); their pages are not stored "
            "(metrics.backup_failures=%d)",
            self._failures_unlogged,
            chunk,
            why,
            self.metrics.backup_failures,
        )
        self._failures_logged_at, self._failures_unlogged = now, 0

    def free_host_chunk(self, m: DecodeOffloadMachine, chunk: Chunk) -> None:
        self.free_host_chunk_each([(m, chunk)])

    def free_host_chunk_each(self, items: Items) -> None:
        ledger, to_free = self.ledger, self._host_to_free
        for _, chunk in items:
            if ledger is not None:
                ledger.free_host(chunk.record.key, "backup", chunk.serial, chunk.host_indices.tolist())
            to_free += chunk.host_pages

    def flush(self) -> None:
        """Return every host page freed since the last flush in one pool call (the progress check ends
        with this, so no allocation ever sees a slot between its free and its return)."""
        if self._host_to_free:
            pages, self._host_to_free = self._host_to_free, []
            self.host_pool.free_pages(pages)

    # --- end of life -------------------------------------------------------------------------------
    def freeze_lengths(self, m: DecodeOffloadMachine, arg: Any) -> None:
        # Release may be deferred to the last copy ack, by when the engine may have re-admitted this
        # object (new row, new lengths): free what the request held when it ended.
        req = m.ctx.req
        m.ctx.end_lengths = (int(req.kv_committed_len), int(req.kv_allocated_len))
        if m.copies and not m.fences:
            self.metrics.deferred_releases += 1

    def request_slots(self, rec: RequestRecord) -> torch.Tensor | np.ndarray:
        """Device slots of the request's own pages: those covering [prefix_len, ceil_page(committed)) plus the
        over-allocation [ceil_page(committed), allocated), each once. The matched prefix's pages [0,
        prefix_len) are the prefix cache's (SGLang 0.5.23 frees [cache_protected_len, kv_allocated_len)).
        From the table's host mirror they are an int64 array, read and freed with no torch call
        (`as_index_array`); without a mirror, a tensor on the table's device."""
        ps = self.page_size
        # pages at positions [prefix_len, ceil_page(committed)) and [ceil_page(committed), allocated):
        # together every page start in [prefix_len, ceil_page(max(committed, allocated)))
        end = self._request_end(rec)
        if self._table is None:  # no host mirror: computed on the table's device, never read here
            return self.device_table.whole_pages(rec.row, rec.prefix_len, end)  # type: ignore[union-attr]
        starts = self._table[rec.row, rec.prefix_len : end : ps]  # the request table's host mirror: never a GPU read
        slots: np.ndarray = np.add.outer(starts - starts % ps, self._offsets_np).reshape(-1)
        return slots

    def _request_end(self, rec: RequestRecord) -> int:
        """The end of the request's own pages: ceil_page(max(committed, allocated)), with the lengths it ended
        with (or, live, its current ones)."""
        if rec.end_lengths is not None:
            committed, allocated = rec.end_lengths
        else:
            assert rec.req is not None  # held until release, which reads these lengths
            committed, allocated = rec.req.kv_committed_len, rec.req.kv_allocated_len
        ps = self.page_size
        return -(-max(allocated, committed) // ps) * ps

    def record_engine_release(self, m: DecodeOffloadMachine, arg: Any) -> None:
        rec = m.ctx
        if self.ledger is not None:  # the slots the ledger has the request own, not its (reusable) row's
            self.ledger.release_owned(rec.key, "released_by_engine")
            self.ledger.prefix_unlocked(rec.key)
        rec.lock = None
        rec.req = None
        self.metrics.engine_releases += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request %s released by the engine (table row %d): nothing freed here", rec.key, rec.row)

    def copies_reading(self, rec: RequestRecord) -> list[CopyHandle]:
        """The handles of the copies in flight that read `rec`'s device slots, in submission order (one per
        offload call, which copies at most one chunk of a request): what its fenced release is fenced by.

        The FIFO is indexed once (each offload call's handle, with the records its chunks copy) and the index
        serves every release until the FIFO changes: the requests that finish in a scheduler iteration
        otherwise each walked the whole FIFO, that iteration's chunks (215 of them at 4096 live, 16/16).
        The FIFO only grows at its end, by new chunks, whose serials increase, and shrinks at its front, so
        the serials of its first and last chunk name what it holds."""
        fifo = self.copy_fifo
        if not fifo:
            self._fifo_index = None
            return []
        index = self._fifo_index
        if index is None or index[0] != fifo[0].serial or index[1] != fifo[-1].serial:
            calls: list[tuple[CopyHandle, set[RequestRecord]]] = []
            handle: Optional[CopyHandle] = None
            records: set[RequestRecord] = set()
            for chunk in fifo:
                if chunk.handle is not handle:  # the chunks of one offload call are adjacent, sharing its handle
                    handle, records = chunk.handle, set()
                    calls.append((handle, records))
                records.add(chunk.record)
            index = self._fifo_index = (fifo[0].serial, fifo[-1].serial, calls)
        return [handle for handle, records in index[2] if rec in records]

    def record_engine_release_fenced(self, m: DecodeOffloadMachine, arg: Any) -> None:
        rec = m.ctx
        handles = self.copies_reading(rec)
        unfenced = [h for h in handles if id(h) not in self.fenced_handles and not h.done()]
        if unfenced:  # refused before anything is recorded: the engine freed slots its stream never waited on
            raise LifecycleError(
                f"request {rec.key}: {len(unfenced)} copies still read the slots the engine freed, "
                "and its stream was never made to wait on them (fence_copies_in_flight; B2)"
            )
        fence = SlotFence(handles)
        fence.mark_waited()  # by fence_copies_in_flight, before the engine freed them
        if self.ledger is not None:
            self.ledger.release_owned(rec.key, "released_by_engine_fenced", fence)
            self.ledger.prefix_unlocked(rec.key)
        rec.lock = None
        rec.req = None
        self.metrics.engine_releases += 1

    def release_request(self, m: DecodeOffloadMachine, arg: Any) -> None:
        self._release(m.ctx, None)

    def release_request_each(self, items: Items) -> None:
        """release_request for each item, in order, with every release's device pages freed in one call where the
        allocator says how its free list orders frees (`frees_newest_first`): the pages are laid out so that one
        free leaves the list as one free a request would. Where a release frees by page id (no host mirror, an
        allocator that frees by id: SGLang's, through the adapter), the ids are read in one gather: four GPU ops
        and one free for the batch where each release made three and a free of its own (each op 15-20 us of the
        scheduler's thread on a GPU host: bench/probes/door_phases.py --detail, `device_table.page_ids`).
        The rows, locks and fields then go request by request, as each release does."""
        recs = [m.ctx for m, _ in items]
        free_order = getattr(self.allocator, "frees_newest_first", None)
        newest_first = None if free_order is None else free_order()  # None: an order not known, one at a time
        # A cache that may free pages when a lock goes (kvfsm's SimplePrefixCache evicts at the last unlock) would
        # hand those pages to the allocator between two releases' pages, one release at a time; SGLang's tree cache
        # frees none at unlock (`frees_at_unlock` False: its pages become evictable, and evict() frees them later)
        unlock_frees = getattr(self.prefix_cache, "frees_at_unlock", True) and any(rec.lock is not None for rec in recs)
        if newest_first is None or self.ledger is not None or len(items) < 2 or unlock_frees:
            for m, arg in items:  # the action one item at a time, as the machines' single events take it
                self.release_request(m, arg)
            return
        assert all(rec.req is not None for rec in recs)  # each held until its release
        ends = [self._request_end(rec) for rec in recs]
        order = range(len(recs) - 1, -1, -1) if newest_first else range(len(recs))
        by_id = self.device_table if self._frees_page_ids else None
        if by_id is not None:
            pages = by_id.page_ids_many(
                [recs[i].row for i in order], [recs[i].prefix_len for i in order], [ends[i] for i in order]
            )
            if len(pages):
                self.allocator.free_page_ids(pages, None)  # type: ignore[attr-defined]
        else:
            parts = [self.request_slots(recs[i]) for i in order]
            slots = np.concatenate(parts) if isinstance(parts[0], np.ndarray) else torch.cat(parts)  # type: ignore[arg-type]
            if len(slots):  # none when the matched prefixes are all the requests hold
                self.allocator.free(slots)
        ps = self.page_size
        for rec, end in zip(recs, ends):
            self._release_row(rec, None, max(0, -(-(end - rec.prefix_len) // ps)) * ps)

    def release_request_fenced(self, m: DecodeOffloadMachine, arg: Any) -> None:
        self.release_request_fenced_each([(m, arg)])

    def release_request_fenced_each(self, items: Items) -> None:
        for m, _ in items:  # the fence of each request: its copies still in flight
            self._release(m.ctx, SlotFence(self.copies_reading(m.ctx)))
            self.metrics.fenced_releases += 1

    def _release(self, rec: RequestRecord, fence: Optional[SlotFence]) -> None:
        """release_request, and with a `fence` release_request_fenced: the same frees, the device slots
        tagged with the fence of the copies that still read them."""
        assert rec.req is not None  # held until this release
        # Without a mirror, on an allocator that frees by page id: the pages by id, one GPU op, where their slots
        # took two and the allocator's division of them a third (each 15-20 us of the scheduler's thread on a GPU
        # host: bench/probes/door_phases.py --detail). The slots are then read only by checked mode (it syncs).
        by_id = self.device_table if self._frees_page_ids else None
        slots = None
        if self.ledger is not None:
            slots = self.request_slots(rec)
            self.ledger.release_device(rec.key, "release" if fence is None else "release_fenced", slots.tolist(), fence)
        if by_id is not None:
            pages = by_id.page_ids(rec.row, rec.prefix_len, self._request_end(rec))
            if len(pages):
                self.allocator.free_page_ids(pages, fence)  # type: ignore[attr-defined]
            slots_freed = len(pages) * self.page_size
        else:
            if slots is None:
                slots = self.request_slots(rec)
            if len(slots):  # none when the matched prefix is all the request holds
                if fence is None:
                    self.allocator.free(slots)
                else:
                    self.allocator.free(slots, fence=fence)
            slots_freed = len(slots)
        self._release_row(rec, fence, slots_freed)

    def _release_row(self, rec: RequestRecord, fence: Optional[SlotFence], slots_freed: int) -> None:
        """The rest of a release once its device slots are freed: the table row, the prefix's lock and the
        request's own fields (`slots_freed`: for the log)."""
        req = rec.req
        assert req is not None  # held until this release
        self.req_to_token.free(rec.row)
        lock, rec.lock = rec.lock, None
        if self.ledger is not None:
            self.ledger.prefix_unlocked(rec.key)
        self.prefix_cache.unlock(lock)  # the prefix's pages stay with the cache: unlocked, never freed (B16)
        if req.req_pool_idx == rec.row:
            req.req_pool_idx = None
        if lock is not None and getattr(req, "lock", None) is lock:
            req.lock = None  # as SGLang does: the request no longer holds it
        rec.req = None
        self.metrics.releases += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "request %s released%s: %d device slots, table row %d, prefix %d unlocked",
                rec.key,
                "" if fence is None else f" fenced by {len(fence)} copies",
                slots_freed,
                rec.row,
                rec.prefix_len,
            )
