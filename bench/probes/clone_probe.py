"""Development probe: what it costs to branch an explorer world, and which ways of branching are faithful.

Decision it informed: the bounded explorer (kvfsm.verify.explorer) branches every state it expands. It
keeps its hand-written pickler (`cloning.clone`) rather than `copy.deepcopy(world)`, which this probe
shows cannot copy a world faithfully, and it keeps replay-from-root (re-executing the event prefix from a
fresh engine, `mode="replay"`) as the fallback, which this probe shows is the cheaper way at the default
bound; the numbers are quoted in kvfsm/verify/explorer/cloning.py. Worlds are built at the explorer's
default bound (`ExplorerConfig()`) and at a long-trace bound (six decodes, one re-admission) at several
prefix lengths, reached by seeded random walks over the enabled events, and per world each way of
branching is timed and checked:

- clone:            the explorer's `clone(world)`;
- deepcopy:         `copy.deepcopy(world)`, as is;
- deepcopy+locks:   `copy.deepcopy(world)` with locks made copyable (copyreg), to see past its first failure;
- replay:           `build(config, prefix, check=False)`, what replay mode runs for every child.

A copy is correct when its canonical key equals the original's, what must stay shared or be re-pointed is
(the allocator's mask views its own bytearray, records' weak references reach the copy's requests, the
storage fault predicate reads the copy's engine, the pools are the copy's own), it then runs the walk's next
events with every invariant holding (check_world after each) to the canonical key that replaying prefix +
those events from scratch reaches, and the original is left exactly as it was. Reported: mean milliseconds
per branch, per depth and over all worlds, the fraction of worlds branched correctly with the reasons, and
(unless --no-explore) the whole default-bound search timed in copy and in replay mode.

    python bench/probes/clone_probe.py            # bench/results/clone_probe-cpu.json (~25 s)
    python bench/probes/clone_probe.py --quick    # a smoke run: bench/results/quick/clone_probe-quick-cpu.json
"""

from __future__ import annotations

import argparse
import copy
import copyreg
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common
from common import write_result  # noqa: E402

from kvfsm.verify.explorer import (  # noqa: E402
    ExplorerConfig,
    World,
    apply,
    build,
    canonical_key,
    check_world,
    clone,
    enabled,
    explore,
)

_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))


def _deepcopy_with_locks(w: World) -> World:
    """copy.deepcopy with every lock re-made instead of refused (what deepcopy would need first)."""
    saved = {t: copyreg.dispatch_table.get(t) for t in _LOCK_TYPES}
    copyreg.pickle(_LOCK_TYPES[0], lambda lock: (threading.Lock, ()))
    copyreg.pickle(_LOCK_TYPES[1], lambda lock: (threading.RLock, ()))
    try:
        return copy.deepcopy(w)
    finally:
        for t, f in saved.items():
            if f is None:
                copyreg.dispatch_table.pop(t, None)
            else:
                copyreg.dispatch_table[t] = f


_ENDS = ("finish", "abort", "retract")


def walk(cfg: ExplorerConfig, length: int, rng: random.Random, end_weight: float = 0.1) -> list[tuple]:
    """`length` events from the root, each drawn among the enabled ones (a duplicate finish, a guaranteed
    no-op, left out; ending a request weighted `end_weight`, so walks reach the bound's deep states);
    shorter if the world goes quiet (only a progress check left, twice)."""
    w, events = World(cfg), []
    for _ in range(length):
        choices = [ev for ev in enabled(w) if ev[0] != "end_again"]
        if choices == [("progress",)] and events and events[-1] == ("progress",):
            break
        ev = rng.choices(choices, [end_weight if ev[0] in _ENDS else 1.0 for ev in choices])[0]
        apply(w, ev)
        events.append(ev)
    return events


def _structure(w: World, c: World) -> list[str]:
    """What a faithful copy must keep shared or re-point, by name, where `c` (a copy of `w`) does not."""
    import numpy as np

    bad = []
    a = c.engine.allocator
    if a._allocated.data_ptr() != np.frombuffer(a._allocated_bytes, dtype=np.uint8).ctypes.data:
        bad.append("allocator mask no longer views its bytearray")
    reqs = {id(r) for r in c.reqs if r is not None}
    for key, rec in c.engine.manager._records.items():
        req = rec.req_ref()
        if req is None or id(req) not in reqs or key != id(req):
            bad.append("a lifecycle record's weak reference (or its key) points at the original's request")
            break
    probe = "clone-probe-key"
    c.engine.fail_writes.add(probe)
    try:
        if not c.engine.storage._fail(probe) or w.engine.storage._fail(probe):
            bad.append("the storage fault predicate (a closure) reads the original engine")
    finally:
        c.engine.fail_writes.discard(probe)
    if c.engine.allocator is w.engine.allocator or c.engine.host_pool is w.engine.host_pool:
        bad.append("pools shared with the original")
    return bad


def _branch_ok(
    cfg: ExplorerConfig,
    prefix: list[tuple],
    cont: list[tuple],
    want_key: tuple,
    method: Callable[[World, list[tuple]], World],
) -> tuple[bool, Optional[str], list[str]]:
    """Is one branch made by `method` a faithful, independent copy? (ok, why not, what it broke)."""
    original = build(cfg, prefix, check=False)
    key0 = canonical_key(original)
    try:
        c = method(original, prefix)
    except Exception as exc:  # noqa: BLE001 - a failure to copy is the finding
        return False, f"copy failed: {type(exc).__name__}: {exc}", []
    broken = _structure(original, c)
    try:
        if canonical_key(c) != key0:
            return False, "the copy's canonical key differs from the original's", broken
        for ev in cont:
            apply(c, ev)
            check_world(c)
        if canonical_key(c) != want_key:
            return False, f"after {len(cont)} more events the copy's key is not the one replaying them reaches", broken
    except Exception as exc:  # noqa: BLE001
        return False, f"the copy broke running the next events: {type(exc).__name__}: {exc}", broken
    try:
        check_world(original)
        if canonical_key(original) != key0:
            return False, "running events on the copy changed the original", broken
    except Exception as exc:  # noqa: BLE001
        return False, f"running events on the copy broke the original: {type(exc).__name__}: {exc}", broken
    return not broken, ("; ".join(broken) or None), broken


METHODS: dict[str, Callable[[World, list[tuple]], World]] = {
    "clone": lambda w, prefix: clone(w),
    "deepcopy": lambda w, prefix: copy.deepcopy(w),
    "deepcopy+locks": lambda w, prefix: _deepcopy_with_locks(w),
    "replay": lambda w, prefix: build(w.config, prefix, check=False),
}


def _time_ms(fn: Callable[[], Any], reps: int) -> Optional[float]:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        try:
            fn()
        except Exception:  # noqa: BLE001 - a method that cannot copy has no time
            return None
        times.append(time.perf_counter() - t)
    return statistics.mean(times) * 1e3


def probe_bound(
    cfg: ExplorerConfig, depths: list[int], worlds: int, n_cont: int, reps: int, rng: random.Random
) -> dict[str, Any]:
    """Every method on `worlds` walks' worlds at each depth of one bound: per-depth and overall summaries."""
    samples: list[dict[str, Any]] = []  # one per (walk, depth)
    need = max(depths) + n_cont
    for k in range(worlds):
        for _ in range(50):  # a walk long enough for every depth
            events = walk(cfg, need, rng)
            if len(events) >= need:
                break
        for d in depths:
            if d + n_cont > len(events):
                continue  # the walk went quiet before this depth
            prefix, cont = events[:d], events[d : d + n_cont]
            want = canonical_key(build(cfg, prefix + cont))  # every invariant checked on the way
            row: dict[str, Any] = {"walk": k, "depth": d}
            for name, method in METHODS.items():
                ok, why, broken = _branch_ok(cfg, prefix, cont, want, method)
                w = build(cfg, prefix, check=False)
                row[name] = {
                    "ms": _time_ms(lambda: method(w, prefix), reps),
                    "correct": ok,
                    "why": why,
                    "broken": broken,
                }
            samples.append(row)
            print(
                f"walk {k} depth {d:2d}: "
                + "  ".join(
                    f"{n} {r['ms']:.2f} ms {'ok' if r['correct'] else 'WRONG'}"
                    if r["ms"] is not None
                    else f"{n} failed"
                    for n, r in ((n, row[n]) for n in METHODS)
                ),
                flush=True,
            )

    def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        out = {}
        for name in METHODS:
            ms = [r[name]["ms"] for r in rows if r[name]["ms"] is not None]
            wrong = [r[name]["why"] for r in rows if not r[name]["correct"]]
            out[name] = {
                "mean_ms": round(statistics.mean(ms), 3) if ms else None,
                "correct": f"{len(rows) - len(wrong)}/{len(rows)}",
                "first_failure": wrong[0] if wrong else None,
                "broken": sorted({b for r in rows for b in r[name]["broken"]}),
            }
        return out

    by_depth = {
        str(d): summary([r for r in samples if r["depth"] == d])
        for d in depths
        if any(r["depth"] == d for r in samples)
    }
    overall = summary(samples)
    for d, s in by_depth.items():
        print(f"depth {d:>2s}: " + "  ".join(f"{n} {v['mean_ms']} ms ({v['correct']})" for n, v in s.items()))
    print("all     : " + "  ".join(f"{n} {v['mean_ms']} ms ({v['correct']})" for n, v in overall.items()))
    for n, v in overall.items():
        if v["first_failure"]:
            print(f"  {n}: {v['first_failure']}")
        for b in v["broken"]:
            print(f"  {n}: {b}")
    # per sample only (ms, correct): the reasons are in the summaries
    compact = [
        {
            "walk": r["walk"],
            "depth": r["depth"],
            **{n: [None if r[n]["ms"] is None else round(r[n]["ms"], 3), r[n]["correct"]] for n in METHODS},
        }
        for r in samples
    ]
    return {"bound": cfg.describe(), "depths": depths, "overall": overall, "by_depth": by_depth, "samples": compact}


def search_modes(cfg: ExplorerConfig) -> dict[str, Any]:
    """The whole search at `cfg` in each branching mode (what the per-branch costs add up to)."""
    out = {}
    for mode in ("copy", "replay"):
        res = explore(cfg, mode=mode)
        out[mode] = {
            "states": res.states,
            "edges": res.edges,
            "depth": res.depth,
            "complete": res.complete,
            "branches": res.copies,
            "in_place": res.in_place,
            "validated": res.validated,
            "seconds": round(res.seconds, 2),
            "fallback": res.fallback,
        }
        print(f"explore {mode}: {out[mode]}", flush=True)
    return out


# the explorer's default bound, and one whose traces are long enough to show where the costs cross
DEFAULT = ExplorerConfig()
LONG = ExplorerConfig(decodes=6, readmits=1, max_context=32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--depths",
        type=int,
        nargs="+",
        default=[0, 6, 12, 18],
        help="event-prefix lengths to branch at, default bound (its BFS depth is 18)",
    )
    ap.add_argument(
        "--long-depths",
        type=int,
        nargs="+",
        default=[0, 15, 30, 45, 60],
        help="event-prefix lengths to branch at, long-trace bound (none: skip it)",
    )
    ap.add_argument("--worlds", type=int, default=8, help="random walks per bound (one world per depth each)")
    ap.add_argument("--cont", type=int, default=8, help="events run on each copy to check it")
    ap.add_argument("--reps", type=int, default=5, help="timed branches per world and method")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-explore", action="store_true", help="skip the whole search in each mode (~20 s)")
    ap.add_argument("--quick", action="store_true", help="2 walks, 2 depths, no search: bench/results/quick/")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.depths, args.long_depths, args.worlds, args.reps, args.no_explore = [0, 12], [0, 30], 2, 2, True
    rng = random.Random(args.seed)
    payload: dict[str, Any] = {
        "config": {"worlds": args.worlds, "cont": args.cont, "reps": args.reps, "seed": args.seed, "quick": args.quick}
    }
    print(f"default bound: {DEFAULT.describe()}")
    payload["default_bound"] = probe_bound(DEFAULT, args.depths, args.worlds, args.cont, args.reps, rng)
    if args.long_depths:
        print(f"long-trace bound: {LONG.describe()}")
        payload["long_bound"] = probe_bound(LONG, args.long_depths, args.worlds, args.cont, args.reps, rng)
    if not args.no_explore:
        payload["explore_default_bound"] = search_modes(DEFAULT)
    print(write_result("clone_probe", payload, args.out, quick=args.quick))


if __name__ == "__main__":
    main()
