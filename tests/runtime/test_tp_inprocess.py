"""B14 in one process, with a stand-in all-reduce that honours its op: a wrong reduction is caught.

Two SimEngines are two TP ranks (threads); their managers run the real ProgressConsensus over a
`ThreadGroup` (tests/tp_threads.py), whose all_reduce reduces with the op it is given, as
torch.distributed does (test_tp_gloo.py checks it against gloo). The ranks make the same scheduler
decisions with rank-specific copy and backup timing; after every progress check their ordered device/host
free logs and their stored keys must agree, and no rank may raise.

With the real consensus (MIN) they agree. A consensus that reduces with MAX, or with all_reduce's default
(SUM, the op forgotten), is caught. The op-blind stand-in (MIN whatever the op, what
tests/stateful/test_mutants.py uses) lets the MAX consensus pass: that is the hole this closes.
"""

from __future__ import annotations

import functools
import random
import threading
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from timing import join_all
from tp_threads import OpBlindGroup, ThreadGroup, reduce_inputs, reduce_stacked, route_all_reduce

from kvfsm.runtime.tp import ProgressConsensus
from kvfsm.verify.engine import SimEngine

R = dist.ReduceOp
SEEDS = range(6)


def _engine(group: ThreadGroup, log: list[Any]) -> SimEngine:
    e = SimEngine(page_size=2, stride=4, device_slots=96, host_slots=16, rows=4, max_context=48, backup_queue=2)
    consensus = ProgressConsensus(None)
    consensus.group, consensus.world = group, group.world  # the real agree() over the in-process group
    e.manager.consensus = consensus
    alloc_free, host_free = e.allocator.free, e.host_pool.free_pages
    e.allocator.free = lambda idx: (
        log.append(("device_free", torch.as_tensor(idx).tolist())),  # type: ignore[method-assign]
        alloc_free(idx),
    )[1]
    e.host_pool.free_pages = lambda pages: (
        log.append(("host_free", e.host_pool.slots_of(pages).tolist())),  # type: ignore[method-assign]
        host_free(pages),
    )[1]
    return e


def run_ranks(group: ThreadGroup, seed: int, iterations: int = 80) -> Optional[str]:
    """Two ranks, the same decisions, their own timing: the first divergence or rank error, or None."""
    logs: list[list[Any]] = [[], []]
    engines = [_engine(group, logs[r]) for r in range(2)]
    timing = [random.Random(seed * 7 + r + 1) for r in range(2)]
    errors: list[BaseException] = []

    def progress(rank: int) -> None:
        group.bind(rank)
        try:
            e, rng = engines[rank], timing[rank]
            pending = [h for h in e.copies.pending if rng.random() < 0.5]
            rng.shuffle(pending)
            for h in pending:
                e.copies.complete(h)
            while e.worker.pending and rng.random() < 0.5:  # one backup thread per rank: FIFO
                e.worker.run(0)
            e.manager.check_progress()
        except BaseException as exc:  # noqa: BLE001 - reported as the finding
            errors.append(exc)
            group.abort()

    work = random.Random(seed)
    retracted: list[list[Any]] = [[], []]
    for it in range(iterations):
        plan: list[tuple[Any, ...]] = []
        if work.random() < 0.4:
            plan.append(("admit", work.randrange(1, 10), work.randrange(0, 3), work.random() < 0.5))
        for k in range(4):
            plan.append(("step", k, work.choice((0, 0, 1, 3)), work.random()))
        for rank, e in enumerate(engines):
            for act in plan:
                if act[0] == "admit":
                    if act[3] and retracted[rank]:
                        e.admit("", 0, req=retracted[rank].pop(0))
                    else:
                        e.admit(f"r{it}", act[1], act[2])
                elif act[1] < len(e.live):
                    req = e.live[act[1]]
                    if act[3] < 0.05:
                        e.end(req, "finish")
                    elif act[3] < 0.08:
                        e.end(req, "retract")
                        retracted[rank].append(req)
                    elif not e.decode(req, act[2]):
                        e.end(req, "abort")
                    else:
                        e.manager.offload(req)
        threads = [threading.Thread(target=progress, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        join_all(threads, f"iteration {it}: both ranks' progress checks", 60)
        if errors:
            first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
            return f"iteration {it}: a rank raised {type(first).__name__}: {first}"
        if logs[0] != logs[1]:
            i = next((i for i, (a, b) in enumerate(zip(*logs)) if a != b), min(map(len, logs)))
            return f"iteration {it}: free #{i} differs: {logs[0][i : i + 1]} vs {logs[1][i : i + 1]}"
        stored = [sorted(e.manager.fx.stored) for e in engines]
        if stored[0] != stored[1]:
            return f"iteration {it}: stored keys differ ({len(stored[0])} vs {len(stored[1])})"
    return None


def _agree_with(op: Any) -> Any:
    """ProgressConsensus.agree, reducing with `op` (None: all_reduce's default) instead of MIN."""

    def agree(self: ProgressConsensus, *counts: int) -> tuple[int, ...]:
        if self.world <= 1:
            return counts
        t = torch.tensor(counts, dtype=torch.int64, device=self.device)
        if op is None:
            dist.all_reduce(t, group=self.group)
        else:
            dist.all_reduce(t, op=op, group=self.group)
        return tuple(int(x) for x in t.tolist())

    return agree


WRONG = {"max": R.MAX, "sum": R.SUM, "default_op": None}


# ---- the stand-in itself --------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_thread_group_reduces_with_the_op_given(world: int) -> None:
    inputs = [reduce_inputs(r) for r in range(world)]
    group = ThreadGroup(world)
    for op_name in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", None):
        for dtype in ("int64", "float32"):
            if dtype == "float32" and op_name in ("BAND", "BOR", "BXOR"):
                continue
            op = R.SUM if op_name is None else getattr(R, op_name)
            stacked = torch.stack([x[dtype] for x in inputs])
            want = {
                "SUM": stacked.sum(0),
                "PRODUCT": stacked.prod(0),
                "MIN": stacked.min(0).values,
                "MAX": stacked.max(0).values,
                None: stacked.sum(0),
            }.get(op_name)
            if want is None:
                f = {"BAND": int.__and__, "BOR": int.__or__, "BXOR": int.__xor__}[op_name]  # type: ignore[index]
                cols = stacked.T.tolist()
                want = torch.tensor([functools.reduce(f, c) for c in cols], dtype=stacked.dtype)
            got = [x[dtype].clone() for x in inputs]

            def rank(r: int, got: list[torch.Tensor] = got, op: Any = op, op_name: Any = op_name) -> None:
                group.bind(r)
                if op_name is None:
                    group.all_reduce(got[r])  # torch.distributed's default op: SUM
                else:
                    group.all_reduce(got[r], op=op)

            threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
            for t in threads:
                t.start()
            join_all(threads, f"all_reduce({op_name}, {dtype}) on {world} rank threads", 10)
            for r in range(world):
                assert torch.equal(got[r], want.to(stacked.dtype)), (op_name, dtype, r, got[r], want)
    with pytest.raises(ValueError):
        reduce_stacked(torch.stack([x["int64"] for x in inputs]), R.AVG)
    with pytest.raises(ValueError):
        reduce_stacked(torch.stack([x["float32"] for x in inputs]), R.BXOR)
    assert torch.equal(reduce_stacked(torch.tensor([[1, 5], [3, 2]]), R(R.MIN)), torch.tensor([1, 2]))  # a ReduceOp too


def test_consensus_is_the_min_over_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    route_all_reduce(monkeypatch)
    group = ThreadGroup(2)
    out: list[Any] = [None, None]

    def rank(r: int) -> None:
        group.bind(r)
        c = ProgressConsensus(None)
        c.group, c.world = group, 2
        out[r] = (c.agree(*[(3, 7, 0), (5, 2, 0)][r]), c.check_same(4, 8), c.check_same(4, 8 + r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    join_all(threads, "two ranks' consensus", 10)
    assert out == [((3, 2, 0), True, False)] * 2


# ---- B14 over it --------------------------------------------------------------------------------------


def test_ranks_agree_with_the_real_consensus(monkeypatch: pytest.MonkeyPatch) -> None:
    route_all_reduce(monkeypatch)
    for seed in SEEDS:
        group = ThreadGroup(2)
        assert run_ranks(group, seed) is None, f"seed {seed}: ranks diverged with the real MIN consensus"
        assert group.calls >= 80  # every progress check went through the group


@pytest.mark.parametrize("wrong", list(WRONG))
def test_a_wrong_reduction_is_caught(wrong: str, monkeypatch: pytest.MonkeyPatch) -> None:
    route_all_reduce(monkeypatch)
    monkeypatch.setattr(ProgressConsensus, "agree", _agree_with(WRONG[wrong]))
    found = None
    for seed in SEEDS:
        found = run_ranks(ThreadGroup(2), seed)
        if found:
            break
    assert found, f"a consensus reducing with {wrong} went unnoticed"


def test_the_op_blind_stand_in_misses_a_max_consensus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the stand-in must honour op: reducing with MIN whatever it is asked, it makes MAX look right."""
    route_all_reduce(monkeypatch)
    monkeypatch.setattr(ProgressConsensus, "agree", _agree_with(R.MAX))
    for seed in SEEDS[:3]:
        assert run_ranks(OpBlindGroup(2), seed) is None
