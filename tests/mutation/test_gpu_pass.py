"""The GPU pass's bookkeeping, on the CPU: the survivors that only a CUDA host tells apart are never counted as
equivalent, each still applies to today's source, and docs/mutation.md says what tests/mutation/gpu_pass.json
holds (the pass itself runs on a GPU machine: tests/mutation/gpu_pass.py run)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import zlib
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpu_pass  # noqa: E402
import mutate  # noqa: E402


def _survivor_lines() -> list[str]:
    return [l for l in mutate.REPORT.read_text().splitlines() if gpu_pass.LINE.match(l)]


def test_no_survivor_is_called_equivalent_for_lack_of_a_cuda_host() -> None:
    lines = _survivor_lines()
    assert len(lines) == json.loads(mutate.SURVIVORS.read_text())["summary"]["survived"]
    for line in lines:
        reason = line.split("`: ", 1)[1] if "`: " in line else line
        if mutate.NEEDS_CUDA.search(reason):
            assert "not equivalent, told apart only on a CUDA host (" in line, line
    summary = json.loads(mutate.SURVIVORS.read_text())["summary"]
    assert summary["needs_cuda"] == len([m for m in gpu_pass.selected() if m.scope == "main"]) > 0
    assert summary["equivalent"] + summary["needs_cuda"] + summary["unexplained"] == summary["survived"]


# ids stable across processes (xdist's workers must collect the same tests): not hash(), which is salted
@pytest.mark.parametrize(
    "mutant", gpu_pass.selected(), ids=lambda m: f"{m.qualname[-1]}:{zlib.crc32(m.change.encode()):08x}"
)
def test_each_mutant_of_the_pass_still_applies_to_the_source(mutant: gpu_pass.Mutant, tmp_path: Path) -> None:
    dest = tmp_path / mutant.module_path
    dest.parent.mkdir(parents=True)
    shutil.copy2(mutate.ROOT / mutant.module_path, dest)
    before = dest.read_text()
    gpu_pass.apply(mutant, tmp_path)
    assert dest.read_text() != before


def test_the_report_says_what_the_last_gpu_pass_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpu_pass.py report` on the committed report changes nothing: the doc is current with gpu_pass.json."""
    report, survivors = tmp_path / "mutation.md", tmp_path / "survivors.json"
    shutil.copy2(mutate.REPORT, report)
    shutil.copy2(mutate.SURVIVORS, survivors)
    monkeypatch.setattr(mutate, "REPORT", report)
    monkeypatch.setattr(mutate, "SURVIVORS", survivors)
    assert gpu_pass.cmd_report(None) == 0  # type: ignore[arg-type]
    assert report.read_text() == (mutate.ROOT / "docs" / "mutation.md").read_text()
    assert survivors.read_text() == (HERE / "survivors.json").read_text()


def test_a_kill_in_a_pass_stopped_before_its_clean_run_is_provisional() -> None:
    change = "- a\n+ b"
    stopped = {
        "clean": None,
        "mutants": [
            {"function": "m.x_f", "change": change, "status": "killed", "first_failure": "tests/gpu/test_x.py::test_y"}
        ],
    }
    finished = dict(stopped, clean={"rc": 0})
    assert "provisionally" in mutate.gpu_verdict("m.x_f", change, stopped)
    assert mutate.gpu_verdict("m.x_f", change, finished) == "killed on the GPU by `tests/gpu/test_x.py::test_y`"
    assert mutate.gpu_verdict("m.x_g", change, finished) == "not yet run on a GPU"


def test_the_test_that_killed_a_mutant_before_runs_first_and_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hinted mutant dies at its earlier pass's test without the suites; an unhinted one runs the suites, and a
    failure's section comes back with it (the unmutated run's record keeps it)."""
    (tmp_path / "test_kills.py").write_text("def test_dies():\n    assert 1 == 2, 'told apart'\n")
    (tmp_path / "test_suite.py").write_text("def test_lives():\n    pass\n")
    monkeypatch.setattr(gpu_pass, "SUITES", [([], ["test_suite.py"])])
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    hinted = gpu_pass._run_tests(tmp_path, env, "test_kills.py::test_dies")
    assert hinted["rc"] == 1 and hinted["first_failure"] == "test_kills.py::test_dies"
    assert len(hinted["summary"]) == 1 and "told apart" in hinted["failures"]
    gone = gpu_pass._run_tests(tmp_path, env, "test_renamed.py::test_dies")  # not a kill: the suites decide
    assert gone["rc"] == 0 and len(gone["summary"]) == 2
    plain = gpu_pass._run_tests(tmp_path, env)
    assert plain["rc"] == 0 and len(plain["summary"]) == 1 and "1 passed" in plain["summary"][0]


@pytest.mark.parametrize(
    "name, tag",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("Tesla V100-SXM2-16GB", "v100"),
        ("Some Card", "some-card"),
    ],
)
def test_each_card_logs_under_its_short_name(name: str, tag: str) -> None:
    """A pass's log is named by the card that ran it (mutation_gpu-<tag>.log), so a pass on another card never
    overwrites the log of the mutants an earlier card decided."""
    assert gpu_pass.gpu_tag(name) == tag


def test_each_verdict_in_the_record_names_its_card() -> None:
    record = json.loads(gpu_pass.RESULTS.read_text())
    assert record["mutants"] and all(r.get("gpu", "").startswith("NVIDIA ") for r in record["mutants"])
