"""kvfsm.integrations.vllm without vLLM: the package imports, the manager needs vLLM only on first use, and a
Chunk with the spec's actions (effects.py) hands out slots as vLLM's manager does (fresh in order, then the
last freed first), keeps the gauges and tells the policy what is evictable, over the machine's events alone."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

import kvfsm.integrations.vllm as vllm_integration
from kvfsm.errors import EventRejected
from kvfsm.integrations.vllm import Chunk, ChunkMisuse
from kvfsm.integrations.vllm.effects import ChunkEffects


class Policy:
    """Records what the effects tell a cache policy."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda key: self.calls.append((name, key))


class Tier(ChunkEffects):
    def __init__(self, num_chunks: int) -> None:
        self._num_chunks, self._num_allocated_chunks, self._free_list = num_chunks, 0, []
        self._num_evictable_cache_chunks = self._num_write_pending_chunks = 0
        self._policy, self._chunks = Policy(), {}

    def store(self, key: bytes) -> Chunk:
        chunk = Chunk(self, key)
        chunk.store()
        self._chunks[key] = chunk
        return chunk


def test_the_package_imports_without_vllm_and_names_what_needs_it() -> None:
    try:
        import vllm  # noqa: F401
    except ModuleNotFoundError:
        with pytest.raises(ModuleNotFoundError, match="vllm"):
            vllm_integration.KvfsmOffloadingManager  # noqa: B018
    with pytest.raises(AttributeError):
        vllm_integration.NoSuchThing  # noqa: B018


def test_slots_are_fresh_first_then_the_last_freed() -> None:
    tier = Tier(3)
    a, b, c = (tier.store(k) for k in (b"a", b"b", b"c"))
    assert [x.chunk_id for x in (a, b, c)] == [0, 1, 2] and tier._num_write_pending_chunks == 3
    for x in (a, b, c):
        x.store_done()
    a.evict(), c.evict()
    assert tier._free_list == [0, 2] and set(tier._chunks) == {b"b"}
    assert [tier.store(k).chunk_id for k in (b"d", b"e")] == [2, 0]


def test_ref_cnt_and_readiness_are_views_of_the_machine() -> None:
    tier = Tier(2)
    a = tier.store(b"a")
    assert (a.ref_cnt, a.is_ready, bool(a)) == (-1, False, True)  # a policy's `get(...) or ...` must see it
    a.store_done()
    assert (a.ref_cnt, a.is_ready, tier._num_evictable_cache_chunks) == (0, True, 1)
    a.pin(), a.pin()
    assert (a.ref_cnt, tier._num_evictable_cache_chunks) == (2, 0)
    a.unpin()
    assert tier._policy.calls == [("mark_evictable", b"a"), ("mark_non_evictable", b"a")]
    a.unpin()
    assert (a.ref_cnt, tier._num_evictable_cache_chunks) == (0, 1)
    assert tier._policy.calls[-1] == ("mark_evictable", b"a")


def test_a_rollback_frees_the_slot_and_forgets_the_chunk() -> None:
    tier = Tier(1)
    a = tier.store(b"a")
    a.rollback()
    assert (tier._chunks, tier._free_list, tier._num_write_pending_chunks) == ({}, [0], 0)
    assert tier._policy.calls == [("remove", b"a")]


@pytest.mark.parametrize("event", ["evict", "pin", "unpin"])
def test_a_pending_chunk_refuses_what_would_read_or_hand_out_its_slot(event: str) -> None:
    tier = Tier(1)
    a = tier.store(b"a")
    with pytest.raises(EventRejected):
        getattr(a, event)()
    assert (a.snapshot(), tier._free_list, tier._num_write_pending_chunks) == ((1, 1, 0), [], 1)


def test_chunk_misuse_names_call_key_and_state_and_survives_pickling() -> None:
    err = ChunkMisuse("complete_load", b"\x01\x02", "ready", "no load in flight")
    assert isinstance(err, AssertionError) and "complete_load: key 0102 (chunk ready)" in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert (again.call, again.key, again.state, again.reason) == (err.call, err.key, err.state, err.reason)
