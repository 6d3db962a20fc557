"""Helpers shared by the data-plane tests."""

from __future__ import annotations

import time
from typing import Any

import torch

from kvfsm.dataplane import DeviceKVPool, HostKVPool, KVCacheConfig


def fill_random(t: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Fill any tensor with random *bit patterns* (every byte value, NaN encodings included)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g)
    t.view(torch.uint8).view(-1).copy_(raw.to(t.device))
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    """A bit-exact comparable view (NaN == NaN when the bits agree)."""
    return t.contiguous().view(torch.uint8)


def make_device_pool(config: KVCacheConfig, slots: int = 64, device: str = "cpu", seed: int = 0) -> DeviceKVPool:
    pool = DeviceKVPool.create(config, slots, device)
    fill_random(pool.storage, seed)
    return pool


def make_host_pool(
    config: KVCacheConfig, slots: int = 32, page_size: int = 4, layout: str = "layer_first"
) -> HostKVPool:
    return HostKVPool(config, slots, page_size, layout)  # type: ignore[arg-type]


def check_orders_after_compute_and_never_blocks(
    eng: Any, dev: DeviceKVPool, host: HostKVPool, di: torch.Tensor, hi: torch.Tensor
) -> tuple[Any, Any]:
    """A CUDA engine's offload reads the KV written on the compute stream before it (without blocking
    the host), and its load-back lands after compute-stream work enqueued before it. Returns the two
    handles for backend-specific checks."""
    fresh = fill_random(torch.empty_like(dev.storage[:, :, di]), 12)
    eng.submit_d2h(dev, di, host, hi).wait()  # warm-up: JIT compilation stays out of the timing below
    eng.submit_h2d(host, hi, dev, di).wait()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of busy compute stream
    dev.storage.index_copy_(2, di, fresh)  # the KV the offload must see, written after the sleep
    t0 = time.perf_counter()
    h = eng.submit_d2h(dev, di, host, hi)
    first = h.done()
    elapsed = time.perf_counter() - t0
    assert first is False and elapsed < 0.05, elapsed
    assert h._keepalive is not None  # indices and buffers stay alive while the copy may read them
    h.wait()
    assert h.done() and h._keepalive is None
    assert torch.equal(bits(host.token_view()[:, :, hi]), bits(fresh.cpu()))
    back = torch.empty_like(fresh)
    dev.storage.index_fill_(2, di, 0)  # on the compute stream: the load-back must land after this
    h2 = eng.submit_h2d(host, hi, dev, di)
    h2.wait_stream()
    back.copy_(dev.storage[:, :, di])
    torch.cuda.synchronize()
    assert torch.equal(bits(back), bits(fresh))
    return h, h2
