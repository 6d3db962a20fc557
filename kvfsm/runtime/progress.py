"""Progress: the copies and backups that completed, MIN-agreed over the TP group, fed to the machines as batch
events in FIFO order; and what a caller asks of that state (in flight, idle, drained)."""

from __future__ import annotations

from typing import Any

import kvfsm.generated.decode_offload as spec_gen
from kvfsm.errors import LifecycleError
from kvfsm.generated.decode_offload import DecodeOffloadMachine
from kvfsm.runtime.effects import Chunk, RequestRecord
from kvfsm.runtime.lifecycles import Lifecycles


class TPMismatch(LifecycleError):
    """The TP ranks disagree on sizes (page, stride, host pool, backup queue): MIN-agreed counts would then
    free different slots on different ranks, so progress is refused and nothing changes."""


def _fire(event_each: Any, chunks: list[Chunk]) -> None:
    """A generated batch event for `chunks`, each on its request's machine (nothing when empty)."""
    if chunks:
        event_each([chunk.record.machine for chunk in chunks], chunks)


def _unlink_released(chunks: list[Chunk]) -> None:
    """After completions: a lifecycle that just ended and whose request object is already gone (it
    finished under in-flight backups, then the engine dropped it) gives up its record <-> machine cycle."""
    for chunk in chunks:
        rec: RequestRecord = chunk.record  # the chunk is done with: its record may give up its machine
        m = rec.machine
        if m is not None and m.state in spec_gen.TERMINAL and rec.req_ref() is None:
            rec.machine = rec.chain = None  # and the record <-> last chunk cycle (Chunk)


class Progress(Lifecycles):
    """The progress check of a `DecodeOffloadManager`."""

    _sizes: tuple[int, int, int, int]
    _sizes_agree: bool

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

    def has_inflight_device_transfer(self) -> bool:
        """Whether a device-to-host copy may still read device slots (SGLang's gate before moving KV pages)."""
        return bool(self.fx.copy_fifo)

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
