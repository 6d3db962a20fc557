"""How fast the bounded explorer (`kvfsm check`) is, and what each search technique buys, in one run.

The techniques, measured as a ladder on the same bounds (each step adds one to the one before; every step
reaches the same states, see tests/verify/test_reduction_soundness.py):

1. clone:     every child branched by a full pickle round trip of its parent (the plain search,
              with request symmetry);
2. +sparse:   object arrays pickled by their filled slots (the stored-page index's mostly-empty rings);
3. +snapshot: each state pickled once, every child unpickled from it (cloning.Snapshot);
4. +orbits:   events of a request the state is symmetric in with a smaller one are not run (a symmetric
              request's event stands for them);
5. +sleep:    partial-order reduction by sleep sets (events that commute are not run in both orders).

Then request symmetry's own factor (the states it merges), `jobs` worker processes against one, and the
named bounds (kvfsm.verify.bounds: ci and default) explored as `kvfsm check` explores them. Reported per
run: states, events run (edges), wall and CPU seconds, states per CPU second; per technique, the factor by
which it cut states and edges and the speed-up in CPU time. CPU time is what the search costs; wall time on
a shared machine also counts the others' processes. Each ladder step runs `--repeat` times, interleaved
with the other steps, and the fastest is kept.

    python bench/explorer_speed.py            # bench/results/explorer_speed-<machine>.json (~30 min, 2 cores)
    python bench/explorer_speed.py --quick    # bench/results/quick/explorer_speed-quick-<machine>.json (~1 min)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for common
from common import machine  # noqa: E402

import kvfsm.verify.explorer.cloning as cloning  # noqa: E402
from kvfsm.verify.bounds import BOUNDS, Bound  # noqa: E402
from kvfsm.verify.explorer import ExplorerConfig, explore  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

LADDER: list[tuple[str, dict[str, Any], bool]] = [  # (step, explore() arguments, sparse object arrays)
    ("clone", dict(mode="clone", por=False, orbits=False), False),
    ("+sparse", dict(mode="clone", por=False, orbits=False), True),
    ("+snapshot", dict(mode="copy", por=False, orbits=False), True),
    ("+orbits", dict(mode="copy", por=False, orbits=True), True),
    ("+sleep", dict(mode="copy", por=True, orbits=True), True),
]


def ladder_bounds(quick: bool) -> dict[str, ExplorerConfig]:
    if quick:
        return {"two-requests": ExplorerConfig(requests=2), "three-chunks": ExplorerConfig(requests=1, decodes=5)}
    parts = {p.name: p.config for b in BOUNDS.values() for p in b.parts}
    return {n: parts[n] for n in ("three-requests", "host-contention", "readmit-3-chunks", "readmit-contention")}


def run(cfg: ExplorerConfig, sparse: bool = True, **kw: Any) -> dict[str, Any]:
    cloning.SPARSE_OBJECT_ARRAYS = sparse
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        res = explore(cfg, **kw)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    finally:
        cloning.SPARSE_OBJECT_ARRAYS = True
    assert res.complete and res.violation is None, (cfg.describe(), res.violation)
    return {
        "states": res.states,
        "edges": res.edges,
        "depth": res.depth,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "states_per_cpu_s": round(res.states / cpu, 1) if cpu else None,
        "pruned": res.pruned,
        "mirrored": res.mirrored,
        "reexpanded": res.reexpanded,
        "copies": res.copies,
        "snapshots": res.snapshots,
        "coverage": len(res.coverage),
    }


def ladder(bounds: dict[str, ExplorerConfig], repeat: int) -> list[dict[str, Any]]:
    """Every step on every bound, `repeat` rounds (steps interleaved within a round); the fastest run kept."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for r in range(repeat):
        for step, kw, sparse in LADDER:
            for name, cfg in bounds.items():
                got = run(cfg, sparse, **kw)
                print(
                    f"  round {r + 1} {step:10s} {name:20s} {got['states']:7d} states {got['edges']:8d} events "
                    f"{got['cpu_s']:7.1f} s CPU {got['wall_s']:7.1f} s wall",
                    flush=True,
                )
                key = (step, name)
                if key not in best or got["cpu_s"] < best[key]["cpu_s"]:
                    best[key] = got
    out = []
    for step, kw, sparse in LADDER:
        per = {name: best[(step, name)] for name in bounds}
        total = {k: round(sum(p[k] for p in per.values()), 2) for k in ("states", "edges", "wall_s", "cpu_s")}
        total["states_per_cpu_s"] = round(total["states"] / total["cpu_s"], 1) if total["cpu_s"] else None
        out.append({"step": step, "explore": kw, "sparse_object_arrays": sparse, "bounds": per, "total": total})
    for before, after in zip(out, out[1:]):
        b, a = before["total"], after["total"]
        after["vs_previous"] = {
            "states_factor": round(b["states"] / a["states"], 3),
            "edges_factor": round(b["edges"] / a["edges"], 3),
            "cpu_speedup": round(b["cpu_s"] / a["cpu_s"], 3),
        }
    first, last = out[0]["total"], out[-1]["total"]
    out[-1]["vs_first"] = {
        "edges_factor": round(first["edges"] / last["edges"], 3),
        "cpu_speedup": round(first["cpu_s"] / last["cpu_s"], 3),
    }
    return out


def symmetry(bounds: dict[str, ExplorerConfig]) -> dict[str, Any]:
    """Request symmetry's factor: the same search (+snapshot, nothing else) with it off and on."""
    out = {}
    for name, cfg in bounds.items():
        on, off = (
            run(cfg, mode="copy", por=False, orbits=False),
            run(cfg, mode="copy", por=False, orbits=False, symmetry=False),
        )
        out[name] = {
            "on": on,
            "off": off,
            "states_factor": round(off["states"] / on["states"], 3),
            "edges_factor": round(off["edges"] / on["edges"], 3),
            "cpu_speedup": round(off["cpu_s"] / on["cpu_s"], 3),
        }
        print(f"  symmetry {name:20s} off {off['states']} states, on {on['states']}", flush=True)
    return out


def jobs(cfg: ExplorerConfig, counts: list[int]) -> list[dict[str, Any]]:
    out = []
    for n in counts:
        got = run(cfg, jobs=n)
        got["jobs"] = n
        out.append(got)
        print(f"  jobs {n}: {got['states']} states {got['wall_s']:.1f} s wall", flush=True)
    return out


def named(bound: Bound) -> dict[str, Any]:
    """A named bound as `kvfsm check` explores it (the defaults: every technique on)."""
    parts = {}
    for p in bound.parts:
        parts[p.name] = run(p.config)
        print(
            f"  {bound.name} {p.name:22s} {parts[p.name]['states']:7d} states {parts[p.name]['wall_s']:7.1f} s wall",
            flush=True,
        )
    total = {k: round(sum(v[k] for v in parts.values()), 2) for k in ("states", "edges", "wall_s", "cpu_s")}
    return {"command": bound.command, "parts": parts, "total": total}


def machine_slug() -> str:
    info = machine()
    raw = f"{platform.machine()}-{info.get('cpu', 'cpu')}-{os.cpu_count()}cpu"
    return re.sub(r"[^a-z0-9]+", "-", raw.lower()).strip("-")


def main(argv: Optional[list[str]] = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small bounds, one round: checks the script, not the numbers (results under bench/results/quick/)",
    )
    ap.add_argument("--repeat", type=int, default=2, help="rounds of the ladder (the fastest run is kept)")
    ap.add_argument("--jobs", type=int, nargs="+", default=[1, 2], help="worker counts to compare")
    ap.add_argument("--no-default", action="store_true", help="skip the default bound (minutes)")
    ap.add_argument("--out", help="write the JSON here instead")
    args = ap.parse_args(argv)
    bounds = ladder_bounds(args.quick)
    print(f"technique ladder on {', '.join(bounds)}", flush=True)
    doc: dict[str, Any] = {
        "benchmark": "explorer_speed",
        "machine": machine(),
        "quick": bool(args.quick),
        "utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "load_average_at_start": list(os.getloadavg()),
        "ladder_bounds": {n: c.describe() for n, c in bounds.items()},
    }
    doc["ladder"] = ladder(bounds, 1 if args.quick else args.repeat)
    print("request symmetry", flush=True)
    doc["symmetry"] = symmetry({n: c for n, c in bounds.items() if c.requests > 1})
    print("jobs", flush=True)
    doc["jobs"] = jobs(next(c for c in reversed(list(bounds.values())) if c.requests > 1), args.jobs)
    doc["jobs_bound"] = next(n for n, c in reversed(list(bounds.items())) if c.requests > 1)
    print("named bounds", flush=True)
    names = ["ci"] if args.quick or args.no_default else ["ci", "default"]
    doc["named_bounds"] = {n: named(BOUNDS[n]) for n in names}
    doc["load_average_at_end"] = list(os.getloadavg())
    if args.out:
        path = Path(args.out)
    elif args.quick:
        path = RESULTS / "quick" / f"explorer_speed-quick-{machine_slug()}.json"
    else:
        path = RESULTS / f"explorer_speed-{machine_slug()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
