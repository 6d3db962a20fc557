"""Tests written to kill survivors of `make mutate` in kvfsm/runtime/config.py, storage_options.py and build.py
(docs/mutation.md)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvfsm.dataplane import DeviceKVPool, KVCacheConfig, page_hashes
from kvfsm.dataplane.storage.process import ProcessStorage
from kvfsm.errors import ConfigError, InputBoundExceeded
from kvfsm.input_limits import ENV_VALUE_LIMITS
from kvfsm.runtime import OffloadConfig
from kvfsm.runtime.build import build_components, close_storage

KV = KVCacheConfig(num_layers=2, kv_heads=1, head_dim=4, attention="mha", dtype=torch.float32)


def _refused(call: Callable[..., object], *args: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        call(*args)
    return info.value


# --- KVFSM_* variables ----------------------------------------------------------------------------------


def test_an_env_value_nested_too_deep_is_refused_naming_the_variable_and_the_bound() -> None:
    """A too-deep KVFSM_* value is a ConfigError naming the field, the variable and the bound, its cause the breach."""
    var = "KVFSM_STORAGE_EXTRA"
    err = _refused(OffloadConfig.from_env, {var: "[" * 17 + "]" * 17})
    assert (err.field, err.source) == ("storage_extra", f"environment ({var})")
    assert err.reason == "the value nests deeper than 16 levels (bound max_depth=16)"
    cause = err.__cause__
    assert isinstance(cause, InputBoundExceeded)
    assert (cause.source, cause.line, cause.bound, cause.limit) == (f"environment ({var})", 1, "max_depth", 16)
    assert str(cause).startswith(f"environment ({var}):1: the value nests deeper")


def test_an_env_value_with_too_many_elements_is_refused_naming_the_variable_and_the_bound() -> None:
    """A KVFSM_* value past max_elements is refused as the value it is, where a near-bound one is taken whole."""
    var = "KVFSM_STORAGE_EXTRA"
    limit = ENV_VALUE_LIMITS.max_elements
    ok = OffloadConfig.from_env({"KVFSM_STORAGE_BACKEND": "none", var: json.dumps({"x": [0] * (limit - 2)})})
    assert len(ok.storage_extra["x"]) == limit - 2  # the mapping, the list and its items: exactly the bound
    big = {"KVFSM_STORAGE_BACKEND": "none", var: json.dumps({"x": [0] * (limit - 1)})}
    err = _refused(OffloadConfig.from_env, big)
    assert (err.field, err.source) == ("storage_extra", f"environment ({var})")
    assert err.reason == f"the value has more than {limit} elements (bound max_elements={limit})"
    cause = err.__cause__
    assert isinstance(cause, InputBoundExceeded)
    assert (cause.source, cause.line, cause.bound) == (f"environment ({var})", 1, "max_elements")


def test_an_env_value_of_exactly_max_bytes_is_taken_and_one_more_is_refused() -> None:
    """max_bytes is the longest value taken: a value of that length is a field's value, one longer a ConfigError."""
    most = ENV_VALUE_LIMITS.max_bytes
    assert OffloadConfig.from_env({"KVFSM_MODEL_NAME": "m" * most}).model_name == "m" * most
    err = _refused(OffloadConfig.from_env, {"KVFSM_MODEL_NAME": "m" * (most + 1)})
    assert (err.field, err.source) == ("model_name", "environment (KVFSM_MODEL_NAME)")
    assert f"(bound max_bytes={most})" in err.reason


# --- config files ---------------------------------------------------------------------------------------


def test_a_config_path_that_is_no_regular_file_is_refused_as_the_offload_config(tmp_path: Path) -> None:
    """A directory given as the config file is refused at once, saying it is the offload config that is no file."""
    err = _refused(OffloadConfig.from_file, tmp_path)
    assert (err.field, err.source, err.reason) == (None, str(tmp_path), "offload config is not a regular file")


def test_a_config_file_that_is_not_utf8_is_refused_at_its_line(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 are refused naming the file, the line they are on and what the file is."""
    cfg = tmp_path / "offload.yaml"
    cfg.write_bytes(b"page_size: 4\nmodel_name: caf\xe9\n")
    err = _refused(OffloadConfig.from_file, cfg)
    assert (err.field, err.source) == (None, f"{cfg}:2")
    assert err.reason.startswith("offload config is not UTF-8: ")


def test_a_json_config_nested_too_deep_is_refused_at_the_line_of_the_breach(tmp_path: Path) -> None:
    """A JSON config nested past the bound is refused naming the file and the line where the bound is crossed."""
    js = tmp_path / "offload.json"
    js.write_text('{\n"page_size": 4,\n"storage_extra": {"x": ' + "[" * 16 + "]" * 16 + "}\n}\n")
    err = _refused(OffloadConfig.from_file, js)
    assert (err.field, err.source) == (None, f"{js}:3")
    assert err.reason == "offload config nests deeper than 16 levels (bound max_depth=16)"
    first = tmp_path / "first.json"
    first.write_text("[" * 17 + "]" * 17)
    assert _refused(OffloadConfig.from_file, first).source == f"{first}:1"


def test_a_json_config_with_too_many_elements_is_refused_naming_the_file_and_the_bound(tmp_path: Path) -> None:
    """A JSON config of more values than the bound is refused (file:1, the bound), nothing built from it."""
    js = tmp_path / "offload.json"
    js.write_text(json.dumps({"storage_backend": "none", "storage_extra": {"x": [0] * 10_000}}))
    err = _refused(OffloadConfig.from_file, js)
    assert (err.field, err.source) == (None, f"{js}:1")
    assert err.reason == "offload config has more than 10000 elements (bound max_elements=10000)"


def test_a_config_file_key_that_is_no_string_is_refused_as_a_key(tmp_path: Path) -> None:
    """A YAML key that is not a string (a number) is refused as a key of the file, not taken as a field."""
    cfg = tmp_path / "offload.yaml"
    cfg.write_text("page_size: 4\n1: 2\n")
    err = _refused(OffloadConfig.from_file, cfg)
    assert (err.field, err.source) == (None, str(cfg))
    assert err.reason == "offload config keys must be field names, got 1"


# --- storage_extra ----------------------------------------------------------------------------------------


def test_a_page_dims_triple_in_storage_extra_is_taken_for_the_file_store(tmp_path: Path) -> None:
    """FileStorage's page_dims (tuple[int, int, int] | None) may be given: left to the constructor, no TypeError."""
    cfg = tmp_path / "offload.yaml"
    cfg.write_text("storage_extra:\n  page_dims: [2, 4, 8]\n")
    assert OffloadConfig.from_file(cfg).storage_extra == {"page_dims": [2, 4, 8]}
    assert OffloadConfig(storage_extra={"page_dims": (2, 4, 8)}).storage_extra == {"page_dims": (2, 4, 8)}


# --- building -----------------------------------------------------------------------------------------------


def test_storage_process_shares_the_built_host_pool_with_the_store_process(tmp_path: Path) -> None:
    """With storage_process the host pool the manager builds is shared (the child reads pages in place)."""
    shared = OffloadConfig(page_size=4, storage_dir=tmp_path, storage_process=True, copy_backend="cpu")
    built = build_components(shared, device_pool=DeviceKVPool.create(KV, 32))
    try:
        pool = built.host_pool
        assert pool.share_fd is not None and built.owns_storage
        pages = pool.allocator.alloc_pages(1)
        assert pages is not None
        slots = pool.page_slots(pages)
        pool.set_pages_bytes(slots, torch.arange(pool.page_nbytes, dtype=torch.uint8).view(1, -1))
        keys = page_hashes([1, 2, 3, 4], 4)
        store = built.storage
        assert isinstance(store, ProcessStorage) and store.batch_set_from_host(keys, pool, slots) == [True]
        [page] = store.batch_get(keys)
        assert page is not None and torch.equal(page, pool.get_pages_bytes(slots)[0])
    finally:
        close_storage(built.storage)
    in_process = OffloadConfig(page_size=4, storage_dir=tmp_path, copy_backend="cpu")
    plain = build_components(in_process, device_pool=DeviceKVPool.create(KV, 32))
    close_storage(plain.storage)
    assert plain.host_pool.share_fd is None


def test_an_option_hint_richer_than_a_class_is_left_to_the_constructor() -> None:
    """A hint that is neither a class nor a union of them (a typing generic, a Literal) is not checked here, on
    any Python: isinstance() would refuse it as its second argument, so a config naming such an option must reach
    the backend's constructor, which checks it."""
    import typing

    from kvfsm.runtime.storage_options import _accepts

    assert _accepts(typing.Sequence[int], [1, 2]) and _accepts(typing.Literal["a", "b"], "c")
    assert _accepts(tuple[int, int, int], [2, 4, 8]) and not _accepts(str, 5)
