"""Stores fail in ways nobody planned for: a client library's own exception type, or a BaseException from a
library that gives up. Every such write is a failed backup (never a success: B13), the backup worker's
thread lives on and runs every later backup, and nothing is lost or freed twice.

The faults are drawn: the exception type from a list that mixes the expected types with others, and which
of the chunk keys raise.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from timing import backups_settled

from kvfsm.dataplane.storage import MemoryStorage
from kvfsm.dataplane.storage.faulty import FaultyStorage
from kvfsm.runtime import BackupJob, ThreadBackupWorker
from kvfsm.verify.engine import SimEngine


class ClientError(RuntimeError):
    """What a storage client library raises (its own type, not one kvfsm expects)."""


class Abandon(BaseException):
    """Neither an Exception nor an interrupt: a library's way of giving up."""


RAISED = [
    OSError,
    TimeoutError,
    ValueError,
    KeyError,
    ClientError,
    ZeroDivisionError,
    AssertionError,
    MemoryError,
    Abandon,
    SystemExit,
    KeyboardInterrupt,
]


class RaisingEngine(SimEngine):
    """SimEngine whose store raises `exc` for the keys `raising` selects (the n-th distinct key written)."""

    def __init__(self, exc: type[BaseException], raising: frozenset[int], **kw: Any) -> None:
        self.exc, self.raising, self.seen_keys = exc, raising, {}
        super().__init__(**kw)

    def make_storage(self) -> Any:
        def raise_writes(key: str) -> BaseException | None:
            n = self.seen_keys.setdefault(key, len(self.seen_keys))
            return self.exc(f"store client failed on {key[:8]}") if n in self.raising else None

        return FaultyStorage(self.store, raise_writes=raise_writes)


@settings(max_examples=40)
@given(exc=st.sampled_from(RAISED), raising=st.frozensets(st.integers(0, 11), max_size=4), seed=st.integers(0, 3))
def test_a_store_that_raises_anything_fails_that_backup_and_nothing_else(
    exc: type[BaseException], raising: frozenset[int], seed: int
) -> None:
    e = RaisingEngine(exc, raising, page_size=2, stride=2, host_slots=16, device_slots=64, rows=3, backup_queue=2)
    reqs = [e.admit(f"r{i}", 3 + i + seed) for i in range(3)]
    try:
        for _ in range(6):
            for r in reqs:
                e.decode(r)
            e.manager.offload_batch(reqs)
            e.copies.complete_all()
            e.worker.run_all()  # the stepped worker runs the jobs on this thread: an escape would end the run
            e.manager.check_progress()
        for r in reqs:
            e.end(r)
        e.settle()
    except BaseException as escaped:  # noqa: B036  reported as this test's failure, not the session's end
        pytest.fail(f"the store's {type(escaped).__name__} escaped its backup job: {escaped!r}")
    m = e.manager.metrics
    raised, stored = set(e.storage.raised), set(e.store.pages)
    assert not raised & stored, "a page whose write raised was stored"
    assert (m.backup_failures > 0) == bool(raised), (m.backup_failures, raised)  # each raise a failed backup
    assert m.stored_pages == len(stored) > 0  # the other chunks were stored, and counted once
    e.live.clear()
    e.check_teardown()  # every host page back exactly once, nothing leaked


@pytest.mark.parametrize("exc", RAISED, ids=lambda c: c.__name__)
def test_the_backup_thread_survives_every_exception_type(exc: type[BaseException]) -> None:
    """A write that raises `exc` alone and inside a batch: its job fails with that error, the thread lives,
    and the jobs after it succeed."""
    calls: list[list[str]] = []

    def write_many(payloads: list[str]) -> list[list[bool]]:
        calls.append(list(payloads))
        if "raise" in payloads:
            raise exc("store client gave up")
        return [[True] for _ in payloads]

    worker = ThreadBackupWorker(8)
    try:
        first = [BackupJob(p, lambda p: write_many([p])[0], write_many) for p in ("a", "raise", "b")]
        worker.submit_many(first)
        backups_settled(worker, "the backup thread to run on after a write raised " + exc.__name__)
        done = worker.collect_many(3)
        assert [j.ok for j in done] == [True, False, True]
        assert isinstance(done[1].error, exc)
        later = [BackupJob(p, lambda p: write_many([p])[0], write_many) for p in ("c", "d")]
        worker.submit_many(later)
        backups_settled(worker, "the backup thread to run the backups after a failure")
        assert [j.ok for j in worker.collect_many(2)] == [True, True]
        assert worker._thread.is_alive() and threading.active_count() >= 2
    finally:
        worker.close()


def test_a_raising_batch_reaches_nothing_of_the_inner_store() -> None:
    """The fault injector raises before the inner store sees the batch: nothing of a raising batch is kept."""
    inner = MemoryStorage()
    store = FaultyStorage(inner, raise_writes=lambda k: ClientError(k) if k == "bad" else None)
    import torch

    page = torch.zeros(2, dtype=torch.uint8)
    with pytest.raises(ClientError):
        store.batch_set(["ok", "bad"], [page, page])
    assert not inner.pages and store.raised == ["bad"]
    assert store.batch_set(["ok"], [page]) == [True]
