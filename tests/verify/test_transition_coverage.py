"""Transition coverage: every declared transition is exercised by the implementation."""

from __future__ import annotations

import io

from rich.console import Console

from kvfsm.spec import load_spec
from kvfsm.verify.coverage import STANDARD_BOUNDS, explorer_coverage, fuzz, report
from kvfsm.verify.replay import default_spec_path

SPEC = load_spec(default_spec_path())


def test_explorer_exercises_every_declared_transition() -> None:
    """Small complete explorations of the real manager take every transition of the spec (fails otherwise)."""
    sources = explorer_coverage(STANDARD_BOUNDS)
    rep = report(sources, SPEC)
    missing = [f"T{t.id} {t.label}" for t in rep.missing]
    assert not missing, f"never exercised by the explorer: {missing}"
    assert rep.fraction() == f"{len(SPEC.transitions)}/{len(SPEC.transitions)}"


def test_fuzz_run_coverage_and_report() -> None:
    res = fuzz(steps=4000, seed=1)  # episodes alternate fences: both release paths share the steps
    assert res.violation is None, res.violation
    assert res.steps == 4000 and res.episodes > 1
    rep = report({"fuzz": res.coverage}, SPEC)
    assert len(rep.covered) >= 0.75 * len(SPEC.transitions), rep.fraction()
    # the rich table names what the fuzz run never took
    buf = io.StringIO()
    Console(file=buf, width=140).print(rep.table())
    text = buf.getvalue()
    assert "transition coverage" in text
    for t in rep.missing:
        assert f"T{t.id}" in text
    assert ("never" in text) == bool(rep.missing)


def test_report_names_missing_transitions() -> None:
    rep = report({"a": {0, 1}, "b": {1, 2, 999}}, SPEC)
    assert rep.covered == {0, 1, 2, 999}
    assert [t.id for t in rep.missing] == [t.id for t in SPEC.transitions if t.id not in (0, 1, 2)]
    assert rep.fraction("a") == f"2/{len(SPEC.transitions)}"
    rows = {tid: by for tid, _, by in rep.rows()}
    assert rows["T1"] == "a, b" and rows["T2"] == "b" and rows[f"T{len(SPEC.transitions) - 1}"] == "-"
