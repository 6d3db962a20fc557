"""Fairness of the backup queue: a chunk parked because the queue was full is resubmitted at the first
progress check that finds room, before any newer chunk, and in the order it was parked.

Starvation here would hold a chunk's host pages for as long as newer copies keep the queue full. After
every progress check of a random workload, either no chunk is parked or the queue has no room, and the
backups were submitted in the order their copies landed.
"""

from __future__ import annotations

import random

import pytest

from kvfsm.verify.engine import SimEngine


@pytest.mark.parametrize("seed", range(8))
def test_no_chunk_waits_while_the_backup_queue_has_room(seed: int) -> None:
    rng = random.Random(seed)
    e = SimEngine(page_size=2, stride=2, host_slots=48, device_slots=96, rows=5, backup_queue=2, max_context=48)
    fx = e.manager.fx
    submitted: list[int] = []  # chunk serials in backup-submission order
    submit = fx.worker.submit_many

    def record(jobs):  # type: ignore[no-untyped-def]
        submitted.extend(job.payload.serial for job in jobs)
        return submit(jobs)

    fx.worker.submit_many = record
    landed: list[int] = []  # chunk serials in copy-acknowledgement order
    parked_peak = 0
    for step in range(40):
        if len(e.live) < e.rows and rng.random() < 0.5:
            e.admit(f"r{step}", rng.randint(2, 8))
        for req in list(e.live):
            if not e.decode(req):
                e.end(req, "retract")
        e.manager.offload_batch(list(e.live))
        if rng.random() < 0.7:
            fifo = list(fx.copy_fifo)
            e.copies.complete_all()
            landed += [c.serial for c in fifo]
        if fx.worker.pending and rng.random() < 0.4:
            for _ in range(rng.randint(1, len(fx.worker.pending))):
                fx.worker.run(0)
        e.manager.check_progress()
        parked_peak = max(parked_peak, len(fx.parked))
        assert not fx.parked or fx.worker.room() == 0, (
            f"step {step}: {len(fx.parked)} chunks parked while the backup queue has room for {fx.worker.room()}"
        )
        if e.live and rng.random() < 0.1:
            e.end(rng.choice(e.live))
    assert parked_peak > 0, "the workload never filled the backup queue: it tests nothing"
    acked = [s for s in landed if s in set(submitted)]
    assert submitted == acked[: len(submitted)], "backups were not submitted in the order their copies landed"
    for req in list(e.live):
        e.end(req)
    e.settle()
    e.check_teardown()
