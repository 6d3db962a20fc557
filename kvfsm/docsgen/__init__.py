"""Auditor-facing renderings of a spec: Mermaid and Graphviz diagrams, and a Markdown reference."""

from kvfsm.docsgen.render import diagram, markdown

__all__ = ["diagram", "markdown"]
