"""Semantic checks that make a spec trustworthy: each returns errors naming file:line and element.

Guards and invariants are linear comparisons over small counters, so determinism and inductiveness are
decided by enumerating every counter valuation in a box [0, B]^n, with B two past the largest literal in
the spec: enough for every guard in the shipped spec to take each of its truth values.

Counter updates are tied to their causes: each action and each event declares the update it `implies`, and
a transition's `update` must be exactly their sum (check_updates), so an action cannot be given another
action's counter update, and no counter moves without a declared cause.
"""

from __future__ import annotations

import itertools
from collections import defaultdict, deque
from collections.abc import Iterator
from pathlib import Path

from kvfsm.input_limits import SPEC_MAX_CHECK_WORK
from kvfsm.spec import expr as ex
from kvfsm.spec.compiled import CompiledSpec, Transition, build
from kvfsm.spec.errors import SpecError, SpecInvalid

MAX_VALUATIONS = 200_000


def _box(spec: CompiledSpec) -> Iterator[dict[str, int]]:
    nodes = list(spec.guards.values()) + list(spec.state_invariants.values()) + [n for n, _ in spec.invariants.values()]
    bound = max([3] + [v + 2 for n in nodes for v in ex.literals(n)])
    if (bound + 1) ** len(spec.counters) > MAX_VALUATIONS:
        raise SpecInvalid(
            [
                spec.lines.error(
                    ("counters",),
                    "counters",
                    f"guards need counter values up to {bound} over {len(spec.counters)} counters; "
                    f"more than {MAX_VALUATIONS} valuations to check (use smaller literals)",
                )
            ]
        )
    work = (bound + 1) ** len(spec.counters) * 2 ** len(spec.params) * (len(spec.transitions) + len(spec.states))
    if work > SPEC_MAX_CHECK_WORK:  # a spec from a pull request must not keep `validate` busy for hours
        raise SpecInvalid(
            [
                spec.lines.error(
                    ("counters",),
                    "counters",
                    f"checking needs {work} valuations of transitions and states, more than "
                    f"{SPEC_MAX_CHECK_WORK} (bound SPEC_MAX_CHECK_WORK): fewer counters, params, "
                    "transitions or smaller literals",
                )
            ]
        )
    for values in itertools.product(range(bound + 1), repeat=len(spec.counters)):
        for flags in _param_values(spec):
            yield dict(zip(spec.counters, values)) | flags


def _param_values(spec: CompiledSpec) -> Iterator[dict[str, int]]:
    """Every assignment of the spec's params (each 0 or 1, fixed for a machine's life)."""
    for values in itertools.product((0, 1), repeat=len(spec.params)):
        yield dict(zip(spec.params, values))


def _guard_holds(spec: CompiledSpec, t: Transition, env: dict[str, int]) -> bool:
    return t.guard is None or bool(ex.evaluate(spec.guards[t.guard], env))


def _enabled(spec: CompiledSpec, t: Transition) -> list[dict[str, int]]:
    """The valuations of the box at which `t` may fire: its source state's invariants and its guard hold.

    Worked out once per (source, guard) for the spec and shared by the checks that walk transitions
    (determinism, invariants, fences): evaluating the expression trees for every transition and valuation in
    each of them was most of their CPU time. With `CompiledSpec.state_holds` remembering its answers, `kvfsm
    validate spec/decode_offload.yaml` went from 0.391 to 0.340 s of CPU (bench/cli_startup.py, the 2-core
    development machine)."""
    key = ("enabled", t.src, t.guard)
    got = spec.derived.get(key)
    if got is None:
        box = spec.derived.get("box")
        if box is None:
            box = spec.derived["box"] = list(_box(spec))
        got = spec.derived[key] = [env for env in box if spec.state_holds(t.src, env) and _guard_holds(spec, t, env)]
    return got


def _apply(t: Transition, env: dict[str, int]) -> dict[str, int]:
    out = dict(env)
    for counter, delta in t.update:
        out[counter] += delta
    return out


def check_structure(spec: CompiledSpec) -> list[SpecError]:
    """Reachability, dead ends, terminal states, totality, unused names."""
    errors: list[SpecError] = []
    lines = spec.lines
    model = spec.model
    out_edges: dict[str, set[str]] = defaultdict(set)
    for t in spec.transitions:
        out_edges[t.src].add(t.dst)

    seen, queue = {spec.initial}, deque([spec.initial])
    while queue:
        for nxt in out_edges[queue.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    for s, m in model.states.items():
        loc, element = ("states", s), f"state {s!r}"
        if s not in seen:
            errors.append(lines.error(loc, element, f"unreachable from the initial state {spec.initial!r}"))
        if not m.terminal and not (out_edges[s] - {s}):
            errors.append(
                lines.error(loc, element, "non-terminal state with no way out (mark it terminal or add a transition)")
            )
        if m.terminal:
            for t in spec.transitions:
                if t.src == s and t.acquires:
                    errors.append(
                        lines.error(
                            ("transitions", t.rule),
                            f"transitions[{t.rule}] {t.label}",
                            f"terminal state {s!r} can still acquire {', '.join(t.acquires)}",
                        )
                    )
                elif t.src == s and t.dst != s:
                    errors.append(
                        lines.error(
                            ("transitions", t.rule),
                            f"transitions[{t.rule}] {t.label}",
                            f"terminal state {s!r} has a way out to {t.dst!r}",
                        )
                    )

    for s in spec.states:
        for e in spec.events:
            handled = bool(spec.handlers(s, e))
            outcome = spec.outcomes.get((s, e))
            if handled and outcome is not None:
                errors.append(
                    SpecError(
                        spec.path,
                        outcome.line,
                        f"({s}, {e})",
                        f"has transitions and is also declared {outcome.kind} here",
                    )
                )
            elif not handled and outcome is None:
                errors.append(
                    lines.error(
                        ("states", s),
                        f"({s}, {e})",
                        f"not total: event {e!r} in state {s!r} has no transition and is neither ignored nor an error",
                    )
                )

    used_guards = {t.guard for t in spec.transitions}
    used_actions = {a for t in spec.transitions for a in t.actions} | set(model.create.actions if model.create else ())
    for g in model.guards:
        if g not in used_guards:
            errors.append(lines.error(("guards", g), f"guard {g!r}", "declared but used by no transition"))
    for a in model.actions:
        if a not in used_actions:
            errors.append(lines.error(("actions", a), f"action {a!r}", "declared but used by no transition"))
    for e in model.events:
        if not any(t.event == e for t in spec.transitions):
            errors.append(lines.error(("events", e), f"event {e!r}", "has no transition in any state"))
    return errors


def check_determinism(spec: CompiledSpec) -> list[SpecError]:
    """Two transitions of one (state, event) whose guards can both hold is nondeterminism."""
    errors: list[SpecError] = []
    by_pair: dict[tuple[str, str], list[Transition]] = defaultdict(list)
    for t in spec.transitions:
        by_pair[(t.src, t.event)].append(t)
    for (_s, _event), ts in by_pair.items():
        for a, b in itertools.combinations(ts, 2):
            witness = next((env for env in _enabled(spec, a) if _guard_holds(spec, b, env)), None)
            if witness is not None:
                errors.append(
                    spec.lines.error(
                        ("transitions", b.rule),
                        f"transitions[{b.rule}] {b.label}",
                        f"nondeterministic with transitions[{a.rule}] {a.label}: both guards hold at {witness}",
                    )
                )
    return errors


def check_invariants(spec: CompiledSpec) -> list[SpecError]:
    """Every invariant is inductive: it holds initially and every transition preserves it."""
    errors: list[SpecError] = []
    for flags in _param_values(spec):
        start = {c: m.initial for c, m in spec.model.counters.items()} | flags
        if not spec.state_holds(spec.initial, start):
            errors.append(
                spec.lines.error(
                    ("states", spec.initial),
                    f"state {spec.initial!r}",
                    f"the initial counters {start} violate its invariants",
                )
            )
            break
    for t in spec.transitions:
        for env in _enabled(spec, t):
            post = _apply(t, env)
            if not spec.state_holds(t.dst, post):
                errors.append(
                    spec.lines.error(
                        ("transitions", t.rule),
                        f"transitions[{t.rule}] {t.label}",
                        f"breaks the invariants of {t.dst!r}: {env} -> {post}",
                    )
                )
                break
    return errors


def implied_update(spec: CompiledSpec, t: Transition) -> dict[str, list[tuple[str, int, int]]]:
    """Counter -> the (source, delta, line) of every implication a transition carries: its event's and each of
    its actions' `implies` (an action listed twice implies twice)."""
    model, lines = spec.model, spec.lines
    out: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    for c, d in model.events[t.event].implies.items():
        out[c].append((f"event {t.event!r}", d, lines.line(("events", t.event, "implies", c))))
    for a in t.actions:
        for c, d in model.actions[a].implies.items():
            out[c].append((f"action {a!r}", d, lines.line(("actions", a, "implies", c))))
    return out


def check_updates(spec: CompiledSpec) -> list[SpecError]:
    """Counters move only for a declared reason: a transition's `update` is exactly the sum of the updates its
    event and its actions imply. An update no action or event implies, an implied update the transition
    leaves out, or a different delta (an action given another action's counter update) is an error."""
    errors: list[SpecError] = []
    seen: set[tuple[int, str, str]] = set()
    for t in spec.transitions:
        declared = dict(t.update)
        implied = implied_update(spec, t)
        for c in sorted(set(declared) | set(implied), key=spec.counters.index):
            d, srcs = declared.get(c, 0), implied.get(c, [])
            v = sum(delta for _, delta, _ in srcs)
            if d == v or (t.rule, t.event, c) in seen:
                continue
            seen.add((t.rule, t.event, c))
            said = f"updates {c} by {d:+d}" if d else f"does not update {c}"
            if not srcs:
                acts = ", ".join(repr(a) for a in t.actions) or "none"
                msg = (
                    f"{said}, but neither its event {t.event!r} nor any of its actions ({acts}) implies a change "
                    f"of {c}; declare `implies: {{{c}: {d:+d}}}` on the action or event that causes it"
                )
            else:
                why = ", ".join(f"{src} (line {line}) implies {c} {delta:+d}" for src, delta, line in srcs)
                total = f"{c} {v:+d}" if v else f"no net change of {c}"
                msg = f"{said}, but {why}" + (f": {total} in all" if len(srcs) > 1 else "")
            loc = ("transitions", t.rule, "update") if declared else ("transitions", t.rule)
            errors.append(spec.lines.error(loc, f"transitions[{t.rule}] {t.label}", msg))
    return errors


def check_resources(spec: CompiledSpec) -> list[SpecError]:
    """Conservation: what is acquired is released somewhere; what a new machine holds is released exactly once."""
    errors: list[SpecError] = []
    lines, model = spec.lines, spec.model
    holds = tuple(model.create.holds) if model.create else ()
    acquired = set(holds) | {r for t in spec.transitions for r in t.acquires}
    released = {r for t in spec.transitions for r in t.releases}
    for r in model.resources:
        loc, element = ("resources", r), f"resource {r!r}"
        if r in acquired and r not in released:
            errors.append(lines.error(loc, element, "acquired on some path and released on none (leak)"))
        if r in released and r not in acquired:
            errors.append(lines.error(loc, element, "released but never acquired (double free)"))
        if r not in acquired and r not in released and not any(r in t.reads for t in spec.transitions):
            errors.append(lines.error(loc, element, "declared but never acquired, read or released"))

    held_at, problems = holdings(spec)
    errors += [lines.error(("transitions", t.rule), f"transitions[{t.rule}] {t.label}", msg) for t, msg in problems]
    for s, m in model.states.items():
        if m.terminal and held_at.get(s):
            errors.append(
                lines.error(
                    ("states", s), f"state {s!r}", f"terminal state still holds {', '.join(sorted(held_at[s]))} (leak)"
                )
            )
    return errors


def holdings(spec: CompiledSpec) -> tuple[dict[str, frozenset[str]], list[tuple[Transition, str]]]:
    """Which single-owner resources (held from creation, never re-acquired) each state holds.

    Propagated along every transition: each state must have one held set, and a release must find the
    resource held. Returns the held sets and the transitions that break those rules.
    """
    holds = tuple(spec.model.create.holds) if spec.model.create else ()
    single = tuple(r for r in holds if not any(r in t.acquires for t in spec.transitions))
    held_at: dict[str, frozenset[str]] = {spec.initial: frozenset(single)}
    problems: list[tuple[Transition, str]] = []
    queue = deque([spec.initial])
    while queue:
        s = queue.popleft()
        held = held_at[s]
        for t in spec.transitions:
            if t.src != s:
                continue
            twice = [r for r in t.releases if r in single and r not in held]
            if twice:
                problems.append(
                    (t, f"releases {', '.join(twice)} which is already released on this path (double release)")
                )
            after = held - set(t.releases)
            if t.dst not in held_at:
                held_at[t.dst] = after
                queue.append(t.dst)
            elif held_at[t.dst] != after:
                problems.append(
                    (
                        t,
                        f"reaches {t.dst!r} holding {sorted(after)} but another path reaches it holding "
                        f"{sorted(held_at[t.dst])}",
                    )
                )
    unique = list({(t.id, msg): (t, msg) for t, msg in problems}.values())
    return held_at, unique


def check_fences(spec: CompiledSpec) -> list[SpecError]:
    """A resource that in-flight operations read (`read_by`) or write (`written_by`) is released plainly only
    once none can be left after the transition; while some may be, only fenced (`releases_fenced`, under the
    resource's `fence` rule), and a fenced release must have something to fence (else it should be a plain
    one). A load-back writes what an offload reads: a release under either is checked against both."""
    errors: list[SpecError] = []
    users = {
        r: [(c, verb) for c, verb in ((m.read_by, "reads"), (m.written_by, "writes")) if c is not None]
        for r, m in spec.model.resources.items()
    }
    users = {r: u for r, u in users.items() if u}
    if not users:
        return errors
    for t in spec.transitions:
        posts = [_apply(t, env) for env in _enabled(spec, t)]
        for r in t.releases:
            if r not in users:
                continue
            busy = next(((c, verb, post) for c, verb in users[r] for post in posts if post[c] >= 1), None)
            where = ("transitions", t.rule), f"transitions[{t.rule}] {t.label}"
            if r not in t.fenced and busy is not None:
                c, verb, post = busy
                errors.append(
                    spec.lines.error(
                        *where,
                        f"releases {r!r} while {c} may still be {post[c]} (at {post}): "
                        f"what {c} counts still {verb} it; release it fenced "
                        f"(`releases_fenced`) or after the last of them",
                    )
                )
            elif r in t.fenced and busy is None and posts:
                counters = list(dict.fromkeys(c for c, _ in users[r]))
                names, what = " and ".join(counters), " or ".join(verb for _, verb in users[r])
                errors.append(
                    spec.lines.error(
                        *where,
                        f"releases {r!r} fenced, but {names} "
                        f"{'is' if len(counters) == 1 else 'are'} 0 after it in every case: "
                        f"nothing {what} it any more; release it plainly",
                    )
                )
    return errors


def check_copy_directions(spec: CompiledSpec) -> list[SpecError]:
    """An action that starts an operation (`implies: {c: +1}`) reads the resources it `reads` and writes those it
    `acquires` (a copy: its source and its destination). On a resource whose releases are checked against
    in-flight operations (`read_by` / `written_by`), an operation counted so for some resource must be the one
    named for its direction, else a release under it (a load-back's writes, say, where only reads are named)
    would go unchecked."""
    errors: list[SpecError] = []
    model = spec.model
    operations = {c for res in model.resources.values() for c in (res.read_by, res.written_by) if c is not None}
    for a, act in model.actions.items():
        started = [c for c, d in act.implies.items() if d > 0 and c in operations]
        for verb, field, resources in (("reads", "read_by", act.reads), ("writes", "written_by", act.acquires)):
            for r in resources:
                res = model.resources.get(r)
                if res is None or (res.read_by is None and res.written_by is None):
                    continue
                named = getattr(res, field)
                for c in started:
                    if named != c:
                        how = "reads" if verb == "reads" else "acquires"
                        errors.append(
                            spec.lines.error(
                                ("actions", a),
                                f"action {a!r}",
                                f"starts what {c} counts, which {verb} {r!r} (it {how} it), but resource {r!r} names "
                                f"{f'{named!r}' if named else 'no counter'} as `{field}`: a release of {r!r} under it "
                                "would not be checked against it",
                            )
                        )
    return errors


CHECKS = (
    check_structure,
    check_updates,
    check_determinism,
    check_invariants,
    check_resources,
    check_fences,
    check_copy_directions,
)


def load_spec(path: str | Path) -> CompiledSpec:
    """Build and check a spec; raise SpecInvalid with every error found."""
    spec = build(path)
    errors = [e for check in CHECKS for e in check(spec)]
    if errors:
        raise SpecInvalid(errors)
    return spec
