"""The DMA path's planning (runs, geometry, strided copy lists), executed on CPU with memmove."""

from __future__ import annotations

import pytest
import torch

from kvfsm.dataplane import DeviceKVPool, KVCacheConfig
from kvfsm.dataplane import dma

from .helpers import bits, make_device_pool, make_host_pool


def test_host_runs() -> None:
    assert dma.host_runs(torch.empty(0, dtype=torch.int64)) == []
    assert dma.host_runs(torch.tensor([4, 5, 6, 7, 0, 1, 2, 3, 9])) == [(0, 4, 4), (4, 0, 4), (8, 9, 1)]
    assert dma.host_runs(torch.arange(10, 20)) == [(0, 10, 10)]
    assert dma.host_runs(torch.tensor([3, 2, 1])) == [(0, 3, 1), (1, 2, 1), (2, 1, 1)]


def test_chunk_runs_cover_the_batch_in_order() -> None:
    runs = [(0, 8, 4), (4, 0, 4), (8, 20, 2), (10, 30, 6)]
    chunks = dma.chunk_runs(runs, bytes_per_token=10, chunk_bytes=70)
    assert [(a, b) for a, b, _ in chunks] == [(0, 8), (8, 16)]
    assert [r for _, _, rs in chunks for r in rs] == runs


@pytest.mark.parametrize("page_size", [1, 4])
def test_strided_copies_round_trip(config: KVCacheConfig, layout: str, page_size: int) -> None:
    dev = make_device_pool(config, 64, seed=21)
    host = make_host_pool(config, 32, page_size, layout)
    x = host.alloc(24)
    assert x is not None
    pages = x.view(-1, page_size)
    hi = pages[torch.randperm(pages.shape[0], generator=torch.Generator().manual_seed(1))[: 16 // page_size]].reshape(-1)
    di = torch.randperm(63, generator=torch.Generator().manual_seed(2))[:16] + 1
    n = hi.numel()
    geo = dma.geometry(host, n)
    runs = dma.host_runs(hi)
    assert sum(r[2] for r in runs) == n

    # offload: gather into staging (as the kernel does), then the DMA copy list, by memmove
    staging = torch.empty(geo.stage_shape, dtype=config.dtype)
    pos = torch.arange(n)
    geo.stage_view(staging).index_copy_(2, pos, dev.token_view().index_select(2, di))
    for a, b, chunk in dma.chunk_runs(runs, config.bytes_per_token, 3 * config.bytes_per_token):
        dma.memmove_copies(dma.plan_copies(geo, chunk, host.kv_buffer.data_ptr(), staging.data_ptr(), "d2h"))
    assert torch.equal(bits(host.token_view()[:, :, hi]), bits(dev.storage[:, :, di]))

    # load-back: DMA copy list into a fresh staging buffer, then scatter into other device slots
    staging2 = torch.zeros(geo.stage_shape, dtype=config.dtype)
    dma.memmove_copies(dma.plan_copies(geo, runs, host.kv_buffer.data_ptr(), staging2.data_ptr(), "h2d"))
    back = DeviceKVPool.create(config, 64)
    dj = torch.randperm(63, generator=torch.Generator().manual_seed(3))[:16] + 1
    back.token_view().index_copy_(2, dj, geo.stage_view(staging2).index_select(2, pos))
    assert torch.equal(bits(back.storage[:, :, dj]), bits(dev.storage[:, :, di]))


def test_dma_worthwhile_policy() -> None:
    host = make_host_pool(KVCacheConfig.llama3_8b(), 128, 16, "layer_first")
    geo = dma.geometry(host, 64)
    wide = [(i * 16, 64 + i * 16, 16) for i in range(4)]  # 16 tokens x 2 KiB = 32 KiB per row
    narrow = [(i, 3 * i, 1) for i in range(64)]
    assert dma.dma_worthwhile(wide, geo, 32 * 1024, 2048)
    assert not dma.dma_worthwhile(narrow, geo, 32 * 1024, 2048)
    assert not dma.dma_worthwhile(wide, geo, 32 * 1024, 2)
