"""The formatter leaves exactly the modules that mutation testing mutates as they are written (pyproject's
`[tool.ruff.format] exclude`): their recorded survivors, equivalences and GPU pass match mutmut's diff lines by
their text, which reformatting would change. A module that joins a mutation scope must join the exclusion too, or
the next format makes its records stale; one that leaves every scope is formatted."""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, which pytest itself requires there
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import mutate  # noqa: E402


def test_the_formatter_leaves_exactly_the_mutated_modules_as_written() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    excluded = {p for p in config["tool"]["ruff"]["format"]["exclude"] if p.startswith("kvfsm/")}
    modules = [str(path.relative_to(ROOT)) for path in sorted(ROOT.glob("kvfsm/**/*.py"))]
    mutated = {rel for scope in mutate.SCOPES.values() for rel in modules if scope.mutates(rel)}
    assert mutated, "no scope mutates a module of kvfsm/"
    assert sorted(mutated - excluded) == [], "mutated, yet the formatter would rewrite them"
    assert sorted(excluded - mutated) == [], "left unformatted, yet no scope mutates them"
    # the generated machines (mutated as kvfsm/generated/) are left as the generator writes them
    assert "generated/**" in config["tool"]["ruff"]["format"]["exclude"]
