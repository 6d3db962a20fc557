"""Tests written to kill survivors of `make mutate` in the generated machine (docs/mutation.md)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from test_kills import ORDERS, Recorder  # tests/mutation is on sys.path (rootdir-relative test modules)
from tests.reference.test_differential import SPEC, RecordingEffects, _outcome, put_into

import kvfsm.generated.decode_offload as gen
from kvfsm.generated.decode_offload import DecodeOffloadMachine
from kvfsm.reference import ReferenceMachine

# Every state with every counter in 0..3 (a decrement that sets a counter to 1 shows only from 3), for both
# values of the param: machines are put straight into them, as the differential test's exhaustive box does.
BOX = [(s, c) for s in range(len(gen.STATES)) for c in itertools.product(range(4), repeat=3)]
# A few per state for batches of two, where one item's branch must not end the batch for the next
PAIR_BOX = [(s, c) for s in range(len(gen.STATES)) for c in ((0, 0, 1), (1, 1, 0), (2, 0, 1), (3, 1, 1))]


@pytest.mark.parametrize("event", gen.EVENTS)
def test_every_single_event_reports_the_spec_transition_it_took_to_the_observer(event: str) -> None:
    """The manager records coverage and checks invariants from what the observer is told, so it must be exact."""
    # from every state and counter valuation, with either param: exactly one call, with the machine itself, the
    # event, its source and target state and the id of the spec transition between them (a declared no-op: the
    # state twice and IGNORED_TRANSITION), as the `transitions` reference calls it; the state and counters as
    # the spec says, and the same without an observer
    for fences in (0, 1):
        fx_g, fx_r, fx_n = RecordingEffects(), RecordingEffects(), RecordingEffects()
        seen_g: list[tuple] = []
        seen_r: list[tuple] = []
        g = DecodeOffloadMachine(fx_g, observer=lambda m, *a: seen_g.append((m, *a)), fences=fences)
        r = ReferenceMachine(SPEC, fx_r, observer=lambda m, *a: seen_r.append(a), fences=fences)
        plain = DecodeOffloadMachine(fx_n, fences=fences)  # no observer: the same transitions, unreported
        for state, counters in BOX:
            for fx, seen in ((fx_g, seen_g), (fx_r, seen_r), (fx_n, None)):
                fx.log.clear()
                if seen is not None:
                    seen.clear()
            got = _outcome(getattr(put_into(g, state, counters), event), f"arg-{state}")
            want = _outcome(put_into(r, state, counters).fire, event, f"arg-{state}")
            quiet = _outcome(getattr(put_into(plain, state, counters), event), f"arg-{state}")
            where = (fences, gen.STATES[state], counters, event)
            assert got == want == quiet, (where, got, want, quiet)
            assert g.snapshot() == r.snapshot() == plain.snapshot(), where
            assert fx_g.log == fx_r.log == fx_n.log, where
            assert [c[1:] for c in seen_g] == seen_r, (where, seen_g, seen_r)
            if got != ("ok",):
                assert seen_g == [] and g.snapshot() == (state, *counters), where
                continue
            assert len(seen_g) == 1, (where, seen_g)
            m, e, src, dst, tid = seen_g[0]
            assert m is g and e == event and src == state and dst == g.state, (where, seen_g)
            if tid == gen.IGNORED_TRANSITION:
                assert SPEC.outcomes[(gen.STATES[state], event)].kind == "ignore", where
                assert g.snapshot() == (state, *counters) and fx_g.log == [], where
            else:
                t = SPEC.transitions[tid]
                assert t.id == tid and (t.src, t.event, t.dst) == (gen.STATES[src], e, gen.STATES[dst]), (where, t)


def _machines(
    fx: Recorder, items: list[tuple[int, tuple[int, int, int]]], fences: int, observer: Any = None
) -> list[DecodeOffloadMachine]:
    ms = [
        put_into(DecodeOffloadMachine(fx, ctx=i, observer=observer, fences=fences), s, c)
        for i, (s, c) in enumerate(items)
    ]
    fx.log.clear()
    return ms


@pytest.mark.parametrize("event", gen.EVENTS)
def test_every_batch_event_equals_its_loop_from_every_state_with_either_param(event: str) -> None:
    """`<event>_each` is the manager's hot path: it must do what the loop of single events does, fences or not."""
    # one machine from every state and counter valuation, two in any two states: the machines end where the
    # loop leaves them, each action gets the loop's items in the event's action order, a rejection is the
    # loop's error with nothing changed and no action run, a raising action puts every machine back, and with
    # an observer the batch runs (and reports) item by item as the loop does
    each = getattr(DecodeOffloadMachine, f"{event}_each")
    batches = [[x] for x in BOX] + [list(p) for p in itertools.product(PAIR_BOX, repeat=2)]
    for fences in (0, 1):
        for items in batches:
            args = [f"arg{i}" for i in range(len(items))]
            fx_loop, fx_batch, fx_obs = Recorder(), Recorder(), Recorder()
            seen_loop: list[tuple] = []
            seen_obs: list[tuple] = []
            loop = _machines(fx_loop, items, fences, observer=lambda m, *a: seen_loop.append((m.ctx, *a)))
            batch = _machines(fx_batch, items, fences)
            observed = _machines(fx_obs, items, fences, observer=lambda m, *a: seen_obs.append((m.ctx, *a)))
            before = [m.snapshot() for m in batch]
            where = (fences, event, items)
            want = ("ok",)
            for m, arg in zip(loop, args):
                want = _outcome(getattr(m, event), arg)
                if want != ("ok",):
                    break
            got, got_obs = _outcome(each, batch, args), _outcome(each, observed, args)
            assert got == got_obs == want, (where, got, got_obs, want)
            assert [m.snapshot() for m in observed] == [m.snapshot() for m in loop], where
            assert fx_obs.log == fx_loop.log and seen_obs == seen_loop, where  # item by item, as the loop
            if want != ("ok",):
                assert [m.snapshot() for m in batch] == before and fx_batch.log == [], where
                continue
            assert [m.snapshot() for m in batch] == [m.snapshot() for m in loop], where
            assert fx_batch.log == [x for a in ORDERS[event] for x in fx_loop.log if x[0] == a], where
            if fx_batch.log:  # the batch's last action raises: every machine is put back as the batch found it
                failing = _machines(Recorder(fail=fx_batch.log[-1][0]), items, fences)
                with pytest.raises(RuntimeError):
                    each(failing, args)
                assert [m.snapshot() for m in failing] == before, where
