"""The formatter covers every module of kvfsm/: pyproject's `[tool.ruff.format]` leaves out only the generated
machines and the Markdown. The mutated modules are no exception: their survivors, equivalences and GPU pass
match mutmut's diff lines by their text, and a formatter that rewrites them (a new ruff release, a changed
setting) is followed by the scopes' runs and tests/mutation/rekey.py, which carries the GPU verdicts over."""

from __future__ import annotations

from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, which pytest itself requires there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_the_formatter_leaves_out_only_the_generated_machines_and_the_markdown() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # the generated machines (kvfsm gen writes them; gen --check holds them to its bytes) and the Markdown (its
    # code blocks quote generated code and spec lines as they are)
    assert sorted(config["tool"]["ruff"]["format"]["exclude"]) == ["*.md", "generated/**"]
