"""Checked mode: each misuse the chunk lifecycle forbids raises ChunkMisuse naming the call and the key, before
anything changes; vLLM's own manager asserts later or ignores it. Replays of the cited vLLM bugs whose wrong
call sequence reaches the manager show checked mode naming the first wrong call."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from driver import key

from kvfsm.integrations.vllm import ChunkMisuse, KvfsmOffloadingManager

A, B, C = key(1, 0), key(1, 1), key(2, 0)


def _ctx(rid: str, *keys: bytes) -> ReqContext:
    ctx = ReqContext(req_id=rid)
    for pos, k in enumerate(keys):
        ctx.set_offload_key_position(k, (pos + 1) * 16)
    return ctx


def _state(m: KvfsmOffloadingManager) -> Any:
    """Everything a later call could observe: chunks, slots, gauges, the policy's lists and the events."""
    chunks = {k: (c.state, c.writes, c.pins, c.chunk_id) for k, c in m._chunks.items()}
    policy = {k: copy.copy(v) for k, v in vars(m._policy).items() if k != "chunks"}
    return (
        chunks,
        m._num_allocated_chunks,
        list(m._free_list),
        m._num_evictable_cache_chunks,
        m._num_write_pending_chunks,
        repr(policy),
        list(m.events or []),
    )


def _stored(m: Any, ctx: ReqContext, *keys: bytes) -> None:
    out = m.prepare_store(list(keys), ctx)
    assert out is not None and out.keys_to_store == list(keys)
    m.complete_store(list(keys), ctx)


def _refused(m: KvfsmOffloadingManager, call: str, k: bytes, state: str, words: str, *args: Any) -> ChunkMisuse:
    before = _state(m)
    with pytest.raises(ChunkMisuse) as info:
        getattr(m, call)(*args)
    err = info.value
    assert (err.call, err.key, err.state) == (call, k, state) and words in err.reason, err
    assert _state(m) == before, "a refused call changed the manager"
    assert m.audit() == []
    return err


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_complete_load_without_prepare_load_is_named(policy: str) -> None:
    m = KvfsmOffloadingManager(4, cache_policy=policy, enable_events=True, checked=True)
    ctx = _ctx("r", A, B)
    _stored(m, ctx, A, B)
    _refused(m, "complete_load", A, "ready", "without prepare_load", [A], ctx)
    vllm = CPUOffloadingManager(4, cache_policy=policy)
    _stored(vllm, _ctx("r", A, B), A, B)
    with pytest.raises(AssertionError):  # vLLM: an assertion, after nothing else
        vllm.complete_load([A], _ctx("r"))


def test_a_double_complete_load_is_named_even_while_another_load_pins_the_chunk() -> None:
    """Two requests load A; one completes twice. vLLM's ref_cnt just drops to 0 and A becomes evictable while
    the other request's load still reads it: no assertion, silent. Checked mode names the second completion."""
    m = KvfsmOffloadingManager(4, checked=True)
    r1, r2 = _ctx("r1", A), _ctx("r2", A)
    _stored(m, r1, A)
    m.prepare_load([A], r1)
    m.prepare_load([A], r2)
    m.complete_load([A], r1)
    _refused(m, "complete_load", A, "pinned", "second complete_load", [A], r1)
    vllm = CPUOffloadingManager(4)
    v1, v2 = _ctx("r1", A), _ctx("r2", A)
    _stored(vllm, v1, A)
    vllm.prepare_load([A], v1), vllm.prepare_load([A], v2)
    vllm.complete_load([A], v1)
    vllm.complete_load([A], v1)  # accepted: the chunk r2 still reads is now evictable
    assert vllm._policy.get(A).ref_cnt == 0


def test_complete_store_of_a_key_never_prepared_is_named() -> None:
    """vLLM ignores it silently (the key is skipped); checked mode names it, in either success value."""
    m = KvfsmOffloadingManager(4, enable_events=True, checked=True)
    ctx = _ctx("r", A, B)
    assert m.prepare_store([A], ctx).keys_to_store == [A]
    for success in (True, False):
        _refused(m, "complete_store", B, "absent", "never prepared", [A, B], ctx, success)
    other = _ctx("o", A)
    _refused(m, "complete_store", A, "write_pending", "never prepared", [A], other)
    m.complete_store([A], ctx)
    _refused(m, "complete_store", A, "ready", "already completed", [A], ctx)


def test_prepare_load_of_a_pending_chunk_is_named() -> None:
    m = KvfsmOffloadingManager(4, checked=True)
    ctx = _ctx("r", A)
    m.prepare_store([A], ctx)
    _refused(m, "prepare_load", A, "write_pending", "only a stored chunk", [A], _ctx("o", A))


def test_a_key_offered_twice_in_one_prepare_store_is_named() -> None:
    """vLLM's manager would allocate two slots for it and lose one (the policy keeps the second)."""
    m = KvfsmOffloadingManager(4, checked=True)
    _refused(m, "prepare_store", A, "absent", "offered twice", [A, B, A], _ctx("r", A, B))
    vllm = CPUOffloadingManager(4)
    out = vllm.prepare_store([A, B, A], _ctx("r", A, B))
    assert out.keys_to_store == [A, B, A] and vllm._num_allocated_chunks == 3  # slot 0 is lost for good


def test_stores_after_on_request_finished_are_named() -> None:
    """vLLM's manager counts the offer (store threshold, ARC) and then fails an assertion; checked mode refuses
    first. The sequence is what an abort of a request that was never scheduled gives the manager when the
    connector still builds store jobs for it (vllm-project/vllm#49118, #52170)."""
    m = KvfsmOffloadingManager(4, checked=True)
    ctx = _ctx("r", A, B)
    m.on_new_request(ctx)
    m.on_request_finished(ctx)
    _refused(m, "prepare_store", A, "absent", "already finished", [A, B], ctx)
    vllm = CPUOffloadingManager(4)
    vctx = _ctx("r", A, B)
    vllm.on_new_request(vctx), vllm.on_request_finished(vctx)
    with pytest.raises(AssertionError, match="after request finalization"):
        vllm.prepare_store([A, B], vctx)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_hit_evicted_before_its_load_is_named_at_the_load(policy: str) -> None:
    """A lookup answers HIT; before the prepare_load that should pin it, another request's store evicts the
    chunk (the lookup-to-load window of vllm-project/vllm#39702, and what an engine sees when a lookup and
    its load are not under one hold of the manager's lock, as in vllm-project/vllm#54914's
    update_state_after_alloc). vLLM's manager fails `Chunk ... not found in cache`; checked mode names the
    load and the key, changing nothing, and unchecked kvfsm raises the same typed error."""
    for checked in (True, False):
        m = KvfsmOffloadingManager(1, cache_policy=policy, checked=checked)
        r1, r2 = _ctx("r1", A), _ctx("r2", C)
        _stored(m, r1, A)
        assert m.lookup(A, r1) is LookupResult.HIT
        out = m.prepare_store([C], r2)
        assert out.evicted_keys == [A]
        if checked:
            _refused(m, "prepare_load", A, "absent", "only a stored chunk", [A], r1)
        else:
            with pytest.raises(ChunkMisuse):
                m.prepare_load([A], r1)
    vllm = CPUOffloadingManager(1, cache_policy=policy)
    v1, v2 = _ctx("r1", A), _ctx("r2", C)
    _stored(vllm, v1, A)
    vllm.prepare_store([C], v2)
    with pytest.raises(AssertionError, match="not found in cache"):
        vllm.prepare_load([A], v1)


def test_checked_mode_accepts_the_scheduler_s_own_sequence() -> None:
    m = KvfsmOffloadingManager(2, enable_events=True, checked=True)
    r1, r2 = _ctx("r1", A, B), _ctx("r2", A, B)
    m.on_new_request(r1)
    out = m.prepare_store([A, B], r1)
    assert out.keys_to_store == [A, B] and out.store_spec.block_ids.tolist() == [0, 1]
    assert m.lookup(A, r2) is LookupResult.HIT_PENDING
    m.complete_store([A, B], r1)
    m.on_request_finished(r1)
    assert m.prepare_load([A, B], r2).block_ids.tolist() == [0, 1]
    assert m.prepare_store([C], _ctx("r3", C)) is None  # both pinned: nothing evictable
    m.complete_load([A, B], r2)
    assert len(m.prepare_store([C], _ctx("r4", C)).evicted_keys) == 1
    assert m.audit() == []


def test_a_completion_of_a_job_from_before_a_reset_is_named() -> None:
    """The slot fence rule of a reset: the connector must drop the completions of jobs submitted before it. If
    one arrives anyway while another request's new store of the same key is in flight, vLLM's manager publishes
    that chunk before its own store is written (a reader would get stale KV); checked mode names the late
    completion and the new store stays pending."""
    m = KvfsmOffloadingManager(2, checked=True)
    r1, r2 = _ctx("r1", A), _ctx("r2", A)
    m.prepare_store([A], r1)
    m.reset_cache()
    assert m.prepare_store([A], r2).keys_to_store == [A]
    _refused(m, "complete_store", A, "write_pending", "never prepared", [A], r1)
    assert m.lookup(A, r2) is LookupResult.HIT_PENDING
    vllm = CPUOffloadingManager(2)
    v1, v2 = _ctx("r1", A), _ctx("r2", A)
    vllm.prepare_store([A], v1)
    vllm.reset_cache()
    vllm.prepare_store([A], v2)
    vllm.complete_store([A], v1)  # accepted: r2's chunk is published before r2's store is written
    assert vllm.lookup(A, v2) is LookupResult.HIT


def test_ref_cnt_is_a_read_only_view_and_slots_come_from_the_spec_s_action() -> None:
    """Difference 3 of docs/vllm.md: vLLM's policy chunks take writes of ref_cnt, kvfsm's chunks refuse them (a
    pin goes through prepare_load, an event of the machine); vLLM allocates in _allocate_chunks, kvfsm in the
    spec's allocate_slot action, so replacing the former changes nothing in kvfsm."""
    for make in (CPUOffloadingManager, KvfsmOffloadingManager):
        m = make(2)
        ctx = _ctx("r", A)
        _stored(m, ctx, A)
        chunk = m._policy.get(A)
        if make is CPUOffloadingManager:
            chunk.ref_cnt = 1
            assert m._policy.get(A).ref_cnt == 1
        else:
            with pytest.raises(AttributeError):
                chunk.ref_cnt = 1
            m.prepare_load([A], ctx)
            assert m._policy.get(A).ref_cnt == 1
    ours = KvfsmOffloadingManager(2)
    ours._allocate_chunks = None  # never called
    assert ours.prepare_store([B], _ctx("r", B)).store_spec.block_ids.tolist() == [0]
