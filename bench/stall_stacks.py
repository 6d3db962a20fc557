"""What a slow call is doing: the scheduler thread's Python stack, sampled once a call runs past a threshold.

A bench arms the sampler around each timed call (`with sampler.call():`). A daemon thread sleeps until a call is
armed, then wakes every `every_ms` from the moment the call has run `after_ms`, reading the calling thread's frames
(`sys._current_frames`) and counting the innermost `depth` frames of each sample as one stack. Calls that end before
`after_ms` are never sampled, so the counts say where the slowest calls spend their late milliseconds, line by line;
a sample taken during a collection is marked (`GcPauses`-style callbacks, `in_collection`).

What it costs the sampled thread: arming and disarming (a condition's notify, microseconds), and in a call past
`after_ms` the interpreter lock every `every_ms` to read the frames (a thread switch of a few microseconds, as the
store's writer threads take it). A call that ends before `after_ms` is not disturbed: the sampler sleeps until then.
"""

from __future__ import annotations

import collections
import gc
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional


def frame_label(path: str, line: int, name: str) -> str:
    """`module/path.py:line name`: the path from its package (after site-packages) or from the repository's top
    folder (kvfsm/, generated/, bench/)."""
    for marker in ("site-packages/", "dist-packages/"):
        if (at := path.rfind(marker)) >= 0:
            return f"{path[at + len(marker) :]}:{line} {name}"
    for top in ("/kvfsm/", "/generated/", "/bench/"):
        if (at := path.rfind(top)) >= 0:
            return f"{path[at + 1 :]}:{line} {name}"
    return f"{path}:{line} {name}"


class StallSampler:
    """Counts the stacks of the calls that run past `after_ms` (see the module doc)."""

    def __init__(self, after_ms: float, every_ms: float = 1.0, depth: int = 6) -> None:
        self.after_ms, self.every_ms, self.depth = after_ms, every_ms, depth
        self.stacks: collections.Counter[tuple[str, ...]] = collections.Counter()
        self.samples = 0
        self.in_collection = 0  # samples taken while a collection ran
        self.slow_calls = 0  # calls that ran past after_ms
        self._collecting = False
        self._armed: Optional[tuple[int, float]] = None  # (thread id, perf_counter at the call's start)
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="stall-sampler", daemon=True)
        gc.callbacks.append(self._on_gc)
        self._thread.start()

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        self._collecting = phase == "start"

    @contextmanager
    def call(self) -> Iterator[None]:
        """Arm the sampler for the calling thread's call inside the block."""
        with self._wake:
            self._armed = (threading.get_ident(), time.perf_counter())
            self._wake.notify()
        try:
            yield
        finally:
            self._armed = None

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._armed is None and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
            counted: Optional[float] = None  # the start of the armed call already counted as slow
            while (armed := self._armed) is not None:
                tid, t0 = armed
                # asleep until the call reaches the threshold: a call that ends before it is never disturbed
                late = self.after_ms - (time.perf_counter() - t0) * 1e3
                time.sleep(max(late, self.every_ms) / 1e3)
                if (time.perf_counter() - t0) * 1e3 < self.after_ms or self._armed is not armed:
                    continue
                frame = sys._current_frames().get(tid)
                if frame is None:
                    continue
                if counted != t0:
                    counted, self.slow_calls = t0, self.slow_calls + 1
                stack = []
                while frame is not None and len(stack) < self.depth:
                    code = frame.f_code
                    stack.append(frame_label(code.co_filename, frame.f_lineno, code.co_name))
                    frame = frame.f_back
                self.stacks[tuple(stack)] += 1
                self.samples += 1
                self.in_collection += self._collecting

    def __enter__(self) -> StallSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=5.0)
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def report(self, top: int = 12) -> dict[str, Any]:
        """The threshold, how many calls passed it, the samples and the most sampled stacks (innermost first)."""
        return {
            "after_ms": self.after_ms,
            "every_ms": self.every_ms,
            "slow_calls": self.slow_calls,
            "samples": self.samples,
            "in_collection": self.in_collection,
            "top": [{"count": n, "stack": list(s)} for s, n in self.stacks.most_common(top)],
        }
