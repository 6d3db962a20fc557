"""Flat (1-D) copy lists for one cuMemcpyBatchAsync call per chunk: planning, merging and the driver
binding's dispatch and fallback, all on CPU (copies executed by memmove; libcuda replaced by a fake)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvfsm.dataplane import DeviceKVPool, HostKVPool, KVCacheConfig
from kvfsm.dataplane import dma
from kvfsm.dataplane.errors import CopyError

from .helpers import bits, fill_random, make_device_pool


def random_host_pages(host: HostKVPool, pages: int, seed: int) -> torch.Tensor:
    """Slots of `pages` distinct random host pages, in random order (batch order)."""
    ps = host.page_size
    perm = torch.randperm(host.size // ps, generator=torch.Generator().manual_seed(seed))[:pages]
    return (perm[:, None] * ps + torch.arange(ps)).reshape(-1)


def as_tuple(f: dma.FlatCopies) -> tuple[list[int], list[int], list[int]]:
    return f.dst.tolist(), f.src.tolist(), f.size.tolist()


# ---- planning -------------------------------------------------------------------------------------


def test_host_runs_array_matches_host_runs() -> None:
    for idx in ([], [4, 5, 6, 7, 0, 1, 2, 3, 9], list(range(10, 20)), [3, 2, 1], [0, 2, 3, 5, 6, 7]):
        t = torch.tensor(idx, dtype=torch.int64)
        assert [tuple(r) for r in dma.host_runs_array(t).tolist()] == dma.host_runs(t)
    assert dma.host_runs_array(np.array([7, 8])).tolist() == [[0, 7, 2]]


def test_merge_adjacent_fuses_only_when_both_sides_continue() -> None:
    # a chain that continues on both sides -> one copy; given out of order on purpose
    f = dma.merge_adjacent([1200, 1000, 1100], [200, 0, 100], [100, 100, 100])
    assert as_tuple(f) == ([1000], [0], [300])
    # source continues, destination does not -> kept apart (sorted by source)
    f = dma.merge_adjacent([5000, 1000], [100, 0], [100, 100])
    assert as_tuple(f) == ([1000, 5000], [0, 100], [100, 100])
    # destination continues, source does not -> kept apart
    f = dma.merge_adjacent([1000, 1100], [0, 500], [100, 100])
    assert as_tuple(f) == ([1000, 1100], [0, 500], [100, 100])
    # empty copies dropped; merge=False keeps the order given
    f = dma.merge_adjacent([9, 1000, 1100], [9, 0, 100], [0, 100, 100], merge=False)
    assert as_tuple(f) == ([1000, 1100], [0, 100], [100, 100])
    assert f.dst.dtype == f.src.dtype == f.size.dtype == np.uint64
    assert dma.merge_adjacent([], [], []).count == 0
    with pytest.raises(ValueError):
        dma.merge_adjacent([1, 2], [1], [1, 1])


def test_flatten_expands_rows_and_merges_full_pitch_copies() -> None:
    # a 2-D copy whose rows are exactly one pitch wide on both sides is one contiguous block
    f = dma.flatten([dma.Copy(dst=10_000, dpitch=64, src=0, spitch=64, width=64, height=5)])
    assert as_tuple(f) == ([10_000], [0], [320])
    # different pitches: one copy per row
    f = dma.flatten([dma.Copy(dst=10_000, dpitch=128, src=0, spitch=64, width=64, height=3)])
    assert as_tuple(f) == ([10_000, 10_128, 10_256], [0, 64, 128], [64, 64, 64])
    # rows of two runs interleave in the staging buffer; run 1 continues run 0 on the host in row 0 only
    copies = [dma.Copy(dst=1000, dpitch=10_000, src=0, spitch=100, width=40, height=2),
              dma.Copy(dst=1040, dpitch=20_000, src=40, spitch=100, width=60, height=2)]
    f = dma.flatten(copies)
    assert as_tuple(f) == ([1000, 11_000, 21_040], [0, 100, 140], [100, 40, 60])
    assert f.nbytes == 200
    assert dma.flatten([]).count == 0


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_flat_plan_equals_flattened_copy_plan(config: KVCacheConfig, layout: str, page_size: int, direction: str) -> None:
    host = HostKVPool(config, 256, page_size, layout, pin_memory=False)  # type: ignore[arg-type]
    hi = random_host_pages(host, 96 // page_size, seed=page_size)
    n = hi.numel()
    geo = dma.geometry(host, n)
    runs = dma.host_runs(hi)
    hb, sb = host.kv_buffer.data_ptr(), 1 << 40  # any staging base will do for the arithmetic
    ref = dma.flatten(dma.plan_copies(geo, runs, hb, sb, direction))  # type: ignore[arg-type]
    got = dma.flat_plan(geo, dma.host_runs_array(hi), hb, sb, direction)  # type: ignore[arg-type]
    assert as_tuple(got) == as_tuple(ref)
    assert got.nbytes == n * config.bytes_per_token
    unmerged = dma.flat_plan(geo, runs, hb, sb, direction, merge=False)  # type: ignore[arg-type]
    assert unmerged.count == len(runs) * geo.rows >= got.count
    assert unmerged.nbytes == got.nbytes


def test_flat_plan_of_a_whole_pool_is_one_copy(config: KVCacheConfig, layout: str) -> None:
    host = HostKVPool(config, 32, 4, layout, pin_memory=False)  # type: ignore[arg-type]
    geo = dma.geometry(host, host.size)
    f = dma.flat_plan(geo, [(0, 0, host.size)], host.kv_buffer.data_ptr(), 1 << 40, "d2h")
    assert as_tuple(f) == ([host.kv_buffer.data_ptr()], [1 << 40], [host.nbytes])


def test_split_by_bytes_covers_everything_in_order() -> None:
    f = dma.merge_adjacent(np.arange(10) * 1000, np.arange(10) * 1000 + 7, [100] * 9 + [1000], merge=False)
    for parts in (1, 2, 3, 4, 16):
        pieces = dma.split_by_bytes(f, parts)
        assert 1 <= len(pieces) <= parts and all(p.count for p in pieces)
        assert np.concatenate([p.dst for p in pieces]).tolist() == f.dst.tolist()
        assert sum(p.nbytes for p in pieces) == f.nbytes
    halves = dma.split_by_bytes(f, 2)
    assert [p.nbytes for p in halves] == [900, 1000]
    assert dma.split_by_bytes(f.part(0, 0), 4) == []


@pytest.mark.parametrize("page_size", [1, 16])
def test_round_trip_through_memmove_batch(config: KVCacheConfig, layout: str, page_size: int) -> None:
    """host pool -> (flat h2d) staging -> device slots -> staging -> (flat d2h) second host pool, bit-exact,
    chunk by chunk, and nothing outside the chosen host slots written."""
    src_host = HostKVPool(config, 256, page_size, layout, pin_memory=False)  # type: ignore[arg-type]
    fill_random(src_host.kv_buffer, seed=5)
    dst_host = HostKVPool(config, 256, page_size, layout, pin_memory=False)  # type: ignore[arg-type]
    dst_host.kv_buffer.zero_()
    hi = random_host_pages(src_host, 128 // page_size, seed=7)
    n = hi.numel()
    geo = dma.geometry(src_host, n)
    runs = dma.host_runs_array(hi)
    chunks = dma.chunk_runs([tuple(r) for r in runs.tolist()], config.bytes_per_token, 20 * config.bytes_per_token)
    assert len(chunks) > 1

    # load-back: batched H2D into staging, then scatter into random device slots
    staging = torch.zeros(geo.stage_shape, dtype=config.dtype)
    for _, _, chunk in chunks:
        f = dma.flat_plan(geo, chunk, src_host.kv_buffer.data_ptr(), staging.data_ptr(), "h2d")
        assert dma.memmove_batch(f.dst, f.src, f.size) == f.count
    pos = torch.arange(n)
    dev = DeviceKVPool.create(config, 200)
    di = torch.randperm(199, generator=torch.Generator().manual_seed(3))[:n] + 1
    dev.token_view().index_copy_(2, di, geo.stage_view(staging).index_select(2, pos))
    assert torch.equal(bits(dev.token_view()[:, :, di]), bits(src_host.token_view()[:, :, hi]))

    # offload: gather the device slots into a fresh staging buffer, then batched D2H into the other pool
    staging2 = torch.zeros(geo.stage_shape, dtype=config.dtype)
    geo.stage_view(staging2).index_copy_(2, pos, dev.token_view().index_select(2, di))
    for a, b, chunk in chunks:
        f = dma.flat_plan(geo, chunk, dst_host.kv_buffer.data_ptr(), staging2.data_ptr(), "d2h")
        for part in dma.split_by_bytes(f, 3):  # as if spread over three copy streams
            dma.memmove_batch(part.dst, part.src, part.size)
    assert torch.equal(bits(dst_host.token_view()[:, :, hi]), bits(src_host.token_view()[:, :, hi]))
    untouched = torch.ones(dst_host.size, dtype=torch.bool)
    untouched[hi] = False
    assert not bits(dst_host.token_view()[:, :, untouched]).any()


def test_flattened_plan_matches_strided_memmove(config: KVCacheConfig, layout: str) -> None:
    """The flat list moves exactly what the strided copy list moves (the existing CPU reference)."""
    dev = make_device_pool(config, 64, seed=21)
    host_a = HostKVPool(config, 64, 4, layout, pin_memory=False)  # type: ignore[arg-type]
    host_b = HostKVPool(config, 64, 4, layout, pin_memory=False)  # type: ignore[arg-type]
    host_a.kv_buffer.zero_()
    host_b.kv_buffer.zero_()
    hi = random_host_pages(host_a, 8, seed=11)
    n = hi.numel()
    geo = dma.geometry(host_a, n)
    staging = torch.empty(geo.stage_shape, dtype=config.dtype)
    di = torch.randperm(63, generator=torch.Generator().manual_seed(2))[:n] + 1
    geo.stage_view(staging).index_copy_(2, torch.arange(n), dev.token_view().index_select(2, di))
    runs = dma.host_runs(hi)
    dma.memmove_copies(dma.plan_copies(geo, runs, host_a.kv_buffer.data_ptr(), staging.data_ptr(), "d2h"))
    f = dma.flatten(dma.plan_copies(geo, runs, host_b.kv_buffer.data_ptr(), staging.data_ptr(), "d2h"))
    dma.memmove_batch(f.dst, f.src, f.size)
    assert torch.equal(bits(host_a.kv_buffer), bits(host_b.kv_buffer))


# ---- CudaDriver.run_batch against a fake libcuda ----------------------------------------------------


def fake_libcuda(exports: tuple[str, ...] = ("v2",), batch_rc: int = 0, version: int = 13000) -> SimpleNamespace:
    """A stand-in for libcuda whose copies are memmoves on CPU memory; records every call."""
    log: dict[str, list[Any]] = {"batch": [], "copy": []}

    def cu_memcpy_async(dst: int, src: int, n: int, stream: int) -> int:
        log["copy"].append((dst, src, n, stream))
        ctypes.memmove(dst, src, n)
        return 0

    def batch(dsts: int, srcs: int, sizes: int, count: int, attrs: int, idxs: int, nattrs: int, *rest: int) -> int:
        *fail, stream = rest
        a = dma.MemcpyAttributes.from_address(attrs)
        log["batch"].append({
            "count": count, "nattrs": nattrs, "idx0": ctypes.c_size_t.from_address(idxs).value,
            "order": a.srcAccessOrder, "flags": a.flags, "src_hint": a.srcLocHint.type,
            "dst_hint": a.dstLocHint.type, "nargs": 8 + len(fail), "stream": stream})
        if batch_rc:
            return batch_rc
        d = (ctypes.c_uint64 * count).from_address(dsts)
        s = (ctypes.c_uint64 * count).from_address(srcs)
        z = (ctypes.c_uint64 * count).from_address(sizes)
        for i in range(count):
            ctypes.memmove(d[i], s[i], z[i])
        return 0

    def get_version(p: Any) -> int:
        p._obj.value = version
        return 0

    def v2(*args: int) -> int:
        assert len(args) == 8, "v2 ABI takes 8 arguments"
        return batch(*args)

    def v1(*args: int) -> int:
        assert len(args) == 9, "v1 ABI takes 9 arguments"
        return batch(*args)

    lib = SimpleNamespace(
        log=log,
        cuMemcpyAsync=cu_memcpy_async,
        cuMemcpy2DAsync_v2=lambda desc, stream: 0,
        cuGetErrorString=lambda rc, p: 0,
        cuDeviceGetAttribute=lambda p, attr, dev: 1,
        cuDriverGetVersion=get_version,
    )
    if "v2" in exports:
        lib.cuMemcpyBatchAsync_v2 = v2
    if "v1" in exports:
        lib.cuMemcpyBatchAsync = v1
    return lib


def scattered(n: int = 37, size: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dma.FlatCopies]:
    """A source buffer, a zeroed destination and n copies of `size` bytes into scattered destination slots."""
    src = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    dst = torch.zeros(4 * n * size, dtype=torch.uint8)
    slots = torch.randperm(4 * n, generator=torch.Generator().manual_seed(seed + 1))[:n].numpy()
    f = dma.merge_adjacent(dst.data_ptr() + slots * size, src.data_ptr() + np.arange(n) * size, [size] * n, merge=False)
    return src, dst, f


def check_scattered(src: torch.Tensor, dst: torch.Tensor, f: dma.FlatCopies) -> None:
    size = int(f.size[0])
    slots = (f.dst.astype(np.int64) - dst.data_ptr()) // size
    assert torch.equal(dst.view(-1, size)[torch.from_numpy(slots)], src.view(-1, size))


@pytest.mark.parametrize("exports, abi, nargs", [(("v2", "v1"), "v2", 8), (("v1",), "v1", 9)])
def test_run_batch_makes_one_call(monkeypatch: pytest.MonkeyPatch, exports: tuple[str, ...], abi: str, nargs: int) -> None:
    monkeypatch.delenv("KVFSM_CU_BATCH", raising=False)
    lib = fake_libcuda(exports)
    drv = dma.CudaDriver(lib=lib, device=0)
    assert drv.batch_abi == abi and drv.batch_available and drv.driver_version == 13000
    src, dst, f = scattered()
    assert drv.run_batch(f.dst, f.src, f.size, stream=1234) == 1
    check_scattered(src, dst, f)
    (call,) = lib.log["batch"]
    assert call == {"count": f.count, "nattrs": 1, "idx0": 0, "order": dma.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                    "flags": 0, "src_hint": 0, "dst_hint": 0, "nargs": nargs, "stream": 1234}
    assert lib.log["copy"] == []
    drv.run_batch(f.dst, f.src, f.size, stream=7, flags=1, hint="d2h")
    last = lib.log["batch"][-1]
    assert (last["flags"], last["src_hint"], last["dst_hint"]) == (1, dma.CU_MEM_LOCATION_TYPE_DEVICE,
                                                                   dma.CU_MEM_LOCATION_TYPE_HOST)
    assert drv.run_batch([], [], [], stream=7) == 0


def test_run_batch_falls_back_when_not_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFSM_CU_BATCH", raising=False)
    lib = fake_libcuda(batch_rc=dma.CUDA_ERROR_NOT_SUPPORTED)
    drv = dma.CudaDriver(lib=lib, device=0)
    src, dst, f = scattered()
    assert drv.run_batch(f.dst, f.src, f.size, stream=5) == f.count
    check_scattered(src, dst, f)
    assert len(lib.log["batch"]) == 1 and not drv.batch_available and "NOT_SUPPORTED" in drv.batch_status
    src, dst, f = scattered(seed=9)
    assert drv.run_batch(f.dst, f.src, f.size, stream=5) == f.count  # not tried again
    check_scattered(src, dst, f)
    assert len(lib.log["batch"]) == 1 and drv.fallback_copies == 2 * f.count


def test_run_batch_other_errors_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFSM_CU_BATCH", raising=False)
    drv = dma.CudaDriver(lib=fake_libcuda(batch_rc=1), device=0)
    _, _, f = scattered()
    with pytest.raises(CopyError, match="cuMemcpyBatchAsync"):
        drv.run_batch(f.dst, f.src, f.size, stream=5)


@pytest.mark.parametrize("case", ["no symbol", "old driver", "off", "null stream"])
def test_run_batch_per_copy_fallback(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    monkeypatch.delenv("KVFSM_CU_BATCH", raising=False)
    lib = fake_libcuda(exports=() if case == "no symbol" else ("v2", "v1"),
                       version=12040 if case == "old driver" else 13000)
    if case == "off":
        monkeypatch.setenv("KVFSM_CU_BATCH", "off")
    drv = dma.CudaDriver(lib=lib, device=0)
    assert drv.batch_available == (case == "null stream")
    src, dst, f = scattered()
    stream = 0 if case == "null stream" else 3
    assert drv.run_batch(f.dst, f.src, f.size, stream) == f.count
    check_scattered(src, dst, f)
    assert lib.log["batch"] == [] and len(lib.log["copy"]) == f.count


def test_resolve_batch_choice() -> None:
    lib = fake_libcuda(exports=("v2", "v1"))
    assert dma.resolve_batch(lib, 13000, "v1")[1] == "v1"
    assert dma.resolve_batch(lib, 13000, "auto")[1] == "v2"
    assert dma.resolve_batch(fake_libcuda(exports=("v1",)), 12080, "v2")[1] is None
    with pytest.raises(ValueError):
        dma.resolve_batch(lib, 13000, "v3")
