"""bench/ab_trees.py: the bench runs on the tree before (first on PYTHONPATH) and on the checkout in turns, each
pair is compared, and a bench that would run the checkout on both trees is refused before any run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
ROOT = BENCH.parent

FAKE = """import argparse, json, sys
{prelude}
import kvfsm
ap = argparse.ArgumentParser()
ap.add_argument("--out")
args = ap.parse_args()
value = getattr(kvfsm, "AB_TOTAL", 1.0)  # the fake tree before says 2.0; the real kvfsm has no such name
rows = [{{"mode": "adapter", "live": 8, "total_ms": {{"median": value, "mean": 3 * value}}}},
        {{"mode": "floor", "live": 8, "total_ms": {{"median": 1.0, "mean": 1.0}}}}]
json.dump({{"rows": rows, "quick": {quick}, "targets": [{{"name": "t", "value": value, "limit": 1.5,
           "met": value <= 1.5}}]}}, open(args.out, "w"))
"""


@pytest.fixture
def ab_trees():
    sys.path.insert(0, str(BENCH))
    try:
        import ab_trees

        yield ab_trees
    finally:
        sys.path.remove(str(BENCH))


def _trees(tmp_path: Path, prelude: str = "", quick: bool = False) -> tuple[Path, Path]:
    base = tmp_path / "before"
    (base / "kvfsm").mkdir(parents=True)
    (base / "kvfsm" / "__init__.py").write_text("AB_TOTAL = 2.0\n")
    bench = tmp_path / "fake_bench.py"
    bench.write_text(FAKE.format(prelude=prelude, quick=quick))
    return base, bench


def test_the_trees_alternate_and_each_pair_is_compared(ab_trees, tmp_path: Path) -> None:
    base, bench = _trees(tmp_path)
    out = tmp_path / "ab.json"
    assert ab_trees.main(["--base", str(base), "--pairs", "2", "--out", str(out), "--", str(bench)]) == 0
    doc = json.loads(out.read_text())
    assert [r["tree"] for r in doc["runs"]] == ["before", "after", "before", "after"]
    assert doc["kvfsm_imported_from"]["before"] == str((base / "kvfsm").resolve())
    assert doc["kvfsm_imported_from"]["after"] == str(ROOT / "kvfsm")
    by = {c["config"]: c["pairs"] for c in doc["compared"]}
    assert [p["median_ratio"] for p in by["mode=adapter live=8"]] == [0.5, 0.5]  # 1.0 after, 2.0 before
    assert [p["mean_ratio"] for p in by["mode=adapter live=8"]] == [0.5, 0.5]
    assert [p["median_ratio"] for p in by["mode=floor live=8"]] == [1.0, 1.0]
    assert doc["targets"] == [{"name": "t", "value": 1.0, "limit": 1.5, "met": True}]  # the checkout's last run


def test_a_bench_that_puts_the_checkout_first_is_refused_before_any_run(ab_trees, tmp_path: Path) -> None:
    base, bench = _trees(tmp_path, prelude=f"sys.path.insert(0, {str(ROOT)!r})")
    with pytest.raises(SystemExit, match="imports kvfsm from .* on the tree before"):
        ab_trees.main(["--base", str(base), "--out", str(tmp_path / "ab.json"), "--", str(bench)])
    assert not (tmp_path / "ab.json").exists()


def test_quick_runs_are_written_as_quick(ab_trees, tmp_path: Path, monkeypatch) -> None:
    """A quick bench's comparison goes where quick results go, never over a recorded one."""
    base, bench = _trees(tmp_path, quick=True)
    written = {}
    monkeypatch.setattr(ab_trees, "write_result", lambda name, doc, out, quick=False: written.update(quick=quick))
    assert ab_trees.main(["--base", str(base), "--pairs", "1", "--", str(bench)]) == 0
    assert written == {"quick": True}
