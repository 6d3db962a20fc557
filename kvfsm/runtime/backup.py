"""Backups run off the scheduler thread: a worker with a bounded number of outstanding jobs.

The scheduler submits only when `room()` > 0 (otherwise the spec parks the chunk) and collects results
FIFO from `completed()`, so every TP rank sees completions in submission order and can agree on a count.
A job is one chunk (what the spec counts and the explorer interleaves); the thread worker runs the jobs
it finds queued together through their `write_many`, one storage call for all their pages.
"""

from __future__ import annotations

import collections
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any


class BackupQueueFull(RuntimeError):
    """submit() without room: the manager must park the chunk instead (the spec's copy_parked)."""


class Job:
    """What a backup worker runs: `write(payload)` stores one payload and returns per-page success; jobs with
    the same `write_many` may be written in one call (ThreadBackupWorker), each ending exactly as if run alone.

    `BackupJob` is a job around any payload. The decode manager's chunk is its own job (`Chunk`): a job object
    beside each chunk would be one more object a chunk for the collector to walk and promote while the chunk
    waits for its store."""

    if not TYPE_CHECKING:  # a mixin's empty slots; the type checker takes the attributes below as declared
        __slots__ = ()
    write: Callable[[Any], Sequence[bool]]  # a shared function, not a closure per job
    # several payloads' writes in one call, per-page results per payload
    write_many: Callable[[list[Any]], list[list[bool]]] | None
    # per-page success, a tuple (a list would be one more object a job; a tuple of bools is untracked at once)
    results: tuple[bool, ...]
    error: BaseException | None

    if TYPE_CHECKING:  # what `write` is called with: a BackupJob's field, a chunk itself (no class attribute
        # here, which a dataclass would take for its field's default)
        @property
        def payload(self) -> Any: ...

    def run(self) -> None:
        try:
            self.results = tuple(self.write(self.payload))
        except BaseException as exc:  # noqa: B036  a store that raises anything is a failed backup, never a
            # success (B13), and the worker thread lives on: a client's own error type, even SystemExit from
            # a library that gives up, must not end the thread every later backup waits on
            self.error = exc
            self.results = ()

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.results) and all(self.results)


@dataclass(slots=True)
class BackupJob(Job):
    """One payload's host-to-storage write (see Job)."""

    payload: Any
    write: Callable[[Any], Sequence[bool]]
    write_many: Callable[[list[Any]], list[list[bool]]] | None = None
    results: tuple[bool, ...] = ()
    error: BaseException | None = None


def run_jobs(jobs: list[Job]) -> None:
    """Run `jobs` (in order), runs of consecutive jobs sharing a `write_many` in one call each. A batch
    that raises or answers malformed is run again job by job, so each job's outcome (a per-page failure,
    an exception) is its own, as if it had run alone."""
    i = 0
    while i < len(jobs):
        many = jobs[i].write_many
        j = i + 1
        if many is not None:
            while j < len(jobs) and jobs[j].write_many == many:
                j += 1
        group = jobs[i:j]
        if len(group) > 1:
            try:
                results = many([job.payload for job in group])  # type: ignore[misc]
            except BaseException:  # noqa: B036  whatever it was, each job is run alone below
                results = None
            if results is not None and len(results) == len(group):
                for job, res in zip(group, results):
                    job.results = tuple(res)
                i = j
                continue
        for job in group:
            job.run()
        i = j


class BackupWorker(ABC):
    """submit() queues a job; flush() hands everything queued to the worker."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"backup queue capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._outstanding = 0  # submitted and not yet collected; only the scheduler thread touches it

    def room(self) -> int:
        """Jobs that may be submitted now; identical on every TP rank that made the same calls."""
        return self.capacity - self._outstanding

    def outstanding(self) -> int:
        return self._outstanding

    def submit(self, job: Job) -> None:
        self.submit_many([job])

    def submit_many(self, jobs: list[Job]) -> None:
        """submit() each job, in order, or raise BackupQueueFull (queuing none) when they do not all fit."""
        if len(jobs) > self.room():
            raise BackupQueueFull(
                f"{len(jobs)} backups submitted with room for {self.room()} "
                f"({self._outstanding} outstanding of {self.capacity})"
            )
        self._outstanding += len(jobs)
        self._enqueue_many(jobs)

    def _enqueue_many(self, jobs: list[Job]) -> None:
        for job in jobs:
            self._enqueue(job)

    def collect(self) -> Job:
        """The oldest finished job (FIFO)."""
        job = self._pop_done()
        self._outstanding -= 1
        return job

    def collect_many(self, n: int) -> list[Job]:
        """The n oldest finished jobs (FIFO); n must not exceed completed()."""
        if n > self.completed():
            raise ValueError(f"collect_many({n}) with {self.completed()} completed")
        pop = self._pop_done
        jobs = [pop() for _ in range(n)]
        self._outstanding -= n
        return jobs

    @abstractmethod
    def completed(self) -> int:
        """How many finished jobs wait to be collected (never blocks)."""

    @abstractmethod
    def _enqueue(self, job: Job) -> None: ...

    @abstractmethod
    def _pop_done(self) -> Job: ...

    def flush(self) -> None:  # noqa: B027 - a no-op unless the worker buffers submissions
        """Make every submitted job visible to the worker (the progress check ends with this)."""

    def close(self) -> None:  # noqa: B027 - a no-op unless the worker holds a thread or a queue
        """Stop accepting work; finished jobs can still be collected."""


class ThreadBackupWorker(BackupWorker):
    """A daemon thread runs jobs in submission order; completions are collected by the scheduler."""

    def __init__(self, capacity: int, name: str = "kvfsm-backup", batch_limit: int = 1024) -> None:
        super().__init__(capacity)
        self.batch_limit = batch_limit  # jobs written in one storage call at most
        self._todo: collections.deque[Job | None] = collections.deque()
        self._done: collections.deque[Job] = collections.deque()
        self._wake = threading.Condition()
        self._queued = False  # jobs appended since the last flush
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._todo:
                    self._wake.wait()
                jobs: list[Job] = []  # everything queued: written together, completed in order
                while self._todo and (job := self._todo[0]) is not None and len(jobs) < self.batch_limit:
                    jobs.append(job)
                    self._todo.popleft()
                if not jobs:
                    self._todo.popleft()  # close()'s None, after every job before it
                    return
            run_jobs(jobs)
            self._done.extend(jobs)

    def _enqueue(self, job: Job | None) -> None:
        # No wake-up per job (a lock and a thread switch each): the manager flushes once per progress
        # check. No wake-up is lost: flush() takes the lock, so it finds this thread either running
        # (it re-reads the queue before waiting) or waiting (the notify reaches it).
        self._todo.append(job)
        self._queued = True

    def _enqueue_many(self, jobs: list[Job]) -> None:
        self._todo.extend(jobs)  # one deque call, as atomic for the worker thread as append
        self._queued = True

    def flush(self) -> None:
        if self._queued:
            self._queued = False
            with self._wake:
                self._wake.notify()

    def completed(self) -> int:
        return len(self._done)

    def _pop_done(self) -> Job:
        return self._done.popleft()

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until every submitted job has finished (tests and shutdown only)."""
        import time

        deadline = time.monotonic() + timeout
        self.flush()
        while len(self._done) < self._outstanding:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def close(self) -> None:
        self._enqueue(None)
        self.flush()
        self._thread.join(timeout=30)


class SteppedBackupWorker(BackupWorker):
    """Runs a job only when told to, in any order: for tests and the explorer to choose interleavings."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.pending: list[Job] = []
        self._done: collections.deque[Job] = collections.deque()

    def _enqueue(self, job: Job) -> None:
        self.pending.append(job)

    def run(self, i: int = 0) -> Job:
        job = self.pending.pop(i)
        job.run()
        self._done.append(job)
        return job

    def run_all(self) -> int:
        n = len(self.pending)
        while self.pending:
            self.run(0)
        return n

    def completed(self) -> int:
        return len(self._done)

    def _pop_done(self) -> Job:
        return self._done.popleft()
