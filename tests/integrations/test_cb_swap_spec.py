"""spec/cb_swap.yaml is valid and generated/cb_swap.py is fresh (needs no transformers); the generated machine
and the reference interpreter agree for both values of the `fences` param, and the validator's fence checks
accept the fenced swap-out for the right reasons (its mutants are rejected)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvfsm.generated.cb_swap as gen
from kvfsm.codegen.generator import generate
from kvfsm.errors import EventRejected, GuardRejected
from kvfsm.reference import ReferenceMachine
from kvfsm.spec import SpecInvalid
from kvfsm.spec.checks import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "spec" / "cb_swap.yaml"
COMPILED = load_spec(SPEC)


def test_spec_is_valid_and_declares_the_swap_lifecycle() -> None:
    spec = COMPILED
    assert spec.name == "CbSwap"
    assert {"preempt", "swap_out_done", "restore", "swap_in_done", "finish", "cancel", "soft_reset"} <= set(spec.events)
    assert {"device_blocks", "host_blocks"} <= set(spec.model.resources)
    for preempt in (t for t in spec.transitions if t.event == "preempt"):
        assert preempt.acquires == ("host_blocks",) and "device_blocks" in preempt.reads
    restore = next(t for t in spec.transitions if t.event == "restore")
    assert restore.acquires == ("device_blocks",) and "host_blocks" in restore.reads


def test_the_fenced_swap_out_releases_the_device_blocks_at_the_preempt_and_only_with_fences() -> None:
    spec = COMPILED
    assert spec.params == ("fences",)
    blocks = spec.model.resources["device_blocks"]
    assert blocks.read_by == "copies" and blocks.fence and "compute stream" in blocks.fence
    by = {(t.src, t.event, t.guard): t for t in spec.transitions}
    fenced = by[("resident", "preempt", "fenced_release")]
    deferred = by[("resident", "preempt", "deferred_release")]
    assert fenced.dst == "swapping_out_fenced" and fenced.fenced == ("device_blocks",)
    assert "device_blocks" in fenced.releases and dict(fenced.update) == {"copies": 1}
    assert deferred.dst == "swapping_out" and not deferred.releases
    # its acknowledgement does what remains: the blocks are gone, only the host blocks are checked
    ack = by[("swapping_out_fenced", "swap_out_done", None)]
    assert ack.dst == "swapped" and not ack.releases and "device_blocks" not in ack.reads
    # a cancel in that window frees the host blocks, which the copy still writes, only at the ack
    cancel = by[("swapping_out_fenced", "cancel", None)]
    assert cancel.dst == "ending_fenced" and not cancel.releases
    assert by[("ending_fenced", "swap_out_done", None)].releases == ("host_blocks",)
    assert spec.outcomes[("swapping_out_fenced", "finish")].kind == "error"
    assert spec.outcomes[("swapping_out_fenced", "restore")].kind == "error"
    assert spec.outcomes[("ending_fenced", "cancel")].kind == "ignore"
    # every plain release of the device blocks leaves no copy in flight; the one fenced release leaves one
    assert gen.FENCED_RELEASES == {fenced.id: ("device_blocks",)}


def test_generated_machine_is_fresh() -> None:
    result = generate(SPEC, ROOT / "generated", check=True)
    assert not result.changed, "generated/cb_swap.py is stale: run `kvfsm gen spec/cb_swap.yaml`"


# ---- the validator's fence checks, on mutants of the spec ---------------------------------------------


def _errors(tmp_path: Path, edit: Callable[[str], str]) -> str:
    text = SPEC.read_text()
    edited = edit(text)
    assert edited != text, "the mutation did not apply"
    path = tmp_path / "cb_swap.yaml"
    path.write_text(edited)
    with pytest.raises(SpecInvalid) as info:
        load_spec(path)
    return "\n".join(str(e) for e in info.value.errors)


def test_a_plain_release_under_the_swap_out_is_rejected(tmp_path: Path) -> None:
    """The fenced preempt with its release made plain: the copy still reads the blocks after it (B2)."""
    msg = _errors(tmp_path, lambda s: s.replace("    releases_fenced: [device_blocks]", "    releases: [device_blocks]"))
    assert "releases 'device_blocks' while copies may still be 1" in msg


def test_a_fenced_release_after_the_ack_is_rejected(tmp_path: Path) -> None:
    """The deferred ack releasing fenced: no copy reads the blocks any more, so it must be a plain release."""
    msg = _errors(tmp_path, lambda s: s.replace(
        "actions: [verify_swap_out, release_device_blocks], update: {copies: -1}}",
        "actions: [verify_swap_out, release_device_blocks_fenced], update: {copies: -1}}"))
    assert "releases 'device_blocks' fenced, but copies is 0 after it in every case" in msg


def test_an_unguarded_fenced_preempt_is_nondeterministic(tmp_path: Path) -> None:
    msg = _errors(tmp_path, lambda s: s.replace("on: preempt, guard: fenced_release,", "on: preempt,"))
    assert "nondeterministic" in msg


# ---- generated machine vs the reference interpreter, both param values ----------------------------------


class RecordingEffects:
    """Logs every action with the machine's bookkeeping at call time; optionally fails one action."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.log: list[tuple[str, Any, tuple[int, ...]]] = []
        self.fail_on = fail_on

    def __getattr__(self, action: str) -> Callable[[Any, Any], None]:
        if action not in COMPILED.model.actions:
            raise AttributeError(action)

        def run(m: Any, arg: Any) -> None:
            self.log.append((action, arg, m.snapshot()))
            if action == self.fail_on:
                raise RuntimeError(f"injected failure in {action}")
        return run


def _outcome(fn: Callable[..., None], *args: Any) -> tuple[Any, ...]:
    try:
        fn(*args)
        return ("ok",)
    except GuardRejected as e:
        return ("guard", e.event, e.state, e.guards)
    except EventRejected as e:
        return ("error", e.event, e.state, e.reason)
    except RuntimeError as e:
        return ("raised", str(e))


events = st.lists(st.tuples(st.sampled_from(COMPILED.events), st.integers(0, 3)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(events, st.sampled_from([None, *COMPILED.model.actions]), st.sampled_from([0, 1]))
def test_generated_matches_reference(stream: list[tuple[str, int]], fail_on: str | None, fences: int) -> None:
    fx_g, fx_r = RecordingEffects(fail_on), RecordingEffects(fail_on)
    obs_g: list[Any] = []
    obs_r: list[Any] = []
    g = gen.CbSwapMachine(fx_g, observer=lambda m, *a: obs_g.append(a), fences=fences)
    r = ReferenceMachine(COMPILED, fx_r, observer=lambda m, *a: obs_r.append(a), fences=fences)
    assert g.snapshot() == r.snapshot()
    for event, arg in stream:
        before = g.snapshot()
        got = _outcome(getattr(g, event), arg)
        assert got == _outcome(r.fire, event, arg), (event, before)
        assert g.snapshot() == r.snapshot() and fx_g.log == fx_r.log and obs_g == obs_r
        if got[0] != "ok":
            assert g.snapshot() == before, "a rejected event changed the machine"


def _reached(fences: int) -> set[int]:
    """Breadth-first over event paths from a new machine with the given param: the transitions they fire."""
    seen: set[int] = set()
    frontier: list[list[str]] = [[]]
    for _ in range(5):
        nxt = []
        for path in frontier:
            for event in COMPILED.events:
                hits: list[int] = []
                m = gen.CbSwapMachine(RecordingEffects(), observer=lambda _m, _e, _s, _d, tid: hits.append(tid),
                                      fences=fences)
                try:
                    for e in path + [event]:
                        getattr(m, e)()
                except EventRejected:
                    continue
                seen.update(h for h in hits if h >= 0)
                nxt.append(path + [event])
        frontier = nxt
    return seen


def test_every_transition_is_reachable_and_each_release_path_only_under_its_param() -> None:
    deferred, fenced = _reached(0), _reached(1)
    assert deferred | fenced == {t.id for t in COMPILED.transitions}
    for seen, guard, states in ((deferred, "fenced_release", {"swapping_out_fenced", "ending_fenced"}),
                                (fenced, "deferred_release", {"swapping_out"})):
        never = {t.id for t in COMPILED.transitions if t.guard == guard or t.src in states}
        assert never and not (seen & never)


def test_a_param_outside_0_and_1_is_refused_by_both_machines() -> None:
    for make in (lambda: gen.CbSwapMachine(RecordingEffects(), fences=2),
                 lambda: ReferenceMachine(COMPILED, RecordingEffects(), fences=2)):
        with pytest.raises(ValueError, match="0 or 1"):
            make()


@pytest.mark.parametrize("fences", [0, 1])
def test_a_swap_out_and_back_in_runs_the_actions_the_spec_names(fences: int) -> None:
    fx = RecordingEffects()
    m = gen.CbSwapMachine(fx, fences=fences)
    for event in ("preempt", "swap_out_done", "restore", "swap_in_done", "finish"):
        getattr(m, event)()
    assert gen.STATES[m.state] == "released" and m.copies == 0
    actions = [a for a, _, _ in fx.log]
    if fences:
        assert actions[:3] == ["start_swap_out", "release_device_blocks_fenced", "verify_landed_swap_out"]
    else:
        assert actions[:3] == ["start_swap_out", "verify_swap_out", "release_device_blocks"]
    assert actions[3:] == ["start_swap_in", "verify_swap_in", "free_host_blocks", "release_device_blocks"]
