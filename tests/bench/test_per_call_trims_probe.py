"""bench/probes/per_call_trims.py: every figure it prints is timed, and it says which kvfsm it timed."""

from __future__ import annotations

import json
from pathlib import Path

import kvfsm


def test_it_times_each_path_of_the_kvfsm_it_imports(import_probe, tmp_path: Path) -> None:
    probe = import_probe("per_call_trims")
    out = tmp_path / "trims.json"
    assert probe.main(["--repeats", "1", "--number", "2000", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["kvfsm"] == str(Path(kvfsm.__file__).parent)
    assert row["picked_rows"] > 0
    assert all(row[k] > 0 for k in row if k.endswith(("_ns", "_us")))
