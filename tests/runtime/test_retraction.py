"""The spec's `retraction` policy (spec/decode_offload.yaml, `policies`): `deferred`, kvfsm's default, retracts
in every live state and defers the release past in-flight copies; `fail_closed`, SGLang 0.5.23's rule, refuses
retraction while a device-to-host copy is tracked, on every TP rank alike. Also the two other calls SGLang's
scheduler makes around it: has_inflight_device_transfer() and release_host_resources()."""

from __future__ import annotations

import threading
import typing

import pytest

from timing import join_all
from tp_threads import ThreadGroup, route_all_reduce

import kvfsm.generated.decode_offload as gen
from kvfsm.errors import LifecycleError, RetractionRefused
from kvfsm.runtime import OffloadConfig
from kvfsm.runtime.tp import ProgressConsensus
from kvfsm.verify.engine import SimEngine, SimRequest


def test_the_config_offers_exactly_the_spec_policy_choices() -> None:
    default, choices = gen.POLICIES["retraction"]
    field = OffloadConfig.model_fields["retraction"]
    assert typing.get_args(field.annotation) == choices and field.default == default == "deferred"


def _offloading(policy: str) -> tuple[SimEngine, SimRequest]:
    """A request with one copy in flight (the deferred engine lands it only when told)."""
    e = SimEngine(page_size=2, stride=2, device_slots=32, host_slots=16, retraction=policy)
    r = e.admit("a", 4)
    assert e.decode(r) and e.decode(r) and e.manager.offload(r)
    assert e.manager.machine_of(r).state == gen.OFFLOADING and e.manager.has_inflight_device_transfer()
    return e, r


def _pools(e: SimEngine) -> tuple:
    m = e.manager.machine_of(e.live[0]) if e.live else None
    return (
        e.allocator.free_slots,
        e.host_pool.free_slots,
        e.req_to_token.free_rows,
        e.protected.size,
        None if m is None else m.snapshot(),
    )


def test_fail_closed_refuses_while_a_copy_is_in_flight_and_changes_nothing() -> None:
    e, r = _offloading("fail_closed")
    before = _pools(e)
    with pytest.raises(RetractionRefused, match="in flight"):
        e.manager.drain_before_retraction()
    with pytest.raises(RetractionRefused, match=r"a#\d+ has 1 device-to-host"):
        e.manager.retract(r)
    assert _pools(e) == before and r.req_pool_idx is not None
    e.copies.complete_all()  # the copy lands: the next check acknowledges it, and retraction may go ahead
    e.manager.drain_before_retraction()
    assert not e.manager.has_inflight_device_transfer()
    assert e.manager.machine_of(r).state == gen.INFLIGHT  # its chunk still holds host slots until backed up
    e.live.remove(r)
    e.manager.retract(r)
    assert e.manager.machine_of(r).state == gen.DRAINING and r.req_pool_idx is None
    e.settle()
    e.check_teardown()


def test_deferred_retracts_under_a_copy_and_releases_at_its_acknowledgement() -> None:
    e, r = _offloading("deferred")
    e.manager.drain_before_retraction()  # only a progress check: nothing landed, nothing raised
    e.live.remove(r)
    e.manager.retract(r)
    assert e.manager.machine_of(r).state == gen.FINISHED and r.req_pool_idx is not None  # held past the copy
    e.settle()
    assert r.req_pool_idx is None
    e.check_teardown()


def test_fail_closed_refuses_on_every_rank_when_one_rank_has_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's copy landed, rank 1's did not: both ranks refuse (MAX-agreed), so they stay in step."""
    route_all_reduce(monkeypatch)
    group = ThreadGroup(2)
    engines = [_offloading("fail_closed")[0] for _ in range(2)]
    for e in engines:
        consensus = ProgressConsensus(None)
        consensus.group, consensus.world = group, group.world
        e.manager.consensus = consensus
    engines[0].copies.complete_all()
    outcome: list = [None, None]

    def rank(i: int) -> None:
        group.bind(i)
        try:
            engines[i].manager.drain_before_retraction()
            outcome[i] = "drained"
        except RetractionRefused:
            outcome[i] = "refused"

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    join_all(threads, "both ranks' drain_before_retraction", 30)
    assert outcome == ["refused", "refused"]
    # the MIN agreement acknowledged nothing on either rank: rank 0 keeps its landed copy tracked too
    assert all(e.manager.has_inflight_device_transfer() for e in engines)


def test_release_host_resources_needs_an_idle_manager_and_gives_the_pool_back() -> None:
    e, r = _offloading("deferred")
    with pytest.raises(LifecycleError, match="drain"):
        e.manager.release_host_resources()
    assert not e.host_pool.released
    e.end(r)
    e.settle()
    e.manager.release_host_resources()
    assert e.host_pool.released and e.host_pool.kv_buffer.numel() == 0
    with pytest.raises(RuntimeError, match="released"):
        e.host_pool.alloc(2)
