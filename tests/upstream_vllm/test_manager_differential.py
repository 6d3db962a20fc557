"""kvfsm's manager against vLLM 0.34.0's CPUOffloadingManager over random scheduler-ordered call sequences:
LRU and ARC, events on and off, store thresholds 1 and 2, failed stores mixed in, kvfsm checked or not. Every
answer must be equal (lookup results, None or a store output with its keys_to_store, slot ids and evicted keys
in order, load slot ids), and so must the drained event streams and the gauges; after every call kvfsm's
audit (no slot in two chunks, capacity, each chunk's spec invariants, the gauges) finds nothing."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import given, settings, strategies as st
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from driver import Pair, key

from kvfsm.generated.offload_chunk import TRANSITIONS
from kvfsm.integrations.vllm import KvfsmOffloadingManager

REACHED: set[int] = set()  # the chunk transitions the random sequences fired, over every example


def _audit(m: Any) -> None:
    if isinstance(m, KvfsmOffloadingManager):
        assert m.audit() == []


def _gauges(m: Any) -> tuple[int, ...]:
    return (m._num_allocated_chunks, len(m._free_list), m._num_evictable_cache_chunks, m._num_write_pending_chunks)


# scheduler steps most often, then worker reports; new requests (on a few shared key chains, so one request's
# stores are another's hits), event drains and cache resets less often
op = st.tuples(
    st.sampled_from(["step"] * 8 + ["complete"] * 6 + ["request"] * 4 + ["events"] + ["reset"]),
    st.integers(0, 1),
    st.integers(1, 6),
    st.integers(1, 2),
    st.integers(1, 3),
    st.lists(st.integers(0, 7), max_size=1),
    st.integers(0, 50),
    st.sampled_from([True, True, True, False]),
    st.sampled_from([False, False, False, True]),
)


CASES = dict(
    policy=st.sampled_from(["lru", "arc"]),
    events=st.booleans(),
    threshold=st.sampled_from([1, 2]),
    num_chunks=st.integers(1, 8),
    checked=st.booleans(),
    ops=st.lists(op, min_size=10, max_size=80),
)


def same_answers(policy: str, events: bool, threshold: int, num_chunks: int, checked: bool, ops: list) -> None:
    args = dict(cache_policy=policy, enable_events=events, store_threshold=threshold)
    ours = KvfsmOffloadingManager(num_chunks, checked=checked, **args)
    ours.observer = lambda _m, _e, _s, _d, tid: REACHED.add(tid)
    pair = Pair([CPUOffloadingManager(num_chunks, **args), ours], check=_audit)
    for kind, chain, length, groups, storing, finishing, job, success, reoffer in ops:
        if kind == "request" or not pair.requests:
            rid = len(pair.requests)
            pair.new_request(rid, [key(chain, p, g) for p in range(length) for g in range(groups)])
        elif kind == "step":
            live = [rid for rid, r in pair.requests.items() if not r.finished] or [0]
            pair.step({rid: storing for rid in live}, [live[i % len(live)] for i in finishing], reoffer)
        elif kind == "complete" and pair.jobs:
            pair.complete(job, success)
        elif kind == "events":
            pair.events()
        elif kind == "reset":
            pair.reset()
        assert _gauges(pair.managers[0]) == _gauges(ours)
    pair.events()
    while pair.jobs:
        pair.complete(0, True)
    assert _gauges(pair.managers[0]) == _gauges(ours)
    theirs, kvfsm = (m.get_stats() for m in pair.managers)
    assert theirs.data == kvfsm.data


# 120 sequences in CI; the deep fuzz profile (KVFSM_FUZZ=deep, tests/conftest.py) runs its own count
EXAMPLES = 120 if os.environ.get("KVFSM_FUZZ", "ci") == "ci" else settings.default.max_examples
test_kvfsm_answers_every_scheduler_call_as_vllm_does = settings(max_examples=EXAMPLES, deadline=None)(
    given(**CASES)(same_answers)
)


def test_the_random_sequences_fire_every_chunk_transition() -> None:
    """The sequences above are no weaker than the spec: a fixed-seed run of the same test (its examples derived
    from the test, the same on every run) fires every transition of spec/offload_chunk.yaml."""
    REACHED.clear()
    fixed = settings(derandomize=True, max_examples=120, deadline=None, database=None)
    fixed(given(**CASES)(same_answers))()
    assert REACHED == set(range(len(TRANSITIONS))), sorted(set(range(len(TRANSITIONS))) - REACHED)
