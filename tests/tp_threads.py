"""An in-process stand-in for a torch.distributed process group: TP ranks as threads of one process.

`ThreadGroup.all_reduce` honours its reduction op as torch.distributed does (default SUM; MIN, MAX, SUM,
PRODUCT, and BAND/BOR/BXOR on integers; AVG and PREMUL_SUM refused, as gloo refuses them), so a test that
runs the real ProgressConsensus over it sees a wrong reduction. tests/runtime/test_tp_gloo.py checks it
against real gloo ranks on the same inputs (`reduce_inputs`).

`route_all_reduce(monkeypatch)` sends `torch.distributed.all_reduce(t, op, group=g)` to `g.all_reduce`
(a consensus whose `group` is a ThreadGroup); anything else still reaches the real function.

It lives in tests/ (on the path of every test directory, like catalog_faults.py) so that any in-process TP
test can use it: tests/runtime/test_tp_inprocess.py and the TP runs of tests/stateful/test_mutants.py do.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from timing import scaled

R = dist.ReduceOp

_BITWISE: dict[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    R.BAND: torch.bitwise_and,
    R.BOR: torch.bitwise_or,
    R.BXOR: torch.bitwise_xor,
}

# (op, how a stack of the ranks' tensors reduces along dim 0)
_REDUCERS: list[tuple[Any, Callable[[torch.Tensor], torch.Tensor]]] = [
    (R.SUM, lambda s: s.sum(dim=0, dtype=s.dtype)),
    (R.PRODUCT, lambda s: s.prod(dim=0, dtype=s.dtype)),
    (R.MIN, lambda s: s.amin(dim=0)),
    (R.MAX, lambda s: s.amax(dim=0)),
    *[(op, functools.partial(lambda f, s: functools.reduce(f, s.unbind(0)), f)) for op, f in _BITWISE.items()],
]

REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")  # the ops gloo and the stand-in share


def reduce_stacked(stacked: torch.Tensor, op: Any) -> torch.Tensor:
    """What all_reduce(op) leaves on every rank, given the ranks' tensors stacked along dim 0."""
    for known, reduce in _REDUCERS:
        if op == known or known == op:  # a RedOpType or a ReduceOp wrapping one
            if any(op == b or b == op for b in _BITWISE) and stacked.is_floating_point():
                raise ValueError(f"all_reduce: {op} needs an integer tensor, got {stacked.dtype}")
            return reduce(stacked)
    raise ValueError(f"all_reduce: unsupported reduction {op!r} (gloo supports {', '.join(REDUCE_OPS)})")


def reduce_inputs(rank: int) -> dict[str, torch.Tensor]:
    """Rank-specific tensors whose reductions differ for every op (used here and by the gloo ranks)."""
    return {
        "int64": torch.tensor(
            [rank + 1, 5 - 2 * rank, -3 * rank, 7 if rank % 2 else -7, 2**12 + rank, 0b1010 ^ rank], dtype=torch.int64
        ),
        "float32": torch.tensor([rank + 0.5, -1.25 * rank, 3.0 - rank, 2.0**-rank], dtype=torch.float32),
    }


class ThreadGroup:
    """`world` ranks, one thread each (each thread calls `bind(rank)` first); collectives meet in a barrier."""

    def __init__(self, world: int, timeout: float = 30.0) -> None:
        self.world = world
        # a hang guard: `timeout` seconds of the reference machine, in this machine's seconds now
        self.barrier = threading.Barrier(world, timeout=scaled(timeout))
        self.slots: list[torch.Tensor | None] = [None] * world
        self.rank_of: dict[int, int] = {}
        self.calls = 0

    def bind(self, rank: int) -> None:
        self.rank_of[threading.get_ident()] = rank

    def reduce(self, stacked: torch.Tensor, op: Any) -> torch.Tensor:
        return reduce_stacked(stacked, op)

    def all_reduce(self, tensor: torch.Tensor, op: Any = R.SUM, group: Any = None, async_op: bool = False) -> None:
        if async_op:
            raise NotImplementedError("the in-process group runs collectives synchronously")
        rank = self.rank_of[threading.get_ident()]
        self.slots[rank] = tensor.detach().clone()
        self.barrier.wait()
        try:
            result = self.reduce(torch.stack(self.slots), op)  # type: ignore[arg-type]
        finally:
            self.barrier.wait()  # every rank has read the slots before any rank's next call writes them
        if rank == 0:
            self.calls += 1
        tensor.copy_(result)

    def abort(self) -> None:
        """Release every rank waiting in a collective (BrokenBarrierError): a rank failed."""
        self.barrier.abort()


class OpBlindGroup(ThreadGroup):
    """MIN whatever `op` says (what tests/stateful/test_mutants.py used before it took ThreadGroup). Kept to
    show what it cannot see."""

    def reduce(self, stacked: torch.Tensor, op: Any) -> torch.Tensor:
        return stacked.amin(dim=0)


def route_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.distributed.all_reduce(t, op, group=g) -> g.all_reduce(t, op) when g is an in-process group."""
    real = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, op: Any = R.SUM, group: Any = None, async_op: bool = False) -> Any:
        if isinstance(group, ThreadGroup):
            return group.all_reduce(tensor, op=op, async_op=async_op)
        return real(tensor, op=op, group=group, async_op=async_op)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
