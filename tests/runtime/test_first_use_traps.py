"""First-use traps of the manager, each pinned by a test that failed before its fix.

- A second request object naming a live request's table row is refused (RowInUse), in unchecked mode too:
  it used to be admitted, and its end freed the live request's slots and row (whose own end then raised
  DoubleFree).
- Offloading a released request raises the spec's EventRejected (what docs/integrations.md promises) where it returned
  False; a request lacking a protocol field raises RequestFieldMissing where it raised AttributeError.
- The runtime logs: backup failures at WARNING (throttled), lifecycle events at DEBUG behind an
  isEnabledFor guard, and it never installs a handler.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from tests.runtime.test_scenarios import decode_to_offload, settle, world

import kvfsm.generated.decode_offload as spec_gen
import kvfsm.runtime.effects as effects_mod
import kvfsm.runtime.ending as ending_mod
import kvfsm.runtime.lifecycles as lifecycles_mod
import kvfsm.runtime.manager as manager_mod
import kvfsm.runtime.offloading as offloading_mod
from kvfsm.dataplane import MemoryStorage
from kvfsm.dataplane.storage import FaultyStorage
from kvfsm.errors import (
    EventRejected,
    InvalidRequest,
    LifecycleError,
    RequestFieldInvalid,
    RequestFieldMissing,
    RowInUse,
)
from kvfsm.verify.engine import SimEngine, SimRequest


def state(e: SimEngine, req: SimRequest) -> str:
    m = e.manager.machine_of(req)
    assert m is not None
    return spec_gen.STATES[m.state]


def impostor_of(req: SimRequest) -> SimRequest:
    """Another request object that names `req`'s table row (an engine bug, or a copied request object)."""
    other = SimRequest("impostor", list(req.origin_input_ids))
    other.req_pool_idx, other.output_ids = req.req_pool_idx, list(req.output_ids)
    other.kv_committed_len, other.kv_allocated_len = req.kv_committed_len, req.kv_allocated_len
    return other


# --- a second object naming a live request's row ---------------------------------------------------------


@pytest.mark.parametrize("holder_state", ["allocated", "offloading", "inflight", "finished"])
def test_a_second_object_on_a_live_row_is_refused_and_changes_nothing(holder_state: str) -> None:
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32, checked=False)
    real = e.admit("real", 4)
    if holder_state == "allocated":
        assert not e.manager.offload(real)  # nothing past the prompt yet: admitted, nothing submitted
        for _ in range(3):
            e.decode(real)
    else:
        decode_to_offload(e, real)
        if holder_state == "inflight":
            e.copies.complete_all()
            e.manager.check_progress()
        elif holder_state == "finished":
            e.end(real)  # copy in flight: release deferred, the row still held
    assert state(e, real) == holder_state
    fake = impostor_of(real)
    before = world(e)
    # offload's per-row early exit answers False without looking at the object (changing nothing) while
    # the row's live lifecycle has no stride due; from the due point on it looks, and refuses
    fake.kv_committed_len = real.kv_committed_len + e.stride
    for call in (e.manager.finalize, e.manager.abort, e.manager.retract, e.manager.offload):
        with pytest.raises(RowInUse) as exc:
            call(fake)
        assert exc.value.row == real.req_pool_idx and exc.value.holder == e.manager.machine_of(real).ctx.key
        assert isinstance(exc.value, InvalidRequest) and isinstance(exc.value, LifecycleError)
    with pytest.raises(RowInUse):
        e.manager.offload_batch([fake], np.array([fake.req_pool_idx]), np.array([fake.kv_committed_len]))
    assert world(e) == before and e.manager.machine_of(fake) is None
    if holder_state != "finished":
        e.end(real)  # the real request's end frees its own slots once: no DoubleFree
    settle(e)
    assert state(e, real) == "released"
    e.check_teardown()


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("holder_state", ["allocated", "offloading", "inflight"])
def test_a_live_request_that_names_another_row_is_refused_and_changes_nothing(holder_state: str, batched: bool) -> None:
    """A live request keeps its row until it ends: one whose req_pool_idx moved to another (allocated) row
    while its lifecycle lives is refused, InvalidRequest, and neither row is read or freed; put back on its
    row it offloads as before."""
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32, checked=True)
    real = e.admit("real", 4)
    assert not e.manager.offload(real)  # admitted: nothing past the prompt yet
    for _ in range(3):
        e.decode(real)
    if holder_state != "allocated":
        assert e.manager.offload(real)
        if holder_state == "inflight":
            e.copies.complete_all()
            e.manager.check_progress()
        for _ in range(2):
            e.decode(real)
    assert state(e, real) == holder_state
    other = e.admit("other", 4)  # another live request's row
    own, moved = real.req_pool_idx, other.req_pool_idx
    real.req_pool_idx = moved
    before = world(e)
    with pytest.raises(InvalidRequest, match=f"holds row {own}"):
        if batched:
            e.manager.offload_batch([real], np.array([moved]), np.array([real.kv_committed_len]))
        else:
            e.manager.offload(real)
    assert world(e) == before and state(e, real) == holder_state
    assert e.manager.machine_of(real).ctx.row == own
    real.req_pool_idx = own
    assert e.manager.offload(real)
    for req in (real, other):
        e.end(req)
    settle(e)
    e.check_teardown()


def test_two_new_objects_on_one_row_in_one_batch_admit_neither() -> None:
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32, checked=False)
    real = e.admit("real", 4)
    for _ in range(3):
        e.decode(real)
    fake = impostor_of(real)
    before = world(e)
    rows = np.array([real.req_pool_idx, fake.req_pool_idx])
    with pytest.raises(RowInUse, match="admitted by this call"):
        e.manager.offload_batch([real, fake], rows, np.array([real.kv_committed_len, fake.kv_committed_len]))
    assert world(e) == before
    assert e.manager.machine_of(real) is None and e.manager.machine_of(fake) is None
    assert e.manager.offload(real)  # the real one alone is fine
    e.end(real)
    settle(e)
    e.check_teardown()


def test_a_row_released_and_handed_out_again_is_admitted() -> None:
    """The check looks at whether the row's last lifecycle still holds it, not at who held it once."""
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32, rows=1, checked=False)
    first = e.admit("first", 4)
    decode_to_offload(e, first)
    e.end(first)
    settle(e)
    second = e.admit("second", 4)  # the only row again
    assert second.req_pool_idx == 0
    decode_to_offload(e, second)
    e.end(second)
    settle(e)
    e.check_teardown()


# --- released requests and missing fields -----------------------------------------------------------------


@pytest.mark.parametrize("ended", ["released", "draining"])
@pytest.mark.parametrize("batched", [False, True])
def test_offloading_an_ended_request_raises_event_rejected(ended: str, batched: bool) -> None:
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32)
    r = e.admit("a", 4)
    decode_to_offload(e, r)
    e.copies.complete_all()
    e.manager.check_progress()  # inflight: the backup still holds host pages
    e.end(r)
    if ended == "released":
        settle(e)
    assert state(e, r) == ended and r.req_pool_idx is None  # what release leaves an engine to look at
    before = world(e)
    with pytest.raises(EventRejected) as exc:
        if batched:
            e.manager.offload_batch([r], np.array([-1]), np.array([r.kv_committed_len]))
        else:
            e.manager.offload(r)
    assert exc.value.event == "offload" and exc.value.state == ended
    assert world(e) == before
    settle(e)
    e.check_teardown()


def test_a_request_never_admitted_without_a_row_still_just_has_nothing_to_offload() -> None:
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32)
    waiting = SimRequest("waiting", [1, 2, 3])
    waiting.output_ids = [4]
    assert waiting.req_pool_idx is None
    assert e.manager.offload(waiting) is False
    assert e.manager.offload_batch([waiting], np.array([-1]), np.array([3])) == 0
    e.manager.finalize(waiting)  # nothing is held: a no-op, as before
    assert e.manager.machine_of(waiting) is None


@pytest.mark.parametrize(
    "field",
    ["req_pool_idx", "kv_committed_len", "kv_allocated_len", "prefix_len", "origin_input_ids", "output_ids", "rid"],
)
def test_a_missing_request_field_is_named_with_the_protocol(field: str) -> None:
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32, checked=False)
    r = e.admit("a", 4)
    for _ in range(3):
        e.decode(r)
    delattr(r, field)
    before = world(e)
    calls: list[Any] = [e.manager.offload, e.manager.finalize]
    if field in ("req_pool_idx", "output_ids", "rid"):  # what offload_batch reads before admitting
        calls.append(lambda req: e.manager.offload_batch([req]))
    for call in calls:
        with pytest.raises(RequestFieldMissing) as exc:
            call(r)
        assert exc.value.field == field and "OffloadRequest" in str(exc.value) and repr(field) in str(exc.value)
        assert isinstance(exc.value, InvalidRequest) and not isinstance(exc.value, AttributeError)
        assert isinstance(exc.value.__cause__, AttributeError) or exc.value.__cause__ is None
    assert world(e) == before and e.manager.machine_of(r) is None


@pytest.mark.parametrize("admitted", [False, True])
@pytest.mark.parametrize("field", ["kv_committed_len", "kv_allocated_len"])
def test_a_length_that_is_not_an_integer_is_named_with_the_protocol(field: str, admitted: bool) -> None:
    """A None (or a float) where a length belongs is RequestFieldInvalid, before a lifecycle starts or at any
    call of a live one that uses it, with nothing changed (offload's early exit compares without checking
    types: a float that says no chunk is due gets False, the answer to the comparison); an integer scalar of
    numpy is an integer."""
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32, checked=False)
    r = e.admit("a", 4)
    for _ in range(3):
        e.decode(r)
    if admitted:
        e.manager.offload(r)
        settle(e)
    good = getattr(r, field)
    for bad in (None, float(good)):
        setattr(r, field, bad)
        before, machine = world(e), e.manager.machine_of(r)
        calls: list[Any] = [e.manager.finalize]
        if field == "kv_committed_len":
            calls += [e.manager.offload, lambda req: e.manager.offload_batch([req])]
        for call in calls:
            if bad is not None and call == e.manager.offload and admitted:
                assert call(r) is False  # the early exit: not yet a whole stride past the last chunk
                continue
            with pytest.raises(RequestFieldInvalid) as exc:
                call(r)
            assert exc.value.field == field and repr(bad) in str(exc.value)
        assert world(e) == before and e.manager.machine_of(r) is machine
    setattr(r, field, np.int64(good))
    e.manager.finalize(r)
    settle(e)


def test_an_attribute_error_of_the_manager_itself_is_not_blamed_on_the_request(monkeypatch) -> None:
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32)
    r = e.admit("a", 4)
    for _ in range(3):
        e.decode(r)

    def broken(self: Any, req: Any) -> None:
        raise AttributeError("'DecodeOffloadManager' object has no attribute 'nothing'")

    monkeypatch.setattr(manager_mod.DecodeOffloadManager, "_offloadable_record", broken)
    with pytest.raises(AttributeError, match="nothing") as exc:
        e.manager.offload(r)
    assert not isinstance(exc.value, RequestFieldMissing)


# --- logging -----------------------------------------------------------------------------------------------


class FailingStoreEngine(SimEngine):
    """Every page write fails."""

    def make_storage(self) -> Any:
        return FaultyStorage(MemoryStorage(), fail_writes=lambda _key: True)


def test_backup_failures_are_warned_once_then_throttled(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvfsm")
    e = FailingStoreEngine(page_size=2, stride=2, device_slots=64, host_slots=32, checked=False)
    r = e.admit("a", 4)
    for _ in range(3):
        decode_to_offload(e, r)
        settle(e)
    assert e.manager.metrics.backup_failures == 3
    warned = [rec for rec in caplog.records if rec.name == "kvfsm.runtime.effects"]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING  # the next two within the interval
    assert "1 backup(s) failed" in warned[0].getMessage() and "refused 1 of 1 pages" in warned[0].getMessage()
    e.manager.fx._failures_logged_at -= effects_mod.FAILURE_LOG_INTERVAL_S  # the interval has passed
    decode_to_offload(e, r)
    settle(e)
    warned = [rec for rec in caplog.records if rec.name == "kvfsm.runtime.effects"]
    assert len(warned) == 2 and "3 backup(s) failed" in warned[1].getMessage()  # two held back, and this one
    e.end(r)
    settle(e)
    e.check_teardown()


def test_a_store_that_raises_is_warned_with_its_error(caplog: pytest.LogCaptureFixture) -> None:
    class Exploding(MemoryStorage):
        def batch_set(self, keys: Any, pages: Any) -> list[bool]:
            raise OSError("disk on fire")

    class ExplodingEngine(SimEngine):
        def make_storage(self) -> Any:
            return Exploding()

    caplog.set_level(logging.WARNING, logger="kvfsm")
    e = ExplodingEngine(page_size=2, stride=2, device_slots=64, host_slots=32)
    r = e.admit("a", 4)
    decode_to_offload(e, r)
    settle(e)
    (warned,) = [rec for rec in caplog.records if rec.name == "kvfsm.runtime.effects"]
    assert "disk on fire" in warned.getMessage()
    e.end(r)
    settle(e)


def test_lifecycle_events_are_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kvfsm")
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32)
    r = e.admit("a", 4)
    decode_to_offload(e, r)
    e.end(r)  # deferred: the copy is in flight
    settle(e)
    key = e.manager.machine_of(r).ctx.key
    debug = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.DEBUG and key in rec.getMessage()]
    assert [m.split(": ")[0].split(" ", 2)[2].split(" ")[0] for m in debug] == [
        "admitted",
        "offloaded",
        "finish",
        "released",
    ], debug
    assert "finish: offloading -> finished" in debug[2]
    assert all(rec.name.startswith("kvfsm.") for rec in caplog.records)


def test_debug_logging_costs_nothing_when_disabled(monkeypatch, caplog: pytest.LogCaptureFixture) -> None:
    """At the default level no lifecycle message is even formatted: the hot paths ask isEnabledFor first."""
    caplog.set_level(logging.INFO, logger="kvfsm")

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("logger.debug called with DEBUG disabled")

    for module in (lifecycles_mod, offloading_mod, ending_mod, effects_mod):  # every module that logs per request
        monkeypatch.setattr(module.logger, "debug", refuse)
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32, checked=False)
    reqs = [e.admit(f"r{i}", 4) for i in range(3)]
    for _ in range(6):
        for r in reqs:
            e.decode(r)
        e.manager.offload_batch(reqs)
        settle(e)
    for r in reqs:
        e.end(r)
    settle(e)
    e.check_teardown()


def test_the_library_installs_no_handler() -> None:
    import kvfsm.runtime.build  # noqa: F401  (every module that logs is imported)
    import kvfsm.runtime.config  # noqa: F401

    for name in (
        "kvfsm",
        "kvfsm.runtime",
        "kvfsm.runtime.lifecycles",
        "kvfsm.runtime.offloading",
        "kvfsm.runtime.ending",
        "kvfsm.runtime.effects",
        "kvfsm.runtime.build",
        "kvfsm.runtime.config",
    ):
        logger = logging.getLogger(name)
        assert [h for h in logger.handlers if not type(h).__name__.startswith("LogCapture")] == [], name


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the fallback happens only without CUDA")
def test_make_copy_engine_warns_when_a_cuda_device_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    from kvfsm.dataplane import CpuCopyEngine, make_copy_engine

    caplog.set_level(logging.WARNING, logger="kvfsm")
    assert type(make_copy_engine("cuda")) is CpuCopyEngine
    (rec,) = caplog.records
    assert rec.name == "kvfsm.dataplane" and "CUDA is not available" in rec.getMessage()
    caplog.clear()
    make_copy_engine("cpu")
    make_copy_engine()  # documented: CUDA when present, else the CPU engine
    assert caplog.records == []
