"""Offloading: which chunks are due, their host pages, and one copy and one batch `offload` event for them.

Three doors lead here: `offload(req)`, the seed's call per request; `reserve_offload` / `reserve_due` then
`submit_reserved`, for a caller that must answer per request at once but may submit an iteration's chunks
together (SGLang's adapter); and `offload_batch`, a whole decode batch in one call. All three make the
transitions a loop of `offload` calls would make, and take host pages in the same order.
"""

from __future__ import annotations

import itertools
import logging
import operator
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Optional, Union, cast

import numpy as np
import torch

from kvfsm.dataplane.pools.allocator import PageSlots
from kvfsm.errors import InvalidRequest, RowInUse
from kvfsm.generated.decode_offload import DecodeOffloadMachine
from kvfsm.runtime.effects import Chunk, LiveRecord, token_slice
from kvfsm.runtime.lifecycles import OFFLOADABLE, Lifecycles
from kvfsm.runtime.protocols import (
    OffloadRequest,
    describe,
    offloadable_tokens,
    raise_if_field_missing,
    raise_if_length_invalid,
)

logger = logging.getLogger(__name__)
_DEBUG = logging.DEBUG

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


def _host_full(due: list[tuple[LiveRecord, OffloadRequest, int]]) -> None:
    """The spec's host_full for each request whose chunk found no host room."""
    DecodeOffloadMachine.host_full_each([rec.machine for rec, _, _ in due], [None] * len(due))


_reservation_serials = itertools.count(1)


class Reservation(NamedTuple):
    """A chunk whose host pages are taken and whose copy waits for `submit_reserved` (reserve_offload)."""

    record: LiveRecord
    req: OffloadRequest  # held strongly: its record keeps its machine (a LiveRecord) until submitted
    tokens: int
    pages: list[int]
    inc_len: int  # the record's inc_len when reserved: a lifecycle that moved on since is not submitted
    serial: int  # unique in the process: each is submitted once, to the manager that made it


class Offloading(Lifecycles):
    """The offload doors of a `DecodeOffloadManager`."""

    _reserved: set[int]
    _max_chunk: int
    _page_offsets: np.ndarray
    _arange: np.ndarray

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
        if rec is None or rec.row != row or rec.req_ref() is not req or rec.machine.state not in OFFLOADABLE:
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
            if m is not None and m.state in OFFLOADABLE and rec.inc_len == inc_len and id(rec) not in seen:
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
                if rec is None or rec.row != row or rec.req_ref() is not req or rec.machine.state not in OFFLOADABLE:
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
        if rec is None or rec.row != row or rec.req_ref() is not req or rec.machine.state not in OFFLOADABLE:
            rec = self._admit(req, self._check_offloadable(req))
        return rec

    def _reject_if_ended(self, req: OffloadRequest) -> None:
        """A request without a row whose lifecycle ended (release set its req_pool_idx to None) cannot
        offload: the spec's typed error, EventRejected, changing nothing. One never admitted just has
        nothing to offload yet."""
        rec = self._records.get(id(req))
        if rec is not None and rec.req_ref() is req and rec.machine.state not in OFFLOADABLE:
            rec.machine.offload(None)

    def _check_offloadable(self, req: OffloadRequest) -> int:
        """The slow path of an offload (the request has no live lifecycle on the row it names): raise,
        changing nothing, unless `req` can be admitted. A lifecycle that ended gets the spec's typed error;
        a live one whose request now names another row is refused (InvalidRequest): a request keeps its row
        until it ends, and copying from either row could read another request's KV."""
        rec = self._current(req)
        if rec is not None:
            if rec.machine.state not in OFFLOADABLE:
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
