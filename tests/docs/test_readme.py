"""The README's integration example runs as written; the committed auditor docs are fresh."""

from __future__ import annotations

import re

import pytest
from pathlib import Path

from kvfsm.docsgen import markdown
from kvfsm.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]


def test_readme_integration_example_runs(tmp_path):
    text = (ROOT / "README.md").read_text()
    section = text.split("## Integrating with an engine", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 20 <= len(code.strip().splitlines()) <= 45
    exec(compile(code, "README.md", "exec"), {"store_dir": tmp_path / "store"})


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "spec").glob("*.yaml")))
def test_committed_auditor_docs_are_fresh(name):
    spec = load_spec(ROOT / f"spec/{name}.yaml")
    assert (ROOT / f"docs/spec/{name}.md").read_text() == markdown(spec, f"spec/{name}.yaml")
