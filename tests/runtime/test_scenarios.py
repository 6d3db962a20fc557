"""One scenario per behaviour of the seed and per bug class (docs/bug-catalog.md) the manager must rule out,
driven through SimEngine (real CPU pools, copies that land only when told, backups that run only when told)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import kvfsm.generated.decode_offload as spec_gen
from kvfsm.dataplane import DoubleFree, page_hashes
from kvfsm.errors import EventRejected
from kvfsm.runtime import (
    CheckedModeError,
    ConfigError,
    DecodeOffloadManager,
    InvalidRequest,
    OffloadConfig,
    SimplePrefixCache,
    ThreadBackupWorker,
)
from kvfsm.runtime.effects import OffloadEffects
from kvfsm.verify.engine import SimEngine, SimRequest

# --- helpers ---------------------------------------------------------------------------------------------


def ref_hashes(tokens: list[int], page_size: int) -> list[str]:
    """The seed's page hashes, written out with hashlib: sha256(prior digest || uint32-LE tokens), chained."""
    prev, out = b"", []
    for i in range(0, len(tokens) // page_size * page_size, page_size):
        h = hashlib.sha256(prev + b"".join(struct.pack("<I", t) for t in tokens[i : i + page_size]))
        prev = h.digest()
        out.append(h.hexdigest())
    return out


def tokens_of(req: SimRequest) -> list[int]:
    return list(req.origin_input_ids) + list(req.output_ids)


def state(engine: SimEngine, req: SimRequest) -> str:
    m = engine.manager.machine_of(req)
    assert m is not None
    return spec_gen.STATES[m.state]


def settle(engine: SimEngine, max_rounds: int = 100) -> None:
    engine.settle(max_rounds)


def decode_to_offload(engine: SimEngine, req: SimRequest, max_steps: int = 40) -> int:
    """Decode (offloading after each step) until a chunk is submitted; the number of decode steps."""
    for step in range(1, max_steps + 1):
        assert engine.decode(req)
        if engine.manager.offload(req):
            return step
    raise AssertionError("no chunk was offloaded")


def world(engine: SimEngine) -> tuple[Any, ...]:
    """Everything a rejected call must leave alone."""
    a_free, a_mask = engine.allocator.snapshot()
    h_free, h_mask = engine.host_pool.allocator.snapshot()
    # free sets, not free-list order: a rejected offload may hand its host pages back to the end of the list
    return (
        sorted(a_free.tolist()),
        a_mask.tolist(),
        sorted(h_free.tolist()),
        h_mask.tolist(),
        engine.req_to_token.free_rows,
        engine.protected.size,
        engine.manager.metrics.as_dict(),
        len(engine.copies.pending),
        len(engine.worker.pending),
        len(engine.manager.fx.copy_fifo),
        dict(engine.manager.fx.stored),
        sorted((r.key, r.machine.snapshot()) for r in engine.manager.live_records()),
    )


class FreeLog:
    """Wraps the device allocator's free to count calls and slots."""

    def __init__(self, engine: SimEngine) -> None:
        self.calls: list[list[int]] = []
        inner = engine.allocator.free

        def free(indices: Any) -> None:
            self.calls.append(sorted(torch.as_tensor(indices).reshape(-1).tolist()))
            inner(indices)

        engine.allocator.free = free  # type: ignore[method-assign]


def held_slots(engine: SimEngine, req: SimRequest) -> list[int]:
    """Every slot of every page the request's table row maps for [0, allocated)."""
    ps = engine.page_size
    end = -(-req.kv_allocated_len // ps) * ps
    pages = {int(s) // ps for s in engine.req_to_token.read(req.req_pool_idx, 0, end).tolist()}
    return sorted(p * ps + i for p in pages for i in range(ps))


# --- stride, what is offloaded, hashes -------------------------------------------------------------------


@pytest.mark.parametrize("page,stride,want", [(4, 10, 8), (4, 8, 8), (4, 3, 4), (4, 0, 4), (1, 5, 5), (2, 0, 2)])
def test_stride_rounds_down_to_whole_pages(page: int, stride: int, want: int) -> None:
    assert OffloadConfig(page_size=page, offload_stride=stride).stride == want


def test_chunks_are_one_rounded_stride_long() -> None:
    e = SimEngine(page_size=4, stride=10, device_slots=64, host_slots=32)
    r = e.admit("a", 4)
    assert decode_to_offload(e, r) == 8  # 8 tokens after the prompt are needed, not 10
    assert e.manager.metrics.offloaded_tokens == 8
    chunk = e.manager.fx.copy_fifo[0]
    assert (chunk.start, chunk.end) == (4, 12)


def test_last_sampled_token_is_never_offloaded() -> None:
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32)
    r = e.admit("a", 4)  # prompt [0, 4) is the prefill side's; decode offloads from position 4
    assert e.decode(r, speculative=2)  # tokens: prompt + 2 outputs; the second output has no KV yet
    assert len(tokens_of(r)) == 6 and r.kv_committed_len == 5
    r.kv_committed_len = 6  # even if the engine claimed the last sampled token's KV were committed ...
    assert not e.manager.offload(r)  # ... position 5 is the last sampled token: [4, 6) is not complete
    r.kv_committed_len = 5
    assert e.decode(r)
    assert e.manager.offload(r)
    chunk = e.manager.fx.copy_fifo[0]
    assert (chunk.start, chunk.end) == (4, 6)
    assert list(chunk.tokens) == r.output_ids[:2] and len(r.output_ids) == 3  # output_ids[-1] excluded


def test_prompt_prefix_seeds_the_hash_chain() -> None:
    e = SimEngine(page_size=2, stride=4, device_slots=128, host_slots=64, backup_queue=8)
    r = e.admit("a", 5)  # page-aligned prompt prefix: [0, 4); position 4 (a prompt token) is decode's
    for _ in range(13):
        assert e.decode(r)
        e.manager.offload(r)
    settle(e)
    tokens = tokens_of(r)
    end = e.manager.machine_of(r).ctx.prefill_len + e.manager.machine_of(r).ctx.inc_len
    assert end == 16
    want = ref_hashes(tokens[:end], 2)
    assert want == page_hashes(tokens[:end], 2)  # kvfsm.dataplane agrees with the hashlib reference
    stored = {pos: h for h, (_key, pos) in e.manager.fx.stored.items()}
    assert stored == {pos: want[pos // 2] for pos in range(4, end, 2)}  # chained on the prompt's pages
    assert set(e.store.pages) == set(stored.values())
    assert want[0] not in e.store.pages and want[1] not in e.store.pages  # the prefill side stores those
    e.end(r)
    settle(e)
    e.check_teardown()


def test_remainder_shorter_than_a_stride_waits() -> None:
    e = SimEngine(page_size=2, stride=4, device_slots=64, host_slots=32)
    r = e.admit("a", 4)
    results = []
    for _ in range(6):
        assert e.decode(r)
        results.append(e.manager.offload(r))
    assert results == [False, False, False, True, False, False]
    rec = e.manager.machine_of(r).ctx
    assert rec.inc_len == 4 and e.host_pool.free_slots == e.host_pool.capacity - 4


def test_tail_is_freed_without_offload() -> None:
    e = SimEngine(page_size=2, stride=4, device_slots=64, host_slots=32)
    r = e.admit("a", 4)
    for _ in range(7):  # 4 tokens fill a stride, 3 more (one of them the last sampled) never do
        assert e.decode(r)
        e.manager.offload(r)
    settle(e)
    assert e.manager.metrics.offloaded_tokens == 4
    assert sorted(pos for _h, (_k, pos) in e.manager.fx.stored.items()) == [4, 6]
    e.end(r)
    settle(e)
    assert e.manager.metrics.offloaded_tokens == 4 and e.manager.metrics.releases == 1
    e.check_teardown()
    # a request whose whole output is a tail: never offloaded, still released
    r2 = e.admit("b", 3)
    assert e.decode(r2) and not e.manager.offload(r2)
    e.end(r2)
    assert state(e, r2) == "released"
    e.check_teardown()


# --- host slots and backups ------------------------------------------------------------------------------


@pytest.mark.parametrize("outcome", ["stored", "page_fails", "store_raises"])
def test_host_slots_are_freed_only_when_the_backup_completes(outcome: str) -> None:
    e = SimEngine(page_size=2, stride=4, device_slots=64, host_slots=32)
    r = e.admit("a", 4)
    decode_to_offload(e, r)
    hashes = ref_hashes(tokens_of(r)[:8], 2)[2:4]
    if outcome == "page_fails":
        e.fail_writes.add(hashes[0])  # one page of the chunk fails: the whole chunk is a failed backup
    elif outcome == "store_raises":

        def broken(keys: Any, pages: Any) -> list[bool]:
            raise OSError("disk gone")

        e.storage.batch_set = broken  # type: ignore[method-assign]
    cap = e.host_pool.capacity
    assert e.host_pool.free_slots == cap - 4
    e.copies.complete_all()
    e.manager.check_progress()  # copy acked, backup queued: host slots still held
    assert state(e, r) == "inflight" and e.host_pool.free_slots == cap - 4
    e.worker.run_all()  # the backup ran but its completion is not yet observed
    assert e.host_pool.free_slots == cap - 4
    e.manager.check_progress()
    assert e.host_pool.free_slots == cap and state(e, r) == "allocated"
    m = e.manager.metrics
    if outcome == "stored":
        assert m.backup_failures == 0 and m.stored_pages == 2
        assert set(e.manager.fx.stored) == set(hashes) and e.store.batch_exists(hashes) == 2
    else:
        assert m.backup_failures == 1 and m.stored_pages == 0
        assert not set(hashes) & set(e.manager.fx.stored)  # never reported as stored (B13)
        assert hashes[0] not in e.store.pages and e.store.batch_exists(hashes) == 0
    e.end(r)
    settle(e)
    e.check_teardown()


def test_backup_queue_full_parks_the_chunk_and_resubmits_it() -> None:
    e = SimEngine(page_size=2, stride=4, device_slots=64, host_slots=32, backup_queue=1)
    r = e.admit("a", 4)
    decode_to_offload(e, r)
    decode_to_offload(e, r)
    e.copies.complete_all()
    e.manager.check_progress()  # first ack queues its backup, second ack finds the queue full
    m = e.manager.machine_of(r)
    assert (spec_gen.STATES[m.state], m.copies, m.parked, m.backups) == ("inflight", 0, 1, 1)
    assert e.manager.metrics.parked_chunks == 1 and len(e.manager.fx.parked) == 1 and len(e.worker.pending) == 1
    assert e.host_pool.free_slots == e.host_pool.capacity - 8  # the parked chunk keeps its host slots
    e.worker.run_all()
    e.manager.check_progress()  # backup 1 done (its host slots freed), the parked chunk is resubmitted
    assert (m.parked, m.backups) == (0, 1) and not e.manager.fx.parked and len(e.worker.pending) == 1
    assert e.host_pool.free_slots == e.host_pool.capacity - 4
    e.worker.run_all()
    e.manager.check_progress()
    assert state(e, r) == "allocated" and e.manager.metrics.stored_pages == 4  # nothing was dropped
    e.end(r)
    settle(e)
    e.check_teardown()


def test_host_pool_full_retry_leaves_no_state_and_succeeds_later() -> None:
    e = SimEngine(page_size=2, stride=4, device_slots=64, host_slots=8)
    a = e.admit("a", 4)
    decode_to_offload(e, a)
    decode_to_offload(e, a)  # the host pool is now full
    b = e.admit("b", 4)
    for _ in range(3):
        e.decode(b)
        assert not e.manager.offload(b)  # less than a stride: no attempt, no retry counted
    e.decode(b)
    before = world(e)
    mb = e.manager.machine_of(b)
    snap, inc = mb.snapshot(), mb.ctx.inc_len
    assert e.host_pool.free_slots == 0
    assert not e.manager.offload(b)
    assert e.manager.metrics.host_full_retries == 1
    after = world(e)
    metrics_before, metrics_after = before[6], after[6]
    assert metrics_after == {**metrics_before, "host_full_retries": 1}
    assert after[:6] + after[7:] == before[:6] + before[7:]  # nothing else changed
    assert mb.snapshot() == snap and mb.ctx.inc_len == inc and e.host_pool.free_slots == 0
    settle(e)  # a's backups complete and return the host slots
    assert e.manager.offload(b)
    chunk = e.manager.fx.copy_fifo[-1]
    assert chunk.record is mb.ctx and (chunk.start, chunk.end) == (4, 8)  # the same chunk, retried
    for req in (a, b):
        e.end(req)
    settle(e)
    e.check_teardown()


# --- release ---------------------------------------------------------------------------------------------


def test_release_exactly_once_frees_the_speculative_over_allocation() -> None:
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32)
    r = e.admit("a", 3, prefix_len=2)
    for _ in range(4):
        assert e.decode(r, speculative=3)
    assert r.kv_allocated_len > -(-r.kv_committed_len // 2) * 2  # whole pages beyond the committed ones
    expected = held_slots(e, r)
    prefix = e.req_to_token.read_host(r.req_pool_idx, 0, 2).tolist()
    frees = FreeLog(e)
    e.end(r)
    # one free of the request's own pages, every page once, over-allocation included (B5); then the prefix
    # cache evicts the matched prefix's page, which the manager only unlocked (B16)
    assert frees.calls == [sorted(set(expected) - set(prefix)), prefix]
    assert e.manager.metrics.releases == 1 and e.protected.size == 0
    e.check_teardown()


def test_release_is_deferred_while_a_copy_is_in_flight() -> None:
    e = SimEngine(page_size=2, stride=4, device_slots=32, host_slots=16)
    r = e.admit("a", 4)
    decode_to_offload(e, r)
    slots, row, free_before = held_slots(e, r), r.req_pool_idx, e.allocator.free_slots
    frees = FreeLog(e)
    e.end(r)  # finish with the copy still pending
    assert state(e, r) == "finished" and e.manager.metrics.releases == 0 and not frees.calls
    assert bool(e.allocator.is_allocated(slots).all()) and e.allocator.free_slots == free_before
    assert e.req_to_token.is_allocated(row) and e.protected.size == r.prefix_len
    # another request cannot get those slots meanwhile: the copy reads what `a` wrote (B2)
    other = e.admit("b", 8)
    assert other is not None and not set(held_slots(e, other)) & set(slots)
    e.decode(other)
    chunk = e.manager.fx.copy_fifo[0]
    e.copies.complete_all()
    assert e.host_page_ok(chunk)
    e.manager.check_progress()  # the ack releases
    assert state(e, r) == "draining" and frees.calls == [slots] and not e.req_to_token.is_allocated(row)
    e.end(other)
    settle(e)
    assert state(e, r) == "released"
    e.check_teardown()


@pytest.mark.parametrize("deferred", [False, True])
def test_release_is_idempotent(deferred: bool) -> None:
    e = SimEngine(page_size=2, stride=4, device_slots=64, host_slots=32)
    r = e.admit("a", 4)
    if deferred:
        decode_to_offload(e, r)
    frees = FreeLog(e)
    e.manager.finalize(r)
    e.manager.finalize(r)  # a second finalize is a declared no-op (B9)
    assert e.manager.metrics.ignored_duplicate_releases == 1
    settle(e)
    e.manager.finalize(r)
    e.manager.abort(r)
    assert e.manager.metrics.ignored_duplicate_releases == 3
    assert len(frees.calls) == 1 and e.manager.metrics.releases == 1
    e.live.remove(r)
    e.check_teardown()


@pytest.mark.parametrize("how", ["abort", "retract", "finish"])
@pytest.mark.parametrize("live", ["allocated", "offloading", "inflight", "inflight_parked"])
def test_end_is_accepted_in_every_live_state_and_leaks_nothing(how: str, live: str) -> None:
    e = SimEngine(page_size=2, stride=4, device_slots=64, host_slots=32, backup_queue=1)
    r = e.admit("a", 5, prefix_len=3)
    e.decode(r)
    assert not e.manager.offload(r)  # the machine exists, nothing offloaded yet
    if live != "allocated":
        decode_to_offload(e, r)
    if live == "inflight_parked":
        decode_to_offload(e, r)
    if live.startswith("inflight"):
        e.copies.complete_all()
        e.manager.check_progress()
    m = e.manager.machine_of(r)
    assert spec_gen.STATES[m.state] == live.split("_")[0]
    if live == "inflight_parked":
        assert (m.parked, m.backups) == (1, 1)
    e.end(r, how)
    assert state(e, r) == {"allocated": "released", "offloading": "finished"}.get(live, "draining")
    settle(e)
    assert state(e, r) == "released" and e.manager.metrics.releases == 1
    e.check_teardown()


# --- request identity ------------------------------------------------------------------------------------


def test_reused_rid_never_sees_the_old_request_state() -> None:
    e = SimEngine(page_size=2, stride=4, device_slots=64, host_slots=32)
    old = e.admit("x", 4)
    decode_to_offload(e, old)
    e.end(old)  # finished: its release waits for the copy ack
    new = e.admit("x", 4)  # a new request object with the same rid
    e.decode(new)
    assert not e.manager.offload(new)
    m_old, m_new = e.manager.machine_of(old), e.manager.machine_of(new)
    assert m_new is not m_old and spec_gen.STATES[m_new.state] == "allocated" and m_new.ctx.inc_len == 0
    new_snapshot, new_slots, new_row = m_new.snapshot(), held_slots(e, new), new.req_pool_idx
    e.copies.complete_all()
    e.worker.run_all()
    e.manager.check_progress()  # late ack of the old request: releases the old one only
    e.worker.run_all()
    e.manager.check_progress()
    assert state(e, old) == "released"
    assert m_new.snapshot() == new_snapshot and new.req_pool_idx == new_row
    assert bool(e.allocator.is_allocated(new_slots).all()) and e.req_to_token.is_allocated(new_row)
    assert {k for k, _pos in e.manager.fx.stored.values()} == {m_old.ctx.key}
    for _ in range(3):
        e.decode(new)
    assert e.manager.offload(new)  # the new lifecycle offloads from its own start
    assert e.manager.fx.copy_fifo[-1].start == 4
    e.end(new)
    settle(e)
    e.check_teardown()


def test_retracted_request_readmitted_into_the_same_row_is_a_new_lifecycle() -> None:
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32, rows=1)
    r = e.admit("a", 4)
    for _ in range(3):
        e.decode(r)
    e.end(r, "retract")
    first = e.manager.machine_of(r)
    assert spec_gen.STATES[first.state] == "released" and r.req_pool_idx is None
    assert e.admit("a", 0, req=r) is r and r.req_pool_idx == 0  # the only row again
    e.decode(r)
    assert e.manager.offload(r)
    assert e.manager.machine_of(r) is not first
    e.end(r)
    settle(e)
    assert state(e, r) == "released"
    e.check_teardown()


def test_retract_with_copy_in_flight_then_readmit_frees_each_lifecycle_once() -> None:
    e = SimEngine(page_size=2, stride=4, device_slots=64, host_slots=32, rows=2)
    r = e.admit("a", 4)
    for _ in range(2):
        e.decode(r, speculative=2)
    decode_to_offload(e, r)
    old_slots = held_slots(e, r)
    e.end(r, "retract")  # deferred: the copy still reads the old slots
    first = e.manager.machine_of(r)
    assert spec_gen.STATES[first.state] == "finished"
    assert e.admit("a", 0, req=r) is r  # re-admitted before the ack: new row, new slots, new lengths
    new_slots = held_slots(e, r)
    assert not set(new_slots) & set(old_slots)
    decode_to_offload(e, r)
    second = e.manager.machine_of(r)
    assert second is not first and spec_gen.STATES[second.state] == "offloading"
    frees = FreeLog(e)
    settle(e)  # the old lifecycle's ack releases exactly what it held when it was retracted
    assert frees.calls == [old_slots] and spec_gen.STATES[first.state] == "released"
    assert bool(e.allocator.is_allocated(new_slots).all())
    e.end(r)
    settle(e)
    assert frees.calls[1:] == [new_slots]
    e.check_teardown()


# --- rejected calls --------------------------------------------------------------------------------------


def test_offload_of_a_released_request_is_rejected_and_changes_nothing() -> None:
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32)
    r = e.admit("a", 4)
    for _ in range(3):
        e.decode(r)
    row = r.req_pool_idx
    e.end(r)
    assert state(e, r) == "released"
    r.req_pool_idx = row  # a stale row index: the engine did not notice the release
    before = world(e)
    with pytest.raises(EventRejected) as exc:
        e.manager.offload(r)
    assert exc.value.event == "offload" and exc.value.state == "released"
    assert world(e) == before


def test_offload_after_finish_with_copy_in_flight_is_rejected_and_changes_nothing() -> None:
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32)
    r = e.admit("a", 4)
    decode_to_offload(e, r)
    e.manager.finalize(r)
    for _ in range(2):
        e.decode(r)
    before = world(e)
    with pytest.raises(EventRejected) as exc:
        e.manager.offload(r)
    assert exc.value.state == "finished"
    assert world(e) == before


@pytest.mark.parametrize("row", [99, -5, "free_row"])
def test_invalid_table_row_is_rejected_and_changes_nothing(row: Any) -> None:
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32, rows=2)
    r = e.admit("a", 4)
    for _ in range(3):
        e.decode(r)
    r.req_pool_idx = 1 if row == "free_row" else row
    assert row != "free_row" or not e.req_to_token.is_allocated(1)
    before = world(e)
    with pytest.raises(InvalidRequest):
        e.manager.offload(r)
    with pytest.raises(InvalidRequest):
        e.manager.finalize(r)
    assert e.manager.machine_of(r) is None
    assert world(e) == before


# --- checked mode ----------------------------------------------------------------------------------------


def test_checked_mode_catches_a_host_double_free(monkeypatch: pytest.MonkeyPatch) -> None:
    e = SimEngine(page_size=2, stride=4, device_slots=64, host_slots=32)
    r = e.admit("a", 4)
    decode_to_offload(e, r)
    chunk = e.manager.fx.copy_fifo[0]
    original = OffloadEffects.free_host_chunk

    def twice(self: OffloadEffects, m: Any, c: Any) -> None:  # the mutant: frees the chunk's host slots twice
        original(self, m, c)
        original(self, m, c)

    monkeypatch.setattr(OffloadEffects, "free_host_chunk", twice)
    e.copies.complete_all()
    e.manager.check_progress()
    e.worker.run_all()
    free_before = e.host_pool.free_slots
    with pytest.raises(CheckedModeError) as exc:
        e.manager.check_progress()
    err = exc.value
    assert err.request == e.manager.machine_of(r).ctx.key and err.event == "backup"
    assert err.slot in chunk.host_indices.tolist() and "double free" in err.problem
    assert err.request in str(err) and f"slot {err.slot}" in str(err)
    assert e.host_pool.free_slots == free_before + 4  # the ledger stopped the second free before the pool
    e.host_pool.check_conservation()


def test_checked_mode_catches_a_device_double_release(monkeypatch: pytest.MonkeyPatch) -> None:
    e = SimEngine(page_size=2, stride=4, device_slots=64, host_slots=32)
    r = e.admit("a", 4)
    for _ in range(2):
        e.decode(r)
    original = OffloadEffects.release_request

    def twice(self: OffloadEffects, m: Any, arg: Any) -> None:  # the mutant: frees the device slots twice
        slots = self.request_slots(m.ctx)
        original(self, m, arg)
        if self.ledger is not None:
            self.ledger.release_device(m.ctx.key, "release", slots.tolist())
        self.allocator.free(slots)

    monkeypatch.setattr(OffloadEffects, "release_request", twice)
    with pytest.raises(CheckedModeError) as exc:
        e.end(r)
    err = exc.value
    assert err.request.startswith("a#") and err.event == "release" and err.slot is not None
    assert "double release" in err.problem
    # unchecked, only the allocator's mask stands between the mutant and a corrupted free list
    e2 = SimEngine(page_size=2, stride=4, device_slots=64, host_slots=32, checked=False)
    r2 = e2.admit("a", 4)
    e2.decode(r2)
    with pytest.raises(DoubleFree):
        e2.end(r2)


def test_checked_mode_catches_premature_reuse_of_a_live_slot() -> None:
    e = SimEngine(page_size=2, stride=4, device_slots=64, host_slots=32)
    a = e.admit("a", 4)
    decode_to_offload(e, a)  # a's pages are now known to the ledger
    a_slots = e.req_to_token.read(a.req_pool_idx, 4, 8).clone()
    b = e.admit("b", 4)
    for _ in range(3):
        e.decode(b)
    assert not e.manager.offload(b)  # b's machine exists; less than a stride so far
    e.decode(b)
    e.req_to_token.write(b.req_pool_idx, 4, a_slots)  # an allocator bug hands a's live slots to b
    before = world(e)
    with pytest.raises(CheckedModeError) as exc:
        e.manager.offload(b)
    err = exc.value
    assert err.request == e.manager.machine_of(b).ctx.key and err.event == "offload"
    assert err.slot in a_slots.tolist() and "premature reuse" in err.problem
    assert e.manager.machine_of(a).ctx.key in err.problem
    assert world(e) == before  # the host slots taken for the chunk were given back


# --- trace, configuration --------------------------------------------------------------------------------


def test_trace_writes_one_json_line_per_transition(tmp_path: Path) -> None:
    path = tmp_path / "trace" / "t.jsonl"
    e = SimEngine(page_size=2, stride=4, device_slots=64, host_slots=32, trace_path=str(path))
    r = e.admit("a", 4)
    decode_to_offload(e, r)
    e.manager.finalize(r)
    e.manager.finalize(r)
    e.copies.complete_all()
    e.manager.check_progress()
    e.worker.run_all()
    e.manager.check_progress()
    e.live.remove(r)
    e.check_teardown()
    e.manager.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0] == {"kind": "header", "spec_sha256": spec_gen.SPEC_SHA256}
    rows = lines[1:]
    fields = {"t", "req", "event", "from", "to", "transition", "counters", "acquired", "released"}
    assert all(set(x) == fields for x in rows)
    key = e.manager.machine_of(r).ctx.key
    assert {x["req"] for x in rows} == {key}
    from kvfsm.generated.decode_offload import TRANSITIONS

    def tid(src: str, event: str, dst: str) -> int:  # the spec's id of that transition
        return next(i for i, t in enumerate(TRANSITIONS) if t[:2] == (src, event) and t[3] == dst)

    assert [(x["event"], x["from"], x["to"], x["transition"]) for x in rows] == [
        ("offload", "allocated", "offloading", tid("allocated", "offload", "offloading")),
        ("finish", "offloading", "finished", tid("offloading", "finish", "finished")),
        ("finish", "finished", "finished", -1),
        ("copy_done", "finished", "draining", tid("finished", "copy_done", "draining")),
        ("backup_done", "draining", "released", tid("draining", "backup_done", "released")),
    ]
    assert [x["counters"] for x in rows] == [
        {"copies": 1, "parked": 0, "backups": 0},
        {"copies": 1, "parked": 0, "backups": 0},
        {"copies": 1, "parked": 0, "backups": 0},
        {"copies": 0, "parked": 0, "backups": 1},
        {"copies": 0, "parked": 0, "backups": 0},
    ]
    assert rows[0]["acquired"] == ["host_slots"] and rows[0]["released"] == []
    assert rows[3]["released"] == ["device_slots", "table_row", "prefix_lock"]
    assert rows[4]["released"] == ["host_slots"] and rows[2]["acquired"] == rows[2]["released"] == []
    ts = [x["t"] for x in rows]
    assert ts == sorted(ts)


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="page_size"):
        OffloadConfig.load(page_size=0)
    with pytest.raises(ConfigError, match="offload_stride"):
        OffloadConfig.load(offload_stride=-1)
    with pytest.raises(ConfigError, match=r"environment.*page_size"):
        OffloadConfig.from_env({"KVFSM_PAGE_SIZE": "abc"})
    assert OffloadConfig.from_env({"KVFSM_PAGE_SIZE": "4", "KVFSM_CHECKED": "true"}).page_size == 4
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("page_size: [1, 2\nstride: 3\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        OffloadConfig.from_file(bad_yaml)
    bad_value = tmp_path / "value.yaml"
    bad_value.write_text("page_size: 4\nbackup_queue_size: 0\n")
    with pytest.raises(ConfigError, match=r"value.yaml.*backup_queue_size"):
        OffloadConfig.from_file(bad_value)
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"page_sise": 4}))
    with pytest.raises(ConfigError, match="page_sise"):
        OffloadConfig.from_file(unknown)
    not_mapping = tmp_path / "list.yaml"
    not_mapping.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        OffloadConfig.from_file(not_mapping)


# --- the default worker and storage, end to end ----------------------------------------------------------


@pytest.mark.parametrize("in_process", [True, False], ids=["file", "file_in_a_child_process"])
def test_thread_worker_and_file_storage_round_trip(tmp_path: Path, in_process: bool) -> None:
    sim = SimEngine(page_size=2, stride=4, device_slots=64, host_slots=32, rows=2)
    sim.manager.close()
    config = OffloadConfig(
        page_size=2,
        offload_stride=4,
        copy_backend="cpu",
        storage_backend="file",
        storage_dir=tmp_path / "store",
        model_name="org/tiny",
        checked=True,
        backup_queue_size=2,
        storage_process=not in_process,
    )
    protected = SimplePrefixCache(sim.allocator)
    sim.protected = protected
    manager = DecodeOffloadManager(
        config,
        device_pool=sim.device_pool,
        allocator=sim.allocator,
        req_to_token=sim.req_to_token,
        prefix_cache=protected,
    )
    sim.manager = manager
    assert isinstance(manager.fx.worker, ThreadBackupWorker)
    storage = manager.fx.storage
    assert type(storage).__name__ == ("FileStorage" if in_process else "ProcessStorage")
    reqs = [sim.admit("a", 5), sim.admit("b", 4)]
    for _ in range(9):
        for req in reqs:
            assert sim.decode(req)
            manager.offload(req)
    manager.drain()
    assert manager.metrics.offloaded_tokens == 16 and manager.metrics.backup_failures == 0
    assert manager.metrics.stored_pages == len(manager.fx.stored) == 8
    assert manager.host_pool.free_slots == manager.host_pool.capacity
    keys = list(manager.fx.stored)
    pages = storage.batch_get(keys)
    by_key = {manager.machine_of(r).ctx.key: r for r in reqs}
    dev = sim.device_pool.token_view()
    for key, page in zip(keys, pages):
        owner, pos = manager.fx.stored[key]
        req = by_key[owner]
        slots = sim.req_to_token.read(req.req_pool_idx, pos, pos + 2)
        want = dev.index_select(2, slots).contiguous().view(torch.uint8).reshape(-1)  # (planes, L, page, H, D)
        assert page is not None and torch.equal(page, want), (key, owner, pos)
    assert len(list((tmp_path / "store").glob("*_org-tiny_0_1.bin"))) == 8
    for req in reqs:
        sim.end(req)
    manager.drain()
    manager.close()
    assert sim.allocator.free_slots == sim.allocator.capacity and protected.size == 0
    assert manager.host_pool.free_slots == manager.host_pool.capacity
    assert sim.req_to_token.free_rows == sim.rows
    if not in_process:  # the manager built the store, so its close() ended the store process
        assert storage.pid is None  # type: ignore[union-attr]


@pytest.mark.parametrize("limit", [0, 3])
def test_the_stored_page_index_is_bounded(limit: int) -> None:
    """A long-running manager keeps at most `stored_index_pages` entries (newest kept); counts stay whole."""
    e = SimEngine(page_size=2, device_slots=96, host_slots=32, rows=2, max_context=48, stored_index_pages=limit)
    r = e.admit("a", 4)
    order: list[str] = []
    for _ in range(12):
        e.decode(r)
        e.manager.offload(r)
        before = set(e.manager.fx.stored)
        settle(e)
        order += [h for h in e.manager.fx.stored if h not in before]
    assert e.manager.metrics.stored_pages >= 5
    assert len(e.manager.fx.stored) == min(limit, e.manager.metrics.stored_pages)
    if limit:
        assert list(e.manager.fx.stored) == order[-limit:]
    e.end(r)
    settle(e)
    e.check_teardown()
