"""Each `kvfsm` command imports only what it uses: `--help` builds no spec model, code generator or docs
renderer and imports no torch; the spec tools (validate, gen, schema, diagram, docs) import neither torch nor
numpy. Checked on the modules a fresh interpreter holds after the command ran, not on timings, so a change
that pulls torch into the command line fails here on any machine, however busy (bench/cli_startup.py measures
the time itself)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from timing import run_watched

ROOT = Path(__file__).resolve().parents[2]
SPEC = "spec/decode_offload.yaml"

# Runs `kvfsm <argv>` as the installed entry point does, then prints the exit code and every module loaded.
PROBE = """
import json, sys
sys.argv = ["kvfsm", *json.loads(sys.argv[1])]
from kvfsm.cli import app
try:
    app()
    code = 0
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""

HEAVY = ("torch", "numpy")
# what only the spec tools themselves need: the spec models, the code generator, the docs renderer
SPEC_TOOLING = ("jinja2", "kvfsm.spec", "kvfsm.codegen", "kvfsm.docsgen")


def _run(argv: list[str]) -> tuple[int, set[str]]:
    proc = run_watched([sys.executable, "-c", PROBE, json.dumps(argv)], f"kvfsm {' '.join(argv)}", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc["code"], set(doc["modules"])


def _loaded(modules: set[str], roots: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == r or m.startswith(r + ".") for r in roots))


def test_importing_the_cli_loads_no_spec_model_generator_or_torch() -> None:
    proc = run_watched(
        [sys.executable, "-c", "import json, sys, kvfsm.cli; print(json.dumps(sorted(sys.modules)))"],
        "import kvfsm.cli",
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    modules = set(json.loads(proc.stdout))
    assert _loaded(modules, HEAVY + SPEC_TOOLING + ("pydantic",)) == []


def test_help_loads_no_spec_model_generator_or_torch() -> None:
    code, modules = _run(["--help"])
    assert code == 0
    assert _loaded(modules, HEAVY + SPEC_TOOLING + ("pydantic",)) == []


# a command's own help: typer converts its parameters with pydantic, but nothing of the command runs
@pytest.mark.parametrize("argv", [["validate", "--help"], ["gen", "--help"], ["check", "--help"]], ids=" ".join)
def test_a_command_s_help_runs_none_of_it(argv: list[str]) -> None:
    code, modules = _run(argv)
    assert code == 0
    assert _loaded(modules, HEAVY + SPEC_TOOLING) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", SPEC],
        ["gen", SPEC, "--check"],
        ["schema", "--check"],
        ["diagram", SPEC],
        ["docs", SPEC],
    ],
    ids=" ".join,
)
def test_spec_tools_load_neither_torch_nor_numpy(argv: list[str], request: pytest.FixtureRequest) -> None:
    if argv[0] == "schema":  # --check: the committed schema is this pydantic's rendering
        request.getfixturevalue("schema_as_committed")
    code, modules = _run(argv)
    assert code == 0
    assert "kvfsm.spec.model" in modules  # the command ran its spec path, not just its help
    assert _loaded(modules, HEAVY) == []
