"""Development probe: what one lifecycle event costs the scheduler thread over 256 and 4096 live requests,
through the struct-of-arrays batch machine (generated/decode_offload_rows.py) against today's batch event over
machine objects (`DecodeOffloadMachine.<event>_each`) and a loop of single events; and how many gc-tracked
objects each keeps per request.

Each event is timed with every request once in the batch, and twice (a request's two chunks in one batch:
the rows machine decides repeated rows in rounds). Effects are no-ops (every `<action>`, `<action>_each` and `<action>_rows` returns at once), so what is timed
is the machine: the from-state and guard decisions, the counter and state writes, the action dispatch. Every
request runs the steady cycle offload -> copy_done -> backup_done (allocated -> offloading -> inflight ->
allocated: start_copy; hash_chunk and submit_backup; mark_stored and free_host_chunk), each event fired for
all requests at once, with gc off while timed (the median of many cycles), then with gc on to count the
collections the cycles trigger. Tracked objects are counted with gc.get_objects() before and after building
the requests' machines (the machine objects alone; the runtime keeps more per request around them).

    python bench/probes/rows_machine_probe.py          # bench/results/quick/rows_machine_probe-<machine>.json
    python bench/probes/rows_machine_probe.py --quick  # a smoke run (few cycles), marked quick
    python bench/probes/rows_machine_probe.py --serving-only  # only the serving regime (below)

The serving regime (`serving` in the JSON): a table of 5,128 rows (the serving loop's at 4096 live), each event
fired over the 64 or 256 rows whose chunk is due in an iteration (page 64 or 16), a fresh random set each cycle.
What a lifecycle run by the rows machine would spend an iteration in the machine alone, effects aside.

Both write under bench/results/quick/ (git-ignored): CPU figures from a shared development machine, kept
out of the recorded results.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common
from common import QUICK, machine_tag, write_result  # noqa: E402

import kvfsm.generated.decode_offload as gen  # noqa: E402
from kvfsm.generated.decode_offload import DecodeOffloadMachine  # noqa: E402
from kvfsm.generated.decode_offload_rows import DecodeOffloadRows  # noqa: E402

CYCLE = ("offload", "copy_done", "backup_done")
SIZES = (256, 4096)


class NoOpEffects:
    """Every action of the spec, in its three call forms, doing nothing."""


for _action in {a for t in gen.TRANSITIONS for a in t[4]} | {"seed_hash_chain"}:
    setattr(NoOpEffects, _action, lambda self, m, arg: None)
    setattr(NoOpEffects, f"{_action}_each", lambda self, items: None)
    setattr(NoOpEffects, f"{_action}_rows", lambda self, rows, args: None)


def tracked_per_request(build: Callable[[int], Any], n: int) -> tuple[float, Any]:
    """gc-tracked objects that `build(n)` keeps alive, per request, and what it built."""
    gc.collect()
    before = len(gc.get_objects())
    built = build(n)
    gc.collect()
    return (len(gc.get_objects()) - before) / n, built


def time_cycles(fire: dict[str, Callable[[], None]], cycles: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median and fastest microseconds of each event of the cycle over `cycles` cycles, gc off (on a shared
    machine the fastest is the figure least touched by other load)."""
    samples: dict[str, list[int]] = {e: [] for e in CYCLE}
    gc.collect()
    gc.disable()
    try:
        for _ in range(cycles):
            for e in CYCLE:
                t0 = time.perf_counter_ns()
                fire[e]()
                samples[e].append(time.perf_counter_ns() - t0)
    finally:
        gc.enable()
    return ({e: statistics.median(s) / 1e3 for e, s in samples.items()}, {e: min(s) / 1e3 for e, s in samples.items()})


def collections(fire: dict[str, Callable[[], None]], cycles: int) -> dict[str, float]:
    """Collections per cycle (generation 0 and generation 2) that the cycles trigger, gc on."""
    gc.collect()
    before = [s["collections"] for s in gc.get_stats()]
    for _ in range(cycles):
        for e in CYCLE:
            fire[e]()
    after = [s["collections"] for s in gc.get_stats()]
    return {"gen0_per_cycle": (after[0] - before[0]) / cycles, "gen2_per_cycle": (after[2] - before[2]) / cycles}


def doors(n: int, times: int) -> dict[str, tuple[float, dict[str, Callable[[], None]]]]:
    """Per way of firing: tracked objects per request and the event callables over n requests, each request
    `times` times in every batch (two chunks of one request acknowledged in one progress check)."""
    fx = NoOpEffects()

    def machines(k: int) -> list[DecodeOffloadMachine]:
        return [DecodeOffloadMachine(fx, ctx=None) for _ in range(k)]  # type: ignore[arg-type]

    def table(k: int) -> DecodeOffloadRows:
        t = DecodeOffloadRows(fx, k)  # type: ignore[arg-type]
        t.create(np.arange(k))
        return t

    for build in (machines, table):  # first builds fill numpy's and the interpreter's caches: not per request
        tracked_per_request(build, 8)
    per_loop, ms_loop = tracked_per_request(machines, n)
    per_each, ms_each = tracked_per_request(machines, n)
    per_rows, rows = tracked_per_request(table, n)
    idx, args = np.tile(np.arange(n), times), [None] * (n * times)
    ms_loop, ms_each = ms_loop * times, ms_each * times

    def loop(e: str) -> Callable[[], None]:
        def run() -> None:
            for m in ms_loop:
                getattr(m, e)(None)

        return run

    def each(e: str) -> Callable[[], None]:
        batch = getattr(DecodeOffloadMachine, f"{e}_each")
        return lambda: batch(ms_each, args)

    def by_rows(e: str) -> Callable[[], None]:
        event = getattr(rows, e)
        return lambda: event(idx)

    return {
        "rows": (per_rows, {e: by_rows(e) for e in CYCLE}),
        "each": (per_each, {e: each(e) for e in CYCLE}),
        "loop": (per_loop, {e: loop(e) for e in CYCLE}),
    }


def serving_events(table_rows: int, live: int, batch: int, cycles: int, seed: int = 0) -> dict[str, Any]:
    """The serving loop's regime: a table of `table_rows` requests (4096 live with the loop's spare rows), each
    event fired over the `batch` rows whose chunk is due (64 an iteration at page 64, 256 at page 16), a fresh
    random set each cycle; through the rows machine and through `_each` over machine objects. Median us, gc off."""
    fx = NoOpEffects()
    table = DecodeOffloadRows(fx, table_rows)  # type: ignore[arg-type]
    table.create(np.arange(table_rows))
    machines = [DecodeOffloadMachine(fx, ctx=None) for _ in range(table_rows)]  # type: ignore[arg-type]
    rng = np.random.default_rng(seed)
    picks = [np.sort(rng.choice(live, batch, replace=False)) for _ in range(cycles + 20)]
    args = [None] * batch
    fire: dict[str, dict[str, Callable[[np.ndarray], None]]] = {
        "rows": {e: getattr(table, e) for e in CYCLE},
        "each": {
            e: (lambda ev: lambda idx: ev([machines[i] for i in idx.tolist()], args))(
                getattr(DecodeOffloadMachine, f"{e}_each")
            )
            for e in CYCLE
        },
    }
    out: dict[str, Any] = {"table_rows": table_rows, "live": live, "batch": batch, "cycles": cycles}
    for door, events in fire.items():
        samples: dict[str, list[int]] = {e: [] for e in CYCLE}
        gc.collect()
        gc.disable()
        try:
            for k, idx in enumerate(picks):
                for e in CYCLE:
                    t0 = time.perf_counter_ns()
                    events[e](idx)
                    if k >= 20:  # the first cycles warm the caches
                        samples[e].append(time.perf_counter_ns() - t0)
        finally:
            gc.enable()
        out[door] = {f"{e}_us": round(statistics.median(v) / 1e3, 1) for e, v in samples.items()}
        out[door]["cycle_us"] = round(sum(out[door][f"{e}_us"] for e in CYCLE), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few cycles: checks the script, not the numbers")
    ap.add_argument("--out", default=None, help="where the JSON goes (default: bench/results/quick/)")
    ap.add_argument(
        "--serving-only",
        action="store_true",
        help="only the serving regime (`serving` in the JSON): 4096 live, events over 64 and 256 rows",
    )
    a = ap.parse_args()
    serving = [serving_events(5128, 4096, batch, 20 if a.quick else 2000) for batch in (64, 256)]
    for row in serving:
        print(
            f"serving regime, events over {row['batch']} of {row['live']} live rows: rows machine "
            f"{row['rows']['cycle_us']} us a cycle, _each {row['each']['cycle_us']} us"
        )
    if a.serving_only:
        out = a.out or (QUICK / f"rows_machine_probe-serving{'-quick' if a.quick else ''}-{machine_tag()}.json")
        print(
            f"wrote {write_result('rows_machine_probe', {'cycle': list(CYCLE), 'serving': serving}, out=out, quick=a.quick)}"
        )
        return
    rows_out: list[dict[str, Any]] = []
    for times in (1, 2):
        for n in SIZES:
            cycles = 5 if a.quick else max(30, 40_000 // n)
            for door, (per_request, fire) in doors(n, times).items():
                for e in CYCLE:  # warm-up: one cycle
                    fire[e]()
                timed, fastest = time_cycles(fire, cycles)
                row = {
                    "live": n,
                    "times_per_batch": times,
                    "door": door,
                    "cycles": cycles,
                    "tracked_objects_per_request": round(per_request, 3),
                    **{f"{e}_us": round(v, 1) for e, v in timed.items()},
                    **{f"{e}_min_us": round(v, 1) for e, v in fastest.items()},
                    **{f"{e}_ns_per_item": round(v * 1e3 / (n * times), 1) for e, v in timed.items()},
                    **collections(fire, cycles),
                }
                rows_out.append(row)
                print(
                    f"{n:5d} x{times} {door:5s} "
                    + "  ".join(f"{e} {timed[e]:8.1f} us" for e in CYCLE)
                    + f"  tracked/request {per_request:.3f}  gen0/cycle {row['gen0_per_cycle']:.2f}"
                )
    speedups = []
    for times in (1, 2):
        for n in SIZES:
            by = {r["door"]: r for r in rows_out if r["live"] == n and r["times_per_batch"] == times}
            for e in CYCLE:
                speedups.append(
                    {
                        "live": n,
                        "times_per_batch": times,
                        "event": e,
                        "each_over_rows": round(by["each"][f"{e}_us"] / by["rows"][f"{e}_us"], 1),
                        "loop_over_rows": round(by["loop"][f"{e}_us"] / by["rows"][f"{e}_us"], 1),
                    }
                )
    out = a.out or (QUICK / f"rows_machine_probe{'-quick' if a.quick else ''}-{machine_tag()}.json")
    path = write_result(
        "rows_machine_probe",
        {"sizes": list(SIZES), "cycle": list(CYCLE), "rows": rows_out, "speedups": speedups, "serving": serving},
        out=out,
        quick=a.quick,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
