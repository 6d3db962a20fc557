"""The DMA path's planning: host runs, flat (1-D) copy lists and their merging and splitting, executed on
CPU by memmove (the same arrays one cuMemcpyBatchAsync call would take)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvfsm.dataplane import DeviceKVPool, HostKVPool, KVCacheConfig
from kvfsm.dataplane.copy import dma
from kvfsm.dataplane.copy.cuda_driver import memmove_batch

from .helpers import bits, fill_random, make_device_pool


def random_host_pages(host: HostKVPool, pages: int, seed: int) -> torch.Tensor:
    """Slots of `pages` distinct random host pages, in random order (batch order)."""
    ps = host.page_size
    perm = torch.randperm(host.size // ps, generator=torch.Generator().manual_seed(seed))[:pages]
    return (perm[:, None] * ps + torch.arange(ps)).reshape(-1)


def as_tuple(f: dma.FlatCopies) -> tuple[list[int], list[int], list[int]]:
    return f.dst.tolist(), f.src.tolist(), f.size.tolist()


def reference_copies(
    geo: dma.Geometry, runs: np.ndarray, host_base: int, stage_base: int, direction: str
) -> tuple[list[int], list[int], list[int]]:
    """Every (run, row) as one 1-D copy, by plain loops: the independent reference for flat_plan."""
    dst, src, size = [], [], []
    for pos, slot, length in runs.tolist():
        for row in range(geo.rows):
            h = host_base + slot * geo.unit + row * geo.host_pitch
            s = stage_base + pos * geo.unit + row * geo.stage_pitch
            dst.append(h if direction == "d2h" else s)
            src.append(s if direction == "d2h" else h)
            size.append(length * geo.unit)
    return dst, src, size


def test_host_runs_array() -> None:
    def runs(idx: list[int]) -> list[list[int]]:
        return dma.host_runs_array(torch.tensor(idx, dtype=torch.int64)).tolist()

    assert runs([]) == []
    assert runs([4, 5, 6, 7, 0, 1, 2, 3, 9]) == [[0, 4, 4], [4, 0, 4], [8, 9, 1]]
    assert runs(list(range(10, 20))) == [[0, 10, 10]]
    assert runs([3, 2, 1]) == [[0, 3, 1], [1, 2, 1], [2, 1, 1]]
    assert runs([0, 2, 3, 5, 6, 7]) == [[0, 0, 1], [1, 2, 2], [3, 5, 3]]
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


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_flat_plan_equals_the_reference(config: KVCacheConfig, layout: str, page_size: int, direction: str) -> None:
    host = HostKVPool(config, 256, page_size, layout, pin_memory=False)  # type: ignore[arg-type]
    hi = random_host_pages(host, 96 // page_size, seed=page_size)
    n = hi.numel()
    geo = dma.geometry(host, n)
    runs = dma.host_runs_array(hi)
    hb, sb = host.kv_buffer.data_ptr(), 1 << 40  # any staging base will do for the arithmetic
    ref = dma.merge_adjacent(*reference_copies(geo, runs, hb, sb, direction))
    got = dma.flat_plan(geo, runs, hb, sb, direction)  # type: ignore[arg-type]
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
    bounds = dma.chunk_bounds(n, config.bytes_per_token, 20 * config.bytes_per_token)
    chunks = [dma.clip_runs(runs, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    assert len(chunks) > 1

    # load-back: batched H2D into staging, then scatter into random device slots
    staging = torch.zeros(geo.stage_shape, dtype=config.dtype)
    for chunk in chunks:
        f = dma.flat_plan(geo, chunk, src_host.kv_buffer.data_ptr(), staging.data_ptr(), "h2d")
        assert memmove_batch(f.dst, f.src, f.size) == f.count
    pos = torch.arange(n)
    dev = DeviceKVPool.create(config, 200)
    di = torch.randperm(199, generator=torch.Generator().manual_seed(3))[:n] + 1
    dev.token_view().index_copy_(2, di, geo.stage_view(staging).index_select(2, pos))
    assert torch.equal(bits(dev.token_view()[:, :, di]), bits(src_host.token_view()[:, :, hi]))

    # offload: gather the device slots into a fresh staging buffer, then batched D2H into the other pool
    staging2 = torch.zeros(geo.stage_shape, dtype=config.dtype)
    geo.stage_view(staging2).index_copy_(2, pos, dev.token_view().index_select(2, di))
    for chunk in chunks:
        f = dma.flat_plan(geo, chunk, dst_host.kv_buffer.data_ptr(), staging2.data_ptr(), "d2h")
        for part in dma.split_by_bytes(f, 3):  # as if spread over three copy streams
            memmove_batch(part.dst, part.src, part.size)
    assert torch.equal(bits(dst_host.token_view()[:, :, hi]), bits(src_host.token_view()[:, :, hi]))
    untouched = torch.ones(dst_host.size, dtype=torch.bool)
    untouched[hi] = False
    assert not bits(dst_host.token_view()[:, :, untouched]).any()


def test_merged_flat_plan_moves_what_the_reference_moves(config: KVCacheConfig, layout: str) -> None:
    """Merging copies changes how the bytes move, not which: the merged list executed by memmove_batch
    writes the same host bytes as the reference's row copies executed one by one."""
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
    runs = dma.host_runs_array(hi)
    for d, s, z in zip(*reference_copies(geo, runs, host_a.kv_buffer.data_ptr(), staging.data_ptr(), "d2h")):
        ctypes.memmove(d, s, z)
    f = dma.flat_plan(geo, runs, host_b.kv_buffer.data_ptr(), staging.data_ptr(), "d2h")
    memmove_batch(f.dst, f.src, f.size)
    assert torch.equal(bits(host_a.kv_buffer), bits(host_b.kv_buffer))


# ---- direct row copies ("dma_rows") ---------------------------------------------------------------


def _row_copy_by_loops(src5: torch.Tensor, si: list[int], dst5: torch.Tensor, di: list[int]) -> None:
    """The independent reference: one assignment per (plane, layer, position)."""
    for p in range(src5.shape[0]):
        for layer in range(src5.shape[1]):
            for a, b in zip(si, di):
                dst5[p, layer, b] = src5[p, layer, a]


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_row_copies_move_exactly_the_named_rows(config: KVCacheConfig, layout: str, direction: str) -> None:
    dev = make_device_pool(config, 64, "cpu", seed=3)
    host = HostKVPool(config, 32, 1, layout, pin_memory=False)
    fill_random(host.kv_buffer, 4)
    di = np.array([9, 3, 40, 41, 17], dtype=np.int64)
    hi = np.array([30, 2, 3, 11, 0], dtype=np.int64)
    d5, h5 = dev.token_view(), host.token_view()
    src5, si, dst5, dst_i = (d5, di, h5, hi) if direction == "d2h" else (h5, hi, d5, di)
    expected = dst5.clone()
    _row_copy_by_loops(src5, si.tolist(), expected, dst_i.tolist())
    flat = dma.row_copies(src5, si, dst5, dst_i)
    c = config
    assert flat.count == c.num_planes * c.num_layers * len(di) and set(flat.size.tolist()) == {c.row_bytes}
    assert memmove_batch(flat.dst, flat.src, flat.size) == flat.count
    assert torch.equal(bits(dst5.contiguous()), bits(expected.contiguous()))


def test_row_copies_of_whole_block_rows_are_one_copy_per_block() -> None:
    """The transformers pool's geometry: one plane, one layer, a whole engine block per row."""
    cfg = KVCacheConfig(num_layers=1, kv_heads=1, head_dim=4096, attention="mla")
    dev = make_device_pool(cfg, 16, "cpu", seed=5)
    host = HostKVPool(cfg, 8, 1, pin_memory=False)
    flat = dma.row_copies(dev.token_view(), np.array([5, 2, 9]), host.token_view(), np.array([1, 0, 7]))
    assert flat.count == 3 and flat.nbytes == 3 * cfg.bytes_per_token
    memmove_batch(flat.dst, flat.src, flat.size)
    assert torch.equal(bits(host.token_view()[:, :, [1, 0, 7]]), bits(dev.token_view()[:, :, [5, 2, 9]]))


def test_row_copies_refuse_rows_that_are_not_contiguous() -> None:
    cfg = KVCacheConfig(num_layers=2, kv_heads=4, head_dim=8)
    dev = make_device_pool(cfg, 8, "cpu")
    host = HostKVPool(cfg, 8, 1, pin_memory=False)
    with pytest.raises(ValueError, match="contiguous"):
        dma.row_copies(
            dev.token_view().transpose(3, 4), np.array([1]), host.token_view().transpose(3, 4), np.array([1])
        )
    with pytest.raises(ValueError, match="1 source rows vs 2"):
        dma.row_copies(dev.token_view(), np.array([1]), host.token_view(), np.array([1, 2]))


def test_row_copies_from_kept_geometries_equal_those_from_the_views(config: KVCacheConfig, layout: str) -> None:
    """A RowGeometry (what the dma_rows backend keeps per pool) addresses the same copies as the view it was
    taken from; rows of another shape or dtype do not pair."""
    dev = make_device_pool(config, 64, "cpu", seed=3)
    host = HostKVPool(config, 32, 1, layout, pin_memory=False)
    d5, h5 = dev.token_view(), host.token_view()
    gd, gh = dma.RowGeometry.of(d5), dma.RowGeometry.of(h5)
    assert len(gd.bases) == config.num_planes * config.num_layers and gd.row == config.row_bytes
    a = dma.row_copies(d5, [9, 3, 40], h5, [30, 2, 3])
    b = dma.row_copies(gd, [9, 3, 40], gh, [30, 2, 3])
    assert (a.dst, a.src, a.size) == (b.dst, b.src, b.size)
    other = HostKVPool(
        KVCacheConfig(
            num_layers=config.num_layers,
            kv_heads=config.kv_heads,
            head_dim=config.head_dim,
            attention=config.attention,
            dtype=torch.float16 if config.dtype != torch.float16 else torch.bfloat16,
        ),
        8,
        1,
        pin_memory=False,
    )
    with pytest.raises(ValueError, match="views differ"):
        dma.row_copies(gd, [1], dma.RowGeometry.of(other.token_view()), [1])
    with pytest.raises(ValueError, match="P, L, S, H, D"):
        dma.RowGeometry.of(d5[0])
