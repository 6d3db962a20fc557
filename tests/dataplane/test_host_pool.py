"""HostKVPool: layouts, sizing, the RAM check, allocated-mask rejections, page bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfsm.dataplane import (
    DeviceKVPool,
    DoubleAlloc,
    DoubleFree,
    DuplicateIndex,
    HostKVPool,
    HostMemoryError,
    KVCacheConfig,
    NeverAllocated,
    NotAllocated,
    PartialPage,
)
from kvfsm.dataplane.pools import host_pool as host_pool_mod

from .helpers import bits, fill_random


def snap(h: HostKVPool) -> tuple[list[int], list[bool], int]:
    free, mask = h.allocator.snapshot()
    return free.tolist(), mask.tolist(), h.free_slots


@pytest.mark.parametrize(
    "attention,layout,shape",
    [
        ("mha", "layer_first", (2, 3, 32, 2, 8)),
        ("mha", "page_first", (2, 32, 3, 2, 8)),
        ("mla", "layer_first", (3, 32, 1, 24)),
        ("mla", "page_first", (32, 3, 1, 24)),
    ],
)
def test_layouts(attention: str, layout: str, shape: tuple[int, ...]) -> None:
    cfg = KVCacheConfig.tiny(attention)  # type: ignore[arg-type]
    h = HostKVPool(cfg, 32, 4, layout)  # type: ignore[arg-type]
    assert tuple(h.kv_buffer.shape) == shape
    v = h.token_view()
    assert tuple(v.shape) == (cfg.num_planes, 3, 32, *cfg.token_shape)
    assert v.data_ptr() == h.kv_buffer.data_ptr()  # a view, not a copy
    assert h.pinned == torch.cuda.is_available()


def test_sizing_by_ratio_and_bytes() -> None:
    cfg = KVCacheConfig.tiny()
    dev = DeviceKVPool.create(cfg, 64)
    assert HostKVPool.for_device_pool(dev, page_size=4, ratio=2.0).size == 128
    assert HostKVPool.for_device_pool(dev, page_size=4, ratio=0.3).size == 16  # rounded down to pages
    h = HostKVPool.for_device_pool(dev, page_size=4, size_bytes=10 * cfg.bytes_per_token, ratio=2.0)
    assert h.size == 8 and h.nbytes == 8 * cfg.bytes_per_token
    with pytest.raises(ValueError):
        HostKVPool.for_device_pool(dev, ratio=None)


def test_too_large_is_a_typed_error_naming_both_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = KVCacheConfig.llama3_8b()
    monkeypatch.setattr(host_pool_mod, "available_host_memory", lambda: 2**30)
    with pytest.raises(HostMemoryError) as ei:
        HostKVPool(cfg, 16384, 64)  # 2 GiB
    assert ei.value.requested_bytes == 16384 * cfg.bytes_per_token
    assert ei.value.available_bytes == 2**30
    assert str(2**31) in str(ei.value) and str(2**30) in str(ei.value)


def test_meminfo_is_read() -> None:
    avail = host_pool_mod.available_host_memory()
    assert avail is None or avail > 0


def test_alloc_page_granular_never_partial() -> None:
    h = HostKVPool(KVCacheConfig.tiny(), 16, 4)
    x = h.alloc(12)
    assert x is not None and x.dtype == torch.int64 and x.device.type == "cpu"
    before = snap(h)
    assert h.alloc(8) is None
    assert snap(h) == before
    with pytest.raises(ValueError):
        h.alloc(2)
    assert snap(h) == before


def test_double_free_and_double_alloc_rejected_without_change() -> None:
    h = HostKVPool(KVCacheConfig.tiny(), 16, 4)
    x = h.alloc(8)
    assert x is not None
    h.free(x[:4])
    for bad, exc in (
        (x[:4], DoubleFree),
        (torch.arange(12, 16), NeverAllocated),
        (x[4:6], PartialPage),
        (torch.cat([x[4:8], x[4:8]]), DuplicateIndex),
    ):
        before = snap(h)
        with pytest.raises(exc):
            h.free(bad)
        assert snap(h) == before
        h.check_conservation()
    h.allocator._free_pages.appendleft(int(x[4]) // 4)  # corrupt the free list
    before = snap(h)
    with pytest.raises(DoubleAlloc):
        h.alloc(4)
    assert snap(h) == before


@pytest.mark.parametrize("src_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("dst_layout", ["layer_first", "page_first"])
def test_page_bytes_round_trip_across_layouts(config: KVCacheConfig, src_layout: str, dst_layout: str) -> None:
    a = HostKVPool(config, 32, 4, src_layout)  # type: ignore[arg-type]
    b = HostKVPool(config, 32, 4, dst_layout)  # type: ignore[arg-type]
    fill_random(a.kv_buffer, 1)
    xa, xb = a.alloc(12), b.alloc(12)
    assert xa is not None and xb is not None
    xa = xa.view(3, 4)[torch.tensor([2, 0, 1])].reshape(-1)  # pages in a scattered order
    data = a.get_pages_bytes(xa)
    assert data.dtype == torch.uint8 and data.shape == (3, a.page_nbytes)
    assert a.page_nbytes == 4 * config.bytes_per_token
    b.set_pages_bytes(xb, data)
    assert torch.equal(bits(b.token_view()[:, :, xb]), bits(a.token_view()[:, :, xa]))
    one = a.get_page_bytes(xa[:4])
    assert torch.equal(one, data[0])
    staging = np.full(4 * a.page_nbytes, 7, dtype=np.uint8)  # gathered into a caller's buffer: its head, in place
    into = a.get_pages_bytes(xa, out=staging)
    assert (
        torch.equal(into, data) and into.data_ptr() == staging.ctypes.data and (staging[3 * a.page_nbytes :] == 7).all()
    )
    for bad in (staging[: 3 * a.page_nbytes - 1], staging.view(np.int16), staging.reshape(4, -1)):
        with pytest.raises(ValueError, match="out must be"):
            a.get_pages_bytes(xa, out=bad)
    b.set_page_bytes(xb[4:8], one)
    assert torch.equal(bits(b.token_view()[:, :, xb[4:8]]), bits(a.token_view()[:, :, xa[:4]]))


def test_page_bytes_reject_partial_and_unallocated() -> None:
    h = HostKVPool(KVCacheConfig.tiny(), 16, 4)
    x = h.alloc(4)
    assert x is not None
    with pytest.raises(PartialPage):
        h.get_pages_bytes(x[:3])
    with pytest.raises(PartialPage):
        h.get_pages_bytes(x.flip(0))
    with pytest.raises(NotAllocated):
        h.get_pages_bytes(torch.arange(8, 12))
    with pytest.raises(ValueError):
        h.set_pages_bytes(x, torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_a_shared_pool_is_one_memory_wherever_it_is_mapped(layout: str, attention: str) -> None:
    """shared=True: the buffer is a zeroed anonymous memory file (no name in /dev/shm); a pool attached from its
    descriptor (as the store process does) has the same geometry and bytes, sees writes either way, counts
    every page allocated, and refuses a file smaller than its pool. An ordinary pool shares nothing."""
    import gc
    import os

    from kvfsm.dataplane.pools.shared_memory import identity

    cfg = KVCacheConfig(num_layers=2, head_dim=8, kv_heads=2 if attention == "mha" else 1, attention=attention)  # type: ignore[arg-type]
    pool = HostKVPool(cfg, 6 * 4, 4, layout, pin_memory=False, shared=True)  # type: ignore[arg-type]
    assert pool.share_fd is not None and os.fstat(pool.share_fd).st_size == pool.nbytes
    assert not pool.kv_buffer.view(torch.uint8).any() and pool.kv_buffer.shape == pool._shape()
    assert pool.free_slots == pool.capacity == 24
    x = pool.alloc(8)
    assert x is not None
    fill_random(pool.kv_buffer, 3)
    twin = HostKVPool(cfg, 24, 4, layout, attach_fd=os.dup(pool.share_fd))  # type: ignore[arg-type]
    assert twin.share_fd is None and not twin.pinned and twin.free_slots == 0 and twin.size == pool.size
    assert torch.equal(twin.get_pages_bytes(twin.page_slots(pool.pages_of(x))), pool.get_pages_bytes(x))
    twin.kv_buffer.view(torch.uint8)[:5] = 42
    assert (pool.kv_buffer.view(torch.uint8)[:5] == 42).all()
    assert identity(pool.share_fd) == identity(os.dup(pool.share_fd))
    other = HostKVPool(cfg, 24, 4, layout, pin_memory=False, shared=True)  # type: ignore[arg-type]
    assert other.share_fd is not None and identity(other.share_fd) != identity(pool.share_fd)
    refused = os.dup(pool.share_fd)
    with pytest.raises(ValueError, match="bytes, not the"):
        HostKVPool(cfg, 48, 4, layout, attach_fd=refused)  # type: ignore[arg-type]
    with pytest.raises(OSError):
        os.fstat(refused)  # the refused attach closed the descriptor it was handed
    assert HostKVPool(cfg, 24, 4, layout, pin_memory=False).share_fd is None  # type: ignore[arg-type]
    fds = (pool.share_fd, other.share_fd)
    del pool, twin, other, x
    gc.collect()
    for fd in fds:  # a pool's memory file is closed with the last view of its buffer
        with pytest.raises(OSError):
            os.fstat(fd)


def test_pages_of_names_whole_allocated_pages_in_order() -> None:
    h = HostKVPool(KVCacheConfig.tiny(), 16, 4)
    pages = h.alloc_pages(3)
    assert pages is not None
    assert h.pages_of(h.page_slots(pages[::-1])) == pages[::-1]
    assert h.pages_of(h.slots_of(pages[1:])) == pages[1:]
    with pytest.raises(PartialPage):
        h.pages_of(h.slots_of(pages)[:6])
    h.free_pages(pages[:1])
    with pytest.raises(NotAllocated):
        h.pages_of(h.page_slots(pages))


def test_meminfo_available_is_parsed_from_kib_to_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """MemAvailable is in KiB (1024 bytes); no such line, or no readable file, means "unknown" (None)."""
    import io

    def fake_open(text: str):
        def opener(path: str, *args: object, **kwargs: object) -> io.StringIO:
            assert path == "/proc/meminfo"
            return io.StringIO(text)

        return opener

    monkeypatch.setattr(host_pool_mod, "open", fake_open("MemTotal:  4000 kB\nMemAvailable:  1000 kB\n"), raising=False)
    assert host_pool_mod.available_host_memory() == 1_024_000
    monkeypatch.setattr(host_pool_mod, "open", fake_open("MemTotal:  4000 kB\nMemFree:  1000 kB\n"), raising=False)
    assert host_pool_mod.available_host_memory() is None

    def unreadable(path: str, *args: object, **kwargs: object) -> io.StringIO:
        raise FileNotFoundError(path)

    monkeypatch.setattr(host_pool_mod, "open", unreadable, raising=False)
    assert host_pool_mod.available_host_memory() is None
