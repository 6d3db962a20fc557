"""L3 interop with the real SGLang 0.5.23: keys and page files, written by one side and read by the other.

Run in `.venv-sglang` (`make test-upstream`; conftest.py installs the CUDA-only stand-ins and skips the
directory without sglang). What is compared, bytes and keys alike:

- keys: kvfsm's `page_hashes` (plain, chained, namespaced, wide) against upstream's native hash as its
  decode offload manager calls it (`DecodeKVCacheOffloadManager._compute_prefix_hash`, seeded by
  `mem_cache.utils.storage_namespace_seed`), and `request_namespace` against upstream `Req`'s
  normalisation of `extra_key`, `cache_salt` and `lora_id`;
- page files: upstream's `HiCacheFile` writes the pages of upstream's own `MHATokenToKVPoolHost`
  (`_write_page`: `get_data_page(flat=True)`), kvfsm's `FileStorage` reads them (no sidecar: length-checked,
  counted unverified) into a kvfsm `HostKVPool`; and the reverse, kvfsm's `batch_set_from_host` and
  upstream's `_read_page` (`set_from_flat_data_page`). Per host layout: layer_first, page_first (SGLang's
  default) and page_first_direct, each with the matching `FileStorage(layout=...)`;
- names: HiCacheFile's file names for MHA at TP 2 and for MLA, and `exists` on kvfsm's pages;
- Mooncake: upstream's `MooncakeStore.batch_set_v1` / `batch_get_v1` / `batch_exists` (its own key tagging,
  `_batch_preprocess` and zero-copy calls, over its host pool of layout page_first or page_first_direct)
  and kvfsm's `MooncakeStorage` share one in-memory stand-in for the Mooncake client (`FakeMooncake`: the
  master is a separate binary and not what is under test), each reading what the other wrote. The upstream
  store object is made without its `__init__` (which connects to a master) and given the attributes that
  `__init__` derives for TP rank 1 of 2, no pipeline, no DCP.
"""

from __future__ import annotations

import ctypes
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sglang = pytest.importorskip("sglang")

from sglang.srt.disaggregation.decode_kvcache_offload_manager import DecodeKVCacheOffloadManager  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig, PoolName  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed as upstream_seed  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from kvfsm.dataplane import FileStorage, HostKVPool, KVCacheConfig  # noqa: E402
from kvfsm.dataplane.hashing import page_hashes, request_namespace, storage_namespace_seed  # noqa: E402
from kvfsm.dataplane.storage.mooncake import MooncakeStorage  # noqa: E402

MODEL = "org/Interop-1B"
L, H, D, T, PAGES = 3, 2, 8, 4, 6
DTYPE = torch.float16
# upstream host layout -> the FileStorage layout whose page files it reads and writes
FILE_LAYOUT = {"layer_first": "layer_first", "page_first": "page_first", "page_first_direct": "layer_first"}


# ---- keys ---------------------------------------------------------------------------------------------
def upstream_chain(
    tokens: list[int], page_size: int, prior: str | None, extra_key: str | None, cache_salt: str | None
) -> list[str]:
    """Upstream's decode offload hash chain, through its own method (a stand-in `self` with what it reads)."""
    fake = SimpleNamespace(page_size=page_size, cache_controller=SimpleNamespace(get_hash_str=get_hash_str))
    req = SimpleNamespace(extra_key=extra_key, cache_salt=cache_salt)
    return DecodeKVCacheOffloadManager._compute_prefix_hash(fake, req, tokens, prior)


PARTS = [None, "", "tenant-a", "ünïcode ✓"]


@pytest.mark.parametrize("extra_key", PARTS)
@pytest.mark.parametrize("cache_salt", PARTS)
def test_namespaced_keys_match_upstream(extra_key: str | None, cache_salt: str | None) -> None:
    assert storage_namespace_seed(extra_key, cache_salt) == upstream_seed(extra_key, cache_salt)
    tokens = list(range(100, 100 + 4 * 5))
    want = upstream_chain(tokens, 4, None, extra_key, cache_salt)
    assert page_hashes(tokens, 4, extra_key=extra_key, cache_salt=cache_salt) == want
    prior = want[1]  # a chain continued from a prior ignores the namespace, upstream and here
    assert (
        page_hashes(tokens[8:], 4, prior, extra_key=extra_key, cache_salt=cache_salt)
        == upstream_chain(tokens[8:], 4, prior, extra_key, cache_salt)
        == want[2:]
    )


def test_plain_wide_and_empty_keys_match_upstream() -> None:
    rng = random.Random(17)
    for _ in range(200):
        ps = rng.choice([1, 2, 4, 16])
        wide = rng.random() < 0.5
        tokens = [
            rng.randrange(0, 2**63) if wide and rng.random() < 0.3 else rng.randrange(0, 2**32)
            for _ in range(ps * rng.randrange(0, 4))
        ]
        prior = rng.choice([None, f"{rng.getrandbits(256):064x}"])
        ek = rng.choice(PARTS)
        assert page_hashes(tokens, ps, prior, extra_key=ek) == upstream_chain(tokens, ps, prior, ek, None)
        assert page_hashes(tokens, ps, prior) == (get_hash_str(tokens, prior, ps) if tokens else [])
    assert page_hashes([], 4) == get_hash_str([], None, 4) == []
    for bad in ([-1], [2**63]):  # both sides refuse ids outside [0, 2**63 - 1]
        with pytest.raises(ValueError):
            page_hashes(bad, 1)
        with pytest.raises((ValueError, IndexError, OverflowError)):
            get_hash_str(bad, None, 1)


@pytest.mark.parametrize(
    "extra_key, cache_salt, lora_id",
    [(None, "", None), ("", None, None), (None, None, "lora-1"), ("ek", "s", "L"), (None, "s", ""), ("", "", "")],
)
def test_request_namespace_matches_upstream_req(
    extra_key: str | None, cache_salt: str | None, lora_id: str | None
) -> None:
    req = Req(
        "r",
        "",
        [1, 2, 3],
        SamplingParams(max_new_tokens=1),
        lora_id=lora_id,
        extra_key=extra_key,
        cache_salt=cache_salt,
    )
    assert request_namespace(extra_key, cache_salt, lora_id) == (req.extra_key, req.cache_salt)


# ---- page files -------------------------------------------------------------------------------------------
def hicache_file(directory: Path, *, tp_rank: int = 0, tp_size: int = 1, is_mla: bool = False) -> HiCacheFile:
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    cfg = HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=MODEL,
        extra_config={"file_storage_path": str(directory)},
    )
    directory.mkdir(parents=True, exist_ok=True)
    return HiCacheFile(cfg)


def upstream_host_pool(layout: str) -> MHATokenToKVPoolHost:
    """Upstream's own MHA host pool on CPU (no pinning: cuda_only's stand-in), random KV bits."""
    k = tuple(torch.zeros(64, H, D, dtype=DTYPE) for _ in range(L))
    v = tuple(torch.zeros(64, H, D, dtype=DTYPE) for _ in range(L))
    ptrs = [torch.tensor([t.data_ptr() for t in side], dtype=torch.uint64) for side in (k, v)]
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=KVBufferLayout.NHD),
        page_size=T,
        head_num=H,
        head_dim=D,
        v_head_dim=D,
        dtype=DTYPE,
        device=torch.device("cpu"),
    )
    pool = MHATokenToKVPoolHost(
        info,
        1.0,
        0,
        T,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=64,
        start_layer=0,
        end_layer=L,
        host_token_capacity=PAGES * T,
    )
    g = torch.Generator().manual_seed(hash(layout) & 0xFFFF)
    pool.kv_buffer.view(torch.int16).copy_(
        torch.randint(-(2**15), 2**15, pool.kv_buffer.shape, generator=g, dtype=torch.int16)
    )
    return pool


def upstream_tokens(pool: MHATokenToKVPoolHost) -> torch.Tensor:
    """Upstream's host buffer as (plane, layer, slot, head, dim), from its documented shapes."""
    b = pool.kv_buffer
    if pool.layout == "layer_first":  # (2, L, S, H, D)
        return b
    if pool.layout == "page_first":  # (2, S, L, H, D)
        return b.transpose(1, 2)
    assert pool.layout == "page_first_direct"  # (2, pages, L, T, H, D)
    return b.permute(0, 2, 1, 3, 4, 5).reshape(2, L, -1, H, D)


def kvfsm_pool() -> HostKVPool:
    pool = HostKVPool(
        KVCacheConfig(num_layers=L, kv_heads=H, head_dim=D, attention="mha", dtype=DTYPE),
        PAGES * T,
        page_size=T,
        layout="layer_first",
    )
    pool.alloc_pages(PAGES)
    return pool


def page_keys(n: int = PAGES) -> list[str]:
    return page_hashes(list(range(1000, 1000 + n * T)), T, extra_key="tenant", cache_salt="s")


@pytest.mark.parametrize("layout", list(FILE_LAYOUT))
def test_sglang_writes_kvfsm_reads(tmp_path: Path, layout: str) -> None:
    up = upstream_host_pool(layout)
    hf = hicache_file(tmp_path)
    keys = page_keys()
    for j, key in enumerate(keys):  # what upstream's batch_set_v2 does per page
        assert hf._write_page(PoolName.KV, key, up, j * T)
    assert sorted(os.listdir(tmp_path)) == sorted(f"{k}_{MODEL.replace('/', '-')}_0_1.bin" for k in keys)
    page_nbytes = 2 * L * T * H * D * DTYPE.itemsize
    fs = FileStorage(
        tmp_path,
        model_name=MODEL,
        layout=FILE_LAYOUT[layout],
        page_dims=(2, L, T),
        page_nbytes=page_nbytes,
        stale_temp_age_s=None,
    )
    assert fs.batch_exists(keys) == PAGES
    got = fs.batch_get(keys)
    assert all(g is not None for g in got) and fs.unverified_reads == PAGES and fs.stats.reads_corrupt == 0
    mine = kvfsm_pool()
    mine.set_pages_bytes(mine.slots_of(range(PAGES)), torch.cat(got))  # type: ignore[arg-type]
    assert torch.equal(mine.token_view().view(torch.int16), upstream_tokens(up).view(torch.int16))


@pytest.mark.parametrize("layout", list(FILE_LAYOUT))
def test_kvfsm_writes_sglang_reads(tmp_path: Path, layout: str) -> None:
    mine = kvfsm_pool()
    g = torch.Generator().manual_seed(5)
    mine.kv_buffer.view(torch.int16).copy_(
        torch.randint(-(2**15), 2**15, mine.kv_buffer.shape, generator=g, dtype=torch.int16)
    )
    keys = page_keys()
    fs = FileStorage(tmp_path, model_name=MODEL, layout=FILE_LAYOUT[layout], page_dims=(2, L, T), stale_temp_age_s=None)
    assert fs.batch_set_from_host(keys, mine, mine.slots_of(range(PAGES))) == [True] * PAGES
    hf = hicache_file(tmp_path)
    up = upstream_host_pool(layout)
    up.kv_buffer.zero_()
    for j, key in enumerate(keys):  # what upstream's batch_get_v2 does per page
        assert hf.exists(key)
        assert hf._read_page(PoolName.KV, key, up, j * T)
    assert torch.equal(upstream_tokens(up).view(torch.int16), mine.token_view().view(torch.int16))
    # the page file is the page: byte for byte what upstream's host pool flattens
    for j, key in enumerate(keys):
        raw = Path(fs.path_of(key)).read_bytes()
        assert raw == up.get_data_page(j * T, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
    # kvfsm's own reader checks its pages against their sidecars (not unverified)
    assert all(p is not None for p in fs.batch_get(keys)) and fs.unverified_reads == 0


def test_file_names_match_upstream_for_tp_and_mla(tmp_path: Path) -> None:
    key = page_keys(1)[0]
    page = torch.arange(64, dtype=torch.int64).to(torch.uint8)
    for tp_rank, tp_size, is_mla in ((1, 2, False), (0, 1, True), (1, 4, True)):
        d = tmp_path / f"{tp_rank}-{tp_size}-{is_mla}"
        hf = hicache_file(d, tp_rank=tp_rank, tp_size=tp_size, is_mla=is_mla)
        fs = FileStorage(d, model_name=MODEL, tp_rank=tp_rank, tp_size=tp_size, is_mla=is_mla, stale_temp_age_s=None)
        assert fs.batch_set([key], [page]) == [True]
        assert os.path.basename(fs.path_of(key)) == f"{key}{hf.config_suffix}.bin"
        assert hf.exists(key)
        back = torch.zeros(64, dtype=torch.uint8)
        assert hf.get(key, back) is not None and torch.equal(back, page)


# ---- Mooncake ---------------------------------------------------------------------------------------------
class FakeMooncake:
    """The Mooncake client calls both stores make, over a dict of bytes (copies through raw addresses, as
    the transfer engine does)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def _read(self, ptrs, sizes) -> bytes:  # type: ignore[no-untyped-def]
        if isinstance(ptrs, (list, tuple)):
            return b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))
        return ctypes.string_at(ptrs, sizes)

    def batch_put_from(self, keys, ptrs, sizes, cfg=None):  # type: ignore[no-untyped-def]
        for k, p, n in zip(keys, ptrs, sizes):
            self.objects[k] = self._read(p, n)
        return [0] * len(keys)

    batch_put_from_multi_buffers = batch_put_from

    def batch_get_into(self, keys, ptrs, sizes):  # type: ignore[no-untyped-def]
        out = []
        for k, p, n in zip(keys, ptrs, sizes):
            data = self.objects.get(k)
            if data is None:
                out.append(-704)  # OBJECT_NOT_FOUND
                continue
            if isinstance(p, (list, tuple)):
                at = 0
                for q, m in zip(p, n):
                    ctypes.memmove(q, data[at : at + m], m)
                    at += m
            elif len(data) > n:
                out.append(-600)  # INVALID_PARAMS: the buffer is too small
                continue
            else:
                ctypes.memmove(p, data, len(data))
            out.append(len(data))
        return out

    batch_get_into_multi_buffers = batch_get_into

    def batch_is_exist(self, keys):  # type: ignore[no-untyped-def]
        return [1 if k in self.objects else 0 for k in keys]

    def get_size(self, key):  # type: ignore[no-untyped-def]
        return len(self.objects[key]) if key in self.objects else -704

    def register_buffer(self, addr, nbytes):  # type: ignore[no-untyped-def]
        return 0

    def unregister_buffer(self, addr):  # type: ignore[no-untyped-def]
        return 0

    def batch_remove(self, keys, force=False):  # type: ignore[no-untyped-def]
        return [0 if self.objects.pop(k, None) is not None else -704 for k in keys]

    def close(self) -> int:
        return 0


def upstream_mooncake(client: FakeMooncake, host_pool: MHATokenToKVPoolHost, tp_rank: int = 1) -> MooncakeStore:
    """Upstream's MooncakeStore with what its __init__ sets for this deployment (no master to connect to)."""
    store = object.__new__(MooncakeStore)
    store.store = client
    store.mem_pool_host = host_pool
    store.config_prefix = MODEL.replace("/", "-")  # __init__: the model name, "/" -> "-"
    store.is_mla_backend = False
    store.should_split_heads = False
    store.dcp_size = 1
    store.local_rank, store.pp_rank, store.enable_pp = tp_rank, 0, False
    store.mha_suffix, store.mla_suffix = f"{tp_rank}", ""
    store.enable_storage_metrics = False
    store._use_group_semantics = False
    store._replicate_config_cls = SimpleNamespace
    return store


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])  # upstream's Mooncake MHA layouts
def test_mooncake_pages_cross_between_sglang_and_kvfsm(layout: str) -> None:
    client = FakeMooncake()
    up = upstream_host_pool(layout)
    upstream = upstream_mooncake(client, up)
    keys = page_keys()
    idx = torch.arange(PAGES * T, dtype=torch.int64)
    assert upstream.batch_set_v1(keys, idx) == [True] * PAGES
    mine = MooncakeStorage(
        "127.0.0.1:1",
        client=client,
        model_name=MODEL,
        tp_rank=1,
        tp_size=2,
        layout=FILE_LAYOUT[layout],
        page_dims=(2, L, T),
        op_timeout_s=5.0,
    )
    try:
        assert sorted(client.objects) == sorted(o for k in keys for o in mine.key_of(k))  # the same keys
        assert mine.batch_exists(keys) == PAGES
        got = mine.batch_get(keys)
        assert all(g is not None for g in got)
        pool = kvfsm_pool()
        pool.set_pages_bytes(pool.slots_of(range(PAGES)), torch.cat(got))  # type: ignore[arg-type]
        assert torch.equal(pool.token_view().view(torch.int16), upstream_tokens(up).view(torch.int16))

        # the reverse: kvfsm stores (from its host pool, and from page bytes), upstream loads
        client.objects.clear()
        g = torch.Generator().manual_seed(11)
        pool.kv_buffer.view(torch.int16).copy_(
            torch.randint(-(2**15), 2**15, pool.kv_buffer.shape, generator=g, dtype=torch.int16)
        )
        half = PAGES // 2
        assert mine.batch_set_from_host(keys[:half], pool, pool.slots_of(range(half))) == [True] * half
        rows = pool.get_pages_bytes(pool.slots_of(range(half, PAGES)))
        assert mine.batch_set(keys[half:], list(rows.unbind(0))) == [True] * (PAGES - half)
        assert upstream.batch_exists(keys) == PAGES
        up.kv_buffer.zero_()
        assert upstream.batch_get_v1(keys, idx) == [True] * PAGES
        assert torch.equal(upstream_tokens(up).view(torch.int16), pool.token_view().view(torch.int16))
    finally:
        mine.close()
