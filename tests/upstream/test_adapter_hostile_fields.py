"""The SGLang adapter's request fields, fuzzed from the outside: a Req of SGLang 0.5.23 whose fields the
adapter reads (`kv.req_pool_idx`, `kv.kv_committed_len`, `kv.kv_allocated_len`, `kv.cache_protected_len`,
`origin_input_ids`, `output_ids`, `rid`) holds a value no scheduler would give it, and the scheduler's calls
go on (`offload_kv_cache`, `finalize_release_on_finish`, `check_offload_progress`).

The invariant: each call returns, or raises one of kvfsm's typed errors (kvfsm.errors) and then nothing
changed (host pool, device allocator, every lifecycle's state, the store); nothing is written outside the
store. The `ci` profile runs EXAMPLES, `KVFSM_FUZZ=deep` DEEP_EXAMPLES (hypothesis, in .venv-sglang with the
rest of tests/upstream).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import harness
from scenarios import ReqSpec, Scenario
from test_differential import _KvfsmProbe

import kvfsm.errors
import kvfsm.generated.decode_offload as spec_gen
from kvfsm.integrations.sglang import DecodeKVCacheOffloadManager
from kvfsm.spec import load_spec
from kvfsm.spec.locations import packaged_spec

EXAMPLES, DEEP_EXAMPLES = 25, 1000
TYPED = (kvfsm.errors.LifecycleError, kvfsm.errors.ConfigError, kvfsm.errors.InputRejected)
SC = Scenario(
    name="hostile-fields",
    page_size=4,
    stride=8,
    requests=tuple(ReqSpec(f"r{i}", tuple(range(100 * i + 1, 100 * i + 11)), decode=12) for i in range(3)),
)


class Adapter(DecodeKVCacheOffloadManager):
    """The production adapter (unchecked, as SGLang runs it), with the harness's probe."""

    @staticmethod
    def harness_probe() -> harness.Probe:
        return _KvfsmProbe()


def _deep() -> bool:
    return os.environ.get("KVFSM_FUZZ", "ci") == "deep"


# Values of the fields' own types (the request protocol's ints and lists of ints, a str rid) that no
# scheduler would set: negative, past the table or the pool, lengths that contradict each other.
hostile_ints = st.integers(-(2**70), 2**70) | st.sampled_from([-1, 0, 1, 3, 7, 8, 9, 16, 64, 2**31, 2**63])
FIELDS = {
    "kv.req_pool_idx": hostile_ints | st.none(),
    "kv.kv_committed_len": hostile_ints,
    "kv.kv_allocated_len": hostile_ints,
    "kv.cache_protected_len": hostile_ints,
    "origin_input_ids": st.lists(hostile_ints, max_size=12),
    "output_ids": st.lists(hostile_ints, max_size=12),
    "rid": st.text(max_size=8),
}
CALLS = st.sampled_from(["offload_kv_cache", "finalize_release_on_finish", "check_offload_progress"])


def _set(req: Any, field: str, value: Any) -> None:
    target = req.kv if field.startswith("kv.") else req
    setattr(target, field.removeprefix("kv."), value)


def _decode(run: Any, steps: int) -> None:
    """Admit the scenario's requests, then `steps` iterations of progress check, decode and offload calls."""
    for spec in SC.requests:
        run.admit(spec)
    for t in range(1, steps + 1):
        run.mgr.check_offload_progress()
        for spec in SC.requests:
            run.decode_and_offload(spec, t)
        run.settle()


def _get(req: Any, field: str) -> Any:
    return getattr(req.kv if field.startswith("kv.") else req, field.removeprefix("kv."))


# A Req whose row is no longer its lifecycle's row was released by SGLang itself (a retraction): the adapter
# ends that lifecycle with the spec's released_by_engine, which frees nothing, before it looks at the Req
# again. That move is the only change a refused call may leave behind.
_SPEC = load_spec(packaged_spec())
ENGINE_RELEASE = {t.src: t.dst for t in _SPEC.transitions if t.event == "released_by_engine"}


def _engine_released(state: tuple, victim: int) -> tuple:
    states = list(state[2])
    states[victim] = ENGINE_RELEASE.get(states[victim], states[victim])
    return (*state[:2], tuple(states), *state[3:])


def _progress(run: Any) -> None:
    try:
        run.mgr.check_offload_progress()
    except TYPED:
        pass
    run.settle()


def _state(run: Any, store: str) -> tuple:
    mgr = run.mgr
    machines = (mgr.manager.machine_of(mgr._views.view(req)) for req in run.reqs.values())
    states = tuple(
        None if m is None else spec_gen.STATES[m.state] if isinstance(m.state, int) else m.state for m in machines
    )
    return (
        mgr.manager.host_pool.free_slots,
        run.allocator.available_size(),
        states,
        len(mgr._pending),
        tuple(sorted(os.listdir(store))),
    )


@settings(
    max_examples=DEEP_EXAMPLES if _deep() else EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    steps=st.integers(0, 9),
    victim=st.integers(0, 2),
    edits=st.lists(
        st.sampled_from(sorted(FIELDS)).flatmap(lambda f: st.tuples(st.just(f), FIELDS[f])), min_size=1, max_size=3
    ),
    calls=st.lists(CALLS, min_size=1, max_size=4),
)
def test_hostile_request_fields_end_in_typed_errors_that_change_nothing(
    steps: int, victim: int, edits: list[tuple[str, Any]], calls: list[str]
) -> None:
    with tempfile.TemporaryDirectory() as root:
        store = os.path.join(root, "store")
        os.mkdir(store)
        with harness.published(SC, 0, store):
            run = harness._Run(SC, Adapter, 0, harness._tp_group_world1(), store)
            try:
                _decode(run, steps)
                req = run.reqs[SC.requests[victim].rid]
                for field, value in edits:
                    _set(req, field, value)
                for call in calls:
                    _progress(run)  # the chunks accepted before are submitted: what follows is the call's alone
                    before = _state(run, store)
                    try:
                        if call == "check_offload_progress":
                            run.mgr.check_offload_progress()
                        else:
                            getattr(run.mgr, call)(req)
                    except TYPED:
                        run.settle()
                        after = _state(run, store)
                        if any(f == "kv.req_pool_idx" for f, _ in edits):
                            before = _engine_released(before, victim)
                        assert after == before, f"{call} raised a typed error but changed state"
            finally:
                try:
                    run.probe.close(run.mgr)
                except TYPED:
                    pass  # a lifecycle that cannot end with these fields is refused at shutdown too
        assert sorted(os.listdir(root)) == ["store"]
        assert all(not name.endswith(".tmp") for name in os.listdir(store))


# Found by this fuzzer when its values were not limited to the fields' own types: a length that is not an
# integer once escaped as TypeError (offload_kv_cache's early exit and the manager's reserve_offload compare
# kv_committed_len; the spec's freeze_lengths action converts both lengths). Each is now RequestFieldInvalid,
# naming the field, with nothing changed.
@pytest.mark.parametrize(
    "steps, field, call",
    [
        (1, "kv.kv_committed_len", "offload_kv_cache"),
        (0, "kv.kv_committed_len", "offload_kv_cache"),
        (0, "kv.kv_allocated_len", "finalize_release_on_finish"),
    ],
)
def test_request_fields_of_other_types(steps: int, field: str, call: str) -> None:
    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = harness._Run(SC, Adapter, 0, harness._tp_group_world1(), store)
        try:
            _decode(run, steps)
            req = run.reqs[SC.requests[0].rid]
            good = _get(req, field)
            _set(req, field, None)
            before = _state(run, store)
            with pytest.raises(kvfsm.errors.RequestFieldInvalid, match=field.split(".")[-1]):
                getattr(run.mgr, call)(req)
            assert _state(run, store) == before, f"{call} refused the request but changed state"
            _set(req, field, good)
        finally:
            run.probe.close(run.mgr)
