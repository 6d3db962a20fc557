"""Pydantic models of the spec format: the shape of a spec file, before its semantic checks.

The models reject unknown keys and wrong types; `kvfsm.spec.checks` then resolves names and proves the
structural properties (reachability, determinism, totality, resource conservation).
"""

from __future__ import annotations

import keyword
from typing import Annotated, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator


def _not_keyword(name: str) -> str:
    if keyword.iskeyword(name) or keyword.issoftkeyword(name) or name in ("same", "true", "false", "not", "and", "or"):
        raise ValueError(f"{name!r} is reserved (a Python or spec keyword) and cannot name an element")
    return name


Name = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]*$", max_length=64), AfterValidator(_not_keyword)]
MachineName = Annotated[str, StringConstraints(pattern=r"^[A-Z][A-Za-z0-9]*$", max_length=64)]
Doc = Annotated[str, StringConstraints(min_length=1, max_length=400, pattern=r"^[^\n]+$")]
Names = Union[Name, list[Name]]
# A counter update: each named counter moves by +1 or -1 (a transition's `update`, and the update an action or
# an event implies, which `kvfsm validate` checks every transition's `update` against).
Update = dict[Name, Literal[1, -1]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Counter(_Strict):
    doc: Doc
    initial: int = Field(0, ge=0)


class Param(_Strict):
    """A constant of one machine, 0 or 1, fixed when it is created (what the data plane under it can do)."""

    doc: Doc


class Resource(_Strict):
    doc: Doc
    read_by: Optional[Name] = Field(
        None,
        description=(
            "The counter of in-flight operations that read this resource (device slots: `copies`). `kvfsm validate` "
            "rejects a plain release of it by a transition after which that counter may be above zero, and an action "
            "that starts one of them (`implies` +1) and `reads` it while this names another counter."
        ),
    )
    written_by: Optional[Name] = Field(
        None,
        description=(
            "The counter of in-flight operations that write this resource (a load-back's device blocks: `swap_ins`), "
            "checked as `read_by` is; an action that starts one of them (`implies` +1) and `acquires` it writes it."
        ),
    )
    fence: Optional[Doc] = Field(
        None,
        description=(
            "The rule under which it may be released while those operations (`read_by`, `written_by`) still read or "
            "write it (`releases_fenced`): what the release carries and what must pass before it is handed out and "
            "written again."
        ),
    )


class Guard(_Strict):
    doc: Doc
    expr: str = Field(min_length=1)


class Action(_Strict):
    doc: Doc
    acquires: list[Name] = []
    reads: list[Name] = []
    releases: list[Name] = []
    releases_fenced: list[Name] = Field(
        [],
        description=(
            "Resources released while operations still read or write them, each carrying their fences (its `fence` "
            "rule)."
        ),
    )
    implies: Update = Field(
        {},
        description=(
            "The counter update running this action implies (submitting a copy: `{copies: +1}`). `kvfsm validate` "
            "checks that every transition's `update` is exactly the sum of its event's and its actions' `implies`."
        ),
    )


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
    implies: Update = Field(
        {},
        description=(
            "The counter update the event itself reports, in every transition it fires, whatever the machine does "
            "about it: an acknowledgement ends something an action started (`copy_done`: `{copies: -1}`)."
        ),
    )


def _as_list(value: object) -> object:
    return [value] if isinstance(value, str) else value


class TransitionRule(_Strict):
    """One row of the transition table; `from` and `on` may list several names (their product)."""

    src: list[Name] = Field(alias="from", min_length=1)
    on: list[Name] = Field(min_length=1)
    guard: Optional[Name] = None
    to: Annotated[
        str, StringConstraints(pattern=r"^[a-z][a-z0-9_]*$", max_length=64)
    ]  # a state, or 'same': a self-loop
    actions: list[Name] = []
    update: Update = {}
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


class Policy(_Strict):
    """A rule of the manager around the machines that an integrator selects, with the spec naming each choice:
    what a choice changes is stated here, so an auditor reads it beside the transitions it constrains."""

    doc: Doc
    default: Name
    choices: dict[Name, Doc] = Field(min_length=2)

    @model_validator(mode="after")
    def _default_is_a_choice(self) -> Policy:
        if self.default not in self.choices:
            raise ValueError(f"default {self.default!r} is not one of the choices {', '.join(self.choices)}")
        return self


class SpecModel(_Strict):
    machine: MachineName
    doc: Doc
    counters: dict[Name, Counter] = {}
    params: dict[Name, Param] = {}
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
    policies: dict[Name, Policy] = {}

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
