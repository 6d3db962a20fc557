"""A resolved spec: transitions expanded to one row per (state, event, guard), expressions parsed, lines kept.

This is what the generator, the reference interpreter, the docs and the explorer consume; building it
resolves every name, so those consumers never meet a dangling reference.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from kvfsm.spec import expr as ex
from kvfsm.spec.errors import SpecError, SpecInvalid
from kvfsm.spec.loader import LineMap, load_yaml
from kvfsm.spec.model import SpecModel

SAME = "same"


@dataclass(frozen=True)
class Transition:
    """One expanded transition; `id` is stable for a given spec and indexes coverage and traces."""

    id: int
    src: str
    event: str
    guard: Optional[str]
    dst: str
    actions: tuple[str, ...]
    update: tuple[tuple[str, int], ...]
    acquires: tuple[str, ...]
    reads: tuple[str, ...]
    releases: tuple[str, ...]  # every resource it releases, fenced or not
    line: int
    rule: int
    fenced: tuple[str, ...] = ()  # those of `releases` released fenced (while operations still read them)

    @property
    def label(self) -> str:
        guard = f" [{self.guard}]" if self.guard else ""
        return f"{self.src} --{self.event}{guard}--> {self.dst}"


@dataclass(frozen=True)
class Outcome:
    """A declared no-op (`ignore`) or typed error (`error`) for one (state, event) pair."""

    kind: str
    state: str
    event: str
    reason: str
    line: int


@dataclass(frozen=True)
class CompiledSpec:
    path: str
    sha256: str
    model: SpecModel
    lines: LineMap = field(repr=False)
    states: tuple[str, ...]
    events: tuple[str, ...]
    counters: tuple[str, ...]
    params: tuple[str, ...]
    initial: str
    transitions: tuple[Transition, ...]
    outcomes: dict[tuple[str, str], Outcome]
    guards: dict[str, ex.Node]
    state_invariants: dict[str, ex.Node]
    invariants: dict[str, tuple[ex.Node, tuple[str, ...]]]
    # state_holds' answers by (state, valuation), and what the checks derive from the spec (kvfsm/spec/checks.py):
    # several checks ask the same questions of every transition of a state
    _holds: dict[tuple[str, tuple[tuple[str, int], ...]], bool] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    derived: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.model.machine

    def handlers(self, state: str, event: str) -> list[Transition]:
        return [t for t in self.transitions if t.src == state and t.event == event]

    def state_holds(self, state: str, env: dict[str, int]) -> bool:
        """Whether `env` satisfies the state's invariant and every global invariant that applies there.

        Remembered by (state, valuation): the checks ask it of the states transitions lead to, for every
        valuation that fires them."""
        key = (state, tuple(env.items()))
        got = self._holds.get(key)
        if got is None:
            inv = self.state_invariants.get(state)
            got = (inv is None or bool(ex.evaluate(inv, env))) and all(
                ex.evaluate(node, env) for node, where in self.invariants.values() if not where or state in where
            )
            self._holds[key] = got
        return got


def _pydantic_errors(exc: ValidationError, lines: LineMap) -> list[SpecError]:
    out = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        element = ".".join(str(p) for p in loc) or "<root>"
        out.append(lines.error(loc, element, err["msg"]))
    return out


def build(path: str | Path) -> CompiledSpec:
    """Load, validate the shape, resolve names; raises SpecInvalid listing every error with file:line."""
    data, lines, raw = load_yaml(path)
    if not isinstance(data, dict):
        raise SpecInvalid([lines.error((), "<root>", "a spec is a mapping of sections")])
    try:
        model = SpecModel.model_validate(data)
    except ValidationError as exc:
        raise SpecInvalid(_pydantic_errors(exc, lines)) from None

    errors: list[SpecError] = []
    err = lambda loc, element, msg: errors.append(lines.error(loc, element, msg))  # noqa: E731
    states, events, counters = tuple(model.states), tuple(model.events), tuple(model.counters)
    params = tuple(model.params)
    for p in params:
        if p in model.counters:
            err(("params", p), f"param {p!r}", "is also the name of a counter")

    def parse(loc: tuple, element: str, text: str) -> Optional[ex.Node]:
        try:
            node = ex.parse(text)
        except ex.ExprError as e:
            err(loc, element, f"bad expression {text!r}: {e}")
            return None
        for name in sorted(ex.names(node) - set(counters) - set(params)):
            err(loc, element, f"unknown counter {name!r} in {text!r}" + (", nor is it a param" if params else ""))
        return node

    def known(loc: tuple, element: str, kind: str, name: str, pool) -> bool:
        if name not in pool:
            err(loc, element, f"unknown {kind} {name!r}")
            return False
        return True

    guards = {g: parse(("guards", g, "expr"), f"guard {g!r}", m.expr) for g, m in model.guards.items()}
    state_invs = {
        s: parse(("states", s, "invariant"), f"state {s!r}", m.invariant)
        for s, m in model.states.items()
        if m.invariant is not None
    }
    invariants = {}
    for i, inv in enumerate(model.invariants):
        node = parse(("invariants", i, "expr"), f"invariant {inv.name!r}", inv.expr)
        for s in inv.states or ():
            known(("invariants", i, "states"), f"invariant {inv.name!r}", "state", s, model.states)
        invariants[inv.name] = (node, tuple(inv.states or ()))
    for r, res in model.resources.items():
        for verb in ("read_by", "written_by"):
            if getattr(res, verb) is not None:
                known(("resources", r, verb), f"resource {r!r}", "counter", getattr(res, verb), model.counters)
        if res.fence is not None and res.read_by is None and res.written_by is None:
            err(
                ("resources", r, "fence"),
                f"resource {r!r}",
                "declares a fence rule but no `read_by` or "
                "`written_by` counter: a fence is the completion of what reads or writes it",
            )
    for a, act in model.actions.items():
        for verb in ("acquires", "reads", "releases", "releases_fenced"):
            for r in getattr(act, verb):
                known(("actions", a, verb), f"action {a!r}", "resource", r, model.resources)
        for r in act.releases_fenced:
            if r in act.releases:
                err(("actions", a, "releases_fenced"), f"action {a!r}", f"releases {r!r} both plainly and fenced")
            elif r in model.resources and model.resources[r].fence is None:
                err(
                    ("actions", a, "releases_fenced"),
                    f"action {a!r}",
                    f"releases {r!r} fenced, but resource {r!r} declares no `fence` rule",
                )
        for c in act.implies:
            known(("actions", a, "implies", c), f"action {a!r}", "counter", c, model.counters)
    for e, ev in model.events.items():
        for c in ev.implies:
            known(("events", e, "implies", c), f"event {e!r}", "counter", c, model.counters)
    if model.create is not None:
        for r in model.create.holds:
            known(("create", "holds"), "create", "resource", r, model.resources)
        for a in model.create.actions:
            if known(("create", "actions"), "create", "action", a, model.actions) and model.actions[a].acquires:
                err(
                    ("create", "actions"),
                    "create",
                    f"action {a!r} acquires; what a new machine holds belongs in `holds`",
                )
            elif a in model.actions and model.actions[a].implies:
                implied = ", ".join(f"{c} {d:+d}" for c, d in model.actions[a].implies.items())
                err(
                    ("create", "actions"),
                    "create",
                    f"action {a!r} implies {implied} (line {lines.line(('actions', a, 'implies'))}); a new machine's "
                    "counters start at their `initial` values, so a creation action may imply no update",
                )

    transitions: list[Transition] = []
    for index, rule in enumerate(model.transitions):
        loc = ("transitions", index)
        where = f"transitions[{index}]"
        ok = all(
            [known(loc + ("from",), where, "state", s, model.states) for s in rule.src]
            + [known(loc + ("on",), where, "event", e, model.events) for e in rule.on]
        )
        if rule.to != SAME:
            ok &= known(loc + ("to",), where, "state", rule.to, model.states)
        if rule.guard is not None:
            ok &= known(loc + ("guard",), where, "guard", rule.guard, model.guards)
        ok &= all([known(loc + ("actions",), where, "action", a, model.actions) for a in rule.actions])
        ok &= all([known(loc + ("update",), where, "counter", c, model.counters) for c in rule.update])
        if not ok:
            continue
        acts = [model.actions[a] for a in rule.actions]
        gather = lambda verb: tuple(dict.fromkeys(x for a in acts for x in getattr(a, verb)))  # noqa: E731
        for s in rule.src:
            for e in rule.on:
                transitions.append(
                    Transition(
                        id=len(transitions),
                        src=s,
                        event=e,
                        guard=rule.guard,
                        dst=s if rule.to == SAME else rule.to,
                        actions=tuple(rule.actions),
                        update=tuple(rule.update.items()),
                        acquires=gather("acquires"),
                        reads=gather("reads"),
                        releases=tuple(dict.fromkeys(gather("releases") + gather("releases_fenced"))),
                        line=lines.line(loc),
                        rule=index,
                        fenced=gather("releases_fenced"),
                    )
                )

    outcomes: dict[tuple[str, str], Outcome] = {}
    for section, kind in (("ignore", "ignore"), ("errors", "error")):
        for index, rule in enumerate(getattr(model, section)):
            loc = (section, index)
            where = f"{section}[{index}]"
            ok = all(
                [known(loc + ("in",), where, "state", s, model.states) for s in rule.states]
                + [known(loc + ("on",), where, "event", e, model.events) for e in rule.on]
            )
            if not ok:
                continue
            for s in rule.states:
                for e in rule.on:
                    if (s, e) in outcomes:
                        prev = outcomes[(s, e)]
                        err(loc, where, f"({s}, {e}) is already declared {prev.kind} at line {prev.line}")
                        continue
                    outcomes[(s, e)] = Outcome(kind, s, e, rule.reason, lines.line(loc))

    initial = [s for s, m in model.states.items() if m.initial]
    if len(initial) != 1:
        err(
            ("states",),
            "states",
            f"exactly one initial state is required, found {len(initial)}"
            + (f": {', '.join(initial)}" if initial else ""),
        )
    if errors:
        raise SpecInvalid(errors)
    return CompiledSpec(
        path=str(path),
        sha256=hashlib.sha256(raw).hexdigest(),
        model=model,
        lines=lines,
        states=states,
        events=events,
        counters=counters,
        params=params,
        initial=initial[0],
        transitions=tuple(transitions),
        outcomes=outcomes,
        guards={k: v for k, v in guards.items() if v is not None},
        state_invariants={k: v for k, v in state_invs.items() if v is not None},
        invariants={k: (n, w) for k, (n, w) in invariants.items() if n is not None},
    )
