"""The backup worker: jobs are chunks, written in batches, each ending exactly as if run alone."""

from __future__ import annotations

import gc
import threading

import pytest

from timing import backups_settled

from kvfsm.runtime import BackupJob, ThreadBackupWorker
from kvfsm.runtime.backup import run_jobs
from kvfsm.runtime.effects import Chunk
from kvfsm.verify.engine import SimEngine


class Store:
    """Per-payload page results; payloads named 'raise' make any write that includes them raise."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def write(self, payload: str) -> list[bool]:
        return self.write_many([payload])[0]

    def write_many(self, payloads: list[str]) -> list[list[bool]]:
        self.calls.append(list(payloads))
        if "raise" in payloads:
            raise OSError("store down")
        return [[not p.startswith("bad")] * 2 for p in payloads]


def jobs_for(store: Store, payloads: list[str]) -> list[BackupJob]:
    return [BackupJob(p, store.write, store.write_many) for p in payloads]


def outcome(jobs: list[BackupJob]) -> list[tuple[bool, tuple[bool, ...], bool]]:
    return [(j.ok, j.results, j.error is not None) for j in jobs]


@pytest.mark.parametrize("payloads", [["a", "b", "c"], ["a", "bad", "c"], ["a", "raise", "c"], ["raise"], []])
def test_batched_equals_one_by_one(payloads: list[str]) -> None:
    alone, together = Store(), Store()
    one_by_one = jobs_for(alone, payloads)
    for job in one_by_one:
        job.run()
    batched = jobs_for(together, payloads)
    run_jobs(batched)
    assert outcome(batched) == outcome(one_by_one)
    if len(payloads) > 1 and "raise" not in payloads:
        assert together.calls == [payloads]  # one store call for the whole run of jobs
    if "raise" in payloads and len(payloads) > 1:
        assert [p for call in together.calls[1:] for p in call] == payloads  # retried job by job


def test_a_malformed_batch_answer_falls_back_to_single_writes() -> None:
    store = Store()
    short = jobs_for(store, ["a", "b"])
    for job in short:
        job.write_many = lambda payloads: [[True]]  # one answer for two jobs
    run_jobs(short)
    assert outcome(short) == [(True, (True, True), False)] * 2


def test_thread_worker_writes_what_is_queued_together_and_completes_in_order() -> None:
    store = Store()
    gate = threading.Event()
    first = BackupJob("first", lambda p: (gate.wait(5), [True])[1])  # holds the thread while more queue up
    worker = ThreadBackupWorker(16)
    worker.submit(first)
    worker.flush()
    rest = jobs_for(store, [f"p{i}" for i in range(5)])
    for job in rest:
        worker.submit(job)
    worker.flush()
    gate.set()
    backups_settled(worker)
    assert [worker.collect().payload for _ in range(6)] == ["first"] + [f"p{i}" for i in range(5)]
    assert store.calls == [[f"p{i}" for i in range(5)]]
    worker.close()


def test_submit_many_is_all_or_nothing_and_collect_many_is_fifo() -> None:
    from kvfsm.runtime.backup import BackupQueueFull, SteppedBackupWorker

    store = Store()
    w = SteppedBackupWorker(3)
    with pytest.raises(BackupQueueFull):
        w.submit_many(jobs_for(store, ["a", "b", "c", "d"]))
    assert w.outstanding() == 0 and w.pending == []  # nothing queued
    jobs = jobs_for(store, ["a", "bad", "c"])
    w.submit_many(jobs)
    assert w.room() == 0 and w.pending == jobs
    w.run(2)
    w.run(0)
    with pytest.raises(ValueError):
        w.collect_many(3)  # only two finished
    got = w.collect_many(2)
    assert [j.payload for j in got] == ["c", "a"] and w.outstanding() == 1  # completion order
    w.run_all()
    assert [j.payload for j in w.collect_many(1)] == ["bad"] and w.outstanding() == 0


def test_a_waiting_chunk_is_its_own_backup_job() -> None:
    """The decode manager queues its chunks themselves, not a job object beside each, and a written chunk's
    outcome is a tuple the collector stops tracking: a chunk waiting for its store is one tracked object."""
    e = SimEngine(page_size=2, stride=2, host_slots=48, device_slots=96, rows=2, backup_queue=8, max_context=48)
    fx = e.manager.fx
    e.admit("a", 3)
    for _ in range(4):
        for req in list(e.live):
            assert e.decode(req)
        e.manager.offload_batch(list(e.live))
    e.copies.complete_all()
    e.manager.check_progress()
    jobs = list(fx.worker.pending)
    assert jobs and all(type(job) is Chunk and job.payload is job for job in jobs)
    assert all(job.results == () and job.error is None for job in jobs)  # nothing written yet
    fx.worker.run_all()
    gc.collect()
    assert all(job.ok and type(job.results) is tuple and not gc.is_tracked(job.results) for job in jobs)
    e.manager.check_progress()
    assert fx.worker.completed() == 0 and not fx.worker.pending
    for req in list(e.live):
        e.end(req)
    e.settle()
    e.check_teardown()
