#!/usr/bin/env python3
"""The `kvfsm` command line's start-up cost: CPU time (user + sys of the child process) of `kvfsm --help` and
`kvfsm validate spec/decode_offload.yaml`, the median of --runs runs each (targets: <= 0.2 s and <= 0.35 s),
with `python -c pass` and `python -c "import pydantic"` measured in the same run beside them for scale.

CPU time, not wall time: on a shared machine a busy neighbour stretches the wall clock, not the CPU seconds a
process spends. Each run is a fresh process (resource.getrusage(RUSAGE_CHILDREN) before and after it), so a
warm page cache is the only thing runs share; the first run of each command is a warm-up and is not counted.

Writes JSON to bench/results/quick/cli_startup-quick-cpu.json (git-ignored: a plain run never overwrites a
recorded result), or to bench/results/cli_startup-cpu.json with --record, or to --out.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import target, write_result  # noqa: E402

SPEC = "spec/decode_offload.yaml"
# what each command may cost at most, in CPU seconds (median)
LIMITS = {"kvfsm --help": 0.2, f"kvfsm validate {SPEC}": 0.35}


def kvfsm_command() -> list[str]:
    """The installed `kvfsm` entry point beside this interpreter (what a user runs), else the module."""
    script = Path(sys.executable).with_name("kvfsm")
    if script.is_file():
        return [str(script)]
    found = shutil.which("kvfsm")
    return [found] if found else [sys.executable, "-c", "import sys; from kvfsm.cli import app; sys.exit(app())"]


def cpu_seconds(argv: list[str], runs: int) -> list[float]:
    """User + sys CPU seconds of `argv`, once per run (after one uncounted warm-up); a non-zero exit fails."""
    samples = []
    for i in range(runs + 1):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode:
            raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.decode(errors='replace')}")
        if i:
            samples.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
    return samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7, help="counted runs per command (default 7; the median is reported)")
    ap.add_argument(
        "--record",
        action="store_true",
        help="write bench/results/cli_startup-cpu.json (committed) instead of bench/results/quick/",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here instead")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")

    kvfsm = kvfsm_command()
    commands: dict[str, list[str]] = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import pydantic'": [sys.executable, "-c", "import pydantic"],
        "kvfsm --help": [*kvfsm, "--help"],
        f"kvfsm validate {SPEC}": [*kvfsm, "validate", SPEC],
    }
    rows: list[dict[str, Any]] = []
    load_start = os.getloadavg()
    # interleaved rounds, so a burst of load on the machine touches every command alike
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.runs):
        for name, cmd in commands.items():
            samples[name] += cpu_seconds(cmd, 1)
    for name, xs in samples.items():
        rows.append(
            {
                "command": name,
                "median_cpu_s": round(statistics.median(xs), 4),
                "min_cpu_s": round(min(xs), 4),
                "max_cpu_s": round(max(xs), 4),
                "samples_cpu_s": [round(x, 4) for x in xs],
            }
        )
        print(f"{name:45s} median {statistics.median(xs):.3f} s CPU (min {min(xs):.3f}, max {max(xs):.3f})")
    medians = {r["command"]: r["median_cpu_s"] for r in rows}
    targets = [target(f"{name}: median CPU s", medians[name], limit) for name, limit in LIMITS.items()]
    for t in targets:
        print(f"target {t['name']} <= {t['limit']}: {t['value']:.3f} {'met' if t['met'] else 'NOT met'}")
    path = write_result(
        "cli_startup",
        {
            "what": "CPU seconds (user + sys of the child) per command, a fresh process each run, median of the runs",
            "runs": args.runs,
            "kvfsm": kvfsm,
            "cwd": str(ROOT),
            "load_average_at_start": [round(x, 2) for x in load_start],
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            "commands": rows,
            "targets": targets,
        },
        args.out,
        quick=not args.record,
        tag="cpu",
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
