"""Render a checked spec for humans. Deterministic, so CI can require the committed docs to be fresh."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import jinja2

from kvfsm.spec import CompiledSpec


def _edges(spec: CompiledSpec) -> dict[tuple[str, str], list[str]]:
    """Transitions grouped by (source, target), each labelled `event [guard]`."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for t in spec.transitions:
        label = t.event + (f" [{t.guard}]" if t.guard else "")
        if label not in edges[(t.src, t.dst)]:
            edges[(t.src, t.dst)].append(label)
    return edges


def diagram(spec: CompiledSpec, fmt: str = "mermaid") -> str:
    """The state diagram as Mermaid `stateDiagram-v2` or Graphviz `dot` text."""
    edges = _edges(spec)
    terminal = [s for s, m in spec.model.states.items() if m.terminal]
    if fmt == "mermaid":
        lines = ["stateDiagram-v2", f"    [*] --> {spec.initial}"]
        lines += [f"    {a} --> {b}: {', '.join(labels)}" for (a, b), labels in edges.items()]
        lines += [f"    {s} --> [*]" for s in terminal]
        return "\n".join(lines) + "\n"
    if fmt == "dot":
        lines = [
            f"digraph {spec.name} {{",
            "    rankdir=LR;",
            "    node [shape=box, style=rounded];",
            "    __start [shape=point];",
            f"    __start -> {spec.initial};",
        ]
        lines += [f"    {s} [peripheries=2];" for s in terminal]
        newline = "\\n"
        lines += [f'    {a} -> {b} [label="{newline.join(labels)}"];' for (a, b), labels in edges.items()]
        lines.append("}")
        return "\n".join(lines) + "\n"
    raise ValueError(f"unknown diagram format {fmt!r} (use mermaid or dot)")


_BUG_ID = re.compile(r"\bB\d{1,2}\b")
_DOC = jinja2.Environment(
    loader=jinja2.PackageLoader("kvfsm.docsgen", "templates"),
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    undefined=jinja2.StrictUndefined,
)


def markdown(spec: CompiledSpec, spec_path: str) -> str:
    """The auditor's reference: every element with its doc, the full transition table, the diagram."""
    outcomes = sorted(
        spec.outcomes.values(), key=lambda o: (o.kind, spec.states.index(o.state), spec.events.index(o.event))
    )
    # kvfsm's own specs cite its bug classes (B<n>): their pages (docs/spec/) link the catalog beside them.
    cites_catalog = _BUG_ID.search(Path(spec.path).read_text()) is not None
    return _DOC.get_template("spec.md.j2").render(
        spec=spec,
        model=spec.model,
        spec_path=spec_path,
        outcomes=outcomes,
        mermaid=diagram(spec, "mermaid"),
        cites_catalog=cites_catalog,
    )
