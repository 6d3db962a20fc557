"""`kvfsm bench --quick` checks the scripts, not the numbers: it must leave every committed result
(bench/results/*.json and logs) and every committed doc (docs/: results.md, the PNGs) exactly as they were,
write its own JSON, marked `"quick": true`, under bench/results/quick/ (git-ignored) and its plots under
bench/results/quick/plots/, and show a progress bar over the scripts it runs."""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from pathlib import Path

from timing import run_watched

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
QUICK = RESULTS / "quick"


def committed_files() -> dict[str, tuple[int, str]]:
    """Every file a quick run must not touch: mtime and content hash."""
    paths = [p for p in RESULTS.rglob("*") if p.is_file() and QUICK not in p.parents]
    paths += [p for p in (ROOT / "docs").rglob("*") if p.is_file()]
    return {str(p.relative_to(ROOT)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest()) for p in paths}


def test_quick_paths_are_git_ignored() -> None:
    ignored = (ROOT / ".gitignore").read_text().split()
    assert "/bench/results/quick/" in ignored


def test_bench_quick_writes_nothing_committed() -> None:
    before = committed_files()
    assert any(name.startswith("bench/results/") for name in before) and "docs/results.md" in before
    start = time.time() - 1
    proc = run_watched([sys.executable, "-m", "kvfsm.cli", "bench", "--quick"], "kvfsm bench --quick", cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    after = committed_files()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"a quick run changed committed files: {changed}"

    fresh = {
        json.loads(p.read_text())["benchmark"]: json.loads(p.read_text())
        for p in QUICK.glob("*.json")
        if p.stat().st_mtime >= start
    }
    assert {"event_runtime", "manager_overhead", "hash_throughput", "offload_bandwidth"} <= set(fresh), sorted(fresh)
    for name, doc in fresh.items():
        assert doc.get("quick") is True, f"{name}'s quick JSON is not marked quick"
    plots = QUICK / "plots"
    assert (plots / "results.md").stat().st_mtime >= start
    assert "Quick runs" in (plots / "results.md").read_text()
    assert (plots / "event_cost.png").stat().st_mtime >= start

    # the progress bar over the scripts, then one summary line that counts every script and the plots and
    # names where the results went (a plain line: a bar's frame is cut to the console's width)
    assert re.search(r"kvfsm bench\b.*\bdone\b", proc.stdout), proc.stdout[-2000:]
    assert f"kvfsm bench: 5/5 scripts done; results and plots in {QUICK}" in proc.stdout, proc.stdout[-2000:]
