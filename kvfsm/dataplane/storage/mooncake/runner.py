"""Bounded client calls: a few daemon worker threads run Mooncake client calls; callers wait at most a timeout.

A call still pending at its deadline is cancelled (never run); one already running is abandoned and, if it
returns later, its `on_late` hook undoes what it did (the backend removes the keys a late put wrote). While
every worker is stuck in an abandoned call, new calls fail at once (WEDGED) instead of queueing. Workers are
never joined at exit, since a client call can block indefinitely.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from .errors import TIMEOUT, WEDGED

logger = logging.getLogger(__package__)  # the backend's one logger, as before the package split

_PENDING, _RUNNING, _FINISHED, _CANCELLED, _ABANDONED = range(5)


class _Job:
    """One client call; `done` is released when it has finished (the cheapest thing to wait on)."""

    __slots__ = ("fn", "on_late", "done", "state", "result", "error")

    def __init__(self, fn: Callable[[], Any], on_late: Callable[[Any], None] | None) -> None:
        self.fn, self.on_late = fn, on_late
        self.done = threading.Lock()
        self.done.acquire()
        self.state = _PENDING
        self.result: Any = None
        self.error: BaseException | None = None


class _Runner:
    """A few daemon threads running client calls; callers wait at most a timeout (never joined at exit)."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers = workers
        self._q: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.stuck = 0  # abandoned calls still running
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            with self._lock:
                if job.state == _CANCELLED:  # its caller gave up before it started: never run it
                    continue
                job.state = _RUNNING
            try:
                job.result = job.fn()
            except BaseException as e:  # reported to the caller, never kills the worker
                job.error = e
            with self._lock:
                late = job.state == _ABANDONED
                job.state = _FINISHED
                if late:
                    self.stuck -= 1
            job.done.release()
            if late and job.on_late is not None and job.error is None:
                try:
                    job.on_late(job.result)
                except Exception:  # cleanup of an abandoned call is best effort
                    logger.exception("cleanup after a late Mooncake call failed")
            job.fn = job.on_late = None  # type: ignore[assignment]  # drop buffer references now

    def submit(self, fn: Callable[[], Any], on_late: Callable[[Any], None] | None = None) -> _Job | None:
        """Queue a call; None when every worker is stuck in an abandoned call (then nothing is queued)."""
        if self.stuck >= self.workers:
            return None
        job = _Job(fn, on_late)
        self._q.put(job)
        return job

    def call(
        self, fn: Callable[[], Any], timeout: float, on_late: Callable[[Any], None] | None = None
    ) -> tuple[str, Any]:
        return self.wait(self.submit(fn, on_late), timeout)

    def wait(self, job: _Job | None, timeout: float) -> tuple[str, Any]:
        """("ok", result) | ("error", exc) | (TIMEOUT, None) | (WEDGED, None)."""
        if job is None:
            return WEDGED, None
        if not job.done.acquire(timeout=max(0.0, timeout)):
            with self._lock:
                if job.state == _PENDING:
                    job.state = _CANCELLED
                    return TIMEOUT, None
                if job.state == _RUNNING:  # it may still complete: on_late undoes what it did
                    job.state = _ABANDONED
                    self.stuck += 1
                    return TIMEOUT, None
            # finished just as the wait timed out: its result is set
        if job.error is not None:
            return "error", job.error
        return "ok", job.result

    def close(self) -> None:
        """Workers exit once the calls queued so far are done."""
        for _ in self._threads:
            self._q.put(None)

    def join(self) -> None:
        for t in self._threads:
            t.join()
