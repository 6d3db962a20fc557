"""Bounds on what kvfsm reads from outside the engine: spec files, config files and KVFSM_* variables,
replay traces and the schema file. docs/security.md lists the surfaces; this module is the one place the
bounds live, shared by every reader.

A file from a pull request, an environment or another process is hostile until read: a kilobyte of nested
YAML aliases expands to billions of strings, and ten thousand nested brackets overflow the interpreter's
stack in PyYAML's composer or `json.loads`. Every reader here checks size, nesting depth, aliases and
element count *while* it reads (YAML event by event, aliases counted at their expanded size; JSON by a
bracket scan before it is parsed), so nothing is expanded, built or written before a bound has held. A
breach is `InputBoundExceeded`, naming the source, the line and the bound; other unreadable input (not
UTF-8, not a file) is `InputRejected`. Callers wrap them in their own typed errors (SpecInvalid,
ConfigError) or let them through (`kvfsm replay`).

The defaults are far above anything kvfsm writes (the largest shipped spec is 19 KB, nesting 4, about
1,000 YAML nodes; a trace line is about 300 bytes) and each reader takes `limits=` to raise them.
"""

from __future__ import annotations

import io
import os
import stat
from dataclasses import dataclass
from typing import Any, Optional

import yaml

from kvfsm.errors import InputBoundExceeded, InputRejected

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class InputLimits:
    """The bounds of one kind of input. `max_aliases` 0 refuses YAML aliases outright (a spec gains nothing
    from them); `max_elements` counts every mapping, list and scalar node, each alias at its expanded size.
    `max_line_bytes` bounds each line of a line-oriented input (a trace); there `max_elements` and
    `max_depth` bound each line's JSON value."""

    max_bytes: int
    max_depth: int
    max_elements: int
    max_aliases: int = 0
    max_line_bytes: Optional[int] = None


# A spec: a few dozen states, events and transitions (the largest shipped spec: 19 KB, 1,010 nodes, depth 4).
SPEC_LIMITS = InputLimits(max_bytes=1 * MIB, max_depth=16, max_elements=50_000, max_aliases=0)
# The semantic checks enumerate counter valuations for every transition and state (kvfsm.spec.checks): their
# product bounds the time `validate` takes (the shipped specs need at most 6,656; a million is seconds).
SPEC_MAX_CHECK_WORK = 1_000_000
# An OffloadConfig file: twenty fields and a backend's options; aliases allowed (shared option blocks).
CONFIG_LIMITS = InputLimits(max_bytes=1 * MIB, max_depth=16, max_elements=10_000, max_aliases=100)
# One KVFSM_* variable's value (a JSON value where it parses).
ENV_VALUE_LIMITS = InputLimits(max_bytes=64 * KIB, max_depth=16, max_elements=10_000)
# A replay trace: read a line at a time, so the file may be large; each line is one JSON object.
TRACE_LIMITS = InputLimits(max_bytes=16 * GIB, max_depth=8, max_elements=10_000, max_line_bytes=64 * KIB)
# Request keys a replay tracks at once (about 700 bytes of state each: 700 MB at the bound).
TRACE_MAX_REQUESTS = 1_000_000
# The spec format's JSON Schema as shipped (`kvfsm schema --check` compares it; 17 KB).
SCHEMA_LIMITS = InputLimits(max_bytes=4 * MIB, max_depth=64, max_elements=100_000)

# Guard and invariant expressions (kvfsm.spec.expr), whose trees are walked recursively: `not`s and
# parentheses nested, atoms in one sum, digits in one literal. Fixed: the shipped specs use at most 0, 2, 1.
EXPR_MAX_NESTING = 32
EXPR_MAX_TERMS = 64
EXPR_MAX_DIGITS = 9


def open_regular(path: str | os.PathLike[str], what: str) -> io.BufferedReader:
    """The regular file at `path`, open for binary reading. Opened without blocking, so a FIFO or a device
    given as a file is InputRejected at once instead of hanging the reader or streaming forever; OSError
    for a path that is missing or cannot be opened."""
    source = os.fspath(path)
    fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.stat(fd).st_mode):
            raise InputRejected(source, 0, f"{what} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike[str], limits: InputLimits, what: str) -> bytes:
    """The bytes of the regular file at `path` (see open_regular), at most `limits.max_bytes` of them
    (checked on the bytes read, not only on the size the file claims, which may grow meanwhile)."""
    source = os.fspath(path)
    with open_regular(source, what) as f:
        raw = f.read(limits.max_bytes + 1)
    if len(raw) > limits.max_bytes:
        raise InputBoundExceeded(
            source,
            raw.count(b"\n", 0, limits.max_bytes) + 1,
            "max_bytes",
            limits.max_bytes,
            f"{what} is larger than {limits.max_bytes} bytes",
        )
    return raw


def decode_utf8(raw: bytes, source: str, what: str, first_line: int = 1) -> str:
    """`raw` as text; bytes that are not UTF-8 are InputRejected at their line."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = first_line + raw.count(b"\n", 0, exc.start)
        raise InputRejected(source, line, f"{what} is not UTF-8: {exc.reason} at byte {exc.start}") from None


# ---- YAML ----------------------------------------------------------------------------------------------
class _Frame:
    __slots__ = ("anchor", "elements", "depth")

    def __init__(self, anchor: Optional[str]) -> None:
        self.anchor, self.elements, self.depth = anchor, 1, 1


if getattr(yaml, "__with_libyaml__", False):

    class _SafeLoader(
        yaml.composer.Composer, yaml._yaml.CParser, yaml.constructor.SafeConstructor, yaml.resolver.Resolver
    ):
        """PyYAML's safe loader over libyaml's scanner and parser, with PyYAML's own composer: the composer
        takes each event through `get_event`, where BoundedYAMLLoader checks it (libyaml's composer would not).
        What it saves: `kvfsm validate spec/decode_offload.yaml` took 0.340 s of CPU with the pure-Python
        scanner and parser and 0.307 s with these (bench/cli_startup.py, the 2-core development machine)."""

        def __init__(self, text: str) -> None:
            yaml._yaml.CParser.__init__(self, text)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)
            yaml.composer.Composer.__init__(self)

else:  # a PyYAML built without libyaml
    _SafeLoader = yaml.SafeLoader  # type: ignore[misc,assignment]


class BoundedYAMLLoader(_SafeLoader):
    """PyYAML's safe loader, checking every event against `limits` before the composer sees it.

    Depth and element counts are those of the value once aliases are expanded (an alias adds its anchor's
    whole size and depth), so what the composer builds and the constructor expands stays within bounds."""

    def __init__(self, text: str, limits: InputLimits, source: str, what: str) -> None:
        super().__init__(text)
        self.limits, self.source, self.what = limits, source, what
        self._frames: list[_Frame] = []
        self._sizes: dict[str | None, tuple[int, int]] = {}  # anchor -> (expanded elements, expanded depth)
        self._elements = 0
        self._aliases = 0

    def _breach(self, event: yaml.Event, bound: str, limit: int, message: str) -> InputBoundExceeded:
        line = event.start_mark.line + 1 if event.start_mark is not None else 0  # the parser marks every event
        return InputBoundExceeded(self.source, line, bound, limit, message)

    def _add(self, event: yaml.Event, elements: int, depth: int) -> None:
        """Account a node of `elements` nodes and `depth` levels at the current position."""
        lim = self.limits
        self._elements += elements
        if self._elements > lim.max_elements:
            raise self._breach(
                event,
                "max_elements",
                lim.max_elements,
                f"{self.what} has more than {lim.max_elements} elements"
                + (" once its aliases are expanded" if self._aliases else ""),
            )
        reached = len(self._frames) + depth
        if reached > lim.max_depth:
            raise self._breach(
                event,
                "max_depth",
                lim.max_depth,
                f"{self.what} nests deeper than {lim.max_depth} levels (nesting depth {reached}"
                + (", its aliases expanded)" if isinstance(event, yaml.AliasEvent) else ")"),
            )
        if self._frames:
            top = self._frames[-1]
            top.elements += elements
            top.depth = max(top.depth, depth + 1)

    def get_event(self) -> yaml.Event:
        event = super().get_event()
        if event is None:  # libyaml's parser asked past the stream's end, which PyYAML's composer never does
            raise yaml.composer.ComposerError(None, None, f"{self.what} ended in the middle of an event", None)
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self.limits.max_aliases == 0:
                raise self._breach(event, "max_aliases", 0, f"{self.what}s may not use YAML aliases (*{event.anchor})")
            if self._aliases > self.limits.max_aliases:
                raise self._breach(
                    event,
                    "max_aliases",
                    self.limits.max_aliases,
                    f"{self.what} has more than {self.limits.max_aliases} aliases",
                )
            elements, depth = self._sizes.get(event.anchor, (1, 0))  # undefined: the composer names it
            self._add(event, elements, depth)
        elif isinstance(event, yaml.ScalarEvent):
            self._add(event, 1, 0)
            if event.anchor is not None:
                self._sizes[event.anchor] = (1, 0)
        elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            self._add(event, 1, 1)
            self._frames.append(_Frame(event.anchor))
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            done = self._frames.pop()
            if done.anchor is not None:
                self._sizes[done.anchor] = (done.elements, done.depth)
            if self._frames:  # its own node was counted at its start; what it holds joins the parent
                parent = self._frames[-1]
                parent.elements += done.elements - 1
                parent.depth = max(parent.depth, done.depth + 1)
        return event


def _refused_character(text: str, exc: yaml.reader.ReaderError, source: str, what: str) -> InputRejected:
    """A character YAML does not allow (a NUL, most control characters): the reader's ReaderError carries no
    mark, so InputRejected at the character's line. PyYAML's own reader gives the character's index in `text`
    when the loader is made; libyaml's, while it reads, the byte offset in its UTF-8 encoding."""
    if issubclass(_SafeLoader, yaml.SafeLoader):
        line = text.count("\n", 0, exc.position) + 1
    else:
        line = text.encode("utf-8", "surrogatepass").count(b"\n", 0, exc.position) + 1
    return InputRejected(source, line, f"{what} holds character {chr(exc.character)!r}, which YAML does not allow")


def _libyaml_depth(
    exc: yaml.MarkedYAMLError, limits: InputLimits, source: str, what: str
) -> Optional[InputBoundExceeded]:
    """libyaml's scanner stops at its own nesting bound (1000 levels) while it reads ahead, before the events that
    cross ours reach BoundedYAMLLoader: that is the same breach, of `max_depth` (always below libyaml's)."""
    if exc.problem != "exceeded maximum nesting depth":
        return None
    line = exc.problem_mark.line + 1 if exc.problem_mark is not None else 0
    return InputBoundExceeded(
        source, line, "max_depth", limits.max_depth, f"{what} nests deeper than {limits.max_depth} levels"
    )


def _loader(text: str, limits: InputLimits, source: str, what: str) -> BoundedYAMLLoader:
    """A bounded loader over `text`."""
    try:
        return BoundedYAMLLoader(text, limits, source, what)
    except yaml.reader.ReaderError as exc:
        raise _refused_character(text, exc, source, what) from None


def compose_yaml(text: str, limits: InputLimits, source: str, what: str) -> Optional[yaml.Node]:
    """The node tree of one YAML document (None for an empty one), its marks kept; bounds as it reads."""
    loader = _loader(text, limits, source, what)
    try:
        return loader.get_single_node()
    except yaml.reader.ReaderError as exc:
        raise _refused_character(text, exc, source, what) from None
    except yaml.MarkedYAMLError as exc:
        raise _libyaml_depth(exc, limits, source, what) or exc from None
    finally:
        loader.dispose()


def load_yaml_data(text: str, limits: InputLimits, source: str, what: str) -> Any:
    """One YAML document as plain data (safe types only); bounds as it reads."""
    loader = _loader(text, limits, source, what)
    try:
        return loader.get_single_data()
    except yaml.reader.ReaderError as exc:
        raise _refused_character(text, exc, source, what) from None
    except yaml.MarkedYAMLError as exc:
        raise _libyaml_depth(exc, limits, source, what) or exc from None
    finally:
        loader.dispose()


# ---- JSON ----------------------------------------------------------------------------------------------
def check_json_nesting(text: str, limits: InputLimits, source: str, line: int, what: str) -> None:
    """Raise InputBoundExceeded when the JSON text nests deeper than `limits.max_depth` (brackets outside
    strings), before `json.loads` recurses into it. A text with fewer brackets than the bound in all is
    let through at C speed, without a scan."""
    if text.count("[") + text.count("{") <= limits.max_depth:
        return
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limits.max_depth:
                at = line + text.count("\n", 0, i)
                raise InputBoundExceeded(
                    source, at, "max_depth", limits.max_depth, f"{what} nests deeper than {limits.max_depth} levels"
                )
        elif ch in "]}":
            depth -= 1


def count_elements(
    value: Any, limits: InputLimits, source: str, line: int, what: str, text_len: Optional[int] = None
) -> None:
    """Raise InputBoundExceeded when a parsed JSON value holds more than `limits.max_elements` values
    (iteratively: its depth is already bounded, but this walks it without recursion anyway). `text_len`, the
    length of the JSON text it was parsed from, skips the walk when too short to hold that many: k values
    take at least 2k - 1 characters."""
    if text_len is not None and (text_len + 1) // 2 <= limits.max_elements:
        return
    seen, todo = 0, [value]
    while todo:
        v = todo.pop()
        seen += 1
        if seen > limits.max_elements:
            raise InputBoundExceeded(
                source,
                line,
                "max_elements",
                limits.max_elements,
                f"{what} has more than {limits.max_elements} elements",
            )
        if isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)


__all__ = [
    "CONFIG_LIMITS",
    "EXPR_MAX_DIGITS",
    "EXPR_MAX_NESTING",
    "EXPR_MAX_TERMS",
    "ENV_VALUE_LIMITS",
    "SCHEMA_LIMITS",
    "SPEC_LIMITS",
    "SPEC_MAX_CHECK_WORK",
    "TRACE_LIMITS",
    "TRACE_MAX_REQUESTS",
    "BoundedYAMLLoader",
    "InputBoundExceeded",
    "InputLimits",
    "InputRejected",
    "check_json_nesting",
    "compose_yaml",
    "count_elements",
    "decode_utf8",
    "load_yaml_data",
    "open_regular",
    "read_bounded",
]
