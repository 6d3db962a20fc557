"""kvfsm's storage keys are bit-identical with the keys upstream SGLang 0.5.23's decode offload writes.

Upstream's side is its own code: the manager's `_compute_prefix_hash` (called unbound on a stand-in that
has only what it reads), which chains the native C++ `get_hash_str` from `prior or
storage_namespace_seed(req.extra_key, req.cache_salt)`, and `Req.__init__` for the normalisation of
`extra_key` / `cache_salt` / `lora_id`.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
from hypothesis import given, strategies as st
from sglang.srt.disaggregation.decode_kvcache_offload_manager import DecodeKVCacheOffloadManager
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed as upstream_seed
from sglang.srt.sampling.sampling_params import SamplingParams

import harness  # noqa: F401  (installs the CUDA-only replacements before sglang is imported)

from kvfsm.dataplane.hashing import page_hashes, storage_namespace_seed

I64_MAX = 2**63 - 1


def upstream_keys(tokens, page_size, prior=None, extra_key=None, cache_salt=None) -> list[str]:
    manager = SimpleNamespace(page_size=page_size, cache_controller=SimpleNamespace(get_hash_str=get_hash_str))
    req = SimpleNamespace(extra_key=extra_key, cache_salt=cache_salt)
    return DecodeKVCacheOffloadManager._compute_prefix_hash(manager, req, list(tokens), prior or "")


def upstream_req_namespace(extra_key, cache_salt, lora_id):
    req = Req("r", "", array("q", [1]), SamplingParams(), extra_key=extra_key, cache_salt=cache_salt, lora_id=lora_id)
    return req.extra_key, req.cache_salt


PRIOR = "ab" * 32
CASES = {
    "plain": (list(range(1, 17)), 4, None, None, None),
    "one page": ([7, 8, 9, 10], 4, None, None, None),
    "page size 1": ([3, 1, 4, 1, 5], 1, None, None, None),
    "chained": (list(range(100, 116)), 8, PRIOR, None, None),
    "chained ignores namespace": (list(range(100, 116)), 8, PRIOR, "tenant", "salt"),
    "extra_key": (list(range(1, 9)), 4, None, "tenant-a", None),
    "cache_salt": (list(range(1, 9)), 4, None, None, "s3cret"),
    "both": (list(range(1, 9)), 4, None, "tenant-a", "s3cret"),
    "empty extra_key": (list(range(1, 9)), 4, None, "", None),
    "empty both": (list(range(1, 9)), 4, None, "", ""),
    "utf8": (list(range(1, 9)), 4, None, "tenant-ü", "ß"),
    "wide page": ([1, 2, 2**32, 4, 5, 6, 7, 8], 4, None, None, None),
    "wide max": ([I64_MAX, 0, 2**32 - 1, 2**32], 2, None, None, None),
    "wide namespaced": ([2**40] * 8, 4, None, "t", None),
    "just below wide": ([2**32 - 1] * 8, 4, None, None, None),
    "zeros": ([0] * 16, 16, None, None, None),
    "empty": ([], 4, None, None, None),
    "empty namespaced": ([], 4, None, "t", "s"),
    "page 64": (list(range(5, 5 + 128)), 64, None, None, None),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_page_hashes_match_upstream(case: str) -> None:
    tokens, ps, prior, extra_key, cache_salt = CASES[case]
    ours = page_hashes(tokens, ps, prior, extra_key=extra_key, cache_salt=cache_salt)
    assert ours == upstream_keys(tokens, ps, prior, extra_key, cache_salt)


@pytest.mark.parametrize(
    "parts", [(None, None), ("", None), (None, ""), ("", ""), ("a", "b"), ("ab", None), (None, "ab"), ("ü", "日本")]
)
def test_namespace_seed_matches_upstream(parts) -> None:
    assert storage_namespace_seed(*parts) == upstream_seed(*parts)


@pytest.mark.parametrize("bad", [-1, 2**63, 2**64])
def test_out_of_range_ids_are_rejected_by_both(bad: int) -> None:
    tokens = [1, 2, bad, 4]
    with pytest.raises(Exception):  # noqa: B017 - whatever upstream's native hash raises; kvfsm's is below
        upstream_keys(tokens, 4)
    with pytest.raises(ValueError):
        page_hashes(tokens, 4)


def test_request_normalisation_matches_upstream_req() -> None:
    from kvfsm.dataplane.hashing import request_namespace

    for extra_key in (None, "", "k"):
        for cache_salt in (None, "", "s"):
            for lora_id in (None, "", "lora7"):
                assert request_namespace(extra_key, cache_salt, lora_id) == upstream_req_namespace(
                    extra_key, cache_salt, lora_id
                ), (extra_key, cache_salt, lora_id)


_ids = st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 2**16), st.integers(2**32, I64_MAX))
_names = st.one_of(st.none(), st.text(max_size=12))


@given(
    page_size=st.integers(1, 16),
    data=st.data(),
    prior=st.one_of(st.none(), st.binary(min_size=32, max_size=32).map(bytes.hex)),
    extra_key=_names,
    cache_salt=_names,
)
def test_random_inputs_match_upstream(page_size, data, prior, extra_key, cache_salt) -> None:
    n_pages = data.draw(st.integers(0, 5))
    wide = data.draw(st.booleans())
    ids = _ids if wide else st.integers(0, 2**32 - 1)
    tokens = data.draw(st.lists(ids, min_size=n_pages * page_size, max_size=n_pages * page_size))
    ours = page_hashes(tokens, page_size, prior, extra_key=extra_key, cache_salt=cache_salt)
    assert ours == upstream_keys(tokens, page_size, prior, extra_key, cache_salt)
    assert storage_namespace_seed(extra_key, cache_salt) == upstream_seed(extra_key, cache_salt)
