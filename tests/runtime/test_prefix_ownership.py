"""A request's matched prefix belongs to the prefix cache (SGLang 0.5.23's cache_protected_len): admission
takes only whole pages of the prompt, release frees the request's own pages and unlocks the prefix, and the
checked ledger refuses a free of a prefix page (B16)."""

from __future__ import annotations

import numpy as np
import pytest

from kvfsm.errors import InvalidRequest
from kvfsm.runtime.ledger import CheckedModeError
from kvfsm.verify.engine import SimEngine


@pytest.mark.parametrize("prefix", [1, 3, 6, -2, 2.0, "2", None])
def test_a_prefix_that_is_not_whole_pages_of_the_prompt_is_refused_before_anything_changes(prefix) -> None:
    e = SimEngine(page_size=2, stride=2, device_slots=32, host_slots=16)
    req = e.admit("a", 4)
    req.prefix_len = prefix
    assert e.decode(req)
    with pytest.raises(InvalidRequest, match="prefix_len"):
        e.manager.offload(req)
    assert e.manager.machine_of(req) is None


def test_an_integer_scalar_prefix_is_accepted_and_only_the_own_pages_are_freed() -> None:
    e = SimEngine(page_size=2, stride=2, device_slots=32, host_slots=16)
    req = e.admit("a", 5, prefix_len=4)
    prefix_slots = set(e.req_to_token.read_host(req.req_pool_idx, 0, 4).tolist())
    req.prefix_len = np.int64(4)
    for _ in range(3):
        assert e.decode(req)
        e.manager.offload(req)
    freed: list[int] = []
    real_free = e.allocator.free
    e.allocator.free = lambda idx: (freed.append(sorted(np.asarray(idx).tolist())), real_free(idx))[1]
    e.end(req)
    e.settle()
    # the manager frees the request's own pages; then the cache, unlocked, evicts the prefix's
    assert len(freed) == 2 and not prefix_slots & set(freed[0]) and set(freed[1]) == prefix_slots
    assert e.protected.size == 0 and e.protected.locked_pages() == set()  # unlocked, exactly once


def test_the_ledger_owns_prefix_pages_as_the_caches() -> None:
    e = SimEngine(page_size=2, stride=2, device_slots=32, host_slots=16)  # checked mode
    req = e.admit("a", 4, prefix_len=2)
    e.manager.offload(req)  # admits the lifecycle: the ledger learns its prefix pages
    page = int(e.req_to_token.read_host(req.req_pool_idx, 0, 1)[0]) // 2
    with pytest.raises(CheckedModeError, match="B16"):
        e.manager.ledger.release_device("someone", "release", [page * 2])
