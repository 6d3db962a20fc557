"""The CI bound (`kvfsm check --ci`, kvfsm.verify.bounds.CI), which .ci/run explores on every commit: every
sub-bound completely, no invariant violated, every transition of the spec reached (--require-all), within its
budget of events and of CPU (measured against a calibration loop); and docs/explorer-coverage.md, the auditor's page, is what exploring the bounds writes (the CI
section here, the default section under KVFSM_FUZZ=deep, where the default bound is explored too)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from timing import calibration_cpu

import kvfsm.generated.decode_offload as gen
from kvfsm.spec import load_spec
from kvfsm.verify.bounds import CI, DEFAULT
from kvfsm.verify.commands import check
from kvfsm.verify.coverage_page import extract
from kvfsm.verify.replay import default_spec_path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "explorer-coverage.md"
DEEP = os.environ.get("KVFSM_FUZZ", "ci") == "deep"
STALE = "docs/explorer-coverage.md is stale: run `{}`"


def _regenerate(bound_name: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> tuple[int, str, str, float]:
    """Explore a named bound with --require-all, its report written over a copy of the committed page."""
    page = tmp_path / "explorer-coverage.md"
    page.write_text(PAGE.read_text())
    t0 = time.process_time()
    rc = check(bound=bound_name, require_all=True, quiet=True, report=page)
    return rc, capsys.readouterr().out, page.read_text(), time.process_time() - t0


# The CI bound's budget, as work and as speed. Work: the events it runs, fixed by the bounds (a bound that
# grows past this is a conscious edit here). Speed: its CPU time in units of a fixed pure-Python loop timed
# in the same process, so that a slow machine (the 2-core CI machine ran 1.7x slower on some days than on
# others, and an absolute "a minute of CPU" then failed a correct commit) moves both alike; what the ratio
# catches is the explorer or the runtime it drives getting slower per event. Measured on the 2-core CI
# machine (2026-12-02): 39,297 events, 89-100 s of CPU, 0.75 s per calibration loop (about 125 loops).
EVENT_BUDGET = 45_000
CALIBRATION_LOOPS = 190  # 1.5x the measured ratio
CPU_CEILING_S = 400  # whatever the machine: the bound must leave CI well inside its 90 minutes


def test_ci_bound_reaches_every_transition_and_the_page_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    unit = calibration_cpu()  # tests/timing.py: a fixed loop of dict and tuple work, fastest of three
    rc, out, page, cpu = _regenerate("ci", tmp_path, capsys)
    unit = min(unit, calibration_cpu())
    assert rc == 0, out
    assert "every transition reached" in out and "INCOMPLETE" not in out
    assert page == PAGE.read_text(), STALE.format(f"{CI.command} --report docs/explorer-coverage.md")
    section = extract(page, CI)
    assert section is not None
    events = int(re.search(r"(\d+) events run in all", section).group(1))  # type: ignore[union-attr]
    assert events <= EVENT_BUDGET, f"the CI bound runs {events} events, over its budget of {EVENT_BUDGET}"
    loops = cpu / unit
    print(f"CI bound: {events} events, {cpu:.1f} s of CPU = {loops:.0f} calibration loops of {unit:.2f} s")
    assert loops < CALIBRATION_LOOPS, (
        f"the CI bound took {cpu:.0f} s of CPU, {loops:.0f} times the calibration "
        f"loop ({unit:.2f} s here): over its budget of {CALIBRATION_LOOPS}"
    )
    assert cpu < CPU_CEILING_S, f"the CI bound took {cpu:.0f} s of CPU: too slow a machine for CI's 90 minutes"


def test_page_default_section_is_the_default_bound() -> None:
    """Without exploring it: the section names the default bound's sub-bounds exactly as they are now, the
    spec it was generated from is the runtime's, and every declared transition is reached."""
    section = extract(PAGE.read_text(), DEFAULT)
    assert section is not None and "Not generated yet" not in section, STALE.format(DEFAULT.command)
    assert f"sha256 `{gen.SPEC_SHA256[:16]}`" in section, STALE.format(DEFAULT.command)
    assert re.findall(r"^\| `([\w-]+)` \|", section, re.M) == [p.name for p in DEFAULT.parts]
    for part in DEFAULT.parts:
        assert f"- `{part.name}`: {part.config.describe()}" in section, STALE.format(DEFAULT.command)
    spec = load_spec(default_spec_path())
    rows = re.findall(r"^\| T(\d+) \| `[^`]+` \| (.+) \|$", section, re.M)
    assert [int(t) for t, _ in rows] == [t.id for t in spec.transitions]
    assert all(by != "**not reached**" for _, by in rows)
    assert "every sub-bound explored completely" in section


@pytest.mark.skipif(not DEEP, reason="explores the default bound (minutes): KVFSM_FUZZ=deep")
def test_default_bound_reaches_every_transition_and_the_page_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    rc, out, page, _ = _regenerate("default", tmp_path, capsys)
    assert rc == 0, out
    assert page == PAGE.read_text(), STALE.format(f"{DEFAULT.command} --report docs/explorer-coverage.md")
