"""Where the SGLang adapter's extra scheduler-thread time goes, against kvfsm's own batch path, in one run.

bench/sglang_adapter_gpu.py's loop, once per mode (`adapter`, `batch`), with the phases that both doors share
timed per iteration: reserving chunks (the adapter's per-request `_reserve`, or `reserve_due` and `_accept` for a
request whose chunk fell due; inside the batch path's `offload_batch`), submitting them (`submit_reserved` / `_submit`), finishing requests, `_enter` (the adapter's
first sight of a Req) and the progress check, each with its calls an iteration. The adapter's "door" is what its
offload loop spends outside those phases: the early exits of requests with no chunk due. Two more modes run the
floor with SGLang's per-request loop in front of it, as limit probes measured in the iteration itself: around a
callee that does nothing (`bare_door`) and around one that reads only what its answer depends on (`bare_read_door`).

The no-chunk-due call is then timed twice: right after the loop, as the bench does, and again after the
manager drained its copies and backups. A gap between the two is the backup worker's share of the GIL, not
the call's own cost.

    python3 bench/probes/door_phases.py [--device cuda] [--live 4096] [--pages 64 16] [--order sglang]
        [--modes adapter batch bare_door bare_read_door] [--detail] [--out FILE]
Writes bench/results/door_phases-<gpu>.json on a GPU, bench/results/quick/door_phases-quick-cpu.json on a CPU
(or --out).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

import sglang_adapter_gpu as bench  # noqa: E402
from common import target, write_result  # noqa: E402

CALLS = "calls:"  # the per-iteration counter's key prefix, beside each phase's milliseconds

# (object attribute holding it, method) per mode: the phases timed inside the iteration's manager calls
PHASES = {
    # reserve_due and _accept: a due call's reservation past the early exit, so that the door is the quiet calls
    "adapter": [
        ("adapter", "_reserve"),
        ("manager", "reserve_due"),
        ("adapter", "_accept"),
        ("adapter", "_enter"),
        ("adapter", "finalize_release_on_finish"),
        ("adapter", "_flush"),
        ("manager", "submit_reserved"),
        ("manager", "_submit"),  # inside submit_reserved: what is left of it is the reservations' own loop
        ("manager", "check_progress"),
    ],
    "batch": [
        ("manager", "offload_batch"),
        ("manager", "_submit"),
        ("manager", "finalize_batch"),
        ("manager", "check_progress"),
    ],
}
# `bare_door`: the floor (`bare`) with SGLang's per-request loop in front of it, calling a method that does nothing
# (bench._NoOp), timed as its own phase: what the call pattern alone costs in the iteration itself, with the engine's
# heap and caches as the adapter meets them (the bench's `sglang_call_floor_ms` times the same loop warm, 20 passes
# over, after the run)
PHASES["bare_door"] = [("bare", "offload_batch"), ("bare", "finalize"), ("bare", "check_progress")]
# `bare_read_door`: the same, with the least a drop-in must do for a request that has no chunk due in the callee
# (`CommittedExit`): find its own state for the Req and read the Req's committed KV length to compare with it. The
# no-op door bounds the call pattern; this one bounds any adapter that answers from SGLang's objects, as upstream's
# signature makes it (the answer depends on the committed length, which only the Req holds).
PHASES["bare_read_door"] = PHASES["bare_door"]
DOOR_CALLEES = {"bare_door": "noop_door", "bare_read_door": "read_door"}


class CommittedExit:
    """`offload_kv_cache(req)` cut down to an early exit that is never passed: one dict lookup for the Req's own
    state (its due point, kept by the callee as any drop-in keeps some) and one read of `req.kv.kv_committed_len`."""

    def __init__(self) -> None:
        self.due: dict[Any, int] = {}

    def offload_kv_cache(self, req: Any) -> bool:
        due = self.due.get(req)
        if due is None:
            self.due[req] = due = sys.maxsize  # never due: only the exit is timed
        return bool(req.kv.kv_committed_len >= due)

    def forget(self, ended: list[Any]) -> None:
        """Drop the state of Reqs that finished (outside the timed loop), as a drop-in does at their release: held
        on, they would grow the heap every collection walks."""
        for req in ended:
            self.due.pop(req, None)


# --detail: the steps inside those phases, for both doors (owner paths from the loop; keyed "owner.method"): where a
# submit, an admission and a release spend their time on a GPU host, whose table has no host mirror
DETAIL = [
    ("manager", "_copy_slots"),
    ("manager.fx.copy_engine", "submit_d2h"),
    ("manager.fx", "start_copy_each"),
    ("manager", "_admit"),
    ("manager", "_check_admissible"),
    ("manager.fx", "request_slots"),
    ("manager.fx.allocator", "free"),
    ("manager.fx.allocator", "free_page_ids"),
    ("manager.fx.device_table", "page_ids"),
    ("manager.fx.req_to_token", "free"),
    ("manager.fx.prefix_cache", "unlock"),
    ("manager.fx", "copies_reading"),
    ("manager.fx.worker", "submit_many"),
    ("manager.fx", "flush"),
]


def run_mode(
    mode: str,
    live: int,
    page: int,
    device: str,
    warmup: int,
    iterations: int,
    order: str = "sglang",
    detail: bool = False,
) -> dict[str, Any]:
    store = tempfile.mkdtemp(prefix=f"kvfsm-door-{mode}-", dir=bench.SHM if device == "cuda" else None)
    try:
        loop = bench.probe_loop("bare" if mode in DOOR_CALLEES else mode, live, page, device, store, order)
        timed = [False]
        per_iter: list[dict[str, float]] = []
        current: dict[str, float] = defaultdict(float)
        depth = [0]
        for owner, name in PHASES[mode]:
            _wrap(getattr(loop, owner), name, current, timed, depth)
        inner = [0]  # the detail steps nest inside the phases: their own depth, so `outermost` stays the phases'
        for owner, name in DETAIL if detail else ():
            obj = loop
            for attr in owner.split("."):
                obj = getattr(obj, attr, None)
            if obj is not None and hasattr(obj, name):  # a table with a host mirror has no device_table
                _wrap(obj, name, current, timed, inner, key=f"{owner.rsplit('.', 1)[-1]}.{name}")
        if mode == "bare_read_door":
            exit_ = CommittedExit()
            _door_in_front(loop, current, timed, exit_.offload_kv_cache, DOOR_CALLEES[mode], exit_.forget)
        elif mode in DOOR_CALLEES:
            _door_in_front(loop, current, timed, bench._NoOp().offload_kv_cache, DOOR_CALLEES[mode])
        check, offload = loop.check, loop.offload
        parts = [0]

        def part(name: str, seconds: float) -> None:  # an iteration's row closes with its second part
            if timed[0]:
                current[name] += seconds * 1e3
            parts[0] += 1
            if parts[0] % 2 == 0:
                if timed[0]:
                    per_iter.append(dict(current))
                current.clear()

        def measured_check() -> None:
            t0 = time.perf_counter()
            check()
            part("check_ms", time.perf_counter() - t0)

        def measured_offload(ended: list[Any], batch_args: Any = None) -> int:
            t0 = time.perf_counter()
            chunks = offload(ended, batch_args)
            part("offload_ms", time.perf_counter() - t0)
            return chunks

        loop.check, loop.offload = measured_check, measured_offload  # type: ignore[method-assign]
        bench.run_marked(loop, warmup, iterations, timed)
        out: dict[str, Any] = {"mode": mode, "live": live, "page": page, "iterations": len(per_iter)}
        keys = sorted({k for r in per_iter for k in r})
        out["phases_ms"] = {
            k: {
                "median": statistics.median(r.get(k, 0.0) for r in per_iter),
                "mean": statistics.fmean(r.get(k, 0.0) for r in per_iter),
            }
            for k in keys
            if not k.startswith(CALLS)
        }
        # how often each phase ran an iteration (mean): a phase that costs one door more may simply run more often
        out["calls_per_iteration"] = {
            k[len(CALLS) :]: statistics.fmean(r.get(k, 0.0) for r in per_iter) for k in keys if k.startswith(CALLS)
        }
        if mode == "adapter":
            # the calls' time outside every timed phase: the early exits (plus the loop's own overhead)
            door = [r["offload_ms"] + r["check_ms"] - r.get("outermost", 0.0) for r in per_iter]
            out["door_ms"] = {"median": statistics.median(door), "mean": statistics.fmean(door)}
            out["quiet_call_ns_after_loop"] = loop._quiet_call_ns()
            out["threads_after_loop"] = [t.name for t in threading.enumerate()]
            loop.adapter._flush()
            loop.manager.drain()
            time.sleep(0.2)
            out["quiet_call_ns_drained"] = loop._quiet_call_ns()
            out["call_floor_ns"] = loop._call_floor_ms() * 1e6 / max(1, len(loop.live))
        loop.close()
        return out
    finally:
        shutil.rmtree(store, ignore_errors=True)


def _door_in_front(
    loop: Any,
    into: dict[str, float],
    timed: list[bool],
    callee: Callable[[Any], bool],
    key: str,
    after: Optional[Callable[[list[Any]], None]] = None,
) -> None:
    """Make `loop`'s offload phase start with SGLang's loop over its live requests (the adapter mode's loop in
    bench/sglang_adapter_gpu.py, `Loop.offload`) around `callee`, timed into `into[key]`; then, untimed,
    `after(ended)` with the requests that finished."""
    offload = loop.offload

    def door_then_offload(ended: list[Any], batch_args: Any = None) -> int:
        t0 = time.perf_counter()
        chunks = 0
        for req in loop.live:
            ok = callee(req)
            chunks += ok
            if not ok and req.finished_reason is not None:
                pass
        if timed[0]:
            into[key] += (time.perf_counter() - t0) * 1e3
        if after is not None:
            after(ended)
        return chunks + offload(ended, batch_args)

    loop.offload = door_then_offload


def _wrap(
    obj: Any, name: str, into: dict[str, float], timed: list[bool], depth: list[int], key: str | None = None
) -> None:
    """Replace `obj.name` by a wrapper that adds its time to `into[key or name]` while `timed` holds, and to
    `into["outermost"]` when no other timed phase encloses it (phases nest: a finish may flush)."""
    call: Callable[..., Any] = getattr(obj, name)
    key = key or name

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not timed[0]:
            return call(*args, **kwargs)
        depth[0] += 1
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            ms = (time.perf_counter() - t0) * 1e3
            depth[0] -= 1
            into[key] += ms
            into[CALLS + key] += 1
            if depth[0] == 0 and key == name:
                into["outermost"] += ms

    setattr(obj, name, wrapper)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The adapter's target against the batch path in the same run (median of offload calls + progress check)."""
    out = []
    for a in rows:
        b = next((r for r in rows if r["mode"] == "batch" and (r["live"], r["page"]) == (a["live"], a["page"])), None)
        if a["mode"] == "adapter" and b is not None:

            def total(r: dict[str, Any]) -> float:
                return float(r["phases_ms"]["offload_ms"]["median"] + r["phases_ms"]["check_ms"]["median"])

            out.append(
                target(
                    f"adapter / batch, median calls + check, {a['live']} live {a['page']}/{a['page']}",
                    total(a) / total(b),
                    1.3,
                )
            )
            for mode, key in DOOR_CALLEES.items():
                floor = next(
                    (r for r in rows if r["mode"] == mode and (r["live"], r["page"]) == (a["live"], a["page"])), None
                )
                if floor is not None:
                    # The limit probes: a drop-in through SGLang's door does at least the batch door's work plus the
                    # loop around a callee that does nothing (no-op), or that only reads what its answer depends on
                    # (read), as measured in the iteration itself
                    door = floor["phases_ms"][key]["median"]
                    what = key.replace("_door", "")
                    out.append(
                        target(
                            f"limit probe: (batch + {what} door) / batch, median, {a['live']} live {a['page']}/{a['page']}",
                            (total(b) + door) / total(b),
                            1.3,
                        )
                    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--live", type=int, nargs="+", default=[4096])
    ap.add_argument("--pages", type=int, nargs="+", default=[64, 16])
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--device", default="cuda" if bench.torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--order", default="sglang", choices=bench.ORDERS)
    ap.add_argument("--modes", nargs="+", default=["adapter", "batch"], choices=list(PHASES))
    ap.add_argument("--detail", action="store_true", help="also time the steps inside the phases (DETAIL)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for live in args.live:
        for page in args.pages:
            for mode in args.modes:
                row = run_mode(mode, live, page, args.device, args.warmup, args.iterations, args.order, args.detail)
                rows.append(row)
                phases = ", ".join(f"{k} {v['median']:.3f}/{v['mean']:.3f}" for k, v in row["phases_ms"].items())
                extra = ""
                if mode == "adapter":
                    extra = (
                        f"; door {row['door_ms']['median']:.3f}/{row['door_ms']['mean']:.3f} ms; quiet call "
                        f"{row['quiet_call_ns_after_loop'] or 0:.0f} ns after the loop, "
                        f"{row['quiet_call_ns_drained'] or 0:.0f} ns drained; floor {row['call_floor_ns']:.0f} ns"
                    )
                print(f"{mode:8s} live={live} page={page}: (median/mean ms) {phases}{extra}", flush=True)
    print(
        "wrote",
        write_result(
            "door_phases",
            {"settings": vars(args), "rows": rows, "targets": targets(rows)},
            args.out,
            quick=args.device == "cpu",
        ),
    )  # on a CPU it checks the probe, not the numbers
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
