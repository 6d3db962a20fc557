"""B14 with real processes: TP ranks whose copies and backups finish at different times still apply the
same frees and storage writes, in the same scheduler iterations, thanks to the MIN all-reduce.

Each rank (a process, torch.distributed over gloo on CPU) runs the same workload with the same seed over
its own SimEngine pools; only the completion timing differs: before every progress check rank r completes
a random, rank-seeded subset of its pending copies and runs a random number of its oldest backups. Every
device and host free is logged as (iteration, kind, slots) and every storage write as (keys, page digests,
results) in order; the logs are gathered to rank 0 and written per rank as JSON. With ProgressConsensus
the logs are identical; with `agree` replaced by the identity (the control) they differ, so the test can
fail.

The ranks also all-reduce known tensors with every reduction op gloo has, and the parent checks that the
in-process stand-in (tests/tp_threads.py, which test_tp_inprocess.py runs the consensus over)
reduces them the same way. Each rank's exit is checked too: exit code 0, and its process group and store
really destroyed (the file:// rendezvous store's reference count is back to 0)."""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import multiprocessing
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from timing import scaled, tree_cpu, wait_for
from tp_threads import REDUCE_OPS, reduce_inputs, reduce_stacked

from kvfsm.dataplane.storage import FaultyStorage
from kvfsm.runtime import TPMismatch
from kvfsm.runtime.tp import ProgressConsensus
from kvfsm.verify.engine import SimEngine

SEED = 20240611
STEPS = 160
TIMEOUT_S = 60.0


def _fails(key: str) -> bool:
    """About one page in twelve fails to store: chosen by key, so the same on every rank."""
    return int(key[:2], 16) < 22


class TPSimEngine(SimEngine):
    """SimEngine whose manager joins the TP group (copy engine and backup worker passed explicitly)."""

    tp_rank: int = 0
    tp_size: int = 1

    def make_storage(self) -> Any:
        return FaultyStorage(self.store, fail_writes=_fails)

    def manager_options(self) -> dict[str, Any]:
        return {"tp_group": dist.group.WORLD, "tp_rank": self.tp_rank, "tp_size": self.tp_size}


def _instrument(engine: SimEngine, log: list[list[Any]], writes: list[list[Any]], clock: list[int]) -> None:
    """Log (iteration, kind, slots) for every device and host free (the scheduler thread, in check_progress
    and release) and (keys, page digests, results) for every storage write (the backup worker, whose
    writes happen at each rank's own time, so only their order is compared)."""
    alloc_free, host_free, store_set = engine.allocator.free, engine.host_pool.free_pages, engine.storage.batch_set

    def dev_free(indices: Any) -> None:
        log.append([clock[0], "device_free", sorted(int(i) for i in torch.as_tensor(indices).reshape(-1).tolist())])
        alloc_free(indices)

    def h_free(pages: Any) -> None:
        log.append([clock[0], "host_free", engine.host_pool.slots_of(pages).tolist()])
        host_free(pages)

    def batch_set(keys: Any, pages: Any) -> list[bool]:
        digests = [hashlib.sha256(p.contiguous().numpy().tobytes()).hexdigest()[:16] for p in pages]
        ok = store_set(keys, pages)
        writes.append([list(keys), digests, [bool(x) for x in ok]])
        return ok

    engine.allocator.free = dev_free  # type: ignore[method-assign]
    engine.host_pool.free_pages = h_free  # type: ignore[method-assign]
    engine.storage.batch_set = batch_set  # type: ignore[method-assign]


def _complete_some(engine: SimEngine, rng: random.Random, p: float) -> None:
    """This rank's timing: a random subset of pending copies lands (in random order: the manager counts only the
    done prefix of its FIFO) and a random number of the oldest backups runs (one backup thread, FIFO)."""
    pending = [h for h in engine.copies.pending if rng.random() < p]
    rng.shuffle(pending)
    for h in pending:
        engine.copies.complete(h)
    while engine.worker.pending and rng.random() < p:  # a backup thread: FIFO, each rank at its own pace
        engine.worker.run(0)


def _all(flag: bool) -> bool:
    t = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _workload(engine: TPSimEngine, rank: int, clock: list[int]) -> None:
    work = random.Random(SEED)  # the same on every rank: what the scheduler does
    timing = random.Random(SEED * 31 + 7919 * (rank + 1))  # this rank's copy stream and backup thread
    m = engine.manager
    retracted: list[Any] = []
    n = 0
    for step in range(STEPS):
        clock[0] = step
        if work.random() < 0.35 and len(engine.live) < engine.rows:
            if retracted and work.random() < 0.5:
                engine.admit("", 0, req=retracted.pop(0))
            else:
                n += 1
                engine.admit(f"r{n}", work.randrange(1, 12), prefix_len=work.randrange(0, 3))
        for req in list(engine.live):
            roll = work.random()
            spec = work.choice((0, 0, 0, 1, 3))
            if roll < 0.04:
                engine.end(req, work.choice(("finish", "abort")))
                continue
            if not engine.decode(req, speculative=spec):
                engine.end(req, "finish")
                continue
            if work.random() < 0.8:
                m.offload(req)
        for req in [r for r in engine.live if work.random() < 0.03]:
            engine.end(req, "retract")
            retracted.append(req)
        _complete_some(engine, timing, 0.5)
        m.check_progress()
    clock[0] = STEPS
    for req in list(engine.live):
        engine.end(req, "finish")
    for _ in range(10_000):  # drain in lock step: every rank calls check_progress equally often
        if _all(m.idle()):
            break
        clock[0] += 1
        _complete_some(engine, timing, 0.7)
        m.check_progress()
    else:
        raise RuntimeError(
            f"rank {rank} did not drain: {len(m.fx.copy_fifo)} copies, {len(m.fx.parked)} parked, "
            f"{m.fx.worker.outstanding()} backups outstanding, live {m.live_records()}"
        )


def _one_run(rank: int, world: int, out: Path) -> None:
    clock = [0]
    log: list[list[Any]] = []
    writes: list[list[Any]] = []
    TPSimEngine.tp_rank, TPSimEngine.tp_size = rank, world
    engine = TPSimEngine(
        page_size=2, stride=4, device_slots=256, host_slots=24, rows=6, max_context=64, backup_queue=2, checked=True
    )
    assert engine.manager.consensus.world == world
    _instrument(engine, log, writes, clock)
    _workload(engine, rank, clock)
    engine.check_teardown()  # each rank is consistent on its own either way
    engine.manager.close()
    summary = {"rank": rank, "log": log, "writes": writes, "metrics": engine.manager.metrics.as_dict()}
    out.mkdir(exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(summary))
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(summary, gathered, dst=0)
    if rank == 0:
        (out / "gathered.json").write_text(json.dumps(gathered))
    dist.barrier()


def _mismatch_run(rank: int, out: Path) -> None:
    """Ranks whose host pools differ in size: progress must be refused on every rank, changing nothing."""
    engine = TPSimEngine(page_size=2, stride=4, device_slots=64, host_slots=8 + 2 * rank, rows=2, max_context=32)
    before = engine.host_pool.free_slots
    try:
        engine.manager.check_progress()
        outcome = "accepted"
    except TPMismatch as exc:
        outcome = f"TPMismatch: {exc}"
    out.mkdir(exist_ok=True)
    (out / f"rank{rank}.json").write_text(
        json.dumps({"outcome": outcome, "unchanged": engine.host_pool.free_slots == before})
    )
    engine.manager.close()
    dist.barrier()


def _reduce_ops_run(rank: int, out: Path) -> None:
    """all_reduce of known rank-specific tensors with every op gloo has (int64; float32 where it applies)."""
    results: dict[str, list[Any]] = {}
    for op in REDUCE_OPS:
        for dtype, t in reduce_inputs(rank).items():
            if t.is_floating_point() and op in ("BAND", "BOR", "BXOR"):
                continue
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            results[f"{op}/{dtype}"] = t.tolist()
    t = reduce_inputs(rank)["int64"]
    dist.all_reduce(t)  # no op: the default
    results["default/int64"] = t.tolist()
    out.mkdir(exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(results))


def _worker(rank: int, world: int, init: str, out_dir: str, timeout_s: float) -> None:
    """One rank: the workload with ProgressConsensus, again with `agree` as the identity (control), ranks of
    different sizes, the reduction ops; then a clean exit."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    try:
        _one_run(rank, world, Path(out_dir, "consensus"))
        with pytest.MonkeyPatch.context() as mpatch:
            mpatch.setattr(ProgressConsensus, "agree", lambda self, *counts: counts)
            _one_run(rank, world, Path(out_dir, "control"))
        _mismatch_run(rank, Path(out_dir, "mismatch"))
        _reduce_ops_run(rank, Path(out_dir, "reduce"))
    finally:
        # The runs' engines are garbage by now, but a manager lives in reference cycles, and its
        # ProgressConsensus holds the process group: without a collection here the group (and its store)
        # outlive destroy_process_group, and a rank leaves through os._exit with them never destroyed.
        gc.collect()
        dist.destroy_process_group()


def _read(out: Path, world: int) -> list[dict[str, Any]]:
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    gathered = json.loads((out / "gathered.json").read_text())
    assert [g["rank"] for g in gathered] == list(range(world))
    assert gathered == per_rank
    return per_rank


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def tp_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[dict[str, Any]]]:
    """Spawn `world` gloo ranks once; each does the consensus run and the control run."""
    world = request.param
    tmp = tmp_path_factory.mktemp(f"tp{world}")
    # forkserver: torch is imported once by the server, not once per rank (spawn), and nothing is forked
    # from this multi-threaded pytest process.
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "kvfsm.verify.engine"])
    # gloo's own timeout (a collective whose peer never comes) in this machine's seconds now
    ctx = mp.start_processes(
        _worker,
        args=(world, f"file://{tmp / 'store'}", str(tmp), scaled(TIMEOUT_S)),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    try:  # a hang guard on the ranks' progress (their CPU time), not a fixed deadline
        wait_for(
            lambda: ctx.join(timeout=0.2),
            f"{world} gloo ranks to finish",
            3 * TIMEOUT_S,
            poll_s=0,
            progress=lambda: tree_cpu(*(p.pid for p in ctx.processes if p.pid is not None)),
        )
    finally:
        for p in ctx.processes:  # only the processes this fixture started
            if p.is_alive():
                p.kill()
                p.join()
    runs: dict[str, Any] = {mode: _read(tmp / mode, world) for mode in ("consensus", "control")}
    runs["mismatch"] = [json.loads((tmp / "mismatch" / f"rank{r}.json").read_text()) for r in range(world)]
    runs["reduce"] = [json.loads((tmp / "reduce" / f"rank{r}.json").read_text()) for r in range(world)]
    runs["exit"] = {"codes": [p.exitcode for p in ctx.processes], "store": _store_counters(tmp / "store")}
    return runs


def _store_counters(path: Path) -> dict[str, int] | None:
    """The FileStore's own bookkeeping, None once the file is gone: each store instance adds 1 to `refcount/`
    when built and -1 when destroyed (and 1 to `cleanup/`); the one that brings `refcount/` to 0 removes the
    file, best effort. A record is a little-endian uint32 length and the bytes, key then value; an add
    appends its new total as decimal text, so the last record of a key is its value."""
    if not path.exists():
        return None
    data, at, last = path.read_bytes(), 0, {}
    while at < len(data):
        fields = []
        for _ in range(2):
            n = int.from_bytes(data[at : at + 4], "little")
            fields.append(data[at + 4 : at + 4 + n])
            at += 4 + n
        key, value = fields
        if key in (b"refcount/", b"cleanup/"):
            last[key.decode().rstrip("/")] = int(value)
    return last


def _first_difference(a: list[Any], b: list[Any]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"entry {i}: {x} != {y}"
    return f"lengths {len(a)} != {len(b)}"


def test_ranks_apply_identical_frees_and_writes(tp_runs: dict[str, list[dict[str, Any]]]) -> None:
    ranks = tp_runs["consensus"]
    log0 = ranks[0]["log"]
    kinds = {e[1] for e in log0}
    assert kinds == {"device_free", "host_free"}, kinds
    assert len(log0) > 100 and len(ranks[0]["writes"]) > 20
    m0 = ranks[0]["metrics"]
    # the workload reaches back-pressure, host-full retries and failed backups
    assert m0["parked_chunks"] > 0 and m0["host_full_retries"] > 0 and m0["backup_failures"] > 0, m0
    for r in ranks[1:]:
        assert r["log"] == log0, f"rank {r['rank']} diverged from rank 0 at {_first_difference(r['log'], log0)}"
        assert r["writes"] == ranks[0]["writes"], f"rank {r['rank']} wrote differently: " + _first_difference(
            r["writes"], ranks[0]["writes"]
        )
        assert r["metrics"] == m0


def test_control_without_consensus_diverges(tp_runs: dict[str, list[dict[str, Any]]]) -> None:
    logs = [r["log"] for r in tp_runs["control"]]
    assert any(log != logs[0] for log in logs[1:]), "ranks agreed without consensus: the test could not fail"


def test_disagreeing_sizes_refuse_progress_on_every_rank(tp_runs: dict[str, list[dict[str, Any]]]) -> None:
    for r in tp_runs["mismatch"]:
        assert r["outcome"].startswith("TPMismatch"), r
        assert r["unchanged"]


def test_ranks_exit_cleanly(tp_runs: dict[str, Any]) -> None:
    """Every rank exits 0 with its process group destroyed: every rendezvous store instance was destroyed
    (FileStore's reference count is back to 0; the last instance to go removes the file, best effort)."""
    assert all(code == 0 for code in tp_runs["exit"]["codes"]), tp_runs["exit"]
    store = tp_runs["exit"]["store"]
    assert store is None or store.get("refcount") == 0, f"a rank's process group (and store) outlived its exit: {store}"


def test_store_counters_see_a_store_that_outlives(tmp_path: Path) -> None:
    """The exit check can fail: with one of two FileStore instances still alive, its count is 1."""
    path = tmp_path / "store"
    first, second = dist.FileStore(str(path), 2), dist.FileStore(str(path), 2)
    first.set("k", "v")
    assert _store_counters(path) == {"refcount": 2}
    del first
    assert _store_counters(path) == {"refcount": 1, "cleanup": 1}
    del second
    assert _store_counters(path) is None


def test_in_process_stand_in_reduces_like_gloo(tp_runs: dict[str, Any]) -> None:
    """tests/tp_threads.py (what test_tp_inprocess.py runs the consensus over) against real gloo."""
    ranks = tp_runs["reduce"]
    world = len(ranks)
    inputs = [reduce_inputs(r) for r in range(world)]
    assert len(ranks[0]) == 4 * 2 + 3 + 1
    for name, gloo in ranks[0].items():
        op, dtype = name.split("/")
        stacked = torch.stack([x[dtype] for x in inputs])
        want = reduce_stacked(stacked, dist.ReduceOp.SUM if op == "default" else getattr(dist.ReduceOp, op))
        assert want.tolist() == gloo, (name, want.tolist(), gloo)
        assert all(r[name] == gloo for r in ranks), name
