"""kvfsm's vLLM offload manager against vLLM 0.34.0's CPUOffloadingManager, on the same scheduler call sequence.

Run in the vLLM venv (`make vllm-venv`): `.venv-vllm/bin/python bench/vllm_manager.py [--quick]`.

Each size (slots x live requests) replays one seeded workload through both managers, unchecked, and kvfsm's
checked mode apart. A step follows the OffloadingConnector's scheduler: the workers' reports of the last step
(complete_store, one in ten failed, and complete_load), then per live request a prefix scan of lookup (stopping
at the first MISS, waiting on HIT_PENDING), a prepare_load of a new request's hits, a prepare_store of the
request's next chunk, the finishes (a finished request is replaced by a new one that shares a prompt prefix
with others, so lookups hit), and on_schedule_end. The timed figure is the manager calls' time for the whole
replay; the workload's own bookkeeping is the same for both and is timed apart, then subtracted. Runs alternate
between the managers (per repeat the workload alone, then each manager) and the median of the repeats is kept.
`targets`: kvfsm's time over vLLM's, at most 1.0 (required) and at most 1/1.5 (the goal), per size.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from common import target, write_result  # noqa: E402

from kvfsm.integrations.vllm import KvfsmOffloadingManager  # noqa: E402

MISS, HIT_PENDING = LookupResult.MISS, LookupResult.HIT_PENDING
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def workload(live: int, steps: int, seed: int) -> list[list[tuple[Any, ...]]]:
    """The requests of each step as (rid, keys, next, finishing): a request's key chain, the index of its next
    chunk to store, and whether it finishes this step. Prompts share one of 64 prefixes of 8 chunks."""
    rng = random.Random(seed)
    prefixes = [[make_offload_key(bytes([p % 256, p // 256, c, 0]) * 8, 0) for c in range(8)] for p in range(64)]
    serial = 0

    def new_request() -> list[Any]:
        nonlocal serial
        serial += 1
        own = [make_offload_key(serial.to_bytes(8, "big") + bytes([c]) * 24, 0) for c in range(24)]
        return [serial, prefixes[rng.randrange(64)] + own, 0]

    reqs = [new_request() for _ in range(live)]
    plan = []
    for _ in range(steps):
        step = []
        for i, r in enumerate(reqs):
            finishing = r[2] >= len(r[1]) - 1 or rng.random() < 0.02
            step.append((r[0], r[1], r[2], finishing))
            r[2] += 1
            if finishing:
                reqs[i] = new_request()
        plan.append(step)
    return plan


REPLAYED = (
    "complete_store",
    "complete_load",
    "on_new_request",
    "lookup",
    "prepare_load",
    "prepare_store",
    "on_request_finished",
    "on_schedule_end",
)


class Recorder:
    """A manager passed through: every call of the replay goes to `inner`, and `calls` keeps (method, arguments,
    answer) in call order, a request context by its id and a key list as a tuple."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[str, tuple[Any, ...], Any]] = []
        for name in REPLAYED:
            setattr(self, name, self._forward(name))

    def _forward(self, name: str) -> Callable[..., Any]:
        method = getattr(self.inner, name)

        def call(*args: Any) -> Any:
            answer = method(*args)
            shown = tuple(
                a.req_id if isinstance(a, ReqContext) else tuple(a) if isinstance(a, list) else a for a in args
            )
            self.calls.append((name, shown, answer))
            return answer

        return call


_NONE_LEFT = object()


class ReplayFloorManager:
    """No bookkeeping at all: each call returns the next of `answers`, the answers vLLM's manager gave on the
    same call sequence, whatever its arguments."""

    def __init__(self, answers: list[Any]) -> None:
        self._answers = iter(answers)
        self._next = self._answers.__next__

    def lookup(self, key: Any, req_context: Any) -> Any:
        return self._next()

    def prepare_load(self, keys: Any, req_context: Any) -> Any:
        return self._next()

    def complete_load(self, keys: Any, req_context: Any) -> Any:
        return self._next()

    def prepare_store(self, keys: Any, req_context: Any) -> Any:
        return self._next()

    def complete_store(self, keys: Any, req_context: Any, success: bool = True) -> Any:
        return self._next()

    def on_new_request(self, req_context: Any) -> Any:
        return self._next()

    def on_request_finished(self, req_context: Any) -> Any:
        return self._next()

    def on_schedule_end(self, ctx: Any) -> Any:
        return self._next()

    def exhausted(self) -> bool:
        """Whether every answer has been returned."""
        return next(self._answers, _NONE_LEFT) is _NONE_LEFT


def record_floor(num_chunks: int, plan: list[list[tuple[Any, ...]]]) -> list[Any]:
    """vLLM's answers on `plan`, in call order, once the floor is checked to replay them faithfully: through the
    same recorder, a replay of the floor makes the same calls with the same arguments, gets back the same
    objects and leaves no answer unused."""
    vllm = Recorder(CPUOffloadingManager(num_chunks))
    replay(lambda: vllm, plan)
    answers = [answer for _, _, answer in vllm.calls]
    floor = Recorder(ReplayFloorManager(answers))
    replay(lambda: floor, plan)
    assert len(floor.calls) == len(vllm.calls), (len(floor.calls), len(vllm.calls))
    for i, ((name, args, answer), (fname, fargs, fanswer)) in enumerate(zip(vllm.calls, floor.calls)):
        assert (fname, fargs) == (name, args), f"call {i}: the floor got {fname}{fargs}, vLLM's manager {name}{args}"
        assert fanswer is answer, f"call {i} ({name}): the floor answered {fanswer!r}, vLLM's manager {answer!r}"
    assert floor.inner.exhausted(), "the floor's replay left recorded answers unused"
    return answers


def replay(
    make: Callable[[], Any],
    plan: list[list[tuple[Any, ...]]],
    calls: bool = True,
    after: Callable[[Any], None] | None = None,
) -> float:
    """Seconds the replay spends, the manager's calls included only with `calls` (the workload's own cost);
    `after` sees the manager once the clock has stopped."""
    m = make()
    contexts: dict[int, ReqContext] = {}
    stores: list[tuple[list[Any], ReqContext]] = []
    loads: list[tuple[list[Any], ReqContext]] = []
    failed = 0
    gc.collect()
    start = time.perf_counter()
    for step in plan:
        done_stores, stores = stores, []
        done_loads, loads = loads, []
        for keys, ctx in done_stores:
            failed += 1
            if calls:
                m.complete_store(keys, ctx, failed % 10 != 0)
        for keys, ctx in done_loads:
            if calls:
                m.complete_load(keys, ctx)
        finished = []
        for rid, keys, nxt, finishing in step:
            ctx = contexts.get(rid)
            if ctx is None:
                ctx = contexts[rid] = ReqContext(req_id=str(rid))
                for pos, k in enumerate(keys):
                    ctx.set_offload_key_position(k, (pos + 1) * 16)
                if calls:
                    m.on_new_request(ctx)
                hits = []
                for k in keys:
                    res = m.lookup(k, ctx) if calls else MISS
                    if res is MISS or res is HIT_PENDING:
                        break
                    hits.append(k)
                if hits and not (hits and res is HIT_PENDING):
                    if calls:
                        m.prepare_load(hits, ctx)
                    loads.append((hits, ctx))
            key = [keys[nxt]]
            out = m.prepare_store(key, ctx) if calls else None
            if out is not None and out.keys_to_store:
                stores.append((out.keys_to_store, ctx))
            if finishing:
                finished.append((rid, ctx))
        for rid, ctx in finished:
            if calls:
                m.on_request_finished(ctx)
            del contexts[rid]
        if calls:
            m.on_schedule_end(END)
    seconds = time.perf_counter() - start
    if after is not None:
        after(m)
    return seconds


def all_answered(m: ReplayFloorManager) -> None:
    assert m.exhausted(), "a timed floor replay left recorded answers unused"


def measure(num_chunks: int, live: int, steps: int, repeats: int) -> dict[str, Any]:
    plan = workload(live, steps, seed=num_chunks * 7 + live)
    answers = record_floor(num_chunks, plan)
    makers = {
        "floor": lambda: ReplayFloorManager(answers),
        "vllm": lambda: CPUOffloadingManager(num_chunks),
        "kvfsm": lambda: KvfsmOffloadingManager(num_chunks),
        "kvfsm_checked": lambda: KvfsmOffloadingManager(num_chunks, checked=True),
    }
    raw: dict[str, list[float]] = {name: [] for name in makers}
    workload_runs = []
    for _ in range(repeats):
        workload_runs.append(replay(makers["vllm"], plan, calls=False))
        for name, make in makers.items():
            raw[name].append(replay(make, plan, after=all_answered if name == "floor" else None))
    base = statistics.median(workload_runs)
    med = {name: statistics.median(t) - base for name, t in raw.items()}
    calls = steps * live
    return {
        "num_chunks": num_chunks,
        "live_requests": live,
        "steps": steps,
        "request_steps": calls,
        "repeats": repeats,
        "workload_s": base,
        "manager_calls": len(answers),
        "floor_replays_every_answer": True,
        "seconds": med,
        "us_per_request_step": {n: 1e6 * s / calls for n, s in med.items()},
        "ratio_kvfsm_over_vllm": med["kvfsm"] / med["vllm"],
        "ratio_checked_over_vllm": med["kvfsm_checked"] / med["vllm"],
        "ratio_kvfsm_over_floor": med["kvfsm"] / med["floor"],
        "ratio_vllm_over_floor": med["vllm"] / med["floor"],
        "ratio_checked_over_floor": med["kvfsm_checked"] / med["floor"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="checks the script, not the numbers")
    parser.add_argument("--out")
    args = parser.parse_args()
    sizes = [(1_000, 256), (10_000, 256), (100_000, 256), (1_000, 4096), (10_000, 4096), (100_000, 4096)]
    steps, repeats = (4, 1) if args.quick else (40, 5)
    runs = []
    for num_chunks, live in sizes:
        run = measure(num_chunks, live, steps, repeats)
        runs.append(run)
        print(
            f"{num_chunks:>7} slots {live:>5} live: floor {run['seconds']['floor']:.3f}s vllm "
            f"{run['seconds']['vllm']:.3f}s kvfsm {run['seconds']['kvfsm']:.3f}s ratio "
            f"{run['ratio_kvfsm_over_vllm']:.3f} (checked {run['ratio_checked_over_vllm']:.3f}); over the floor "
            f"kvfsm {run['ratio_kvfsm_over_floor']:.2f} vllm {run['ratio_vllm_over_floor']:.2f}",
            flush=True,
        )
    targets = []
    for run in runs:
        label = f"{run['num_chunks']} slots, {run['live_requests']} live"
        targets.append(target(f"kvfsm/vllm time, {label} (required)", run["ratio_kvfsm_over_vllm"], 1.0))
        targets.append(
            target(f"kvfsm/vllm time, {label} (goal: 1.5x faster)", run["ratio_kvfsm_over_vllm"], round(1 / 1.5, 4))
        )
    path = write_result(
        "vllm_manager",
        {
            "runs": runs,
            "targets": targets,
            "checked_mode": "reported apart (ratio_checked_over_vllm), never a target",
            "floor": "ReplayFloorManager: vLLM's recorded answers returned in call "
            "order, no bookkeeping; per run, ratio_*_over_floor, no target",
        },
        out=args.out,
        quick=args.quick,
    )
    print(path)


if __name__ == "__main__":
    main()
