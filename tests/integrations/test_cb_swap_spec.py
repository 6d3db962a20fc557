"""spec/cb_swap.yaml is valid and generated/cb_swap.py is fresh (needs no transformers); the generated machine
and the reference interpreter agree for both values of the `fences` param, and the validator's fence checks
accept the fenced swap-out and the fenced end under a swap-in for the right reasons (their mutants, a fence
that names only the copies that read the blocks among them, are rejected)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

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
    assert blocks.read_by == "swap_outs" and blocks.fence and "compute stream" in blocks.fence
    by = {(t.src, t.event, t.guard): t for t in spec.transitions}
    fenced = by[("resident", "preempt", "fenced_release")]
    deferred = by[("resident", "preempt", "deferred_release")]
    assert fenced.dst == "swapping_out_fenced" and fenced.fenced == ("device_blocks",)
    assert "device_blocks" in fenced.releases and dict(fenced.update) == {"swap_outs": 1}
    assert deferred.dst == "swapping_out" and not deferred.releases
    # its acknowledgement does what remains: the blocks are gone, only the host blocks are checked
    ack = by[("swapping_out_fenced", "swap_out_done", None)]
    assert ack.dst == "swapped" and not ack.releases and "device_blocks" not in ack.reads
    # a cancel in that window frees the host blocks, which the copy still writes, only at the ack
    cancel = by[("swapping_out_fenced", "cancel", None)]
    assert cancel.dst == "ending_fenced" and not cancel.releases
    assert by[("ending_fenced", "swap_out_done", "swap_out_in_flight")].releases == ("host_blocks",)
    assert spec.outcomes[("swapping_out_fenced", "finish")].kind == "error"
    assert spec.outcomes[("swapping_out_fenced", "restore")].kind == "error"
    assert spec.outcomes[("ending_fenced", "cancel")].kind == "ignore"
    # every plain release of the device blocks leaves no copy in flight; each fenced one leaves one: the
    # swap-out's, or the swap-in's of a request ended under it (below)
    ends = {t.id for t in spec.transitions if t.src == "swapping_in" and t.guard == "fenced_release"}
    assert gen.FENCED_RELEASES == {i: ("device_blocks",) for i in {fenced.id} | ends}


def test_a_release_under_the_swap_in_is_fenced_against_it_or_deferred_to_its_ack() -> None:
    """The swap-in (the load-back) writes the device blocks and reads the host blocks: the spec names it for
    both, so an end under it releases the device blocks only fenced (fences) or at its ack (no fences), and
    the host blocks only at its ack, which must be a swap-in's."""
    spec = COMPILED
    device, host = spec.model.resources["device_blocks"], spec.model.resources["host_blocks"]
    assert (device.read_by, device.written_by) == ("swap_outs", "swap_ins") and "swap-in writes them" in device.fence
    assert (host.read_by, host.written_by, host.fence) == ("swap_ins", "swap_outs", None)
    by = {(t.src, t.event, t.guard): t for t in spec.transitions}
    for end in ("finish", "cancel"):
        fenced = by[("swapping_in", end, "fenced_release")]
        assert fenced.dst == "ending_fenced" and fenced.fenced == ("device_blocks",) == fenced.releases
        assert fenced.actions == ("release_device_blocks_fenced", "defer_host_release")
        deferred = by[("swapping_in", end, "deferred_release")]
        assert deferred.dst == "ending" and not deferred.releases
    ack = by[("ending_fenced", "swap_in_done", "swap_in_in_flight")]
    assert ack.dst == "released" and ack.releases == ("host_blocks",) and dict(ack.update) == {"swap_ins": -1}
    # a swap-out's ack for the swap-in's end (or the reverse) is refused, changing nothing
    for state_events in (("restore", "finish", "swap_out_done"), ("preempt", "cancel", "swap_in_done")):
        m = gen.CbSwapMachine(RecordingEffects(), fences=1)
        if state_events[0] == "restore":
            m.preempt(), m.swap_out_done(), m.restore()
        else:
            m.preempt()
        getattr(m, state_events[1])()
        before = m.snapshot()
        assert gen.STATES[m.state] == "ending_fenced"
        with pytest.raises(GuardRejected):
            getattr(m, state_events[2])()
        assert m.snapshot() == before


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
    msg = _errors(
        tmp_path, lambda s: s.replace("    releases_fenced: [device_blocks]", "    releases: [device_blocks]")
    )
    assert "releases 'device_blocks' while swap_outs may still be 1" in msg


def test_a_fenced_release_after_the_ack_is_rejected(tmp_path: Path) -> None:
    """The deferred ack releasing fenced: no copy reads the blocks any more, so it must be a plain release."""
    msg = _errors(
        tmp_path,
        lambda s: s.replace(
            "actions: [verify_swap_out, release_device_blocks], update: {swap_outs: -1}}",
            "actions: [verify_swap_out, release_device_blocks_fenced], update: {swap_outs: -1}}",
        ),
    )
    assert "releases 'device_blocks' fenced, but swap_outs and swap_ins are 0 after it in every case" in msg


FENCED_END = "guard: fenced_release, to: ending_fenced, actions: [release_device_blocks_fenced, defer_host_release]}"


def test_a_fence_rule_that_names_only_the_readers_is_rejected(tmp_path: Path) -> None:
    """The wrong direction: device_blocks names only the swap-outs that read it, so a release under the swap-in
    that writes it would go unchecked; the swap-in's action, which acquires (writes) the blocks, says so."""
    msg = _errors(
        tmp_path, lambda s: s.replace("    read_by: swap_outs\n    written_by: swap_ins\n", "    read_by: swap_outs\n")
    )
    assert (
        "action 'start_swap_in': starts what swap_ins counts, which writes 'device_blocks' (it acquires it), "
        "but resource 'device_blocks' names no counter as `written_by`"
    ) in msg


def test_a_plain_release_under_the_swap_in_is_rejected(tmp_path: Path) -> None:
    """The fenced end under the swap-in with its release made plain: the swap-in still writes the blocks (B2)."""
    msg = _errors(tmp_path, lambda s: s.replace(FENCED_END, FENCED_END.replace("_fenced, defer", ", defer")))
    assert "releases 'device_blocks' while swap_ins may still be 1" in msg and "still writes it" in msg


def test_freeing_the_host_blocks_under_the_swap_in_is_rejected(tmp_path: Path) -> None:
    """The end under the swap-in freeing the host blocks at once: the swap-in still reads them (B10)."""
    msg = _errors(
        tmp_path, lambda s: s.replace(FENCED_END, FENCED_END.replace("defer_host_release", "free_host_blocks"))
    )
    assert "releases 'host_blocks' while swap_ins may still be 1" in msg and "still reads it" in msg


def test_an_ack_of_either_direction_in_an_ending_state_is_rejected(tmp_path: Path) -> None:
    """Without its direction guard, a swap-out's ack would end a request whose swap-in is in flight (B6) and free
    the host blocks that swap-in still reads."""
    msg = _errors(
        tmp_path,
        lambda s: s.replace(
            "on: swap_out_done, guard: swap_out_in_flight, to: released, actions: [free_host_blocks], ",
            "on: swap_out_done, to: released, actions: [free_host_blocks], ",
        ),
    )
    assert "breaks the invariants of 'released': {'swap_outs': 0, 'swap_ins': 1, 'fences': 1}" in msg
    assert "releases 'host_blocks' while swap_ins may still be 1" in msg


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
                m = gen.CbSwapMachine(
                    RecordingEffects(), observer=lambda _m, _e, _s, _d, tid: hits.append(tid), fences=fences
                )
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
    for seen, guard, states in (
        (deferred, "fenced_release", {"swapping_out_fenced", "ending_fenced"}),
        (fenced, "deferred_release", {"swapping_out"}),
    ):
        never = {t.id for t in COMPILED.transitions if t.guard == guard or t.src in states}
        assert never and not (seen & never)


def test_a_param_outside_0_and_1_is_refused_by_both_machines() -> None:
    for make in (
        lambda: gen.CbSwapMachine(RecordingEffects(), fences=2),
        lambda: ReferenceMachine(COMPILED, RecordingEffects(), fences=2),
    ):
        with pytest.raises(ValueError, match="0 or 1"):
            make()


@pytest.mark.parametrize("fences", [0, 1])
def test_a_swap_out_and_back_in_runs_the_actions_the_spec_names(fences: int) -> None:
    fx = RecordingEffects()
    m = gen.CbSwapMachine(fx, fences=fences)
    for event in ("preempt", "swap_out_done", "restore", "swap_in_done", "finish"):
        getattr(m, event)()
    assert gen.STATES[m.state] == "released" and m.swap_outs == m.swap_ins == 0
    actions = [a for a, _, _ in fx.log]
    if fences:
        assert actions[:3] == ["start_swap_out", "release_device_blocks_fenced", "verify_landed_swap_out"]
    else:
        assert actions[:3] == ["start_swap_out", "verify_swap_out", "release_device_blocks"]
    assert actions[3:] == ["start_swap_in", "verify_swap_in", "free_host_blocks", "release_device_blocks"]
