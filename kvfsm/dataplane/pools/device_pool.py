"""Device KV pools (MHA: K and V per layer; MLA: one latent per layer) on any torch device.

All planes and layers live in one tensor `(planes, layers, slots, heads, head_dim)` and the per-layer
buffers the attention kernels use are views of it. One allocation (instead of one per layer) lets a copy
kernel address every (plane, layer, slot) row from a single base pointer and three strides.
"""

from __future__ import annotations

import torch

from .config import KVCacheConfig


def resolve_device(device: torch.device | str | int) -> torch.device:
    """A device with its index filled in ("cuda" -> "cuda:<current>"), so devices compare reliably."""
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


class DeviceKVPool:
    """Token-slot indexed KV storage. Slot indices come from a TokenSlotAllocator of the same size."""

    def __init__(self, config: KVCacheConfig, num_slots: int, device: torch.device | str = "cpu") -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.config = config
        self.size = int(num_slots)
        self.device = resolve_device(device)
        shape = (config.num_planes, config.num_layers, self.size, *config.token_shape)
        # zeros, not empty: a slot never written reads as zeros, so a missing copy is visible in tests.
        self.storage = torch.zeros(shape, dtype=config.dtype, device=self.device)

    @staticmethod
    def create(config: KVCacheConfig, num_slots: int, device: torch.device | str = "cpu") -> DeviceKVPool:
        """The pool class that matches config.attention."""
        cls = MLADeviceKVPool if config.is_mla else MHADeviceKVPool
        return cls(config, num_slots, device)

    @property
    def dtype(self) -> torch.dtype:
        return self.config.dtype

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    has_token_view = True  # False for pools of separate per-layer buffers (layer_pool.LayerBufferKVPool)

    def token_view(self) -> torch.Tensor:
        """`(planes, layers, slots, heads, head_dim)` view; the copy engines index dim 2."""
        return self.storage

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The `[slots, heads, head_dim]` buffer(s) of one layer: (K, V) for MHA, (latent,) for MLA."""
        return tuple(self.storage[p, layer] for p in range(self.config.num_planes))

    def gather_rows(self, idx: torch.Tensor) -> torch.Tensor:
        """`(planes, layers, n, heads, head_dim)` rows at slots `idx` (int64, on the pool's device)."""
        return self.token_view().index_select(2, idx)

    def scatter_rows(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        """Write `(planes, layers, n, heads, head_dim)` rows into slots `idx` (index_copy_, never
        `view[idx] = ...` through a temporary: B15)."""
        self.token_view().index_copy_(2, idx, rows)


class MHADeviceKVPool(DeviceKVPool):
    """Per layer a K and a V buffer `[slots, kv_heads, head_dim]`."""

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.storage[0, layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self.storage[1, layer]


class MLADeviceKVPool(DeviceKVPool):
    """Per layer one latent buffer `[slots, 1, kv_lora_rank + rope_dim]`."""

    def kv_buffer(self, layer: int) -> torch.Tensor:
        return self.storage[0, layer]
