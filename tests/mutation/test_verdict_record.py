"""The verdict record (tests/mutation/verdicts.json.xz): what a run leaves for a checkout that has no workspace.
`save_verdicts` keeps each mutated file's exit codes and function hashes; `restore_verdicts` lays out a workspace
and puts them back where mutmut reads them before it generates mutants, so that mutmut keeps the verdicts of the
functions whose hash is unchanged (its own rule after a change; checked on the sample workspace when this was
written: 20 of 20 verdicts kept, and every mutant of a function given another hash left unchecked)."""

from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mutate  # noqa: E402


def _meta(codes: dict[str, int | None], hashes: dict[str, str]) -> dict:
    return {
        "exit_code_by_key": codes,
        "hash_by_function_name": hashes,
        "type_check_error_by_key": {},
        "durations_by_key": {k: 1.5 for k in codes},
        "estimated_durations_by_key": {},
    }


def test_a_record_puts_every_verdict_and_hash_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    monkeypatch.setattr(mutate, "WORK", work)
    metas = {
        "kvfsm/runtime/a.py.meta": _meta(
            {
                "kvfsm.runtime.a.x_f__mutmut_1": 1,
                "kvfsm.runtime.a.x_f__mutmut_2": 0,
                "kvfsm.runtime.a.x_g__mutmut_1": None,
            },
            {"x_f": "aa", "x_g": "bb"},
        ),
        "kvfsm/b.py.meta": _meta({"kvfsm.b.x_h__mutmut_1": 36}, {"x_h": "cc"}),
    }
    for rel, data in metas.items():
        (work / "mutants" / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / "mutants" / rel).write_text(json.dumps(data))
    run = {"seconds": 5659, "max_children": 2, "reruns": [{"survivors": 7, "seconds": 60, "rc": 0}]}
    (work / "run.json").write_text(json.dumps(run))
    record = mutate.save_verdicts(tmp_path / "verdicts.json.xz")
    saved = json.loads(lzma.decompress(record.read_bytes()))
    assert set(saved["files"]) == set(metas) and saved["run"] == run
    assert all(set(v) == {"exit_code_by_key", "hash_by_function_name"} for v in saved["files"].values())

    laid_out = []
    monkeypatch.setattr(mutate, "layout", lambda: (mutate.shutil.rmtree(work), work.mkdir(), laid_out.append(1)))
    assert mutate.restore_verdicts(record) == 3  # the exit codes recorded (an unchecked mutant holds none)
    assert laid_out == [1]
    for rel, data in metas.items():
        back = json.loads((work / "mutants" / rel).read_text())
        assert back["exit_code_by_key"] == data["exit_code_by_key"]
        assert back["hash_by_function_name"] == data["hash_by_function_name"]
        assert back["durations_by_key"] == {}  # not recorded: only the run of a mutant needs its duration
    assert json.loads((work / "run.json").read_text()) == run  # the report's wall time and later passes


def test_each_scope_keeps_its_record_beside_its_survivors() -> None:
    records = {name: scope.verdicts for name, scope in mutate.SCOPES.items()}
    assert records["main"] == HERE / "verdicts.json.xz"
    assert records["fences-adapter"] == HERE / "verdicts_fences_adapter.json.xz"


def test_the_report_names_a_refresh_from_the_record() -> None:
    restored = mutate._later_pass({"changed": [], "seconds": 90, "restored": True})
    assert "rebuilt from tests/mutation/verdicts.json.xz" in restored and "1.5 min" in restored
    assert "after a change to 0 mutated files" in mutate._later_pass({"changed": [], "seconds": 60})
    assert "7 survivors run again" in mutate._later_pass({"survivors": 7, "seconds": 60})


def test_a_survivor_names_its_function_as_written_even_when_the_class_name_ends_in_x() -> None:
    """mutmut names a method x<U+01C1>Class<U+01C1>method: the report writes Class.method, without eating the x that
    ends a class name (StoredPageIndex) and with the dot between the two."""
    change = "- a = 1\n+ a = 2"
    assert mutate._readable("kvfsm.runtime.stored_index.x\u01c1StoredPageIndex\u01c1_grow", change) == (
        "StoredPageIndex._grow",
        "a = 1",
        "a = 2",
    )
    assert mutate._readable("kvfsm.runtime.build.x_storage_factory", change)[0] == "storage_factory"
