"""How a lifecycle ends: the request finished, was aborted or retracted, or the engine released it itself; and
what the engine calls before it retracts (the drain, and the fence of the copies in flight).

Each is the spec's event on the request's machine, which releases now or once no copy reads the request's slots.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import kvfsm.generated.decode_offload as spec_gen
from kvfsm.errors import RetractionRefused
from kvfsm.generated.decode_offload import DecodeOffloadMachine
from kvfsm.runtime.effects import LiveRecord
from kvfsm.runtime.progress import Progress
from kvfsm.runtime.protocols import OffloadRequest, check_request_lengths, raise_if_field_missing

logger = logging.getLogger(__name__)
_DEBUG = logging.DEBUG


class Ending(Progress):
    """The ends of a `DecodeOffloadManager`'s lifecycles."""

    _fail_closed: bool

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
