"""The integration example of docs/integrations.md runs as written; the committed auditor docs are fresh; the
architecture page names the tree as it is; the README's lifecycle diagram is the spec's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvfsm.docsgen import markdown
from kvfsm.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]


def test_integration_example_runs(tmp_path):
    text = (ROOT / "docs" / "integrations.md").read_text()
    section = text.split("## Integrating with an engine", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 20 <= len(code.strip().splitlines()) <= 45
    exec(compile(code, "docs/integrations.md", "exec"), {"store_dir": tmp_path / "store"})


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "spec").glob("*.yaml")))
def test_committed_auditor_docs_are_fresh(name):
    spec = load_spec(ROOT / f"spec/{name}.yaml")
    assert (ROOT / f"docs/spec/{name}.md").read_text() == markdown(spec, f"spec/{name}.yaml")


def test_architecture_block_matches_the_tree():
    """Every package folder of kvfsm/ is named in docs/architecture.md's layout block, and every module the
    block names exists: a reader can say where a backend, a copy path or an integration goes."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```\n(spec/.*?)```", text, re.S).group(1)
    folders = sorted(
        p.parent.relative_to(ROOT / "kvfsm")
        for p in (ROOT / "kvfsm").rglob("__init__.py")
        if p.parent != ROOT / "kvfsm"
    )
    for folder in folders:
        assert f"{folder.name}/" in block, f"kvfsm/{folder} is not in docs/architecture.md's layout block"
    modules = {p.name for p in (ROOT / "kvfsm").rglob("*.py")} | {p.name for p in (ROOT / "generated").glob("*.py")}
    for name in re.findall(r"\b([a-z_]+\.py)\b", block):
        assert name in modules, f"docs/architecture.md's layout block names {name}, which does not exist"


def test_readme_lifecycle_diagram_is_the_spec_s():
    """The diagram a newcomer sees first is `kvfsm diagram` of the shipped spec, not a drawing that can age."""
    from kvfsm.docsgen import diagram

    text = (ROOT / "README.md").read_text()
    shown = re.search(r"```mermaid\n(.*?)```", text, re.S).group(1)
    assert shown.rstrip("\n") == diagram(load_spec(ROOT / "spec/decode_offload.yaml"), "mermaid").rstrip("\n")
