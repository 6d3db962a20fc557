"""`explore(jobs=N)` / `kvfsm check --jobs N`: worker processes expand each BFS level, and the search is the
one of one process: the same states at the same depths, the same events run, the same coverage, and the
same shortest violation (the workers are forked, so they see a monkeypatched fault too)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from catalog_faults import b2

from kvfsm.cli import app
from kvfsm.verify.explorer import ExplorerConfig, explore


# Two symmetric requests contending for the host pool, and one request re-admitted against it (the CI bound's
# `readmit-host-full`, 321 states). A two-request re-admission bound (1,004 states) cost 21 s of the suite's CPU on
# the 2-core CI machine, searched once alone and once by workers; the reduction soundness tests search it.
@pytest.mark.parametrize(
    "cfg",
    [
        ExplorerConfig(requests=2, host_slots=2, decodes=2),
        ExplorerConfig(requests=1, decodes=3, host_slots=2, readmits=1),
    ],
    ids=["2req-host2", "1req-readmit-host-full"],
)
def test_jobs_reach_what_one_process_reaches(cfg: ExplorerConfig) -> None:
    one = explore(cfg, keep_keys=True)
    two = explore(cfg, keep_keys=True, jobs=2)
    assert one.complete and two.complete and two.jobs == 2
    assert two.keys == one.keys  # every state, each at its depth
    assert (two.states, two.edges, two.pruned, two.reexpanded, two.depth) == (
        one.states,
        one.edges,
        one.pruned,
        one.reexpanded,
        one.depth,
    )
    assert two.coverage == one.coverage


def test_jobs_find_the_same_shortest_violation(monkeypatch: pytest.MonkeyPatch) -> None:
    b2(monkeypatch)
    cfg = ExplorerConfig(requests=2)
    one, three = explore(cfg), explore(cfg, jobs=3)
    assert one.violation is not None and three.violation is not None
    assert three.violation.events == one.violation.events and three.violation.name == one.violation.name
    assert three.states == one.states


def test_check_takes_jobs() -> None:
    res = CliRunner().invoke(app, ["check", "--requests", "2", "--jobs", "2"])
    assert res.exit_code == 0, res.output
    assert "no invariant violated" in res.output
    assert CliRunner().invoke(app, ["check", "--requests", "1", "--jobs", "0"]).exit_code == 2
