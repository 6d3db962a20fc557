"""Which lifecycle a request object has: the manager's table of records, one generated machine each.

A request object is admitted once per lifecycle: on an allocated table row that no other live request holds, with
every protocol field read and checked first (`_check_admissible`), so a refused admission records nothing. A
record leaves the table when its request object is collected (a weak reference's callback, `forget_record`; the
chunks still in flight keep it until they are done), and a request admitted again after its lifecycle ended gets
a new one (`_readmitted`). The other parts of the manager (offloading.py, progress.py, ending.py) find lifecycles
here; the transitions themselves are the generated machine's (kvfsm/generated/decode_offload.py).
"""

from __future__ import annotations

import logging
import operator
import weakref
from typing import Any, Optional, cast

import numpy as np

import kvfsm.generated.decode_offload as spec_gen
from kvfsm.dataplane import ReqToTokenPool
from kvfsm.errors import InvalidRequest, RowInUse
from kvfsm.generated.decode_offload import DecodeOffloadMachine
from kvfsm.runtime.config import OffloadConfig
from kvfsm.runtime.effects import LiveRecord, OffloadEffects, RequestRecord
from kvfsm.runtime.ledger import CheckedModeError, SlotLedger
from kvfsm.runtime.metrics import OffloadMetrics
from kvfsm.runtime.protocols import (
    OffloadRequest,
    check_request_fields,
    describe,
    request_namespace_seed,
)
from kvfsm.runtime.tp import ProgressConsensus
from kvfsm.runtime.trace import TraceWriter

logger = logging.getLogger(__name__)
_DEBUG = logging.DEBUG

# The spec's states in which a lifecycle may offload, and those in which it holds its table row
OFFLOADABLE = spec_gen.HANDLED["offload"]
ROW_HOLDERS = frozenset(s for s, held in spec_gen.HOLDS.items() if "table_row" in held)


def forget_record(records: dict[int, LiveRecord], ref: weakref.KeyedRef[int, OffloadRequest]) -> None:
    """The request object is gone (`ref.key` was its id): drop its record (and, if its lifecycle has ended,
    the record's link to its machine: machine.ctx is the record, so the pair is a reference cycle that only
    the garbage collector would free; a server's collector walking thousands of them is a pause on the hot
    path)."""
    rec: Optional[RequestRecord] = records.pop(ref.key, None)  # out of the table: no longer a LiveRecord
    if rec is not None and rec.machine is not None and rec.machine.state in spec_gen.TERMINAL:
        rec.machine = rec.chain = None  # and the record <-> last chunk cycle (Chunk)


class Lifecycles:
    """The record table of a `DecodeOffloadManager` (kvfsm/runtime/manager.py builds the state declared here)."""

    config: OffloadConfig
    stride: int
    fx: OffloadEffects
    metrics: OffloadMetrics
    ledger: Optional[SlotLedger]
    req_to_token: ReqToTokenPool
    consensus: ProgressConsensus
    trace: Optional[TraceWriter]
    coverage: set[int]
    _fences: int
    _records: dict[int, LiveRecord]
    _row_holder: list[Optional[RequestRecord]]
    _serial: int
    _observer: Any
    _on_request_gone: Any
    _due_at: np.ndarray
    _rows: int
    _table_flat: Any  # the host mirror as a flat numpy view, or None
    _width: int

    def machine_of(self, req: OffloadRequest) -> Optional[DecodeOffloadMachine]:
        rec = self._records.get(id(req))
        return rec.machine if rec is not None and rec.req_ref() is req else None

    def live_records(self) -> list[LiveRecord]:
        return [r for r in self._records.values() if r.machine.state in ROW_HOLDERS]

    def _current(self, req: OffloadRequest) -> Optional[LiveRecord]:
        """The request object's current lifecycle, or None when the next call admits a new one."""
        rec = self._records.get(id(req))
        if rec is not None and rec.req_ref() is req and not self._readmitted(rec, req):
            return rec
        return None

    def _readmitted(self, rec: LiveRecord, req: OffloadRequest) -> bool:
        """Whether `req`, whose lifecycle `rec` has ended, was admitted again (it names a row it now holds)."""
        row = req.req_pool_idx
        if rec.machine.state in OFFLOADABLE or row is None or row == -1:
            return False
        if row != rec.row:
            return True
        # Same row number: still held by the ended lifecycle (release deferred), or released and then
        # handed out again by the engine (allocated again), unless the index is merely stale (row free).
        return (
            rec.machine.state not in ROW_HOLDERS
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
        if holder is not None and holder.machine is not None and holder.machine.state in ROW_HOLDERS:
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
                else self.fx.device_table.span(row, 0, rec.prefix_len).tolist(),  # type: ignore[union-attr]  # set with no mirror
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
