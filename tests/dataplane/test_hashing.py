"""Page hashes against an independent hashlib loop and literal digests (SGLang HiCache compatible)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.dataplane import page_hash, page_hashes


def naive(tokens: list[int], page_size: int, prior: str | None = None) -> list[str]:
    """The seed's algorithm, spelled out: per page, sha256(prior bytes, then each id as u32 LE)."""
    out, last = [], prior
    for i in range(0, len(tokens), page_size):
        h = hashlib.sha256()
        if last:
            h.update(bytes.fromhex(last))
        for t in tokens[i : i + page_size]:
            h.update(t.to_bytes(4, byteorder="little", signed=False))
        last = h.hexdigest()
        out.append(last)
    return out


def test_literal_digests() -> None:
    # computed once with the naive loop above and pasted
    assert page_hashes(list(range(8)), 4) == [
        "baed642339816affb3fe8719792d0e4ce82f12db72b7373d244eaa65445800fe",
        "01414b052706d93bd0f1f1646c0e8ca2fa8ef5efd7bcc99f7a1cee8eb11ad052",
    ]
    assert page_hashes([128000, 9906, 11, 1917], 2, "ab" * 32) == [
        "8e0bc85f089400e69b0c1040c5bd258cdf48d284a9a9f49b2352e2954238254f",
        "94acf0372c486c05fa1fcbfff059ea342bc667509f546e82784dacb5458ef6ef",
    ]
    assert page_hash([2**32 - 1]) == "ad95131bc0b799c0b1af477fb14fcf26a6a9f76079e48bf090acb7e8367bfd0e"


@settings(max_examples=100, deadline=None)
@given(
    page_size=st.integers(1, 9),
    pages=st.integers(0, 6),
    data=st.data(),
    prior=st.one_of(st.none(), st.just(""), st.binary(min_size=32, max_size=32).map(bytes.hex)),
)
def test_matches_naive_loop(page_size: int, pages: int, data: st.DataObject, prior: str | None) -> None:
    tokens = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=page_size * pages, max_size=page_size * pages))
    assert page_hashes(tokens, page_size, prior) == naive(tokens, page_size, prior)


def test_input_types_agree() -> None:
    tokens = list(np.random.default_rng(0).integers(0, 2**31, 256))
    want = naive([int(t) for t in tokens], 64)
    assert page_hashes(tokens, 64) == want
    assert page_hashes(np.asarray(tokens, dtype=np.int64), 64) == want
    assert page_hashes(np.asarray(tokens, dtype=np.uint32), 64) == want
    assert page_hashes(torch.tensor([int(t) for t in tokens], dtype=torch.int64), 64) == want
    assert page_hashes(torch.tensor([int(t) for t in tokens], dtype=torch.int32), 64) == want


def test_chaining_splits() -> None:
    tokens = list(range(1000, 1000 + 48))
    whole = page_hashes(tokens, 16)
    first = page_hashes(tokens[:16], 16)
    rest = page_hashes(tokens[16:], 16, prior_hash=first[-1])
    assert first + rest == whole


def test_partial_page_and_bad_ids_raise() -> None:
    with pytest.raises(ValueError):
        page_hashes(list(range(10)), 4)
    with pytest.raises(ValueError):
        page_hashes([1, -2], 2)
    with pytest.raises(ValueError):
        page_hashes(np.array([2**32], dtype=np.int64), 1)
    with pytest.raises(ValueError):
        page_hashes(np.array([1.0, 2.0]), 2)
    with pytest.raises(ValueError):
        page_hashes([1, 2], 0)
    assert page_hashes([], 4) == []


def test_page_runs_hash_lazily_along_the_chain() -> None:
    """A chain of runs, hashed on first use in any order (and from racing threads), equals the eager
    hashes of the concatenated tokens, and a hashed run stops referencing its predecessor."""
    import threading

    from kvfsm.dataplane import PageRun

    tokens = list(range(1000, 1040))
    want = naive(tokens, 4)
    for ask in ([0, 1, 2, 3], [3], [2, 0, 3, 1]):
        seed = PageRun(tokens[:8], 4)
        runs = [seed]
        for lo, hi in [(8, 16), (16, 32), (32, 40)]:
            runs.append(PageRun(tokens[lo:hi], 4, runs[-1]))
        for i in ask:
            runs[i].hashes
        assert [h for r in runs for h in r.hashes] == want
        assert all(not isinstance(r.prior, PageRun) and r.tokens is None for r in runs)
        assert runs[-1].last_hash == want[-1]
    seed = PageRun(tokens[:8], 4, "ab" * 32)
    runs = [seed] + [PageRun(tokens[i:i + 8], 4) for i in range(8, 40, 8)]
    for prev, run in zip(runs, runs[1:]):
        run.prior = prev
    threads = [threading.Thread(target=lambda r=r: r.hashes) for r in reversed(runs) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [h for r in runs for h in r.hashes] == naive(tokens, 4, "ab" * 32)
    assert PageRun([], 4, "cd" * 32).last_hash == "cd" * 32
