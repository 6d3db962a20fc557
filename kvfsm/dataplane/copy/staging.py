"""Pinned staging for index uploads: host-to-device copies that never make the host wait.

Why: a copy from pageable host memory to the GPU waits for the stream it is ordered on (the engine's copy
stream waits for the decode step), and `tensor.pin_memory()` per upload is an allocator round trip and a
second memcpy. A copy engine uploads its slot indices on every submit, so it carves them from one pinned
int64 buffer instead, in order, like a ring. Each region stays in use until an event recorded after its
copy has passed; space is reused only once `event.query()` says so, never after a synchronize. When the
free space is still being read (the GPU is behind), a buffer twice as large takes over and the old one is
kept until its last copy has passed: the host never blocks, memory grows instead.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

import numpy as np
import torch


class Passable(Protocol):
    """What staging needs of an event: whether the work recorded before it has finished (never blocks)."""

    def query(self) -> bool: ...


class PinnedIndexStaging:
    """int64 staging regions in pinned host memory, each reused only after its copy has passed."""

    def __init__(self, capacity: int = 1 << 16, pin_memory: bool = True) -> None:
        if capacity <= 0:
            raise ValueError(f"staging capacity must be positive, got {capacity}")
        self._pin = pin_memory
        self._new_buffer(capacity)
        self._retired: list[tuple[torch.Tensor, deque[tuple[int, int, Passable]]]] = []
        self._last: tuple[int, int] | None = None  # the region handed out by the last reserve()

    @property
    def capacity(self) -> int:
        return self._buf.numel()

    def _new_buffer(self, capacity: int) -> None:
        self._buf = torch.empty(capacity, dtype=torch.int64, pin_memory=self._pin)
        self._np = self._buf.numpy()
        self._busy: deque[tuple[int, int, Passable]] = deque()  # (start, end, event), oldest first
        self._head = 0  # where the next region starts

    def _reclaim(self) -> None:
        busy = self._busy
        while busy and busy[0][2].query():
            busy.popleft()
        if not busy:
            self._head = 0
        self._retired = [(buf, q) for buf, q in self._retired if not self._drain(q)]

    @staticmethod
    def _drain(q: deque[tuple[int, int, Passable]]) -> bool:
        while q and q[0][2].query():
            q.popleft()
        return not q

    def _fits(self, n: int) -> int | None:
        """Start of a free region of n slots, or None. Busy regions lie in [oldest start, head), maybe wrapped."""
        size, head = self._buf.numel(), self._head
        if not self._busy:
            return 0 if n <= size else None
        tail = self._busy[0][0]
        if tail < head:  # busy: [tail, head)
            if head + n <= size:
                return head
            return 0 if n <= tail else None  # wrap to the front, below the oldest busy region
        return head if head + n <= tail else None  # wrapped, busy: [tail, size) and [0, head)

    def reserve(self, n: int) -> tuple[torch.Tensor, np.ndarray]:
        """A pinned int64 region of n slots (tensor and numpy view of the same memory), free to write now.
        Call `mark(event)` once the copy that reads it has been enqueued."""
        self._reclaim()
        start = self._fits(n)
        if start is None:  # still being read: a larger buffer takes over, the old one lives until it passes
            if self._busy:
                self._retired.append((self._buf, self._busy))
            self._new_buffer(max(2 * self._buf.numel(), 2 * n))
            start = 0
        end = start + n
        self._last = (start, end)
        self._head = end
        return self._buf[start:end], self._np[start:end]

    def mark(self, event: Passable) -> None:
        """The last reserved region is read by work recorded before `event`: reuse it only once that passed."""
        if self._last is None:
            raise RuntimeError("mark() without a reserve()")
        start, end = self._last
        self._last = None
        if end > start:
            self._busy.append((start, end, event))

    def upload(self, values: np.ndarray, device: torch.device, stream: Any) -> torch.Tensor:
        """`values` (int64) as a new tensor on `device`, copied on `stream` without blocking the host. The
        result belongs to `stream`: work on another stream must wait for it and record_stream it."""
        with torch.cuda.stream(stream):
            out = self.upload_here(values, device)
            event = torch.cuda.Event()
            event.record(stream)
        self.mark(event)
        return out

    def upload_here(self, values: np.ndarray, device: torch.device) -> torch.Tensor:
        """`upload` on the current stream, leaving the region reserved: the caller must `mark()` it with an
        event it records on this stream after the copy (a copy engine marks it with its completion event,
        saving an event per upload)."""
        n = int(values.size)
        pinned, view = self.reserve(n)
        np.copyto(view, values.reshape(-1), casting="same_kind")
        out = torch.empty(n, dtype=torch.int64, device=device)
        out.copy_(pinned, non_blocking=True)
        return out


__all__ = ["Passable", "PinnedIndexStaging"]
