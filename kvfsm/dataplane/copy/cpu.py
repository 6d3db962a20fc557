"""CPU copy engines (the CUDA engine's interface, for CI and model checking).

- CpuCopyEngine: copies during submit; handles are born done.
- ThreadCpuCopyEngine: copies on one worker thread, in submission order; done() polls.
- DeferredCpuCopyEngine: copies only when the test says so (complete(handle), complete_next(),
  complete_all()), reading the source *then*. A device slot freed and rewritten before completion
  therefore really corrupts the copy, which is how tests catch B2 (free while a copy still reads).
  With `stream_ordered`, a writer's wait on a handle (`wait_stream`) is a GPU stream wait: the copy reads
  its source then, ordered before the writer's writes, but stays in flight until completed, as a copy
  whose event the host has not yet seen.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import count

from ..errors import CopyError
from .base import CopyEngine, CopyHandle, CopyPlan, plan_copy, run_plan


class DoneHandle(CopyHandle):
    """The handle of a copy that happened during submit (any synchronous engine)."""

    def __init__(self, plan: CopyPlan) -> None:
        self.direction, self.num_tokens, self.nbytes = plan.direction, plan.num_tokens, plan.nbytes

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class CpuCopyEngine(CopyEngine):
    """Synchronous: the copy has happened when submit returns."""

    fences = True  # born done: a fence of its handles has always passed

    def submit_d2h(self, device_pool, device_indices, host_pool, host_indices) -> CopyHandle:  # type: ignore[no-untyped-def]
        plan = plan_copy("d2h", device_pool, device_indices, host_pool, host_indices)
        run_plan(plan)
        return DoneHandle(plan)

    def submit_h2d(self, host_pool, host_indices, device_pool, device_indices) -> CopyHandle:  # type: ignore[no-untyped-def]
        plan = plan_copy("h2d", device_pool, device_indices, host_pool, host_indices)
        run_plan(plan)
        return DoneHandle(plan)


class _FutureHandle(CopyHandle):
    def __init__(self, plan: CopyPlan, future: Future[None]) -> None:
        self.direction, self.num_tokens, self.nbytes = plan.direction, plan.num_tokens, plan.nbytes
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.result()


class ThreadCpuCopyEngine(CopyEngine):
    """Asynchronous on one worker thread (FIFO), like a copy stream; a copy reads its source when it runs."""

    fences = True  # a writer's wait on a handle waits for its future (the host is this engine's stream)

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfsm-copy")

    def _submit(self, plan: CopyPlan) -> CopyHandle:
        plan.device_idx, plan.host_idx = plan.device_idx.clone(), plan.host_idx.clone()
        return _FutureHandle(plan, self._pool.submit(run_plan, plan))

    def submit_d2h(self, device_pool, device_indices, host_pool, host_indices) -> CopyHandle:  # type: ignore[no-untyped-def]
        return self._submit(plan_copy("d2h", device_pool, device_indices, host_pool, host_indices))

    def submit_h2d(self, host_pool, host_indices, device_pool, device_indices) -> CopyHandle:  # type: ignore[no-untyped-def]
        return self._submit(plan_copy("h2d", device_pool, device_indices, host_pool, host_indices))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> ThreadCpuCopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DeferredHandle(CopyHandle):
    """A copy that happens when its engine is told to complete it (wait() completes it too)."""

    def __init__(self, engine: DeferredCpuCopyEngine, plan: CopyPlan, seq: int) -> None:
        self.direction, self.num_tokens, self.nbytes = plan.direction, plan.num_tokens, plan.nbytes
        self.seq = seq
        self._engine = engine
        self._plan: CopyPlan | None = plan
        self.ran = False  # stream_ordered: a waiter ordered the copy's reads before its writes; not landed yet

    def done(self) -> bool:
        return self._plan is None

    def wait(self) -> None:
        self._engine.complete(self)

    def wait_stream(self, stream: object | None = None) -> None:
        self._engine.waits.append((stream, self))  # the wait as enqueued, on the stream it was made on
        if self._engine.stream_ordered:
            self._engine.order(self)
        else:
            self._engine.complete(self)

    def __repr__(self) -> str:
        return f"DeferredHandle(#{self.seq} {self.direction} {self.num_tokens} tokens, done={self.done()})"


class DeferredCpuCopyEngine(CopyEngine):
    """Copies are recorded at submit and performed at complete(): the test controls completion order.
    Its handles are the CPU twin of fences: waiting on one completes its copy first, or, `stream_ordered`,
    performs it and leaves it in flight (the GPU's case: a stream wait orders the waiter, nothing lands).
    `waits` records every stream wait actually made on a handle, as (stream, handle), the stream None for
    the caller's current one: a CPU test can tell a wait that was enqueued from a fence only marked waited."""

    fences = True

    def __init__(self, stream_ordered: bool = False) -> None:
        self.stream_ordered = stream_ordered
        self.waits: list[tuple[object | None, DeferredHandle]] = []
        self._pending: OrderedDict[int, DeferredHandle] = OrderedDict()
        self._seq = count()
        self._lock = threading.Lock()

    def _submit(self, plan: CopyPlan) -> DeferredHandle:
        plan.device_idx, plan.host_idx = plan.device_idx.clone(), plan.host_idx.clone()
        with self._lock:
            handle = DeferredHandle(self, plan, next(self._seq))
            self._pending[handle.seq] = handle
        return handle

    def submit_d2h(self, device_pool, device_indices, host_pool, host_indices) -> DeferredHandle:  # type: ignore[no-untyped-def]
        return self._submit(plan_copy("d2h", device_pool, device_indices, host_pool, host_indices))

    def submit_h2d(self, host_pool, host_indices, device_pool, device_indices) -> DeferredHandle:  # type: ignore[no-untyped-def]
        return self._submit(plan_copy("h2d", device_pool, device_indices, host_pool, host_indices))

    @property
    def pending(self) -> list[DeferredHandle]:
        """Handles not yet completed, oldest first."""
        with self._lock:
            return list(self._pending.values())

    def complete(self, handle: DeferredHandle) -> bool:
        """Perform the copy now, reading the source as it is now. False if it was already completed."""
        with self._lock:
            plan = handle._plan
            if plan is None:
                return False
            if self._pending.get(handle.seq) is not handle:
                raise CopyError(f"{handle!r} was not submitted to this engine")
            if not handle.ran:
                run_plan(plan)  # marked done only once the copy has really happened
            del self._pending[handle.seq]
            handle._plan = None
        return True

    def order(self, handle: DeferredHandle) -> None:
        """A stream wait on `handle`: perform its copy now (its reads come before the waiter's later writes)
        and leave it pending; complete() then only marks it landed."""
        with self._lock:
            if handle._plan is None or handle.ran:
                return
            if self._pending.get(handle.seq) is not handle:
                raise CopyError(f"{handle!r} was not submitted to this engine")
            run_plan(handle._plan)
            handle.ran = True

    def complete_next(self) -> DeferredHandle | None:
        """Complete the oldest pending copy; None when nothing is pending."""
        with self._lock:
            if not self._pending:
                return None
            handle = next(iter(self._pending.values()))
        self.complete(handle)
        return handle

    def complete_all(self) -> int:
        n = 0
        while self.complete_next() is not None:
            n += 1
        return n
