"""Read a spec YAML file into plain data plus a map from each element's path to its line.

Auditors and authors need every error to point at `file:line`; PyYAML's composed node tree keeps the
marks, so we walk it ourselves instead of using `safe_load` (which also silently accepts duplicate keys).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvfsm.spec.errors import SpecError, SpecInvalid

Loc = tuple[Any, ...]
_SCALARS = yaml.constructor.SafeConstructor()


class LineMap:
    """Maps a data path such as ('transitions', 3, 'guard') to its 1-based line in the source."""

    def __init__(self, file: str) -> None:
        self.file = file
        self._lines: dict[Loc, int] = {}

    def record(self, loc: Loc, line: int) -> None:
        self._lines[loc] = line

    def line(self, loc: Loc) -> int:
        """The line of `loc`, or of its nearest recorded ancestor."""
        loc = tuple(loc)
        while loc and loc not in self._lines:
            loc = loc[:-1]
        return self._lines.get(loc, 1)

    def error(self, loc: Loc, element: str, message: str) -> SpecError:
        return SpecError(self.file, self.line(loc), element, message)


def _to_data(node: yaml.Node, loc: Loc, lines: LineMap) -> Any:
    lines.record(loc, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            # Keys are names: take the raw text so YAML 1.1 never turns `on:` into True.
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str):
                raise SpecInvalid([SpecError(lines.file, key_node.start_mark.line + 1, ".".join(map(str, loc)) or "<root>",
                                             f"mapping key must be a name, got {key!r}")])
            if key in out:
                raise SpecInvalid([SpecError(lines.file, key_node.start_mark.line + 1, str(key),
                                             f"duplicate key {key!r} (first at line {lines.line(loc + (key,))})")])
            lines.record(loc + (key,), key_node.start_mark.line + 1)
            out[key] = _to_data(value_node, loc + (key,), lines)
            # keep the key's own line: a value on the next line should not move the element's anchor
            lines.record(loc + (key,), key_node.start_mark.line + 1)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_data(item, loc + (i,), lines) for i, item in enumerate(node.value)]
    return _SCALARS.construct_object(node, deep=True)


def load_yaml(path: str | Path) -> tuple[Any, LineMap, bytes]:
    """Return (data, line map, raw bytes) for `path`; YAML syntax errors become SpecInvalid with a line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecInvalid([SpecError(str(path), 0, "<file>", f"cannot read spec: {exc.strerror or exc}")]) from None
    lines = LineMap(str(path))
    try:
        text = raw.decode("utf-8")
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SpecInvalid([SpecError(str(path), line, "<file>", f"not UTF-8: {exc.reason}")]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise SpecInvalid([SpecError(str(path), line, "<yaml>", f"malformed YAML: {exc.problem or exc}")]) from None
    if node is None:
        raise SpecInvalid([SpecError(str(path), 1, "<file>", "empty spec")])
    return _to_data(node, (), lines), lines, raw
