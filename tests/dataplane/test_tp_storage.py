"""Tensor parallelism and FileStorage: TP ranks sharing one store directory never read or overwrite each
other's pages (MHA), and share exactly one copy of each page where the code says they may (MLA).

Two FileStorage instances (tp_rank 0 and 1, tp_size 2, one directory, one model name) store the same page
keys with different data, concurrently (one thread per rank, two writer threads each, a barrier start),
through `batch_set` and through the backup worker's `batch_set_from_host`. Each rank then reads back only
its own pages, byte-exact; the two ranks' files are disjoint, and each page's sidecar names its own rank's
key (parsed with struct per docs/page-layout.md, not by the code under test).

MLA (`is_mla=True`): the latent is the same on every TP rank, so the documented key has no rank
(`{hash}_{model}`, as SGLang HiCacheFile): both ranks share one file per key, and whatever the order of
their concurrent writes, both read one whole page, the same one.

A rank-blind key (the mutant) must fail the MHA check.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from pathlib import Path

import pytest
import torch

from timing import join_all

from kvfsm.dataplane import DeviceKVPool, FileStorage, HostKVPool, KVCacheConfig, page_hashes
from kvfsm.dataplane.storage import file as storage_mod

MODEL = "org/Model-7B"
N_PAGES = 48
PAGE_BYTES = 8 * 1024
SIDECAR = struct.Struct(
    "<8sIIQII"
)  # docs/page-layout.md: magic, crc32, crc32(key+format), page length, key length, format length


def tp_keys(n: int = N_PAGES) -> list[str]:
    return page_hashes(list(range(3 * n)), 3)


def rank_page(rank: int, key: str, nbytes: int = PAGE_BYTES) -> torch.Tensor:
    """Rank `rank`'s page under `key`: different on every rank (as MHA shards are: other heads)."""
    return torch.frombuffer(
        bytearray(hashlib.sha256(f"{rank}:{key}".encode()).digest() * (nbytes // 32)), dtype=torch.uint8
    )


def file_key(path: Path) -> str:
    """The key a page file's sidecar says it holds (docs/page-layout.md), checked against the page's length."""
    side = path.with_suffix(".kvfsm").read_bytes()
    magic, _crc, _side_crc, plen, klen, flen = SIDECAR.unpack_from(side)
    assert magic == b"KVFSSC01" and len(side) == SIDECAR.size + klen + flen and path.stat().st_size == plen, path
    return side[SIDECAR.size : SIDECAR.size + klen].decode()


def store_concurrently(
    stores: list[FileStorage], pages: list[list[torch.Tensor]], keys: list[str], batch: int = 4
) -> list[list[bool]]:
    """Every rank stores `keys` with its own pages, all ranks at once (a barrier start, interleaved batches)."""
    barrier = threading.Barrier(len(stores))
    results: list[list[bool]] = [[] for _ in stores]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            barrier.wait()
            for i in range(0, len(keys), batch):
                results[r] += stores[r].batch_set(keys[i : i + batch], pages[r][i : i + batch])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(stores))]
    for t in threads:
        t.start()
    join_all(threads, "the rank threads' writes", 60)
    if errors:
        raise errors[0]
    return results


def mha_problems(directory: Path) -> list[str]:
    """Two MHA ranks store the same keys with different data at once; what went wrong, if anything."""
    keys = tp_keys()
    stores = [FileStorage(directory, model_name=MODEL, tp_rank=r, tp_size=2, writers=2) for r in range(2)]
    pages = [[rank_page(r, k) for k in keys] for r in range(2)]
    results = store_concurrently(stores, pages, keys)
    problems = [f"rank {r}: {results[r].count(False)} writes failed" for r in range(2) if not all(results[r])]
    for r, fs in enumerate(stores):
        if fs.stats.writes_skipped:
            problems.append(f"rank {r}: {fs.stats.writes_skipped} pages skipped as already stored (by the other rank?)")
        if fs.batch_exists(keys) != len(keys):
            problems.append(f"rank {r}: batch_exists {fs.batch_exists(keys)} of {len(keys)}")
        got = fs.batch_get(keys)
        wrong = [i for i, (g, p) in enumerate(zip(got, pages[r])) if g is None or not torch.equal(g, p)]
        other = [i for i in wrong if got[i] is not None and torch.equal(got[i], pages[1 - r][i])]  # type: ignore[arg-type]
        if wrong:
            problems.append(
                f"rank {r}: {len(wrong)} pages do not read back as written, {len(other)} of them are rank {1 - r}'s"
            )
    files = [stores[r].path_of(k) for r in range(2) for k in keys]
    if len(set(files)) != len(files):
        problems.append(f"the ranks' page files overlap: {len(files) - len(set(files))} names shared")
    names = sorted(os.listdir(directory))
    if len(names) != 4 * len(keys) or any(not n.endswith((".bin", ".kvfsm")) for n in names):
        problems.append(f"{len(names)} files in the store for 2 x {len(keys)} pages and sidecars: {names[:4]}...")
    for name in names:
        if not name.endswith(".bin"):
            continue
        held = file_key(directory / name)
        if held + ".bin" != name:
            problems.append(f"{name} holds the key {held}")
        if not (held.endswith(f"_{MODEL.replace('/', '-')}_0_2") or held.endswith(f"_{MODEL.replace('/', '-')}_1_2")):
            problems.append(f"{name} names no rank of TP 2")
    return problems


def test_mha_ranks_never_share_pages(tmp_path: Path) -> None:
    assert mha_problems(tmp_path) == []


def test_rank_blind_key_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant: keys without the rank (what MLA does) for MHA, whose shards differ per rank."""
    real = storage_mod.storage_key_suffix
    monkeypatch.setattr(
        storage_mod,
        "storage_key_suffix",
        lambda model_name="", tp_rank=0, tp_size=1, is_mla=False: real(model_name, 0, tp_size, is_mla),
    )
    problems = mha_problems(tmp_path)
    assert any("overlap" in p for p in problems) and any("do not read back" in p for p in problems), problems


def test_other_tp_sizes_and_models_see_nothing(tmp_path: Path) -> None:
    """A TP-4 rank 0 (other shards) or another model never sees TP-2 rank 0's pages; rank 1 never sees pages
    only rank 0 stored."""
    keys = tp_keys(6)
    r0 = FileStorage(tmp_path, model_name=MODEL, tp_rank=0, tp_size=2)
    assert r0.batch_set(keys, [rank_page(0, k) for k in keys]) == [True] * 6
    for other in (
        FileStorage(tmp_path, model_name=MODEL, tp_rank=1, tp_size=2),
        FileStorage(tmp_path, model_name=MODEL, tp_rank=0, tp_size=4),
        FileStorage(tmp_path, model_name="org/Other-7B", tp_rank=0, tp_size=2),
        FileStorage(tmp_path, model_name=MODEL, tp_rank=0, tp_size=2, is_mla=True),
    ):
        assert other.batch_exists(keys) == 0 and other.batch_get(keys) == [None] * 6
        assert other.stats.reads_corrupt == 0


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mha_ranks_store_their_own_host_pages(tmp_path: Path, layout: str) -> None:
    """The backup worker's path: each rank stores its host pool's pages (its own heads) with
    batch_set_from_host, at once; each reads back exactly its own page bytes."""
    cfg = KVCacheConfig(num_layers=2, kv_heads=2, head_dim=16, dtype=torch.float16)  # one rank's shard
    keys = tp_keys(16)
    pools, stores = [], []
    for r in range(2):
        pool = HostKVPool(cfg, 16 * 4, page_size=4, layout=layout)  # type: ignore[arg-type]
        g = torch.Generator().manual_seed(100 + r)
        pool.kv_buffer.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, pool.kv_buffer.shape, generator=g))
        pool.alloc_pages(16)
        pools.append(pool)
        stores.append(FileStorage(tmp_path, model_name=MODEL, tp_rank=r, tp_size=2, writers=2))
    barrier, errors = threading.Barrier(2), []

    def rank(r: int) -> None:
        try:
            barrier.wait()
            for i in range(0, 16, 4):
                assert (
                    stores[r].batch_set_from_host(keys[i : i + 4], pools[r], pools[r].slots_of(range(i, i + 4)))
                    == [True] * 4
                )
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    join_all(threads, "the rank threads' writes from the host pools", 60)
    assert not errors, errors
    for r in range(2):
        want = pools[r].get_pages_bytes(pools[r].slots_of(range(16)))
        got = stores[r].batch_get(keys)
        assert all(g is not None and torch.equal(g, want[i]) for i, g in enumerate(got)), f"rank {r}"
        assert not torch.equal(want, pools[1 - r].get_pages_bytes(pools[1 - r].slots_of(range(16))))
    assert len(os.listdir(tmp_path)) == 2 * 2 * 16  # two ranks' pages and sidecars


def test_mla_ranks_share_one_copy(tmp_path: Path) -> None:
    """MLA: the same latent on every rank, one file per key (no rank in it), either rank's write serves both."""
    keys = tp_keys()
    stores = [FileStorage(tmp_path, model_name=MODEL, tp_rank=r, tp_size=2, is_mla=True, writers=2) for r in range(2)]
    assert stores[0].path_of(keys[0]) == stores[1].path_of(keys[0])
    assert stores[0].path_of(keys[0]).endswith(f"{keys[0]}_{MODEL.replace('/', '-')}.bin")
    latent = [rank_page(0, k) for k in keys]  # identical on both ranks
    results = store_concurrently(stores, [latent, latent], keys)
    assert results == [[True] * len(keys)] * 2
    assert sorted(os.listdir(tmp_path)) == sorted(
        os.path.basename(p) for k in keys for p in (stores[0].path_of(k), stores[0].sidecar_of(stores[0].path_of(k)))
    )
    written = sum(fs.stats.writes_ok for fs in stores)
    assert len(keys) <= written <= 2 * len(keys)  # a rank that finds the page stored skips it
    assert written + sum(fs.stats.writes_skipped for fs in stores) == 2 * len(keys)
    for fs in stores:
        got = fs.batch_get(keys)
        assert all(g is not None and torch.equal(g, p) for g, p in zip(got, latent))
    for name in os.listdir(tmp_path):
        if name.endswith(".bin"):
            assert file_key(tmp_path / name) + ".bin" == name


def test_mla_ranks_that_disagree_still_read_whole_pages(tmp_path: Path) -> None:
    """Ranks that (wrongly) hold different latents race on one file per key: each page reads back as one
    rank's whole page, never a mix, and both ranks read the same one."""
    keys = tp_keys()
    stores = [FileStorage(tmp_path, model_name=MODEL, tp_rank=r, tp_size=2, is_mla=True, writers=2) for r in range(2)]
    pages = [[rank_page(r, k) for k in keys] for r in range(2)]
    store_concurrently(stores, pages, keys, batch=1)
    got = [fs.batch_get(keys) for fs in stores]
    for i in range(len(keys)):
        a, b = got[0][i], got[1][i]
        assert a is not None and b is not None and torch.equal(a, b)
        assert torch.equal(a, pages[0][i]) or torch.equal(a, pages[1][i])
    assert not [n for n in os.listdir(tmp_path) if not n.endswith((".bin", ".kvfsm"))]  # nothing moved aside
    assert sum(fs.stats.reads_corrupt for fs in stores) == 0


def test_the_manager_builds_the_documented_keys(tmp_path: Path) -> None:
    """What the runtime builds from its config: the rank in MHA keys, none in MLA keys."""
    from kvfsm.runtime.build import storage_factory
    from kvfsm.runtime.config import OffloadConfig

    config = OffloadConfig(page_size=4, offload_stride=8, storage_dir=tmp_path, model_name=MODEL)
    model = MODEL.replace("/", "-")
    for attention, want in (("mha", f"_{model}_1_2"), ("mla", f"_{model}")):
        pool = DeviceKVPool.create(KVCacheConfig.tiny(attention), 16)  # type: ignore[arg-type]
        make = storage_factory(config, pool, tp_rank=1, tp_size=2)
        assert make is not None
        fs = make()
        assert isinstance(fs, FileStorage) and fs.suffix == want, (attention, fs.suffix)
