"""The JSON Schema in spec/ is exported from the pydantic models and kept fresh."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvfsm.cli import app
from kvfsm.spec.model import json_schema_text

ROOT = Path(__file__).resolve().parents[2]


def test_committed_schema_is_fresh_and_describes_the_format(schema_as_committed):
    path = ROOT / "spec" / "kvfsm-spec.schema.json"
    assert path.read_text() == json_schema_text()
    schema = json.loads(path.read_text())
    assert {"machine", "states", "events", "transitions"} <= set(schema["required"])
    assert "from" in schema["$defs"]["TransitionRule"]["properties"]


def test_schema_check_cli(tmp_path):
    stale = tmp_path / "schema.json"
    stale.write_text("{}")
    runner = CliRunner()
    assert runner.invoke(app, ["schema", "--check", "--out", str(stale)]).exit_code == 1
    assert runner.invoke(app, ["schema", "--out", str(stale)]).exit_code == 0
    assert runner.invoke(app, ["schema", "--check", "--out", str(stale)]).exit_code == 0
