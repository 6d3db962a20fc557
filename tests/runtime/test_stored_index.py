"""StoredPageIndex.put_many is a loop of put: the same entries, ages and drops, whatever the batch holds."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from kvfsm.runtime.stored_index import StoredPageIndex

# few distinct hashes, so that batches repeat hashes, re-store old ones and store ones just dropped
_hash = st.sampled_from([f"{i:064x}" for i in range(12)])
_put = st.tuples(_hash, st.sampled_from(["k1", "k2", "k3"]), st.integers(0, 1 << 40))
_batches = st.lists(st.lists(_put, max_size=40), max_size=8)


def _state(index: StoredPageIndex) -> list[tuple[str, tuple[str, int]]]:
    """Everything a reader can see: entries oldest first, with their values."""
    return [(h, index[h]) for h in index]


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(0, 20), batches=_batches)
def test_put_many_equals_a_loop_of_put(limit: int, batches: list[list[tuple[str, str, int]]]) -> None:
    batched, looped = StoredPageIndex(limit), StoredPageIndex(limit)
    for batch in batches:
        batched.put_many([h for h, _, _ in batch], [o for _, o, _ in batch], [p for _, _, p in batch])
        for h, o, p in batch:
            looped.put(h, o, p)
        assert _state(batched) == _state(looped)
        assert len(batched) == len(looped) <= limit


def test_a_batch_longer_than_the_ring_goes_put_by_put() -> None:
    batched, looped = StoredPageIndex(3), StoredPageIndex(3)
    batch = [(f"{i:064x}", "k", i) for i in [0, 1, 2, 3, 4, 0, 5, 1]]
    batched.put_many([h for h, _, _ in batch], [o for _, o, _ in batch], [p for _, _, p in batch])
    for h, o, p in batch:
        looped.put(h, o, p)
    assert _state(batched) == _state(looped) == [(f"{i:064x}", ("k", i)) for i in (0, 5, 1)]


def test_put_many_grows_the_ring_and_then_drops_as_the_loop_does() -> None:
    """Past the first ring (1,024 entries) the batch grows it ahead of time; at the limit it drops."""
    rng = random.Random(0)
    batched, looped = StoredPageIndex(3000), StoredPageIndex(3000)
    for _ in range(40):
        batch = [
            (f"{rng.randrange(4000):064x}", rng.choice("ab"), rng.randrange(1 << 20)) for _ in range(rng.randrange(700))
        ]
        batched.put_many([h for h, _, _ in batch], [o for _, o, _ in batch], [p for _, _, p in batch])
        for h, o, p in batch:
            looped.put(h, o, p)
        assert _state(batched) == _state(looped)
    assert len(batched) == 3000
