"""The generated machine and the `transitions` reference agree on every step of random event streams."""

from __future__ import annotations

import importlib
import itertools
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

import kvfsm.generated.decode_offload as gen
from kvfsm.errors import EventRejected, GuardRejected
from kvfsm.reference import ReferenceMachine
from kvfsm.spec import load_spec

SPEC = load_spec("spec/decode_offload.yaml")


class RecordingEffects:
    """Logs every action with the machine's bookkeeping at call time; optionally fails one action."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.log: list[tuple[str, Any, tuple[int, ...]]] = []
        self.fail_on = fail_on

    def __getattr__(self, action: str):
        if action not in SPEC.model.actions:
            raise AttributeError(action)

        def run(m: Any, arg: Any) -> None:
            self.log.append((action, arg, m.snapshot()))
            if action == self.fail_on:
                raise RuntimeError(f"injected failure in {action}")

        return run


def _outcome(fn, *args):
    try:
        fn(*args)
        return ("ok",)
    except GuardRejected as e:
        return ("guard", e.event, e.state, e.guards)
    except EventRejected as e:
        return ("error", e.event, e.state, e.reason)
    except RuntimeError as e:
        return ("raised", str(e))


def _pair(fail_on: str | None = None, fences: int = 0):
    fx_g, fx_r = RecordingEffects(fail_on), RecordingEffects(fail_on)
    obs_g: list = []
    obs_r: list = []
    g = gen.DecodeOffloadMachine(fx_g, observer=lambda m, *a: obs_g.append(a), fences=fences)
    r = ReferenceMachine(SPEC, fx_r, observer=lambda m, *a: obs_r.append(a), fences=fences)
    return (g, fx_g, obs_g), (r, fx_r, obs_r)


events = st.lists(st.tuples(st.sampled_from(SPEC.events), st.integers(0, 3)), max_size=80)


@given(events, st.sampled_from([None, *SPEC.model.actions]), st.sampled_from([0, 1]))
def test_generated_matches_reference(stream, fail_on, fences):
    (g, fx_g, obs_g), (r, fx_r, obs_r) = _pair(fail_on if fail_on != "seed_hash_chain" else None, fences)
    assert g.snapshot() == r.snapshot()
    for event, arg in stream:
        before = g.snapshot()
        got = _outcome(getattr(g, event), arg)
        want = _outcome(r.fire, event, arg)
        assert got == want, (event, before)
        assert g.snapshot() == r.snapshot()
        assert fx_g.log == fx_r.log
        assert obs_g == obs_r
        if got[0] != "ok":
            assert g.snapshot() == before, "a rejected event changed the machine"


def _reached(fences: int) -> set[int]:
    """Breadth-first over events from the initial machine with the given param: the transitions it fires."""
    seen: set[int] = set()
    frontier = [[]]
    for _ in range(8):
        nxt = []
        for path in frontier:
            for event in SPEC.events:
                fx = RecordingEffects()
                hits: list[int] = []
                m = gen.DecodeOffloadMachine(fx, observer=lambda _m, _e, _s, _d, tid: hits.append(tid), fences=fences)
                try:
                    for e in path + [event]:
                        getattr(m, e)()
                except EventRejected:
                    continue
                seen.update(h for h in hits if h >= 0)
                nxt.append(path + [event])
        frontier = nxt[:400]
    return seen


def test_every_transition_is_reachable_by_some_stream():
    """Every declared transition fires for one of the param's values; the deferred release (state finished)
    only without fences, the fenced one (state fenced) only with them."""
    deferred, fenced = _reached(0), _reached(1)
    assert deferred | fenced == {t.id for t in SPEC.transitions}
    for seen, other, state in ((deferred, "fenced_release", "fenced"), (fenced, "deferred_release", "finished")):
        never = {t.id for t in SPEC.transitions if t.guard == other or t.src == state}
        assert never and not (seen & never)


def test_a_param_outside_0_and_1_is_refused_by_both_machines():
    for make in (
        lambda: gen.DecodeOffloadMachine(RecordingEffects(), fences=2),
        lambda: ReferenceMachine(SPEC, RecordingEffects(), fences=2),
    ):
        with pytest.raises(ValueError, match="0 or 1"):
            make()


@pytest.mark.parametrize("event", SPEC.events)
def test_released_machine_rejects_or_ignores_everything(event):
    m = gen.DecodeOffloadMachine(RecordingEffects())
    m.finish()
    assert gen.STATES[m.state] == "released"
    before = m.snapshot()
    outcome = SPEC.outcomes[("released", event)]
    if outcome.kind == "ignore":
        getattr(m, event)()
    else:
        with pytest.raises(EventRejected) as info:
            getattr(m, event)()
        assert info.value.state == "released" and info.value.event == event
    assert m.snapshot() == before


def put_into(m: Any, state: int, counters: tuple[int, int, int]) -> Any:
    """Machine `m` (generated or reference) put straight into `state` with `counters` (copies, parked, backups)."""
    if isinstance(m, ReferenceMachine):
        m._model.state = SPEC.states[state]
        m.counters.update(zip(SPEC.counters, counters))
    else:
        m.state = state
        m.copies, m.parked, m.backups = counters
    return m


def _outcome_from(m, fx: RecordingEffects, state: int, counters: tuple[int, int, int], event: str):
    """Machine `m` put straight into `state` with `counters`, then `event`: (outcome, snapshot, actions)."""
    fx.log.clear()
    put_into(m, state, counters)
    got = _outcome(getattr(m, event), None)
    return got, m.snapshot(), [a for a, _, _ in fx.log]


def test_every_state_counter_valuation_and_event_agrees_with_the_reference():
    """Exhaustively over a box (every state, every counter in 0..3, both params, every event), not only what
    random streams reach: each guard's boundary (copies 1 against 2, a last host chunk against the one
    before) is decided as the spec says, in the generated machine and in `transitions` alike."""
    import itertools

    for fences in (0, 1):
        fx_g, fx_r = RecordingEffects(), RecordingEffects()
        g_m, r_m = gen.DecodeOffloadMachine(fx_g, fences=fences), ReferenceMachine(SPEC, fx_r, fences=fences)
        for state in range(len(SPEC.states)):
            for counters in itertools.product(range(4), repeat=3):
                for event in SPEC.events:
                    g = _outcome_from(g_m, fx_g, state, counters, event)
                    r = _outcome_from(r_m, fx_r, state, counters, event)
                    assert g == r, (fences, SPEC.states[state], counters, event, g, r)


# ---- every shipped spec: its generated machine against the reference, and every transition reachable ----------

SHIPPED = sorted(p.stem for p in Path(__file__).resolve().parents[2].joinpath("spec").glob("*.yaml"))


def _machine_class(name: str) -> tuple[Any, Any]:
    spec = load_spec(Path(__file__).resolve().parents[2] / "spec" / f"{name}.yaml")
    module = importlib.import_module(f"kvfsm.generated.{name}")
    return spec, getattr(module, f"{spec.name}Machine")


class SpecEffects:
    """RecordingEffects for any spec: logs each action of `spec` with the machine's bookkeeping; may fail one."""

    def __init__(self, spec: Any, fail_on: str | None = None) -> None:
        self.spec, self.log, self.fail_on = spec, [], fail_on

    def __getattr__(self, action: str):
        if action not in self.spec.model.actions:
            raise AttributeError(action)

        def run(m: Any, arg: Any) -> None:
            self.log.append((action, arg, m.snapshot()))
            if action == self.fail_on:
                raise RuntimeError(f"injected failure in {action}")

        return run


@pytest.mark.parametrize("name", SHIPPED)
@settings(
    max_examples=30 if os.environ.get("KVFSM_FUZZ", "ci") == "ci" else settings.default.max_examples, deadline=None
)
@given(data=st.data())
def test_every_shipped_spec_generated_matches_reference(name: str, data: st.DataObject) -> None:
    """The same random event streams (each action possibly failing, each param drawn) through the generated
    machine and the `transitions` reference of every spec in spec/: outcomes, bookkeeping, actions and
    observations agree step by step, and a rejected event changes nothing."""
    spec, machine = _machine_class(name)
    params = {p: data.draw(st.sampled_from([0, 1]), label=p) for p in spec.params}
    creating = set(spec.model.create.actions) if spec.model.create else set()  # run by the constructor
    fail_on = data.draw(st.sampled_from([None, *(a for a in spec.model.actions if a not in creating)]), label="fail_on")
    stream = data.draw(st.lists(st.tuples(st.sampled_from(spec.events), st.integers(0, 3)), max_size=60))
    fx_g, fx_r = SpecEffects(spec, fail_on), SpecEffects(spec, fail_on)
    obs_g: list = []
    obs_r: list = []
    g = machine(fx_g, observer=lambda m, *a: obs_g.append(a), **params)
    r = ReferenceMachine(spec, fx_r, observer=lambda m, *a: obs_r.append(a), **params)
    assert g.snapshot() == r.snapshot()
    for event, arg in stream:
        before = g.snapshot()
        got = _outcome(getattr(g, event), arg)
        assert got == _outcome(r.fire, event, arg), (name, event, before)
        assert g.snapshot() == r.snapshot() and fx_g.log == fx_r.log and obs_g == obs_r
        if got[0] != "ok":
            assert g.snapshot() == before, "a rejected event changed the machine"


@pytest.mark.parametrize("name", SHIPPED)
def test_every_transition_of_every_shipped_spec_is_reachable(name: str) -> None:
    """Breadth-first over event paths from a new machine, for every value of its params: every transition
    of every spec in spec/ fires on some path (a transition no path fires is dead text in the spec)."""
    spec, machine = _machine_class(name)
    seen: set[int] = set()
    for values in itertools.product((0, 1), repeat=len(spec.params)):
        params = dict(zip(spec.params, values))
        frontier: list[list[str]] = [[]]
        for _ in range(8):
            nxt = []
            for path in frontier:
                for event in spec.events:
                    hits: list[int] = []
                    m = machine(SpecEffects(spec), observer=lambda _m, _e, _s, _d, tid: hits.append(tid), **params)
                    try:
                        for e in path + [event]:
                            getattr(m, e)()
                    except EventRejected:
                        continue
                    seen.update(h for h in hits if h >= 0)
                    nxt.append(path + [event])
            frontier = nxt[:400]
    assert seen == {t.id for t in spec.transitions}, sorted({t.id for t in spec.transitions} - seen)
