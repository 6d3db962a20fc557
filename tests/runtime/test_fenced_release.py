"""Fenced release (spec param `fences`, state `fenced`, the device_slots fence rule) through the manager.

A request that ends while its copy is in flight gives its device slots back at once, tagged with that
copy's fence; the engine takes them last, with `alloc_fenced`, and its writer waits on the fence. Over
SimEngine: the CPU twin of fences (the deferred engine's copies run when completed, so a writer that skips
the wait really corrupts the copy), checked and unchecked.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

import kvfsm.generated.decode_offload as spec_gen
from kvfsm.dataplane import SlotFence, ThreadCpuCopyEngine, TokenSlotAllocator
from kvfsm.dataplane.copy.base import CopyEngine
from kvfsm.errors import ConfigError
from kvfsm.runtime import CheckedModeError, DecodeOffloadManager, OffloadConfig, SimplePrefixCache
from kvfsm.runtime.ledger import SlotLedger
from kvfsm.verify.engine import SimEngine, SimRequest, kv_value


def _state(e: SimEngine, req: SimRequest) -> str:
    m = e.manager.machine_of(req)
    assert m is not None
    return spec_gen.STATES[m.state]


def _offloading(e: SimEngine, rid: str, prompt: int = 4) -> SimRequest:
    """A request admitted, decoded and with one copy in flight (the deferred engine has not run it)."""
    req = e.admit(rid, prompt)
    assert req is not None
    for _ in range(40):
        assert e.decode(req)
        if e.manager.offload(req):
            return req
    raise AssertionError("no chunk was offloaded")


def _engine(**kw: Any) -> SimEngine:
    opts: dict[str, Any] = dict(page_size=2, stride=4, device_slots=16, host_slots=16, rows=4)
    opts.update(kw)
    return SimEngine(**opts)


@pytest.mark.parametrize("checked", [True, False])
@pytest.mark.parametrize("how", ["finish", "abort", "retract"])
def test_ending_under_a_copy_releases_at_once_fenced_and_the_copy_still_lands_intact(checked: bool, how: str) -> None:
    e = _engine(fenced=True, checked=checked)
    req = _offloading(e, "a")
    free_before = e.allocator.free_slots
    e.end(req, how)
    assert _state(e, req) == "fenced"
    assert e.allocator.free_slots > free_before and e.allocator.fenced_page_count > 0  # back at once, fenced
    assert e.req_to_token.free_rows == e.rows and e.protected.size == 0  # row and prefix too
    chunk = e.manager.fx.copy_fifo[0]
    e.copies.complete_all()
    assert e.host_page_ok(chunk)  # nobody wrote the slots: the copy read the request's own KV
    e.settle()
    assert _state(e, req) == "released"
    e.check_teardown()
    assert e.allocator.reclaim_fenced() > 0 and e.allocator.fenced_page_count == 0  # passed: found by a query


def test_without_fences_the_same_end_defers_the_release_to_the_last_acknowledgement() -> None:
    e = _engine()
    req = _offloading(e, "a")
    free_before = e.allocator.free_slots
    e.end(req, "finish")
    assert _state(e, req) == "finished" and e.allocator.free_slots == free_before
    e.settle()
    e.check_teardown()


@pytest.mark.parametrize("checked", [True, False])
def test_the_next_request_reuses_fenced_slots_after_waiting_and_both_keep_their_kv(checked: bool) -> None:
    """Memory pressure: a finished request's slots are the only room for the next one. With fences it is
    admitted at once, its writer waits on the copy's fence (the copy completes first, CPU twin), and the
    copy still lands the finished request's KV; without fences there is no room until the copy is acked."""
    for fenced in (True, False):
        e = _engine(fenced=fenced, checked=checked, device_slots=12)
        a = _offloading(e, "a", prompt=6)
        while e.allocator.alloc_pages(1) is not None:  # nothing else free: only a's own slots can come back
            pass
        chunk = e.manager.fx.copy_fifo[0]
        e.end(a, "finish")
        b = e.admit("b", 8)  # every page of a's, those its copy reads among them
        if not fenced:
            assert b is None and not chunk.handle.done()
            continue
        assert b is not None
        assert chunk.handle.done()  # b's writer waited on the fence: the CPU twin ran the copy first
        assert e.host_page_ok(chunk)
        got = e.device_pool.token_view()[0, 0, e.req_to_token.read_host(b.req_pool_idx, 0, 8), 0, 0].tolist()
        assert got == [kv_value(b.serial, p) for p in range(8)]


def test_a_writer_that_skips_the_wait_is_caught_by_the_ledger_in_checked_mode() -> None:
    e = _engine(fenced=True, checked=True, skip_fence_wait=True, device_slots=12)
    a = _offloading(e, "a", prompt=6)
    while e.allocator.alloc_pages(1) is not None:
        pass
    e.end(a, "finish")
    with pytest.raises(CheckedModeError, match="neither passed nor been waited on"):
        e.admit("b", 8)


def test_a_writer_that_skips_the_wait_corrupts_the_copy_unchecked() -> None:
    """The fault the ledger catches is real: unchecked, the copy reads the next request's KV."""
    e = _engine(fenced=True, checked=False, skip_fence_wait=True, device_slots=12)
    a = _offloading(e, "a", prompt=6)
    while e.allocator.alloc_pages(1) is not None:
        pass
    chunk = e.manager.fx.copy_fifo[0]
    e.end(a, "finish")
    assert e.admit("b", 8) is not None
    e.copies.complete_all()
    assert not e.host_page_ok(chunk)


def test_a_fenced_release_whose_fence_misses_a_reading_copy_is_caught() -> None:
    class Copy:
        def done(self) -> bool:
            return False

        def wait_stream(self, stream: object = None) -> None:
            pass

    led = SlotLedger(page_size=2)
    first, second = Copy(), Copy()
    led.copy_started("A", 1, [2, 3], [0, 1], first)
    led.copy_started("A", 2, [4, 5], [2, 3], second)
    with pytest.raises(CheckedModeError, match="misses copy of chunk 2"):
        led.release_device("A", "release_fenced", [2, 3, 4, 5], SlotFence([first]))
    led.release_device("A", "release_fenced", [2, 3, 4, 5], SlotFence([first, second]))
    led.claim_device("B", "offload", [6, 7])
    led.copy_started("B", 3, [6, 7], [4, 5], Copy())
    with pytest.raises(CheckedModeError, match="B2"):  # a plain release under a copy stays an error
        led.release_device("B", "release", [6, 7])


def test_a_reused_page_released_again_under_the_old_copy_is_covered_by_its_carried_fence_and_needs_a_new_wait() -> None:
    """A wait orders only the stream that made it: B got A's page fenced, waited, wrote it and released it
    plainly while A's copy still runs (the CUDA case). The ledger accepts that release, covered by the carried
    fence, and the next writer must wait on it again; a release no fence covers is still B2."""

    class Copy:
        landed = False

        def done(self) -> bool:
            return self.landed

        def wait_stream(self, stream: object = None) -> None:
            pass

    led = SlotLedger(page_size=2)
    old = Copy()
    led.copy_started("A", 1, [2, 3], [0, 1], old)
    fence = SlotFence([old])
    led.release_device("A", "release_fenced", [2, 3], fence)
    led.claim_device("B", "grow", [2, 3])
    with pytest.raises(CheckedModeError, match="neither passed nor been waited on"):
        led.device_write("B", [2, 3])
    fence.wait()
    led.device_write("B", [2, 3])
    led.release_device("B", "release", [2, 3])  # plain: covered by the fence the page still carries
    led.claim_device("C", "grow", [2, 3])
    with pytest.raises(CheckedModeError, match="neither passed nor been waited on"):  # B's wait is not C's
        led.device_write("C", [2, 3])
    fence.wait()
    led.device_write("C", [2, 3])
    led.release_device("C", "release", [2, 3])
    old.landed = True
    led.claim_device("D", "grow", [2, 3])
    led.device_write("D", [2, 3])  # passed: no wait needed
    led.copy_completed(1, [2, 3])
    assert not led.device_fence and not led.device_readers
    mine = Copy()  # a release of a page no earlier fence covers stays an error
    led.copy_started("D", 2, [2, 3], [2, 3], mine)
    with pytest.raises(CheckedModeError, match="B2"):
        led.release_device("D", "release", [2, 3])


class _NoFences(CopyEngine):
    def submit_d2h(self, *a: Any) -> Any:
        raise AssertionError

    def submit_h2d(self, *a: Any) -> Any:
        raise AssertionError


def test_fenced_release_needs_an_engine_that_fences_and_an_allocator_that_takes_fences() -> None:
    e = _engine()
    common = dict(
        device_pool=e.device_pool,
        req_to_token=e.req_to_token,
        prefix_cache=SimplePrefixCache(e.allocator),
        host_pool=e.host_pool,
    )
    config = OffloadConfig(
        page_size=2, offload_stride=4, host_pool_ratio=1.0, storage_backend="none", fenced_release=True
    )
    with pytest.raises(ConfigError) as info:
        DecodeOffloadManager(config, allocator=e.allocator, copy_engine=_NoFences(), **common)
    assert info.value.field == "fenced_release" and "_NoFences" in info.value.reason

    class PlainAllocator(TokenSlotAllocator):
        fences = False  # its frees take no fence

    with pytest.raises(ConfigError, match="takes no fences"):
        DecodeOffloadManager(config, allocator=PlainAllocator(16, 2), copy_engine=e.copies, **common)
    with ThreadCpuCopyEngine() as threads:  # every engine kvfsm ships fences
        DecodeOffloadManager(config, allocator=e.allocator, copy_engine=threads, **common).close()
    # without fenced_release neither is needed: the deferred release frees plainly, after the copy
    deferred = config.model_copy(update={"fenced_release": False})
    DecodeOffloadManager(deferred, allocator=PlainAllocator(16, 2), copy_engine=_NoFences(), **common).close()


def test_two_requests_ending_in_one_batch_each_get_their_own_copies_as_fence() -> None:
    e = _engine(fenced=True, checked=False, device_slots=24, rows=4)
    a, b = _offloading(e, "a"), _offloading(e, "b")
    fx = e.manager.fx
    ca, cb = [c for c in fx.copy_fifo if c.record.rid == "a"], [c for c in fx.copy_fifo if c.record.rid == "b"]
    ma, mb = e.manager.machine_of(a), e.manager.machine_of(b)
    a.done = b.done = True
    e.live[:] = []
    spec_gen.DecodeOffloadMachine.finish_each([ma, mb], [None, None])
    assert spec_gen.STATES[ma.state] == spec_gen.STATES[mb.state] == "fenced"
    fences = {id(f): f for f in e.allocator._page_fence.values()}.values()
    assert len(fences) == 2
    by_copy = sorted(sorted(id(h) for h in f._handles) for f in fences)
    assert by_copy == sorted([sorted({id(c.handle) for c in ca}), sorted({id(c.handle) for c in cb})])
    e.settle()
    e.check_teardown()


@pytest.mark.parametrize("checked", [True, False])
def test_the_engine_releasing_a_request_under_a_copy_after_fencing_it_is_recorded_fenced(checked: bool) -> None:
    """With fences the engine may release a request whose copy is in flight itself (SGLang's retraction never
    refused): its stream waits on the copies first (fence_copies_in_flight), the manager records the release
    fenced (released_by_engine_fenced) and frees nothing; a request with no copy in flight is the plain
    released_by_engine."""
    e = _engine(fenced=True, checked=checked, device_slots=24)
    b = _offloading(e, "b")
    e.copies.complete_all()
    e.manager.check_progress()  # b's copy acknowledged: its chunk backs up (inflight)
    a = _offloading(e, "a")
    e.release_itself(a)  # fences the copies (the CPU twin completes them), frees itself, tells the manager
    assert _state(e, a) == "fenced" and e.manager.metrics.engine_releases == 1 and e.manager.metrics.releases == 0
    e.release_itself(b)
    assert _state(e, b) == "draining" and e.manager.metrics.engine_releases == 2
    e.settle()
    assert _state(e, b) == "released"
    assert _state(e, a) == "released"
    e.check_teardown()


def test_an_engine_release_under_a_copy_its_stream_never_waited_on_is_refused() -> None:
    """Without fence_copies_in_flight first, the engine freed slots a copy still reads: refused (B2), and the
    lifecycle keeps them recorded as held."""
    e = _engine(fenced=True, checked=False)
    a = _offloading(e, "a")
    from kvfsm.errors import LifecycleError

    with pytest.raises(LifecycleError, match="never made to wait"):
        e.manager.released_by_engine(a)
    assert _state(e, a) == "offloading"


def _scanned(fifo: Any, rec: Any) -> list[Any]:
    """The handles of `rec`'s copies in flight by a walk of the whole FIFO, each once, in FIFO order."""
    return list({id(c.handle): c.handle for c in fifo if c.record is rec}.values())


@pytest.mark.parametrize("seed", range(6))
def test_the_copy_fifo_index_answers_what_a_walk_of_the_fifo_would_through_submits_acks_and_releases(seed: int) -> None:
    """`copies_reading` indexes the FIFO once per state of it (its first and last chunk): through offload calls
    alone and in batches (one handle for several requests), acknowledgements one copy at a time, and fenced
    releases, which read their fence from it, it answers what walking the FIFO answers."""
    rng = random.Random(seed)
    e = _engine(
        fenced=True,
        checked=seed % 2 == 0,
        page_size=2,
        stride=2,
        device_slots=96,
        host_slots=64,
        rows=6,
        max_context=48,
    )
    fx = e.manager.fx
    asked = fenced = 0
    for step in range(60):
        while len(e.live) < 5 and rng.random() < 0.7:
            if e.admit(f"r{step}-{len(e.live)}", rng.choice([2, 4])) is None:
                break
        for req in list(e.live):
            e.decode(req)
        picked = [r for r in e.live if rng.random() < 0.6]
        if rng.random() < 0.5:
            e.manager.offload_batch(picked)
        else:
            for req in picked:
                e.manager.offload(req)
        for _ in range(rng.randrange(3)):
            e.copies.complete_next()
        if rng.random() < 0.5:
            e.manager.check_progress()
        for rec in e.manager.live_records():
            assert fx.copies_reading(rec) == _scanned(fx.copy_fifo, rec), f"step {step}, {rec.key}"
            asked += 1
        ending = [r for r in e.live if rng.random() < 0.15 or len(r.origin_input_ids) + len(r.output_ids) > 40]
        for req in ending:
            rec = next((r for r in e.manager.live_records() if r.req_ref() is req), None)
            want = [] if rec is None else _scanned(fx.copy_fifo, rec)
            before = set(e.allocator._page_fence)
            e.end(req)
            if want:  # ended under its copies: released at once, fenced by them
                assert rec is not None
                assert spec_gen.STATES[rec.machine.state] == "fenced"
                landing = [h for h in want if not h.done()]  # a fence of landed copies has passed: pages plain
                fences = [f for p, f in e.allocator._page_fence.items() if p not in before]  # the pages it freed
                assert bool(fences) == bool(landing)
                assert all({id(h) for h in landing} <= {id(h) for h in f._handles} for f in fences)
                fenced += bool(landing)
    assert asked > 100 and fenced
    for req in list(e.live):
        e.end(req)
    e.settle()
    e.check_teardown()
