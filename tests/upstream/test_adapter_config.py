"""kvfsm's SGLang adapter is configured as upstream's manager from SGLang's published server config, refuses
what it cannot do with a typed error naming the setting, and answers the scheduler's other calls as upstream.

Each check builds upstream's manager and the adapter over the same SGLang objects (`harness.build_pools`,
a `RadixCache`) under the same published config, or asserts the adapter's `ConfigError`.
"""

from __future__ import annotations

import json
import os
import pickle
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.unified_memory_pool import UnifiedSWAKVPool
from sglang.srt.runtime_context import get_context, get_parallel

import harness
from scenarios import BY_NAME, ReqSpec, Scenario
from test_differential import ProbedAdapter, _run

from kvfsm.dataplane import FileStorage
from kvfsm.dataplane.storage.process import CHILD_FILE_WRITERS
from kvfsm.errors import ConfigError, InvalidRequest
from kvfsm.integrations.sglang import DecodeKVCacheOffloadManager, RequestViews

SC = Scenario(name="config", page_size=4, requests=(ReqSpec("a", tuple(range(1, 10)), decode=9),))


@contextmanager
def published(sc: Scenario, store: str, stride: str | None = None, **fields: Any) -> Iterator[None]:
    """harness.published's server config, with `fields` changed."""
    args = dict(
        page_size=sc.page_size,
        tp_size=1,
        hicache_storage_backend="file",
        hicache_io_backend="direct",
        hicache_mem_layout="layer_first",
        hicache_ratio=sc.host_ratio,
        served_model_name=harness.MODEL,
        hicache_storage_backend_extra_config=json.dumps({"file_storage_path": store}),
    )
    args.update(fields)
    override = get_context().override_server_args(**args)
    override.install()
    get_parallel().override_permanently(tp_rank=0, pp_rank=0, attn_dcp_rank=0)
    old = os.environ.pop(harness.STRIDE_ENV, None)
    if stride is not None:
        os.environ[harness.STRIDE_ENV] = stride
    try:
        yield
    finally:
        os.environ.pop(harness.STRIDE_ENV, None)
        if old is not None:
            os.environ[harness.STRIDE_ENV] = old
        override.restore()


def build(cls: type, sc: Scenario = SC, allocator: Any = None) -> Any:
    r2t, _, alloc = harness.build_pools(sc)
    tree = RadixCache(
        CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=sc.page_size)
    )
    return cls(
        req_to_token_pool=r2t,
        token_to_kv_pool_allocator=allocator or alloc,
        tp_group=harness._tp_group_world1(),
        tree_cache=tree,
    )


def _close(mgr: Any) -> None:
    if isinstance(mgr, harness.UpstreamManager):
        harness.UpstreamProbe().close(mgr)
    else:
        mgr.manager.close()


@pytest.mark.parametrize("stride", [None, "", "0", "-3", "3", "4", "5", "8", "10", "64"])
def test_stride_is_read_and_rounded_as_upstream(stride: str | None) -> None:
    with tempfile.TemporaryDirectory() as store, published(SC, store, stride=stride):
        up, mine = build(harness.UpstreamManager), build(DecodeKVCacheOffloadManager)
        assert mine.offload_stride == up.offload_stride and mine.page_size == up.page_size == 4
        assert mine.tp_world_size == up.tp_world_size == 1
        _close(up), _close(mine)


@pytest.mark.parametrize("sizing", [dict(hicache_ratio=2.0), dict(hicache_ratio=0.3), dict(hicache_size=1)])
@pytest.mark.parametrize("pool", ["mha", "mla"])
def test_host_pool_holds_as_many_tokens_as_upstreams(sizing: dict, pool: str) -> None:
    sc = Scenario(name="sizing", page_size=4, pool=pool, requests=SC.requests)
    with tempfile.TemporaryDirectory() as store, published(sc, store, **sizing):
        if "hicache_size" in sizing:  # 1 GB of these tiny pages is a big buffer: compare sizes, allocate less
            up_size = _upstream_host_tokens(sc, sizing)
            mine = build(DecodeKVCacheOffloadManager, sc)
            assert mine.decode_host_mem_pool.capacity == up_size
            _close(mine)
            return
        up, mine = build(harness.UpstreamManager, sc), build(DecodeKVCacheOffloadManager, sc)
        host = up.decode_host_mem_pool
        assert mine.decode_host_mem_pool.capacity == host.size == host.available_size()
        _close(up), _close(mine)


def _upstream_host_tokens(sc: Scenario, sizing: dict) -> int:
    """Upstream's formula (`HostKVCache.__init__`), for a size too large to build twice here."""
    per_token = 2 * sc.layers * sc.heads * sc.head_dim * 4 if sc.pool == "mha" else sc.layers * 3 * sc.head_dim * 4
    tokens = int(sizing["hicache_size"] * 1e9 // per_token)
    return (tokens // sc.page_size + 1) * sc.page_size


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_other_host_layouts_store_sglangs_page_files(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under --hicache-mem-layout page_first (SGLang's default) and page_first_direct the adapter behaves as
    under layer_first, and its page files hold the bytes in that layout's order: page_first_direct's are
    layer_first's, page_first's are `(2, T, L, H, D)` (MLA `(T, L, 1, D)`), the order SGLang's page_first
    host pool reads (tests/upstream/test_l3_interop.py checks kvfsm's FileStorage against upstream's there).
    Upstream's own manager cannot run these layouts on a CPU (its transfers are sgl_kernel's CUDA ops), so
    the reference is upstream's layer_first run."""

    @contextmanager
    def with_layout(sc: Scenario, rank: int, store_dir: str) -> Iterator[None]:
        with published(sc, store_dir, stride=None if sc.stride is None else str(sc.stride), hicache_mem_layout=layout):
            yield

    names = ("plain-p4-s8", "mla")
    reference = {name: _run(BY_NAME[name], harness.UpstreamManager)[0] for name in names}  # layer_first
    monkeypatch.setattr(harness, "published", with_layout)
    for name in names:
        sc, up = BY_NAME[name], reference[name]
        (mine,) = harness.run_scenario(sc, ProbedAdapter)
        assert [d for d in harness.diff_runs([up], [mine]) if "stored bytes" not in d] == []
        assert up.stored.keys() == mine.stored.keys() and up.stored
        for key, data in up.stored.items():
            want = data if layout == "page_first_direct" else _page_first(sc, data)
            assert mine.stored[key] == want, key


def _page_first(sc: Scenario, layer_first: bytes) -> bytes:
    page = torch.frombuffer(bytearray(layer_first), dtype=harness.DTYPE)
    ps, layers = sc.page_size, sc.layers
    if sc.pool == "mha":
        return page.view(2, layers, ps, sc.heads, sc.head_dim).permute(0, 2, 1, 3, 4).contiguous().numpy().tobytes()
    return page.view(layers, ps, 1, -1).permute(1, 0, 2, 3).contiguous().numpy().tobytes()


def test_hybrid_swa_pool_is_refused_naming_it() -> None:
    swa = object.__new__(UnifiedSWAKVPool)
    fake = SimpleNamespace(get_kvcache=lambda: swa, page_size=4, device="cpu")
    with tempfile.TemporaryDirectory() as store, published(SC, store):
        with pytest.raises(ConfigError, match="UnifiedSWAKVPool"):
            build(DecodeKVCacheOffloadManager, allocator=fake)


def test_other_kv_pools_are_refused() -> None:
    fake = SimpleNamespace(get_kvcache=lambda: object(), page_size=4, device="cpu")
    with tempfile.TemporaryDirectory() as store, published(SC, store):
        with pytest.raises(ConfigError, match="unsupported KV cache type for decode offload: object"):
            build(DecodeKVCacheOffloadManager, allocator=fake)


def test_pool_and_table_on_different_devices_are_refused() -> None:
    """The KV pool and req_to_token must share a device (here the table on the meta device, which has no
    data): the slots the manager reads on the table's device index the pool's buffers."""
    with tempfile.TemporaryDirectory() as store, published(SC, store):
        r2t, kv, alloc = harness.build_pools(SC)
        r2t.req_to_token = r2t.req_to_token.to("meta")
        with pytest.raises(ConfigError, match="both must be on one device"):
            DecodeKVCacheOffloadManager(
                req_to_token_pool=r2t,
                token_to_kv_pool_allocator=alloc,
                tp_group=harness._tp_group_world1(),
                tree_cache=None,
            )


def test_fp8_and_mixed_buffers_are_refused() -> None:
    with tempfile.TemporaryDirectory() as store, published(SC, store):
        r2t, kv, alloc = harness.build_pools(SC)
        kv.v_buffer = [b.to(torch.uint8) for b in kv.v_buffer]
        with pytest.raises(ConfigError, match="float32"):
            DecodeKVCacheOffloadManager(
                req_to_token_pool=r2t,
                token_to_kv_pool_allocator=alloc,
                tp_group=harness._tp_group_world1(),
                tree_cache=None,
            )


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(hicache_storage_backend="mooncake"), "hicache_storage_backend: 'mooncake'"),
        (dict(hicache_storage_backend=None), "hicache_storage_backend: None"),
        (dict(hicache_storage_backend_extra_config="{not json"), "hicache_storage_backend_extra_config: invalid JSON"),
        (dict(hicache_storage_backend_extra_config="[1]"), "must be a JSON object"),
        (dict(hicache_mem_layout="page_head"), "hicache_mem_layout: 'page_head'"),
    ],
)
def test_unsupported_server_settings_are_config_errors(fields: dict, match: str) -> None:
    with tempfile.TemporaryDirectory() as store, published(SC, store, **fields):
        with pytest.raises(ConfigError, match=match):
            build(DecodeKVCacheOffloadManager)


def test_kvfsm_store_process_runs_the_store_in_a_child_process() -> None:
    """kvfsm's own key in the extra config: true builds a shared host pool and a ProcessStorage, which the
    shutdown ends; anything but a bool is a ConfigError naming the key."""
    from kvfsm.dataplane.storage import ProcessStorage

    with tempfile.TemporaryDirectory() as store:
        extra = json.dumps({"file_storage_path": store, "kvfsm_store_process": True})
        with published(SC, store, hicache_storage_backend_extra_config=extra):
            mine = build(DecodeKVCacheOffloadManager)
        storage = mine._storage
        assert isinstance(storage, ProcessStorage) and storage.pid is not None
        assert mine.manager.host_pool.share_fd is not None and mine.manager.fx.storage is storage
        # the child's FileStorage runs CHILD_FILE_WRITERS writers (in-process the adapter keeps one: they would
        # take the scheduler's interpreter lock)
        assert pickle.loads(storage._factory).keywords["writers"] == CHILD_FILE_WRITERS > 1
        with published(SC, store):
            plain = build(DecodeKVCacheOffloadManager)
        assert isinstance(plain._storage, FileStorage) and plain._storage.writers == 1
        plain.release_host_resources()
        mine.release_host_resources()
        assert storage.pid is None
        for bad in ("yes", 0, -2, 1.5, "2", None):
            extra = json.dumps({"file_storage_path": store, "kvfsm_store_process": bad})
            with published(SC, store, hicache_storage_backend_extra_config=extra):
                with pytest.raises(ConfigError, match="kvfsm_store_process must be true or false, or a whole number"):
                    build(DecodeKVCacheOffloadManager)


def test_a_number_of_store_processes_shares_the_writes_by_key() -> None:
    """`"kvfsm_store_process": 2`: two child processes, each a ProcessStorage of the same file store over the
    shared host pool, behind one ShardedStorage; 1 is one child, as true is; the shutdown ends both."""
    from kvfsm.dataplane.storage import ProcessStorage, ShardedStorage

    with tempfile.TemporaryDirectory() as store:
        extra = json.dumps({"file_storage_path": store, "kvfsm_store_process": 2})
        with published(SC, store, hicache_storage_backend_extra_config=extra):
            mine = build(DecodeKVCacheOffloadManager)
        storage = mine._storage
        assert isinstance(storage, ShardedStorage) and mine.manager.fx.storage is storage
        shards = storage.shards
        assert len(shards) == 2 and all(isinstance(s, ProcessStorage) for s in shards)
        pids = [s.pid for s in shards]  # type: ignore[union-attr]
        assert None not in pids and len(set(pids)) == 2
        assert mine.manager.host_pool.share_fd is not None
        mine.release_host_resources()
        assert [s.pid for s in shards] == [None, None]  # type: ignore[union-attr]
        extra = json.dumps({"file_storage_path": store, "kvfsm_store_process": 1})
        with published(SC, store, hicache_storage_backend_extra_config=extra):
            one = build(DecodeKVCacheOffloadManager)
        assert isinstance(one._storage, ProcessStorage)
        one.release_host_resources()


def test_bad_stride_env_is_a_config_error() -> None:
    with tempfile.TemporaryDirectory() as store, published(SC, store, stride="eight"):
        with pytest.raises(ConfigError, match="SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE"):
            build(DecodeKVCacheOffloadManager)


def test_request_views_are_identity_stable_and_refuse_other_objects() -> None:
    views = RequestViews()
    run_reqs = []
    with tempfile.TemporaryDirectory() as store, published(SC, store):
        run = harness._Run(SC, DecodeKVCacheOffloadManager, 0, harness._tp_group_world1(), store)
        run.admit(SC.requests[0])
        req = run.reqs["a"]
        run_reqs.append(req)
        v = views.view(req)
        assert views.view(req) is v
        assert (v.rid, v.req_pool_idx, v.prefix_len, v.kv_allocated_len, v.kv_committed_len) == (
            req.rid,
            req.kv.req_pool_idx,
            req.kv.cache_protected_len,
            req.kv.kv_allocated_len,
            req.kv.kv_committed_len,
        )
        assert v.extra_key == req.extra_key and v.cache_salt == req.cache_salt and v.finished() is False

        class NotAReq:
            rid = "x"

        with pytest.raises(InvalidRequest, match="not an SGLang Req"):
            views.view(NotAReq())
        run.mgr.finalize_release_on_finish(req)
        assert req.kv.req_pool_idx is None and req.kv.kv_allocated_len == 0 and req.lock is None
        run.mgr.manager.close()
    del req, run, v, run_reqs[:]
    import gc

    gc.collect()
    assert len(views._views) == 0  # a view never keeps its Req alive


def test_in_flight_views_follow_upstream() -> None:
    """`len(ongoing_offload)` (the idle check) and `has_inflight_device_transfer()` answer as upstream's
    after every call: a copy counts from its submission to the progress check that acknowledges it."""
    seen = {}
    for cls in (harness.UpstreamManager, DecodeKVCacheOffloadManager):
        with tempfile.TemporaryDirectory() as store, published(SC, store):
            run = harness._Run(SC, cls, 0, harness._tp_group_world1(), store)
            spec = SC.requests[0]
            trace = []
            run.admit(spec)
            for _ in range(1, spec.decode + 1):
                run.decode(spec)
                run.mgr.offload_kv_cache(run.reqs["a"])
                trace.append((len(run.mgr.ongoing_offload), run.mgr.has_inflight_device_transfer()))
                run.settle()
                run.mgr.check_offload_progress()
                trace.append((len(run.mgr.ongoing_offload), run.mgr.has_inflight_device_transfer()))
            run.mgr.drain_before_retraction()  # TP=1: never refuses (every copy has landed)
            seen[cls] = trace
            run.settle()
            run.mgr.check_offload_progress()
            run.mgr.finalize_release_on_finish(run.reqs["a"])
            run.probe.close(run.mgr) if cls is harness.UpstreamManager else run.mgr.manager.close()
    up, mine = seen.values()
    assert up == mine and (1, True) in up
