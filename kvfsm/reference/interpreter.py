"""Load a CompiledSpec into a `transitions.Machine` and expose the generated machine's interface.

The generator and this interpreter share only the CompiledSpec; agreement between them (see the
differential test) is evidence that the generated branches say what the spec says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from transitions import EventData, Machine, MachineError

from kvfsm.errors import EventRejected, GuardRejected
from kvfsm.spec import CompiledSpec, Transition, expr as ex

IGNORED_TRANSITION = -1


class _Model:
    """The object `transitions` drives; it only carries the current state name (and the `trigger` method
    `transitions` adds to it)."""

    state: str
    trigger: Callable[..., bool]


class ReferenceMachine:
    """Same surface as a generated machine: one method per event, `state`, counters, `snapshot()`."""

    def __init__(
        self,
        spec: CompiledSpec,
        fx: Any,
        ctx: Any = None,
        observer: Optional[Callable[..., None]] = None,
        **params: int,
    ) -> None:
        unknown = sorted(set(params) - set(spec.params))
        if unknown or any(v not in (0, 1) for v in params.values()):
            raise ValueError(f"params must be 0 or 1 and among {list(spec.params)}, got {params!r}")
        self.spec, self.fx, self.ctx, self.observer = spec, fx, ctx, observer
        self.counters = {c: m.initial for c, m in spec.model.counters.items()}
        self.params = {p: params.get(p, 0) for p in spec.params}  # constants: guards read them, nothing updates them
        self._model = _Model()
        self._fsm = Machine(
            model=self._model,
            states=list(spec.states),
            initial=spec.initial,
            auto_transitions=False,
            send_event=True,
            ignore_invalid_triggers=False,
        )
        for t in spec.transitions:
            self._fsm.add_transition(
                t.event, t.src, t.dst, conditions=[self._guard(t)], before=[self._effects(t)], after=[self._observe(t)]
            )
        for (state, event), outcome in spec.outcomes.items():
            if outcome.kind == "ignore":
                self._fsm.add_transition(event, state, None, after=[self._ignored(event)])
        for action in spec.model.create.actions if spec.model.create else ():
            getattr(fx, action)(self, None)

    def _guard(self, t: Transition) -> Callable[[EventData], bool]:
        node = self.spec.guards.get(t.guard) if t.guard else None
        return lambda _ev: node is None or bool(ex.evaluate(node, {**self.counters, **self.params}))

    def _effects(self, t: Transition) -> Callable[[EventData], None]:
        def run(ev: EventData) -> None:
            arg = next(iter(ev.args), None)
            for action in t.actions:
                getattr(self.fx, action)(self, arg)
            for counter, delta in t.update:
                self.counters[counter] += delta

        return run

    def _observe(self, t: Transition) -> Callable[[EventData], None]:
        src, dst = self.spec.states.index(t.src), self.spec.states.index(t.dst)
        return lambda _ev: self.observer and self.observer(self, t.event, src, dst, t.id)

    def _ignored(self, event: str) -> Callable[[EventData], None]:
        def run(_ev: EventData) -> None:
            if self.observer:
                s = self.state
                self.observer(self, event, s, s, IGNORED_TRANSITION)

        return run

    @property
    def state(self) -> int:
        return self.spec.states.index(self._model.state)

    def __getattr__(self, name: str) -> Any:
        counters = self.__dict__.get("counters")
        if counters is not None and name in counters:
            return counters[name]
        params = self.__dict__.get("params")
        if params is not None and name in params:
            return params[name]
        spec = self.__dict__.get("spec")
        if spec is not None and name in spec.events:
            return lambda arg=None: self.fire(name, arg)
        raise AttributeError(name)

    def snapshot(self) -> tuple[int, ...]:
        return (self.state, *self.counters.values())

    def fire(self, event: str, arg: Any = None) -> None:
        state = self._model.state
        try:
            accepted = self._model.trigger(event, arg)
        except MachineError:
            outcome = self.spec.outcomes.get((state, event))
            raise EventRejected(self, event, state, outcome.reason if outcome else "not declared") from None
        if not accepted:
            guards = tuple(t.guard for t in self.spec.handlers(state, event) if t.guard)
            raise GuardRejected(self, event, state, guards)
