"""A change measured on a host whose speed drifts: one bench, on the tree before it and on the checkout, in turns.

On the lent GPU hosts the floor's own median moved 10-20% between two runs of one call and the backup
floor's ratio doubled between two hosts (docs/performance.md, "The runs of 2026-12-07"), more than most
changes move anything. Two runs one after the other then say nothing about the change. This runs the bench
`--pairs` times on each tree, alternating (before, after, before, after, ...), in one call, and compares
each pair: a drift that lasts longer than a pair cancels in its ratio.

`--base DIR` is the tree before the change: its `kvfsm/`, `generated/` and `spec/`
(`git archive REV kvfsm generated spec | tar -x -C DIR`), put first on PYTHONPATH for its runs. The checkout
runs as it is, with the same bench script (the checkout's). The bench must take `--out FILE` and write rows
that name their configuration (`mode` or `algo`, `live`, `page`, `storage`, ...) and carry `total_ms` or
`total` with a `median` and a `mean`: bench/sglang_adapter_gpu.py and bench/serving_loop.py do. A run
stopped by `--timeout` keeps the rows its JSON already holds.

    python bench/ab_trees.py --base DIR [--pairs 2] [--timeout 300] [--out FILE] -- BENCH.py [ARGS ...]
Writes bench/results/ab_trees-<machine>.json (or --out; bench/results/quick/ when the bench's runs were quick):
every run's rows, and per configuration the after / before ratio of the medians and of the means, pair by
pair. Its `targets` are the bench's own, from the last run of the checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

KEYS = ("mode", "algo", "live", "page", "stride", "storage", "table", "layers")  # what names a row's configuration
# Where the bench, started as a script with --help, imported kvfsm from: a bench that put the checkout ahead of
# PYTHONPATH would run the checkout on both trees, and the comparison would compare it with itself.
WHICH_KVFSM = """import os, runpy, sys
sys.argv = sys.argv[1:2] + ["--help"]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit:
    pass
module = sys.modules.get("kvfsm")
print("KVFSM_FROM=" + (os.path.dirname(os.path.abspath(module.__file__)) if module else ""))
"""


def config(row: dict[str, Any]) -> str:
    """A row's configuration, as text: the KEYS it has, in that order."""
    return " ".join(f"{k}={row[k]}" for k in KEYS if row.get(k) is not None)


def totals(row: dict[str, Any]) -> dict[str, float] | None:
    t = row.get("total_ms", row.get("total"))
    return {"median": t["median"], "mean": t["mean"]} if isinstance(t, dict) and "median" in t else None


def tree_env(tree: str, base: Path) -> dict[str, str]:
    """The environment of a run on `tree` ("before": `base` first on PYTHONPATH; "after": as it is)."""
    env = dict(os.environ)
    if tree == "before":
        env["PYTHONPATH"] = os.pathsep.join([str(base.resolve())] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def kvfsm_from(tree: str, base: Path, bench: list[str]) -> str:
    """The folder of the kvfsm package the bench imports on `tree` ('' when it imports none)."""
    done = subprocess.run(
        [sys.executable, "-c", WHICH_KVFSM, bench[0]],
        env=tree_env(tree, base),
        capture_output=True,
        text=True,
        timeout=300,
    )
    found = [line for line in done.stdout.splitlines() if line.startswith("KVFSM_FROM=")]
    return found[-1].split("=", 1)[1] if found else ""


def check_trees(base: Path, bench: list[str]) -> dict[str, str]:
    """Each tree's kvfsm, as the bench imports it: the base's on the before tree, another on the after tree."""
    want = str((base / "kvfsm").resolve())
    got = {tree: kvfsm_from(tree, base, bench) for tree in ("before", "after")}
    if got["before"] != want or got["after"] in ("", want):
        raise SystemExit(
            f"{bench[0]} imports kvfsm from {got['before'] or 'nowhere'} on the tree before and from "
            f"{got['after'] or 'nowhere'} on the checkout, where {want} and another are needed: "
            "it must import kvfsm at its top and leave PYTHONPATH ahead of the checkout"
        )
    return got


def run_once(tree: str, base: Path, bench: list[str], timeout: float) -> dict[str, Any]:
    """One run of the bench on `tree` ("before": `base` first on PYTHONPATH; "after": the checkout)."""
    env = tree_env(tree, base)
    with tempfile.TemporaryDirectory(prefix="kvfsm-ab-") as tmp:
        out = Path(tmp) / "run.json"
        try:
            done = subprocess.run(
                [sys.executable, *bench, "--out", str(out)], env=env, timeout=timeout, capture_output=True, text=True
            )
            rc: int | None = done.returncode
            tail = (done.stdout + done.stderr)[-2000:]
        except subprocess.TimeoutExpired as exc:
            rc, tail = None, (str(exc.stdout or "") + str(exc.stderr or ""))[-2000:]
        doc = json.loads(out.read_text()) if out.exists() else {}
    rows = [{"config": config(r), **t} for r in doc.get("rows", []) if (t := totals(r)) is not None]
    return {
        "tree": tree,
        "rc": rc,
        "quick": bool(doc.get("quick")),
        "rows": rows,
        "targets": doc.get("targets", []),
        "output_tail": tail,
    }


def compare(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration, pair by pair (the k-th run of each tree), after / before of the median and the mean;
    a configuration a run lacks (stopped first) leaves its pair out."""
    before = [r for r in runs if r["tree"] == "before"]
    after = [r for r in runs if r["tree"] == "after"]
    out = []
    for name in dict.fromkeys(row["config"] for r in runs for row in r["rows"]):
        pairs = []
        for b, a in zip(before, after):
            rb = [x for x in b["rows"] if x["config"] == name]
            ra = [x for x in a["rows"] if x["config"] == name]
            if rb and ra:  # a bench's repeats of one configuration: their mean
                mb, ma = (statistics.fmean(x["median"] for x in rows) for rows in (rb, ra))
                eb, ea = (statistics.fmean(x["mean"] for x in rows) for rows in (rb, ra))
                pairs.append(
                    {
                        "before_median": mb,
                        "after_median": ma,
                        "median_ratio": ma / mb,
                        "before_mean": eb,
                        "after_mean": ea,
                        "mean_ratio": ea / eb,
                    }
                )
        out.append({"config": name, "pairs": pairs})
    return out


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if "--" not in args_in:
        raise SystemExit("usage: ab_trees.py --base DIR [--pairs N] [--timeout S] [--out FILE] -- BENCH.py [ARGS ...]")
    cut = args_in.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the tree before the change (kvfsm/, generated/, spec/)")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(args_in[:cut])
    bench = args_in[cut + 1 :]
    if not (args.base / "kvfsm" / "__init__.py").is_file():
        raise SystemExit(f"--base {args.base}: no kvfsm/ package there")
    if not bench:
        raise SystemExit("no bench given after --")
    imported = check_trees(args.base, bench)
    runs = []
    for k in range(args.pairs):
        for tree in ("before", "after"):
            runs.append(run_once(tree, args.base, bench, args.timeout))
            print(f"pair {k + 1} {tree}: rc {runs[-1]['rc']}, {len(runs[-1]['rows'])} rows", flush=True)
    compared = compare(runs)
    for c in compared:
        ratios = ", ".join(f"{p['median_ratio']:.3f}" for p in c["pairs"])
        print(f"{c['config']}: after / before medians {ratios or '(no pair)'}")
    last_after = [r for r in runs if r["tree"] == "after"][-1]
    path = write_result(
        "ab_trees",
        {
            "settings": {"base": str(args.base), "pairs": args.pairs, "timeout": args.timeout, "bench": bench},
            "kvfsm_imported_from": imported,
            "runs": runs,
            "compared": compared,
            "targets": last_after["targets"],
        },
        args.out,
        quick=any(r["quick"] for r in runs),
    )  # a quick bench's runs never overwrite a recorded result
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
