"""Pydantic models of the spec format: the shape of a spec file, before its semantic checks.

The models reject unknown keys and wrong types; `kvfsm.spec.checks` then resolves names and proves the
structural properties (reachability, determinism, totality, resource conservation).
"""

from __future__ import annotations

import keyword
from typing import Annotated, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator

def _not_keyword(name: str) -> str:
    if keyword.iskeyword(name) or keyword.issoftkeyword(name) or name in ("same", "true", "false", "not", "and", "or"):
        raise ValueError(f"{name!r} is reserved (a Python or spec keyword) and cannot name an element")
    return name


Name = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]*$", max_length=64), AfterValidator(_not_keyword)]
MachineName = Annotated[str, StringConstraints(pattern=r"^[A-Z][A-Za-z0-9]*$", max_length=64)]
Doc = Annotated[str, StringConstraints(min_length=1, max_length=400, pattern=r"^[^\n]+$")]
Names = Union[Name, list[Name]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Counter(_Strict):
    doc: Doc
    initial: int = Field(0, ge=0)


class Resource(_Strict):
    doc: Doc


class Guard(_Strict):
    doc: Doc
    expr: str = Field(min_length=1)


class Action(_Strict):
    doc: Doc
    acquires: list[Name] = []
    reads: list[Name] = []
    releases: list[Name] = []


class Create(_Strict):
    doc: Doc
    holds: list[Name] = []
    actions: list[Name] = []


class State(_Strict):
    doc: Doc
    initial: bool = False
    terminal: bool = False
    invariant: Optional[str] = None


class Event(_Strict):
    doc: Doc


def _as_list(value: object) -> object:
    return [value] if isinstance(value, str) else value


class TransitionRule(_Strict):
    """One row of the transition table; `from` and `on` may list several names (their product)."""

    src: list[Name] = Field(alias="from", min_length=1)
    on: list[Name] = Field(min_length=1)
    guard: Optional[Name] = None
    to: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]*$", max_length=64)]  # a state, or 'same': a self-loop
    actions: list[Name] = []
    update: dict[Name, Literal[1, -1]] = {}
    doc: Optional[Doc] = None

    _lists = field_validator("src", "on", mode="before")(_as_list)


class OutcomeRule(_Strict):
    """An `ignore` or `errors` row: events that are no-ops, or typed errors, in some states."""

    states: list[Name] = Field(alias="in", min_length=1)
    on: list[Name] = Field(min_length=1)
    reason: Doc

    _lists = field_validator("states", "on", mode="before")(_as_list)


class Invariant(_Strict):
    name: Name
    doc: Doc
    expr: str = Field(min_length=1)
    states: Optional[list[Name]] = Field(None, min_length=1)


class SpecModel(_Strict):
    machine: MachineName
    doc: Doc
    counters: dict[Name, Counter] = {}
    resources: dict[Name, Resource] = {}
    guards: dict[Name, Guard] = {}
    actions: dict[Name, Action] = {}
    create: Optional[Create] = None
    states: dict[Name, State] = Field(min_length=1)
    events: dict[Name, Event] = Field(min_length=1)
    transitions: list[TransitionRule] = Field(min_length=1)
    ignore: list[OutcomeRule] = []
    errors: list[OutcomeRule] = []
    invariants: list[Invariant] = []

    @field_validator("invariants")
    @classmethod
    def _unique_invariants(cls, value: list[Invariant]) -> list[Invariant]:
        names = [i.name for i in value]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate invariant name(s): {', '.join(dup)}")
        return value


def json_schema_text() -> str:
    """The spec format's JSON Schema, deterministic text (what `kvfsm schema` writes to spec/)."""
    import json
    schema = SpecModel.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "kvfsm lifecycle spec"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"
