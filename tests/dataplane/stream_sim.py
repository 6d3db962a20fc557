"""A CPU stand-in for CUDA streams and events, for the staged copy pipeline (pipeline.StreamOps).

Every operation is queued on its named stream and only runs when `run()` executes the queues in a random
interleaving that respects the events: a stream's wait on an event blocks that stream until the record the
event stands for has run (each record makes a fresh event, so a wait always refers to one record, as
cudaStreamWaitEvent does to the latest record at the time of the call). Tensors handed back by upload /
arange / index_select / empty exist at once but hold poison until their producing operation runs, so a
missing wait shows up as wrong data or an out-of-range index in some interleaving. Batched DMA runs by
memmove on the same flat arrays the driver would get.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvfsm.dataplane.copy import dma
from kvfsm.dataplane.copy.cuda_driver import memmove_batch
from kvfsm.dataplane.copy.triton_kernels import KernelConfig


class SimEvent:
    def __init__(self, stream: str) -> None:
        self.stream = stream
        self.fired = False


class SimOps:
    def __init__(self) -> None:
        self.queues: dict[str, deque[tuple[str, Any]]] = {}
        self.recorded_streams: dict[int, set[str]] = {}  # storage pointer -> streams it was recorded on
        self.batches: list[tuple[str, int]] = []  # (stream, copies) per driver call, at enqueue
        self.staging: list[torch.Tensor] = []
        self.executed: list[tuple[str, str]] = []
        self.idle = True  # what caller_idle() answers (the direct-kernel head is taken only when idle)

    def _q(self, s: str) -> deque[tuple[str, Any]]:
        return self.queues.setdefault(s, deque())

    def enqueue(self, s: str, fn: Callable[[], Any]) -> None:
        self._q(s).append(("fn", fn))

    # -- StreamOps --------------------------------------------------------------------------------
    def caller_idle(self) -> bool:
        return self.idle

    def ready(self) -> SimEvent:
        return self.record("compute")

    def record(self, s: str) -> SimEvent:
        ev = SimEvent(s)
        self._q(s).append(("record", ev))
        return ev

    def wait(self, s: str, event: SimEvent) -> None:
        self._q(s).append(("wait", event))

    def upload(self, s: str, arr: np.ndarray, keep: list[object]) -> torch.Tensor:
        src = torch.from_numpy(np.array(arr, dtype=np.int64, copy=True))
        out = torch.full_like(src, -(2**40))  # an index nobody may use: fails loudly if read too early
        self.enqueue(s, lambda: out.copy_(src))
        return out

    def empty(self, s: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Memory from a caching allocator: its previous user may still write it until stream s reaches
        this point (modelled by a poison fill queued on s), so other streams must wait for s first."""
        t = torch.empty(shape, dtype=dtype)
        t.view(torch.uint8).fill_(0xA5)
        self.enqueue(s, lambda: t.view(torch.uint8).fill_(0x5A))
        self.staging.append(t)
        return t

    def arange(self, s: str, n: int) -> torch.Tensor:
        out = torch.full((n,), -(2**40), dtype=torch.int64)
        self.enqueue(s, lambda: out.copy_(torch.arange(n)))
        return out

    def index_select(self, s: str, t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = torch.full((idx.numel(),), -(2**40), dtype=t.dtype)
        self.enqueue(s, lambda: out.copy_(t.index_select(0, idx)))
        return out

    def rows(
        self, s: str, src5: torch.Tensor, sidx: torch.Tensor, dst5: torch.Tensor, didx: torch.Tensor, cfg: KernelConfig
    ) -> None:
        self.enqueue(s, lambda: dst5.index_copy_(2, didx, src5.index_select(2, sidx)))

    def batch(self, s: str, flat: dma.FlatCopies) -> int:
        self.batches.append((s, flat.count))
        self.enqueue(s, lambda: memmove_batch(flat.dst, flat.src, flat.size))
        return 1

    def record_stream(self, t: torch.Tensor, s: str) -> None:
        self.recorded_streams.setdefault(t.untyped_storage().data_ptr(), set()).add(s)

    # -- execution ----------------------------------------------------------------------------------
    def runnable(self, s: str) -> bool:
        q = self.queues[s]
        if not q:
            return False
        kind, x = q[0]
        return kind != "wait" or x.fired

    def run(self, seed: int, done: SimEvent | None = None) -> None:
        """Execute everything queued. Odd seeds pick a random runnable stream at each step; even seeds
        give the streams a random strict priority (a low-priority stream runs only when no other can),
        which finds a missing wait on a short stream. When the record of `done` runs, every queue must
        already be empty (completion is observed after all work)."""
        rng = random.Random(seed)
        names = sorted(self.queues)
        rng.shuffle(names)
        rank = {s: i for i, s in enumerate(names)}
        while any(self.queues.values()):
            ready = sorted(s for s in self.queues if self.runnable(s))
            if not ready:
                raise AssertionError(f"deadlock: {[(s, q[0]) for s, q in self.queues.items() if q]}")
            s = rng.choice(ready) if seed % 2 else min(ready, key=lambda x: rank.get(x, -1))
            kind, x = self.queues[s].popleft()
            self.executed.append((s, kind))
            if kind == "fn":
                x()
            elif kind == "record":
                x.fired = True
                if x is done:
                    left = {k: len(q) for k, q in self.queues.items() if q}
                    assert not left, f"completion recorded while work is pending: {left}"
