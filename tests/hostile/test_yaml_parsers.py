"""The bounded YAML reader over libyaml's scanner and parser and over PyYAML's pure-Python ones (a PyYAML built
without libyaml) gives the same nodes, the same refusals and the same lines (kvfsm/input_limits.py)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

import kvfsm.input_limits as input_limits
from kvfsm.errors import InputRejected

TEXTS = [
    "a: 1\nb: [1, 2, {c: d}]\ne: |\n  text\n",
    "a: é\nb: ok\nc: \x00\n",  # a refused character after a two-byte one: its line, not its byte offset
    "é€😀: 1\nb: \x01",
    "😀😀😀😀😀😀: 1\n\x01\n\n\n\n\n\n",  # libyaml's byte offset of the character lies past later newlines
    "a:\n" + "".join("  " * i + f"- k{i}:\n" for i in range(1, 30)),  # block nesting past max_depth
    "x: " + "[" * 40 + "]" * 40,  # flow nesting past max_depth
    "x: " + "[" * 1500 + "]" * 1500,  # past libyaml's own nesting bound, which it meets reading ahead
    "a: [1, 2\nb: 3\n",  # malformed
]


def _outcome(text: str) -> Any:
    try:
        node = input_limits.compose_yaml(text, input_limits.SPEC_LIMITS, "s.yaml", "spec")
    except InputRejected as exc:
        return type(exc).__name__, exc.line, getattr(exc, "bound", None)
    except yaml.MarkedYAMLError as exc:
        return "malformed", exc.problem_mark.line if exc.problem_mark else None
    return yaml.serialize(node)


@pytest.fixture
def read_with(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bool], list[Any]]]:
    """Every text's outcome with kvfsm.input_limits as it is with libyaml or without (a PyYAML built without
    it); the module is put back afterwards."""

    def outcomes(libyaml: bool) -> list[Any]:
        monkeypatch.setattr(yaml, "__with_libyaml__", libyaml)
        importlib.reload(input_limits)
        assert issubclass(input_limits.BoundedYAMLLoader, yaml.SafeLoader) is not libyaml
        return [_outcome(t) for t in TEXTS]

    yield outcomes
    monkeypatch.undo()
    importlib.reload(input_limits)


@pytest.mark.skipif(not getattr(yaml, "__with_libyaml__", False), reason="this PyYAML has no libyaml")
def test_libyaml_and_pure_python_read_and_refuse_alike(read_with: Callable[[bool], list[Any]]) -> None:
    pure, fast = read_with(False), read_with(True)
    for text, a, b in zip(TEXTS, pure, fast):
        if a[0] == "malformed":  # the two parsers word and place a syntax error each their own way
            assert b[0] == "malformed", text[:40]
        else:
            assert a == b, text[:40]
    assert [o[:2] for o in fast[1:4]] == [("InputRejected", 3), ("InputRejected", 2), ("InputRejected", 2)]
    assert [o[0] for o in fast[4:7]] == ["InputBoundExceeded"] * 3
