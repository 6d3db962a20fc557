"""The manager's storage keys for namespaced and wide-token requests: what a request
stores is `page_hashes(prompt + outputs, page_size, extra_key=..., cache_salt=...)` over the whole page-hash
chain, the prompt's prefill-side prefix included, so a prefill instance that wrote the prompt under
SGLang 0.5.23's keys and this decode side agree. Expected keys come from the public hashing API, whose own
tests (tests/dataplane/test_hashing.py) check it against an independent computation of the algorithm."""

from __future__ import annotations

from typing import Optional

import pytest

from kvfsm.dataplane import page_hashes
from kvfsm.errors import InvalidRequest
from kvfsm.verify.engine import SimEngine, SimRequest


def _run(
    prompt: list[int],
    outputs: int,
    extra_key: Optional[str] = None,
    cache_salt: Optional[str] = None,
    *,
    page_size: int = 2,
    stride: int = 2,
    first_output: int = 7,
    engine: Optional[SimEngine] = None,
) -> tuple[SimEngine, SimRequest]:
    """Admit one request with the given namespace, decode `outputs` tokens offloading after each step, finish
    it and drain: every chunk is stored."""
    e = engine or SimEngine(page_size=page_size, stride=stride, device_slots=64, host_slots=32, max_context=48)
    req = SimRequest("r", list(prompt))
    req.extra_key, req.cache_salt = extra_key, cache_salt
    req.output_ids.append(first_output)
    assert e.admit("", 0, req=req) is req
    for _ in range(outputs):
        assert e.decode(req)
        e.manager.offload(req)
        e.settle()
    e.end(req, "finish")
    e.settle()
    return e, req


def _stored_keys(e: SimEngine) -> list[str]:
    return [h for h, _ in sorted(e.manager.fx.stored.items(), key=lambda kv: kv[1][1])]


def _expected(req: SimRequest, page_size: int, **namespace: Optional[str]) -> list[str]:
    """The whole chain's keys (prompt + outputs but the last, which has no KV yet), minus the prompt's
    page-aligned prefix, which the prefill side stored."""
    tokens = list(req.origin_input_ids) + list(req.output_ids[:-1])
    n = len(tokens) // page_size * page_size
    prefill = len(req.origin_input_ids) // page_size
    return page_hashes(tokens[:n], page_size, **namespace)[prefill:]


@pytest.mark.parametrize(
    "extra_key,cache_salt",
    [(None, None), ("", None), ("tenant-a", None), (None, "salt"), ("lora:7", "s\u00e9l"), ("", "")],
)
@pytest.mark.parametrize("prompt_len", [0, 3, 4])
def test_stored_keys_are_the_namespaced_chain(
    extra_key: Optional[str], cache_salt: Optional[str], prompt_len: int
) -> None:
    e, req = _run([100 + i for i in range(prompt_len)], 9, extra_key, cache_salt)
    got = _stored_keys(e)
    assert got and got == _expected(req, 2, extra_key=extra_key, cache_salt=cache_salt)
    if extra_key is not None or cache_salt is not None:
        assert not set(got) & set(_expected(req, 2)), "a namespaced request stored under the plain chain"
    e.check_teardown()


def test_tenants_with_equal_tokens_never_share_a_key() -> None:
    keys = {}
    for tenant in ("a", "b", None):
        e, _ = _run([5, 6, 7, 8], 8, tenant)
        keys[tenant] = set(_stored_keys(e))
    assert keys["a"] and not keys["a"] & keys["b"] and not keys["a"] & keys[None] and not keys["b"] & keys[None]


def test_wide_token_request_stores_every_chunk() -> None:
    """A page with an id >= 2**32 hashes in the wide encoding; the request's later chunks still store."""
    wide = 2**40 + 3
    e, req = _run([wide, 1, 2, 3], 8, "t", first_output=wide)
    assert e.manager.metrics.backup_failures == 0
    got = _stored_keys(e)
    assert len(got) == 4 and got == _expected(req, 2, extra_key="t")


@pytest.mark.parametrize("field,value", [("extra_key", 5), ("cache_salt", b"salt")])
def test_a_bad_namespace_field_is_refused_before_anything_is_recorded(field: str, value: object) -> None:
    e = SimEngine(page_size=2, stride=2, device_slots=32, host_slots=16)
    req = e.admit("bad", 4)
    setattr(req, field, value)
    assert e.decode(req)
    with pytest.raises(InvalidRequest, match=field):
        e.manager.offload(req)
    assert e.manager.machine_of(req) is None and not e.manager.live_records()
    setattr(req, field, None)  # fixed, the same request offloads and releases normally
    assert e.decode(req) and e.manager.offload(req)
    e.end(req, "finish")
    e.settle()
    e.check_teardown()
