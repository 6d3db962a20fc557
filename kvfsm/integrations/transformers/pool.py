"""`PagedCachePool`: the engine's paged KV cache viewed, without a copy, as a kvfsm `DeviceKVPool`.

The one place that knows the engine's cache layout; kvfsm's copy engines see only a DeviceKVPool whose
slots are the engine's block ids.
"""

from __future__ import annotations

from typing import Any

import torch

from kvfsm.dataplane import KVCacheConfig
from kvfsm.dataplane.pools.device_pool import DeviceKVPool, resolve_device


class PagedCachePool(DeviceKVPool):
    """The engine's full-attention paged cache, viewed (not copied) as a kvfsm DeviceKVPool.

    The engine keeps one flat byte tensor; block b holds, for each of its L layers, the K then the V of
    `page_size` tokens: `(blocks, L, 2, page_size, H, D)`. Permuted, that is kvfsm's
    `(planes=2, layers=L, slots=blocks, page_size*H, D)`: one kvfsm slot is one engine block, and slot
    ids are the engine's block ids (its two trash sectors included, never allocated).
    """

    def __init__(self, allocator: Any) -> None:  # wraps the engine's memory: no DeviceKVPool.__init__
        layers, ps = int(allocator.pages_per_block), int(allocator.tokens_per_page)
        heads, head_dim = int(allocator.num_key_value_heads), int(allocator.head_dim)
        dtype = allocator.cache_dtype
        self.config = KVCacheConfig(num_layers=layers, kv_heads=ps * heads, head_dim=head_dim, attention="mha",
                                    dtype=dtype)
        flat = allocator._copy_view  # [blocks, bytes_per_block] uint8 view of the whole cache tensor
        if flat.shape[1] != self.config.bytes_per_token:
            raise ValueError(f"engine block of {flat.shape[1]} bytes does not match {self.config}")
        blocks = int(flat.shape[0])
        self.size = blocks
        self.device = resolve_device(flat.device)
        self.storage = flat.view(dtype).view(blocks, layers, 2, ps * heads, head_dim).permute(2, 1, 0, 3, 4)
        self.block_bytes = int(flat.shape[1])
        self.tokens_per_block, self.kv_heads = ps, heads

    def blocks(self, block_ids: list[int]) -> torch.Tensor:
        """`(2, L, n, page_size*H, D)` copy of these blocks' KV (for checks)."""
        idx = torch.as_tensor(block_ids, dtype=torch.int64, device=self.device)
        return self.storage.index_select(2, idx)

    def tokens(self, blocks_kv: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The first `num_tokens` token rows `(2, L, num_tokens, H, D)` of a `blocks()` result."""
        p, layers, n, _, d = blocks_kv.shape
        rows = blocks_kv.reshape(p, layers, n * self.tokens_per_block, self.kv_heads, d)
        return rows[:, :, :num_tokens]
