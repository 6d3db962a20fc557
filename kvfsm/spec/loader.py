"""Read a spec YAML file into plain data plus a map from each element's path to its line.

Auditors and authors need every error to point at `file:line`; PyYAML's composed node tree keeps the
marks, so we walk it ourselves instead of using `safe_load` (which also silently accepts duplicate keys).

A spec arrives in pull requests, so it is read within `kvfsm.input_limits.SPEC_LIMITS` (size, nesting
depth, node count) and YAML aliases are refused outright: a spec gains nothing from them, and refusing
them means no expansion to account for. A breach is a SpecInvalid naming the file, the line and the bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvfsm.errors import InputRejected
from kvfsm.input_limits import SPEC_LIMITS, InputLimits, compose_yaml, decode_utf8, read_bounded
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
                raise SpecInvalid(
                    [
                        SpecError(
                            lines.file,
                            key_node.start_mark.line + 1,
                            ".".join(map(str, loc)) or "<root>",
                            f"mapping key must be a name, got {key!r}",
                        )
                    ]
                )
            if key in out:
                raise SpecInvalid(
                    [
                        SpecError(
                            lines.file,
                            key_node.start_mark.line + 1,
                            str(key),
                            f"duplicate key {key!r} (first at line {lines.line(loc + (key,))})",
                        )
                    ]
                )
            lines.record(loc + (key,), key_node.start_mark.line + 1)
            out[key] = _to_data(value_node, loc + (key,), lines)
            # keep the key's own line: a value on the next line should not move the element's anchor
            lines.record(loc + (key,), key_node.start_mark.line + 1)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_data(item, loc + (i,), lines) for i, item in enumerate(node.value)]
    try:
        return _SCALARS.construct_object(node, deep=True)
    except (ValueError, OverflowError, yaml.YAMLError) as exc:  # an int past Python's digit limit, an unknown tag
        raise SpecInvalid(
            [
                SpecError(
                    lines.file,
                    node.start_mark.line + 1,
                    ".".join(map(str, loc)) or "<root>",
                    f"unreadable value: {exc}",
                )
            ]
        ) from None


def load_yaml(path: str | Path, limits: InputLimits = SPEC_LIMITS) -> tuple[Any, LineMap, bytes]:
    """Return (data, line map, raw bytes) for `path`; YAML syntax errors and breaches of `limits` become
    SpecInvalid with a line."""
    path = Path(path)
    try:
        raw = read_bounded(path, limits, "spec")
    except OSError as exc:
        raise SpecInvalid([SpecError(str(path), 0, "<file>", f"cannot read spec: {exc.strerror or exc}")]) from None
    except InputRejected as exc:
        raise SpecInvalid([SpecError(str(path), exc.line, "<input>", exc.reason)]) from None
    lines = LineMap(str(path))
    try:
        node = compose_yaml(decode_utf8(raw, str(path), "spec"), limits, str(path), "spec")
    except InputRejected as exc:
        raise SpecInvalid([SpecError(str(path), exc.line, "<input>", exc.reason)]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise SpecInvalid([SpecError(str(path), line, "<yaml>", f"malformed YAML: {exc.problem or exc}")]) from None
    if node is None:
        raise SpecInvalid([SpecError(str(path), 1, "<file>", "empty spec")])
    return _to_data(node, (), lines), lines, raw
