"""Page hashes against an independent hashlib loop and literal digests (SGLang 0.5.23 HiCache compatible).

The references here are written from the algorithm (docs and kvfsm/dataplane/hashing.py's module doc), with
hashlib and int.to_bytes only: u32 LE pages, the 0xff-tagged u64 LE wide page, and the namespace seed.
tests/upstream/ checks the same against SGLang itself."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvfsm.dataplane import page_hash, page_hashes
from kvfsm.dataplane.hashing import PageRun, request_namespace, storage_namespace_seed


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
        page_hashes(np.array([2**63], dtype=np.uint64), 1)  # 2**32 and up is a wide page; past int64 is not
    with pytest.raises(ValueError):
        page_hashes(np.array([1.0, 2.0]), 2)
    for flags in (np.array([True, False]), torch.tensor([True, False])):  # a bool array is no token ids
        with pytest.raises(ValueError, match="integers"):
            page_hashes(flags, 2)
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
            _ = runs[i].hashes  # computed on first access: in the order `ask` gives
        assert [h for r in runs for h in r.hashes] == want
        assert all(not isinstance(r.prior, PageRun) and r.tokens is None for r in runs)
        assert runs[-1].last_hash == want[-1]
    seed = PageRun(tokens[:8], 4, "ab" * 32)
    runs = [seed] + [PageRun(tokens[i : i + 8], 4) for i in range(8, 40, 8)]
    for prev, run in zip(runs, runs[1:]):
        run.prior = prev
    threads = [threading.Thread(target=lambda r=r: r.hashes) for r in reversed(runs) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [h for r in runs for h in r.hashes] == naive(tokens, 4, "ab" * 32)
    assert PageRun([], 4, "cd" * 32).last_hash == "cd" * 32


# ---- namespaces and wide tokens (SGLang 0.5.23) ----------------------------------------------------------
def ref_seed(extra_key: str | None, cache_salt: str | None) -> str | None:
    """The namespace seed from its definition: domain tag, then per part absent / present + u64 length + UTF-8."""
    if extra_key is None and cache_salt is None:
        return None
    data = b"sglang-cache-namespace-v1"
    for part in (extra_key, cache_salt):
        if part is None:
            data += b"\x00"
        else:
            enc = part.encode("utf-8")
            data += b"\x01" + len(enc).to_bytes(8, "little") + enc
    return hashlib.sha256(data).hexdigest()


def ref_chain(
    tokens: list[int],
    page_size: int,
    prior: str | None = None,
    extra_key: str | None = None,
    cache_salt: str | None = None,
) -> list[str]:
    """Per page: sha256(prior ‖ ids as u32 LE), or sha256(prior ‖ 0xff ‖ ids as u64 LE) if any id >= 2**32;
    the first page's prior is `prior`, else the namespace seed, else nothing."""
    last = prior or ref_seed(extra_key, cache_salt)
    out = []
    for i in range(0, len(tokens), page_size):
        page = tokens[i : i + page_size]
        data = bytes.fromhex(last) if last else b""
        if any(t >= 2**32 for t in page):
            data += b"\xff" + b"".join(t.to_bytes(8, "little") for t in page)
        else:
            data += b"".join(t.to_bytes(4, "little") for t in page)
        last = hashlib.sha256(data).hexdigest()
        out.append(last)
    return out


NAMESPACE_PARTS = [None, "", "a", "tenant-42", "ünïcödé 日本語", "a\x00b"]


def test_namespace_seed_literals() -> None:
    assert storage_namespace_seed(None, None) is None
    # spelled out once by hand (hashlib on the literal byte strings), then pasted
    assert (
        storage_namespace_seed("", None)
        == hashlib.sha256(b"sglang-cache-namespace-v1" + b"\x01" + bytes(8) + b"\x00").hexdigest()
    )
    assert (
        storage_namespace_seed(None, "salt")
        == hashlib.sha256(b"sglang-cache-namespace-v1\x00\x01\x04\x00\x00\x00\x00\x00\x00\x00salt").hexdigest()
    )
    assert (
        storage_namespace_seed("é", "")
        == hashlib.sha256(
            b"sglang-cache-namespace-v1\x01\x02" + bytes(7) + "é".encode() + b"\x01" + bytes(8)
        ).hexdigest()
    )


@pytest.mark.parametrize("extra_key", NAMESPACE_PARTS)
@pytest.mark.parametrize("cache_salt", NAMESPACE_PARTS)
def test_namespace_seed_matches_reference(extra_key: str | None, cache_salt: str | None) -> None:
    assert storage_namespace_seed(extra_key, cache_salt) == ref_seed(extra_key, cache_salt)
    tokens = list(range(7, 7 + 12))
    want = ref_chain(tokens, 4, None, extra_key, cache_salt)
    assert page_hashes(tokens, 4, extra_key=extra_key, cache_salt=cache_salt) == want
    assert page_hashes(tokens, 4, "", extra_key=extra_key, cache_salt=cache_salt) == want  # "" is no prior
    seed = ref_seed(extra_key, cache_salt)
    assert page_hashes(tokens, 4, seed) == want  # the seed is exactly a prior digest
    if seed is not None:
        assert want != ref_chain(tokens, 4)  # a namespace changes every key


def test_namespace_parts_are_separated() -> None:
    seeds = {storage_namespace_seed(e, c) for e in NAMESPACE_PARTS for c in NAMESPACE_PARTS}
    assert len(seeds) == len(NAMESPACE_PARTS) ** 2  # None, "" and joins never collide
    assert storage_namespace_seed("ab", None) != storage_namespace_seed("a", "b")
    assert storage_namespace_seed("", None) != storage_namespace_seed(None, "")


def test_prior_takes_precedence_over_namespace() -> None:
    tokens = list(range(8))
    prior = "cd" * 32
    assert page_hashes(tokens, 4, prior, extra_key="x", cache_salt="y") == ref_chain(tokens, 4, prior)


def test_request_namespace_normalises_like_sglang_req() -> None:
    assert request_namespace() == (None, None)
    assert request_namespace(None, "") == (None, None)  # cache_salt "" -> None
    assert request_namespace("", None) == ("", None)  # extra_key "" kept
    assert request_namespace(None, None, "lora1") == ("lora1", None)
    assert request_namespace("ek", "s", "lora1") == ("eklora1", "s")
    assert request_namespace(None, None, "") == ("", None)  # an empty LoRA id still makes extra_key ""
    assert storage_namespace_seed(*request_namespace(None, "")) is None
    assert storage_namespace_seed(*request_namespace("ek", "", "L")) == ref_seed("ekL", None)
    with pytest.raises(TypeError, match="lora_id"):
        request_namespace(None, None, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cache_salt"):
        storage_namespace_seed(None, b"salt")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="extra_key"):
        storage_namespace_seed("\ud800", None)


def test_wide_tokens() -> None:
    tokens = [1, 2**32, 3, 4]
    want = ref_chain(tokens, 2)
    assert page_hashes(tokens, 2) == want
    # only the page holding the wide id is wide: page 2 hashes as u32 after a wide page 1
    assert want[0] == hashlib.sha256(b"\xff" + (1).to_bytes(8, "little") + (2**32).to_bytes(8, "little")).hexdigest()
    assert (
        want[1]
        == hashlib.sha256(bytes.fromhex(want[0]) + (3).to_bytes(4, "little") + (4).to_bytes(4, "little")).hexdigest()
    )
    assert page_hashes(np.array(tokens, dtype=np.int64), 2) == want
    assert page_hashes(np.array(tokens, dtype=np.uint64), 2) == want
    assert page_hashes(torch.tensor(tokens, dtype=torch.int64), 2) == want
    top = [2**63 - 1]
    assert page_hash(top) == hashlib.sha256(b"\xff" + top[0].to_bytes(8, "little")).hexdigest()
    assert page_hashes([2**32], 1, extra_key="t") == ref_chain([2**32], 1, None, "t")
    # a wide page never collides with the u32 page of the same low words
    assert page_hash([2**32 + 5]) != page_hash([5])


@pytest.mark.parametrize("bad, pos", [([1, -1], 1), ([2**63, 0], 0), ([0, 0, 2**64 - 1], 2), ([0, 2**70], 1)])
def test_out_of_range_ids_name_value_and_position(bad: list[int], pos: int) -> None:
    ps = len(bad)
    with pytest.raises(ValueError, match=rf"token id {bad[pos]} at position {pos}"):
        page_hashes(bad, ps)
    if bad[pos] < 2**64 and bad[pos] >= 0:
        with pytest.raises(ValueError, match=rf"token id {bad[pos]} at position {pos}"):
            page_hashes(np.array(bad, dtype=np.uint64), ps)
    if -(2**63) <= bad[pos] < 0:
        with pytest.raises(ValueError, match=rf"at position {pos}"):
            page_hashes(torch.tensor(bad, dtype=torch.int64), ps)


def test_bad_prior_and_namespace_raise() -> None:
    for prior in ["ab", "zz" * 32, "ab" * 31 + " a", "ab" * 33]:
        with pytest.raises(ValueError, match="prior_hash"):
            page_hashes([1], 1, prior)
    with pytest.raises(ValueError, match="namespace"):
        PageRun([1], 1, namespace="nothex")
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1], 1.0)  # type: ignore[arg-type]


def test_empty_inputs() -> None:
    assert page_hashes([], 4, extra_key="t", cache_salt="s") == []
    assert page_hashes(np.array([], dtype=np.int64), 4) == []
    assert page_hashes([], 4, "ab" * 32) == []


def test_page_runs_carry_the_namespace() -> None:
    """Lazy runs with a namespace give page_hashes' namespaced keys, whichever run holds it and even when the
    chain starts with an empty run (a request with no prompt pages)."""
    tokens = list(range(100, 124))
    seed = storage_namespace_seed("tenant", "salt")
    want = ref_chain(tokens, 4, None, "tenant", "salt")
    first = PageRun(tokens[:8], 4, namespace=seed)
    second = PageRun(tokens[8:], 4, first)
    assert first.hashes + second.hashes == want
    empty = PageRun([], 4, namespace=seed)
    assert empty.last_hash == seed
    assert PageRun(tokens, 4, empty).hashes == want
    every = PageRun(tokens[:4], 4, None, namespace=seed)
    rest = PageRun(tokens[4:], 4, every, namespace=seed)  # a namespace on a linked run is unused
    assert rest.hashes and every.hashes + rest.hashes == want
    assert PageRun(tokens, 4, "ab" * 32, namespace=seed).hashes == ref_chain(tokens, 4, "ab" * 32)
    assert PageRun([], 4).last_hash is None


@settings(max_examples=150, deadline=None)
@given(
    page_size=st.integers(1, 6),
    pages=st.integers(0, 5),
    data=st.data(),
    prior=st.one_of(st.none(), st.just(""), st.binary(min_size=32, max_size=32).map(bytes.hex)),
    extra_key=st.one_of(st.none(), st.text(max_size=6)),
    cache_salt=st.one_of(st.none(), st.text(max_size=6)),
)
def test_matches_reference_with_namespace_and_wide_ids(
    page_size: int, pages: int, data: st.DataObject, prior: str | None, extra_key: str | None, cache_salt: str | None
) -> None:
    ids = st.one_of(st.integers(0, 2**32 - 1), st.integers(2**32, 2**63 - 1), st.sampled_from([0, 2**32 - 1, 2**32]))
    tokens = data.draw(st.lists(ids, min_size=page_size * pages, max_size=page_size * pages))
    try:
        ref_seed(extra_key, cache_salt)
    except UnicodeEncodeError:
        with pytest.raises(ValueError):
            page_hashes(tokens, page_size, None, extra_key=extra_key, cache_salt=cache_salt)
        return
    want = ref_chain(tokens, page_size, prior, extra_key, cache_salt)
    assert page_hashes(tokens, page_size, prior, extra_key=extra_key, cache_salt=cache_salt) == want
    assert (
        page_hashes(np.array(tokens, dtype=np.uint64), page_size, prior, extra_key=extra_key, cache_salt=cache_salt)
        == want
    )
    # any split into two lazy runs gives the same keys
    cut = data.draw(st.integers(0, pages)) * page_size
    seed = storage_namespace_seed(extra_key, cache_salt)
    head = PageRun(tokens[:cut], page_size, prior or None, namespace=seed)
    assert head.hashes + PageRun(tokens[cut:], page_size, head).hashes == want
