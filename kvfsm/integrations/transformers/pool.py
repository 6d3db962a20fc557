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
    """The engine's full-attention paged cache, viewed (not copied) as a kvfsm DeviceKVPool whose slots are
    whole engine blocks.

    The engine keeps one flat byte tensor; block b is one contiguous run holding, for each of its L layers,
    the K then the V of `page_size` tokens: `(blocks, L, 2, page_size, H, D)`. A swap moves whole blocks
    (as the engine's own offloading does, through its `[blocks, bytes]` view), so the copy geometry is one
    row per block: `KVCacheConfig`'s one-plane, one-layer form (`attention="mla"`, one head) with the
    block's elements as the row. One block is then one DMA copy of its bytes ("dma_rows" in the CUDA
    engine) where a K/V-per-layer geometry would need 2 x L copies, and the host pool holds each block in
    the engine's own byte layout. `kv` is the same memory as `(2, L, blocks, page_size*H, D)` (K/V per
    layer); `blocks` and `host_blocks` give that view of some device or host blocks, for checks. Slot ids are the engine's block ids (its two trash sectors
    included, never allocated).
    """

    def __init__(self, allocator: Any) -> None:  # wraps the engine's memory: no DeviceKVPool.__init__
        layers, ps = int(allocator.pages_per_block), int(allocator.tokens_per_page)
        heads, head_dim = int(allocator.num_key_value_heads), int(allocator.head_dim)
        dtype = allocator.cache_dtype
        flat = allocator._copy_view  # [blocks, bytes_per_block] uint8 view of the whole cache tensor
        blocks, block_bytes = int(flat.shape[0]), int(flat.shape[1])
        elements = layers * 2 * ps * heads * head_dim
        self.config = KVCacheConfig(num_layers=1, kv_heads=1, head_dim=elements, attention="mla", dtype=dtype)
        if block_bytes != self.config.bytes_per_token:
            raise ValueError(
                f"engine block of {block_bytes} bytes is not {layers} layers x K/V x {ps} tokens x "
                f"{heads} heads x {head_dim} of {dtype}"
            )
        self.size = blocks
        self.device = resolve_device(flat.device)
        self.storage = flat.view(dtype).view(1, 1, blocks, 1, elements)  # (planes, layers, slots, 1, row)
        self.block_bytes = block_bytes
        self.num_layers, self.tokens_per_block, self.kv_heads, self.head_dim = layers, ps, heads, head_dim
        self.kv = self.kv_of(self.storage[0, 0, :, 0])

    def kv_of(self, rows: torch.Tensor) -> torch.Tensor:
        """Block rows `(n, elements)` (in the engine's block layout) as `(2, L, n, page_size*H, D)`."""
        n = int(rows.shape[0])
        return rows.reshape(n, self.num_layers, 2, self.tokens_per_block * self.kv_heads, self.head_dim).permute(
            2, 1, 0, 3, 4
        )

    def blocks(self, block_ids: list[int]) -> torch.Tensor:
        """`(2, L, n, page_size*H, D)` copy of these device blocks' KV (for checks)."""
        idx = torch.as_tensor(block_ids, dtype=torch.int64, device=self.device)
        return self.kv.index_select(2, idx)

    def host_blocks(self, host_pool: Any, slots: torch.Tensor) -> torch.Tensor:
        """The same view of host slots of a host pool built on this pool's config (for checks)."""
        return self.kv_of(host_pool.token_view()[0, 0, :, 0].index_select(0, slots))

    def tokens(self, blocks_kv: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The first `num_tokens` token rows `(2, L, num_tokens, H, D)` of a `blocks()` result."""
        p, layers, n, _, d = blocks_kv.shape
        rows = blocks_kv.reshape(p, layers, n * self.tokens_per_block, self.kv_heads, d)
        return rows[:, :, :num_tokens]
