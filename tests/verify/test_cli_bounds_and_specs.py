"""`kvfsm check`, `replay`, `gen` and `--version` as a user meets them: bad bounds are usage errors, an
unreached transition is said out loud, and every spec path works from any directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvfsm
import kvfsm.generated.decode_offload as machine
from kvfsm.cli import app
from kvfsm.verify.commands import UNREACHED
from kvfsm.verify.explorer import BoundInvalid, ExplorerConfig

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "spec" / "decode_offload.yaml"


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize(
    "args",
    [
        ["--requests", "0"],
        ["--page-size", "0"],
        ["--slots", "0"],
        ["--host-slots", "0"],
        ["--backup-queue", "0"],
        ["--decodes", "-1"],
        ["--stride", "3"],
        ["--slots", "3"],
        ["--max-depth", "0"],
    ],
)
def test_meaningless_bounds_are_usage_errors_not_violations(args: list[str]) -> None:
    res = cli("check", "--requests", "1", *args) if "--requests" not in args else cli("check", *args)
    assert res.exit_code == 2, res.output
    assert "violation" not in res.output


def test_bound_invalid_names_the_field() -> None:
    with pytest.raises(BoundInvalid, match="stride=3: must be a multiple of page_size=2"):
        ExplorerConfig(stride=3)
    with pytest.raises(BoundInvalid, match="requests=0"):
        ExplorerConfig(requests=0)


def test_check_names_unreached_transitions_and_require_all_fails() -> None:
    res = cli("check", "--requests", "1", "--slots", "8")
    assert res.exit_code == 0, res.output
    assert "not reached at this bound" in res.output and "T3: allocated --host_full--> allocated" in res.output
    assert "every transition reached" not in res.output
    strict = cli("check", "--requests", "1", "--slots", "8", "--require-all")
    assert strict.exit_code == UNREACHED, strict.output


@pytest.mark.parametrize(
    "args",
    [
        ["--ci", "--bound", "default"],
        ["--bound", "ci", "--requests", "1"],
        ["--requests", "1", "--report", "page.md"],
        ["--bound", "nightly"],
    ],
)
def test_named_bounds_and_bound_options_do_not_mix(args: list[str]) -> None:
    res = cli("check", *args)
    assert res.exit_code == 2, res.output
    assert "exploring" not in res.output


def test_check_and_demo_refuse_a_spec_the_runtime_was_not_generated_from(tmp_path: Path) -> None:
    edited = tmp_path / "spec" / "decode_offload.yaml"
    edited.parent.mkdir()
    edited.write_text(SPEC.read_text().replace("doc: ", "doc: (edited) ", 1))
    res = cli("check", "--requests", "1", "--spec", str(edited))
    assert res.exit_code == 2 and "not what" in res.output, res.output
    other = cli("check", "--requests", "1", "--spec", str(ROOT / "spec" / "cb_swap.yaml"))
    assert other.exit_code == 2 and "the manager runs decode_offload.py" in other.output, other.output


def test_replay_takes_spec(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"kind": "header", "spec_sha256": machine.SPEC_SHA256}) + "\n")
    assert cli("replay", str(trace), "--spec", str(SPEC)).exit_code == 0
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [\n")
    res = cli("replay", str(trace), "--spec", str(broken))
    assert res.exit_code == 2 and "broken.yaml" in res.output, res.output


def test_gen_check_is_the_same_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for where in (ROOT, ROOT / "spec", tmp_path):
        monkeypatch.chdir(where)
        for spec in ("decode_offload", "cb_swap"):
            res = cli("gen", str(ROOT / "spec" / f"{spec}.yaml"), "--check")
            assert res.exit_code == 0 and "up to date" in res.output, (where, res.output)
    monkeypatch.chdir(ROOT / "spec")
    assert cli("gen", "decode_offload.yaml", "--check").exit_code == 0
    assert cli("gen", "--check").exit_code == 0  # the shipped spec by default


def test_schema_check_is_the_same_from_spec(monkeypatch: pytest.MonkeyPatch, schema_as_committed: None) -> None:
    monkeypatch.chdir(ROOT / "spec")
    assert cli("schema", "--check").exit_code == 0


def test_gen_writes_a_copied_project_beside_its_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(ROOT / "spec", tmp_path / "spec")
    monkeypatch.chdir(tmp_path / "spec")
    assert cli("gen", "decode_offload.yaml").exit_code == 0
    written = tmp_path / "generated" / "decode_offload.py"
    assert written.read_text() == (ROOT / "generated" / "decode_offload.py").read_text()


def test_two_different_specs_are_refused() -> None:
    res = cli("validate", str(SPEC), "--spec", str(ROOT / "spec" / "cb_swap.yaml"))
    assert res.exit_code == 2 and "two different specs" in res.output


def test_version_prints_version_and_spec_hashes() -> None:
    res = cli("--version")
    assert res.exit_code == 0
    assert res.output.startswith(f"kvfsm {kvfsm.__version__};") and machine.SPEC_SHA256[:16] in res.output
    import kvfsm.generated.cb_swap as cb
    import kvfsm.generated.offload_chunk as oc

    assert cb.SPEC_SHA256[:16] in res.output and oc.SPEC_SHA256[:16] in res.output
