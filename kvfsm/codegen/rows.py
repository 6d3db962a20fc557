"""Compile a checked spec into its struct-of-arrays batch machine (`generated/<machine>_rows.py`).

Beside the per-request machine (generator.py), the same spec becomes one class whose states, counters and
params are numpy arrays indexed by table row and whose events take an array of rows: from-states and guards
become vectorised masks, each transition a mask of the rows that take it, each action one call with the rows
that take it. The spec-independent half (batch checks, repeated rows, rejection, restore) is
kvfsm/row_machine.py. Deterministic as the other generator is: spec order throughout, no clock, stamped.
"""

from __future__ import annotations

import re

from kvfsm.codegen.generator import _env, module_name
from kvfsm.spec import CompiledSpec, expr as ex
from kvfsm.spec.compiled import Transition

# Names the generated class or its decide methods use themselves; a counter or param may not take one.
RESERVED = frozenset(
    {
        "state",
        "created",
        "capacity",
        "fx",
        "grow",
        "snapshot",
        "params",
        "create",
        "s",
        "ns",
        "n",
        "rows",
        "bad",
        "np",
        "self",
        "Decided",
    }
)
_RESERVED_PATTERN = re.compile(r"^(t\d+|at_\w+|g_\w+|new_\w+|_\w*)$")


class RowsUnsupported(ValueError):
    """The spec cannot be compiled into a rows machine as it is (a name clash, too many states)."""


def rows_module_name(spec: CompiledSpec) -> str:
    """`DecodeOffload` -> `decode_offload_rows`: the rows machine's file stem."""
    return f"{module_name(spec)}_rows"


def vector(node: ex.Node | ex.Term, var=lambda n: n) -> str:
    """A guard as a numpy expression over per-row arrays: comparisons parenthesised, `and`/`or`/`not` as
    `&`/`|`/`~`; a sub-expression naming no counter or param is folded to its constant, so `~` only ever
    meets a boolean array."""
    if not ex.names(node):
        return repr(ex.evaluate(node, {}))
    if isinstance(node, ex.Var):
        return var(node.name)
    if isinstance(node, ex.Arith):
        return f"{vector(node.left, var)} {node.op} {vector(node.right, var)}"
    if isinstance(node, ex.Cmp):
        return f"({vector(node.left, var)} {node.op} {vector(node.right, var)})"
    if isinstance(node, ex.BoolOp):
        op = " & " if node.op == "and" else " | "
        return "(" + op.join(vector(i, var) for i in node.items) + ")"
    if isinstance(node, ex.Not):
        return f"~{vector(node.item, var)}"
    raise TypeError(f"not an expression node: {node!r}")


def action_calls(spec: CompiledSpec, transitions: list[Transition]) -> list[tuple[str, list[int]]]:
    """The action calls of one event, in order, each with the transitions that take it there.

    Each transition's own action order is kept (a row takes one transition, so its calls come in its
    transition's order). Among the actions that may come next, the one declared first in the spec's `actions`
    comes first, so an action is called once per event and in the spec's order wherever that order agrees with
    every transition. Where two transitions order two actions both ways, one of them is called again later
    (for the transitions that need it there)."""
    declared = {a: i for i, a in enumerate(spec.model.actions)}
    seqs = [list(t.actions) for t in transitions]
    heads = [0] * len(seqs)
    calls: list[tuple[str, list[int]]] = []
    while True:
        live = [i for i, seq in enumerate(seqs) if heads[i] < len(seq)]
        if not live:
            return calls
        nexts = sorted({seqs[i][heads[i]] for i in live}, key=declared.__getitem__)
        ready = [a for a in nexts if all(a not in seqs[i][heads[i] + 1 :] for i in live)]
        pick = (ready or nexts)[0]
        takers = [i for i in live if seqs[i][heads[i]] == pick]
        for i in takers:
            heads[i] += 1
        calls.append((pick, [transitions[i].id for i in takers]))


def _union(tids: list[int]) -> str:
    return " | ".join(f"t{t}" for t in tids)


def _check_names(spec: CompiledSpec) -> None:
    for name in (*spec.counters, *spec.params):
        if name in RESERVED or _RESERVED_PATTERN.match(name):
            raise RowsUnsupported(
                f"{spec.path}: counter or param {name!r} clashes with a name the rows machine uses itself; rename it"
            )
    if len(spec.states) > 127:
        raise RowsUnsupported(f"{spec.path}: {len(spec.states)} states do not fit the rows machine's int8 state")


def _event(spec: CompiledSpec, event: str, const: dict[str, str]) -> dict:
    transitions = [t for s in spec.states for t in spec.handlers(s, event)]
    used_guards = list(dict.fromkeys(t.guard for t in transitions if t.guard))
    names = set().union(*(ex.names(spec.guards[g]) for g in used_guards)) if used_guards else set()
    updated = [c for c in spec.counters if any(d for t in transitions for cc, d in t.update if cc == c)]
    gathers = [c for c in spec.counters if c in names or c in updated] + [p for p in spec.params if p in names]
    guards = []
    for g in used_guards:
        node = spec.guards[g]
        py = vector(node) if ex.names(node) else f"np.full(rows.size, {ex.evaluate(node, {})!r})"
        if py.startswith("(") and py.endswith(")") and isinstance(node, ex.Cmp):
            py = py[1:-1]
        guards.append(dict(name=g, py=py, text=ex.render(node)))
    branches: list[dict] = []
    rejected: list[str] = []  # where the event is rejected: what takes no transition and is no declared no-op
    for s in spec.states:
        ts = spec.handlers(s, event)
        if not ts:
            continue
        single = len(ts) == 1 and ts[0].guard is None  # every row in the state takes it: no `at_` mask
        masks = []
        earlier: list[str | None] = []
        for t in ts:
            if None in earlier:
                mask = "np.zeros(rows.size, bool)"  # an earlier unguarded transition takes every row
            else:
                parts = [f"s == {const[s]}" if single else f"at_{s}"]
                if t.guard:
                    parts.append(f"g_{t.guard}")
                if earlier:  # the first transition whose guard holds is taken, as in the per-request machine
                    gs = [f"g_{g}" for g in earlier]
                    parts.append("~" + (gs[0] if len(gs) == 1 else "(" + " | ".join(gs) + ")"))
                mask = " & ".join(parts)
            earlier.append(t.guard)
            masks.append(dict(id=t.id, label=t.label, line=t.line, mask=mask, actions=t.actions))
        if all(t.guard for t in ts):
            rejected.append(f"{s} when no guard holds")
        branches.append(dict(state=s, const=const[s], single=single, transitions=masks))
    ignored: list[str] = []
    for kind in ("ignore", "error"):
        groups: dict[str, list[str]] = {}
        for s in spec.states:
            o = spec.outcomes.get((s, event))
            if o is not None and o.kind == kind:
                groups.setdefault(o.reason, []).append(s)
        for reason, states in groups.items():
            if kind == "error":
                rejected.append(f"{', '.join(states)} (declared error)")
            else:
                ignored += states
                branches.append(dict(state=None, ignored=", ".join(states), reason=reason, transitions=[]))
    every = [t.id for t in transitions]
    dsts: dict[str, list[int]] = {}  # target state -> the transitions that change state to it
    for t in transitions:
        if t.dst != t.src:
            dsts.setdefault(t.dst, []).append(t.id)
    deltas: dict[str, dict[int, list[int]]] = {}  # counter -> delta -> the transitions that apply it
    for c in updated:
        for t in transitions:
            for cc, d in t.update:
                if cc == c and d:
                    deltas.setdefault(c, {}).setdefault(d, []).append(t.id)
    calls = action_calls(spec, transitions)
    unions = [*dsts.values(), *(tids for by in deltas.values() for tids in by.values()), *(tids for _, tids in calls)]
    # The union of every transition is named `taken` where it is used more than once or gives the rejected
    # items: by the spec's totality, an item that takes no transition and is in no state where the event is a
    # declared no-op is one where it is a declared error or no guard holds.
    shared = len(every) > 1 and (sum(u == every for u in unions) > 1 or bool(rejected))

    def union(tids: list[int], grouped: bool = False) -> str:
        if shared and tids == every:
            return "taken"
        text = _union(tids)
        return f"({text})" if grouped and len(tids) > 1 else text

    taken = union(every, grouped=True)
    if not rejected:
        bad = None
    elif ignored:
        bad = f"~({union(every)} | " + " | ".join(f"(s == {const[s]})" for s in ignored) + ")"
    else:
        bad = f"~{taken}"
    counter_writes = []
    for c, by in deltas.items():
        terms = [
            f"{'+' if d > 0 else '-'} {'' if abs(d) == 1 else f'{abs(d)} * '}{union(tids, grouped=True)}"
            for d, tids in by.items()
        ]
        counter_writes.append(dict(name=c, py=f"{c} {' '.join(terms)}"))
    return dict(
        name=event,
        doc=spec.model.events[event].doc,
        gathers=gathers,
        guards=guards,
        branches=branches,
        bad=bad,
        rejected=rejected,
        taken=_union(every) if shared else None,
        state_writes=[dict(const=const[d], tids=union(tids)) for d, tids in dsts.items()],
        counter_writes=counter_writes,
        calls=[dict(action=a, takes=union(tids)) for a, tids in calls],
        call_names=tuple(f"{a}_rows" for a, _ in calls),
        action_order=tuple(a for a, _ in calls),
    )


def render_rows(spec: CompiledSpec, spec_path: str) -> str:
    """The rows machine's source text for `spec`, as it would be written beside the per-request machine."""
    _check_names(spec)
    const = {s: s.upper() for s in spec.states}
    model = spec.model
    create = model.create
    events = [_event(spec, e, const) for e in spec.events]
    errors: dict[str, list[tuple[str, str]]] = {}
    guarded: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    for e in spec.events:
        errors[e] = [
            (const[s], o.reason)
            for s in spec.states
            if (o := spec.outcomes.get((s, e))) is not None and o.kind == "error"
        ]
        guarded[e] = [
            (const[s], tuple(t.guard for t in ts if t.guard))
            for s in spec.states
            if (ts := spec.handlers(s, e)) and all(t.guard for t in ts)
        ]
    ctx = dict(
        spec_path=spec_path,
        sha256=spec.sha256,
        name=spec.name,
        doc=model.doc,
        machine_module=module_name(spec),
        class_name=f"{spec.name}Rows",
        effects_name=f"{spec.name}RowsEffects",
        per_request_class=f"{spec.name}Machine",
        states=[dict(name=s, const=const[s], index=i, doc=m.doc) for i, (s, m) in enumerate(model.states.items())],
        terminal_consts=[const[s] for s, m in model.states.items() if m.terminal],
        initial_const=const[spec.initial],
        state_names=spec.states,
        event_names=spec.events,
        counter_names=spec.counters,
        param_names=spec.params,
        counters=[dict(name=c, doc=m.doc, initial=m.initial) for c, m in model.counters.items()],
        params=[dict(name=p, doc=m.doc) for p, m in model.params.items()],
        actions=[dict(name=a, doc=m.doc, effects=_effects_note(m)) for a, m in model.actions.items()],
        events=events,
        errors=errors,
        guarded=guarded,
        create_doc=create.doc if create else "New machines in their initial state.",
        create_holds=", ".join(create.holds) if create else "",
        create_calls=tuple(f"{a}_rows" for a in (create.actions if create else ())),
    )
    return _env().get_template("rows.py.j2").render(**ctx)


def _effects_note(m) -> str:
    parts = [
        f"{verb} {', '.join(items)}"
        for verb, items in (
            ("acquires", m.acquires),
            ("reads", m.reads),
            ("releases", m.releases),
            ("releases fenced", m.releases_fenced),
        )
        if items
    ]
    return "; ".join(parts)
