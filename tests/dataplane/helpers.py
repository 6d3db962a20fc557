"""Helpers shared by the data-plane tests."""

from __future__ import annotations

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


def make_host_pool(config: KVCacheConfig, slots: int = 32, page_size: int = 4, layout: str = "layer_first") -> HostKVPool:
    return HostKVPool(config, slots, page_size, layout)  # type: ignore[arg-type]
