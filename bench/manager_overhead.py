"""Manager work per scheduler iteration with many live requests: the CPU regression guard.

Not the verdict on the manager's cost: it runs a CPU step engine, so it cannot see a call that waits
for the GPU, the CUDA engine's submit, or a collector walking a server's heap. The verdict is
bench/serving_loop.py on a GPU (the real manager, CudaCopyEngine, a busy compute stream). This script
keeps a cheap, GPU-free figure that a change to the hot path can be compared against.

Each iteration is a simulated decode step: the engine thread sleeps `--step-ms` (as it would while the
GPU computes; the backup thread runs then; `--step-waits spin` busy-waits instead, as a default CUDA
synchronize does), every request gains one token (not timed), and then the
manager runs, timed: one offload per request plus one progress check. Two ways to make the offload
calls are measured in the same run: a Python loop of `offload(req)` and one `offload_batch(reqs, rows,
committed)` with the engine's batch arrays. What is timed is the manager's bookkeeping: machines, index
checks, host allocation, the copy's submission and validation, backup hand-off, host frees. Moving
bytes is not; two copy models keep it out:

  step    (default) as on a GPU: a copy submitted in one iteration is performed during the next
          simulated step (outside the timed region) and its completion seen by that iteration's check;
  inline  the synchronous CPU engine copies inside submit and that time is subtracted (its memory
          traffic still evicts the manager's data from the CPU caches mid-iteration, which a GPU copy
          would not: an upper bound).

Beside each configuration, bench/iteration_floor.py's bare iteration (the same operations with no
kvfsm code, no checks and no lifecycle) is timed in the same run and regime; rows report the ratio.

The backup thread's work (page hashing, storage writes) runs inside the simulated step before the
timed region starts; how long it needed past the step's 20 ms is reported as `backup_overrun_ms_mean`
(with `step` copies that includes performing the copies on the CPU first, about 1 ms here).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import target, write_result  # noqa: E402
from iteration_floor import run as run_floor  # noqa: E402

from kvfsm.dataplane import CpuCopyEngine, HostKVPool, KVCacheConfig, ReqToTokenPool, TokenSlotAllocator  # noqa: E402
from kvfsm.dataplane.copy.base import CopyHandle, CopyPlan, plan_copy, run_plan  # noqa: E402
from kvfsm.dataplane.copy.cpu import DoneHandle  # noqa: E402
from kvfsm.dataplane.pools.device_pool import DeviceKVPool  # noqa: E402
from kvfsm.dataplane.storage import MemoryStorage  # noqa: E402
from kvfsm.runtime import DecodeOffloadManager, OffloadConfig, SimplePrefixCache, ThreadBackupWorker  # noqa: E402
from kvfsm.verify.engine import SimRequest  # noqa: E402


class TimedCopyEngine(CpuCopyEngine):
    """`inline`: the CPU engine; only the byte moving (run_plan) is accumulated, validation counts as ours."""

    moving = 0.0

    def submit_d2h(self, device_pool, device_indices, host_pool, host_indices):  # type: ignore[no-untyped-def]
        plan = plan_copy("d2h", device_pool, device_indices, host_pool, host_indices)
        t0 = time.perf_counter()
        run_plan(plan)
        TimedCopyEngine.moving += time.perf_counter() - t0
        return DoneHandle(plan)


class _StepHandle(CopyHandle):
    def __init__(self, plan: CopyPlan) -> None:
        self.direction, self.num_tokens, self.nbytes = plan.direction, plan.num_tokens, plan.nbytes
        self.plan: CopyPlan | None = plan

    def done(self) -> bool:
        return self.plan is None

    def wait(self) -> None:
        if self.plan is not None:
            run_plan(self.plan)
            self.plan = None


class StepCopyEngine(CpuCopyEngine):
    """`step`: submit validates and queues (as the CUDA engine enqueues); the copies are performed by
    `run_pending()` during the simulated decode step, the way a GPU performs them during the next step."""

    moving = 0.0  # nothing is moved inside the timed region

    def __init__(self) -> None:
        self.pending: list[_StepHandle] = []

    def submit_d2h(self, device_pool, device_indices, host_pool, host_indices):  # type: ignore[no-untyped-def]
        handle = _StepHandle(plan_copy("d2h", device_pool, device_indices, host_pool, host_indices))
        self.pending.append(handle)
        return handle

    def run_pending(self) -> None:
        for handle in self.pending:
            handle.wait()
        self.pending.clear()


def run(
    live: int,
    iterations: int,
    page: int,
    stride: int,
    context: int,
    mode: str,
    step_s: float,
    copy_model: str = "step",
    step_wait: str = "sleep",
) -> dict:
    kv = KVCacheConfig(num_layers=1, kv_heads=1, head_dim=8, attention="mha", dtype=torch.float16)
    slots = (live + 1) * context
    device_pool = DeviceKVPool.create(kv, slots)
    allocator = TokenSlotAllocator(slots, page)
    table = ReqToTokenPool(live, context)
    host = HostKVPool(kv, slots, page)
    config = OffloadConfig(page_size=page, offload_stride=stride, storage_backend="none", backup_queue_size=4 * live)
    worker = ThreadBackupWorker(4 * live)
    engine = StepCopyEngine() if copy_model == "step" else TimedCopyEngine()
    manager = DecodeOffloadManager(
        config,
        device_pool=device_pool,
        allocator=allocator,
        req_to_token=table,
        prefix_cache=SimplePrefixCache(),
        host_pool=host,
        copy_engine=engine,
        storage=MemoryStorage(),
        backup_worker=worker,
    )
    # Requests at every phase of the stride, so each iteration has live/stride chunks due (steady state):
    # a 128-token prompt (whole pages) and 1..stride tokens already decoded.
    reqs = []
    for i in range(live):
        r = SimRequest(f"r{i}", list(range(1000 + i, 1128 + i)))
        r.req_pool_idx = table.alloc()
        table.write(r.req_pool_idx, 0, allocator.alloc(context))
        r.output_ids = list(range(1 + i % stride))
        r.kv_committed_len = r.kv_allocated_len = len(r.origin_input_ids) + len(r.output_ids) - 1
        reqs.append(r)
    # The engine's batch arrays (SGLang keeps CPU copies of req_pool_indices and seq_lens).
    rows = np.array([r.req_pool_idx for r in reqs], dtype=np.int64)
    committed = np.array([r.kv_committed_len for r in reqs], dtype=np.int64)
    per_iter, chunks, backup_overrun = [], [], []
    gc.collect()
    gc.disable()  # a collection pause is the interpreter's, not the manager's; counted separately below
    try:
        for it in range(iterations):
            t_step = time.perf_counter()
            if isinstance(engine, StepCopyEngine):
                engine.run_pending()  # the copies submitted last iteration land during this step
            if step_wait == "spin":  # the scheduler thread busy-waits on the GPU, as a CUDA sync spins by default
                until = time.perf_counter() + step_s
                while time.perf_counter() < until:
                    pass
            else:
                time.sleep(step_s)  # the GPU computes the step; the backup thread writes meanwhile
            # Storage writes are byte moving too: let them finish in the step rather than contend for the
            # GIL inside the timed region (how long that took past the step is reported, not hidden).
            worker.wait_idle()
            backup_overrun.append(max(0.0, time.perf_counter() - t_step - step_s))
            for r in reqs:  # the step's result: one more committed token per request (not timed)
                r.kv_committed_len += 1
                r.kv_allocated_len = r.kv_committed_len
                r.output_ids.append(it)
            committed += 1
            TimedCopyEngine.moving = 0.0
            before = manager.metrics.chunks
            t0 = time.perf_counter()
            if mode == "batch":
                manager.offload_batch(reqs, rows, committed)
            else:
                offload = manager.offload
                for r in reqs:
                    offload(r)
            manager.check_progress()
            per_iter.append(time.perf_counter() - t0 - TimedCopyEngine.moving)
            chunks.append(manager.metrics.chunks - before)
    finally:
        gc.enable()
    t0 = time.perf_counter()
    gc.collect()
    gc_s = time.perf_counter() - t0
    manager.drain()
    manager.close()
    host.check_conservation()
    admit = per_iter[0]  # the first call admits every request (a once-per-request cost, reported apart)
    per_iter, chunks = per_iter[1:], chunks[1:]
    order = sorted(per_iter)
    median = order[len(order) // 2]
    mean = sum(per_iter) / len(per_iter)
    return {
        "mode": mode,
        "copy_model": copy_model,
        "step_wait": step_wait,
        "live_requests": live,
        "iterations": iterations,
        "page_size": page,
        "stride": stride,
        "chunks_per_iteration_mean": sum(chunks) / len(chunks),
        "step_ms": step_s * 1e3,
        "manager_us_per_iteration_mean": mean * 1e6,
        "manager_us_per_iteration_median": median * 1e6,
        "manager_us_per_iteration_p90": order[int(len(order) * 0.9)] * 1e6,
        "manager_us_per_request": mean * 1e6 / live,
        "share_of_20ms_step": mean / 0.020,
        "admission_us_per_request": admit * 1e6 / live,
        "gc_ms_after_run": gc_s * 1e3,
        "backup_overrun_ms_mean": sum(backup_overrun) / len(backup_overrun) * 1e3,
        "stored_pages": manager.metrics.stored_pages,
    }


def verdict_rows(rows: list[dict], copy_model: str, step_wait: str) -> list[dict]:
    """The rows the verdict reads: the batch path at 4096 live, with the first copy model and step wait."""
    return [
        r
        for r in rows
        if r["live_requests"] == 4096
        and r["mode"] == "batch"
        and r["copy_model"] == copy_model
        and r["step_wait"] == step_wait
    ]


def targets(at_4096: list[dict]) -> list[dict]:
    """The verdict: 400 us an iteration at 4096 live, 2% of a 20 ms decode step, per page/stride."""
    return [
        target(
            f"batch us an iteration, 4096 live {r['page_size']}/{r['stride']}, {r['copy_model']} copies, "
            f"{r['step_wait']} step",
            r["manager_us_per_iteration_mean"],
            400,
        )
        for r in at_4096
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--live", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--iterations", type=int, default=65, help="timed iterations after the admitting one")
    ap.add_argument(
        "--configs",
        nargs="+",
        default=["64/64", "16/64", "16/16"],
        help="page/stride pairs (stride = page is the seed's default)",
    )
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op threads: the CPU copy engine stands in for a GPU copy, and its OpenMP "
        "workers would otherwise spin on the scheduler's cores after every copy",
    )
    ap.add_argument(
        "--copy-models",
        nargs="+",
        choices=["step", "inline"],
        default=["step", "inline"],
        help="how byte moving is kept out of the timed region (see the module doc); the verdict uses the first",
    )
    ap.add_argument("--modes", nargs="+", choices=["batch", "loop"], default=["batch", "loop"])
    ap.add_argument(
        "--step-waits",
        nargs="+",
        choices=["sleep", "spin"],
        default=["sleep"],
        help="how the engine thread waits out the simulated step: sleep (off the CPU; the verdict "
        "uses the first) or spin (busy-waiting, as a default CUDA synchronize does)",
    )
    ap.add_argument(
        "--no-floor",
        action="store_true",
        help="skip bench/iteration_floor.py's bare iteration (otherwise measured in this run, per "
        "page/stride, live count and step wait, and each row reports its ratio to it)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run (checks the script, not the numbers): results under bench/results/quick/",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    rows = []
    for cfg in args.configs:
        page, stride = (int(x) for x in cfg.split("/"))
        for n in args.live:
            floors = (
                {}
                if args.no_floor
                else {
                    wait: run_floor(n, args.iterations + 2, page, stride, args.step_ms / 1e3, wait)[
                        "floor_us_per_iteration_mean"
                    ]
                    for wait in args.step_waits
                }
            )
            for copy_model in args.copy_models:
                for mode in args.modes:
                    for wait in args.step_waits:
                        row = run(
                            n,
                            args.iterations + 1,
                            page,
                            stride,
                            context=256,
                            mode=mode,
                            step_s=args.step_ms / 1e3,
                            copy_model=copy_model,
                            step_wait=wait,
                        )
                        if floors:
                            row["floor_us_per_iteration_mean"] = floors[wait]
                            row["over_floor"] = row["manager_us_per_iteration_mean"] / floors[wait]
                        print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
                        rows.append(row)
    at_4096 = verdict_rows(rows, args.copy_models[0], args.step_waits[0])
    verdict_targets = targets(at_4096)
    verdict = {f"{r['page_size']}/{r['stride']}": t["met"] for r, t in zip(at_4096, verdict_targets)}
    path = write_result(
        "manager_overhead",
        {
            "runs": rows,
            "targets": verdict_targets,
            "torch_threads": args.torch_threads,
            "verdict_copy_model": args.copy_models[0],
            "verdict_step_wait": args.step_waits[0],
            "batch_meets_target_at_4096": verdict,
        },
        args.out,
        quick=args.quick,
    )
    print(f"meets target (batch, 4096 live, {args.copy_models[0]} copies) by page/stride: {verdict}\n-> {path}")


if __name__ == "__main__":
    main()
