"""Compile a checked spec into a plain Python module: one class, one method per event, guards inlined.

Deterministic by construction: iteration follows the spec's own order, the template has no clock or
environment in it, and the output is stamped with the spec's sha256 so staleness is detectable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import jinja2

from kvfsm.spec import CompiledSpec, expr as ex, load_spec
from kvfsm.spec.checks import holdings
from kvfsm.spec.locations import default_out_dir, generated_dir, spec_stamp


def module_name(spec: CompiledSpec) -> str:
    """`DecodeOffload` -> `decode_offload`: the generated module's file stem."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", spec.name).lower()


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("kvfsm.codegen", "templates"),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
        autoescape=False,
    )
    env.filters["pyrepr"] = repr
    return env


def _effects_note(acquires, reads, releases) -> str:
    parts = [
        f"{verb} {', '.join(items)}"
        for verb, items in (("acquires", acquires), ("reads", reads), ("releases", releases))
        if items
    ]
    return "; ".join(parts)


def batch_action_order(spec: CompiledSpec, event: str) -> list[str] | None:
    """One order of the actions of `event`'s transitions that keeps each transition's own order: the order
    in which its batch form (`<event>_each`) calls them. None when two transitions order two actions both
    ways: that event's batch form then runs item by item."""
    order: list[str] = []
    transitions = [t for s in spec.states for t in spec.handlers(s, event)]
    for t in transitions:
        for a in t.actions:
            if a not in order:
                order.append(a)
    for t in transitions:
        at = [order.index(a) for a in t.actions]
        if at != sorted(at):
            return None
    return order


def render(spec: CompiledSpec, spec_path: str) -> str:
    """The generated module's source text for `spec`, as it would be written at `spec_path`'s sibling."""
    const = {s: s.upper() for s in spec.states}
    guard_py = {g: ex.render(node, lambda n: f"self.{n}") for g, node in spec.guards.items()}
    guard_m = {g: ex.render(node, lambda n: f"m.{n}") for g, node in spec.guards.items()}
    events = []
    for e, em in spec.model.events.items():
        branches = []
        for s in spec.states:
            ts = spec.handlers(s, e)
            if ts:
                branches.append(
                    dict(
                        kind="transitions",
                        state=s,
                        const=const[s],
                        guarded=all(t.guard for t in ts),
                        guards=tuple(t.guard for t in ts),
                        transitions=[
                            dict(
                                id=t.id,
                                label=t.label,
                                line=t.line,
                                guard=t.guard,
                                guard_py=guard_py.get(t.guard or ""),
                                guard_m=guard_m.get(t.guard or ""),
                                actions=t.actions,
                                updates=t.update,
                                src=t.src,
                                dst=t.dst,
                                dst_const=const[t.dst],
                            )
                            for t in ts
                        ],
                    )
                )
        for kind in ("ignore", "error"):
            groups: dict[str, list[str]] = {}
            for s in spec.states:
                o = spec.outcomes.get((s, e))
                if o is not None and o.kind == kind:
                    groups.setdefault(o.reason, []).append(s)
            for reason, states in groups.items():
                branches.append(
                    dict(
                        kind=kind,
                        states=states,
                        reason=reason,
                        last=False,
                        test=" or ".join(f"s == {const[s]}" for s in states),
                    )
                )
        if branches[-1]["kind"] == "error":
            branches[-1]["last"] = True
        events.append(
            dict(
                name=e,
                doc=em.doc,
                branches=branches,
                batch_actions=batch_action_order(spec, e),
                handled_consts=[const[s] for s in spec.states if spec.handlers(s, e)],
                ignored_consts=[
                    const[s] for s in spec.states if (o := spec.outcomes.get((s, e))) is not None and o.kind == "ignore"
                ],
            )
        )
    model = spec.model
    create = model.create
    ctx = dict(
        spec_path=spec_path,
        sha256=spec.sha256,
        name=spec.name,
        doc=model.doc,
        class_name=f"{spec.name}Machine",
        effects_name=f"{spec.name}Effects",
        states=[
            dict(name=s, const=const[s], index=i, doc=m.doc, terminal=m.terminal)
            for i, (s, m) in enumerate(model.states.items())
        ],
        initial_const=const[spec.initial],
        state_invariants=[
            dict(name=f"state {st}", const=const[st], py=ex.render(node, lambda n: f"m.{n}"))
            for st, node in spec.state_invariants.items()
        ],
        invariants=[
            dict(name=name, consts=[const[st] for st in where], py=ex.render(node, lambda n: f"m.{n}"))
            for name, (node, where) in spec.invariants.items()
        ],
        holds=[(const[st], tuple(sorted(holdings(spec)[0].get(st, ())))) for st in spec.states],
        state_names=spec.states,
        event_names=spec.events,
        counter_names=spec.counters,
        events=events,
        counters=[dict(name=c, doc=m.doc, initial=m.initial) for c, m in model.counters.items()],
        params=[dict(name=p, doc=m.doc) for p, m in model.params.items()],
        param_names=spec.params,
        actions=[
            dict(name=a, doc=m.doc, effects=_effects_note(m.acquires, m.reads, m.releases))
            for a, m in model.actions.items()
        ],
        transitions=spec.transitions,
        create_doc=create.doc if create else "A new machine in its initial state.",
        create_holds=", ".join(create.holds) if create else "",
        create_actions=list(create.actions) if create else [],
        policies=[
            dict(name=n, default=pol.default, choices=tuple(pol.choices), line=spec.lines.line(("policies", n)))
            for n, pol in model.policies.items()
        ],
    )
    return _env().get_template("machine.py.j2").render(**ctx)


@dataclass(frozen=True)
class GenResult:
    """What `generate` wrote or compared: `path` is the per-request machine, `files` every module it generates
    for the spec (the per-request machine, then the rows machine) with whether each differed."""

    path: Path
    changed: bool  # whether any of `files` differed from what the spec generates
    files: tuple[tuple[Path, bool], ...] = ()

    @property
    def stale(self) -> list[Path]:
        """The generated files that differ from what the spec generates (missing ones included)."""
        return [p for p, changed in self.files if changed]


def generate(spec_path: str | Path, out_dir: str | Path | None = None, check: bool = False) -> GenResult:
    """Write (or with `check`, compare) the generated modules for the spec at `spec_path`: its per-request
    machine (`<machine>.py`) and its struct-of-arrays batch machine (`<machine>_rows.py`, codegen/rows.py).

    `out_dir` defaults to the spec's own `generated/` (`locations.default_out_dir`), and the stamped spec
    path does not depend on the working directory, so any directory gives the same result."""
    from kvfsm.codegen.rows import render_rows, rows_module_name

    spec = load_spec(spec_path)
    folder = Path(out_dir if out_dir is not None else default_out_dir(Path(spec_path)))
    stamp = spec_stamp(Path(spec_path))
    files = []
    for stem, source in ((module_name(spec), render(spec, stamp)), (rows_module_name(spec), render_rows(spec, stamp))):
        target = folder / f"{stem}.py"
        current = target.read_text() if target.exists() else None
        changed = current != source
        if changed and not check:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(source)
        files.append((target, changed))
    return GenResult(files[0][0], any(c for _, c in files), tuple(files))


def runtime_mismatch(spec_path: str | Path, module: str = "decode_offload") -> str | None:
    """Why the runtime's machine `kvfsm.generated.<module>` is not what `spec_path` generates, or None.

    `demo` and `check` run the manager, which runs that machine: a claim about a spec the runtime was not
    generated from would be about nothing. Raises SpecInvalid for an invalid spec."""
    spec = load_spec(spec_path)
    if module_name(spec) != module:
        return f"{spec_path} generates {module_name(spec)}.py, but the manager runs {module}.py"
    result = generate(spec_path, generated_dir(), check=True)
    if result.changed:
        stale = ", ".join(str(p) for p in result.stale)
        return f"{stale} is not what {spec_path} generates: run `kvfsm gen {spec_path}`"
    return None
