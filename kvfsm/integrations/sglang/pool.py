"""SGLang's per-layer KV buffers as a kvfsm device pool.

SGLang's `MHATokenToKVPool` keeps `k_buffer[l]` and `v_buffer[l]`, `MLATokenToKVPool` `kv_buffer[l]`:
separate allocations of `[size + page_size, heads, dim]` each. `SGLangDeviceKVPool` presents them, in
place, as kvfsm's `LayerBufferKVPool` (kvfsm.dataplane.pools.layer_pool), which every kvfsm copy engine
copies from: `CpuCopyEngine` on a CPU server (synchronous, as upstream's CPU path acks at `write`),
`CudaCopyEngine` on a GPU server (one Triton launch over the buffers' pointer table, on kvfsm's copy
stream, behind the decode step). Anything else is refused with a ConfigError naming the pool type.
"""

from __future__ import annotations

from typing import Any

import torch

from kvfsm.dataplane.pools.layer_pool import LayerBufferKVPool
from kvfsm.errors import ConfigError

from .settings import SOURCE


def _buffers(kv_pool: Any) -> tuple[list[list[torch.Tensor]], bool]:
    """(per plane, the per-layer buffers; is MLA) of an SGLang MHA or MLA pool; anything else: ConfigError."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.unified_memory_pool import UnifiedSWAKVPool

    name = type(kv_pool).__name__
    if isinstance(kv_pool, UnifiedSWAKVPool):
        raise ConfigError(
            "kv_cache",
            f"{name} (hybrid sliding-window attention) is not supported by kvfsm's SGLang "
            f"adapter: its SWA pages would need their own host pool and transfers; use "
            f"upstream's DecodeKVCacheOffloadManager for hybrid SWA models",
            SOURCE,
        )
    if isinstance(kv_pool, MLATokenToKVPool):
        return [list(kv_pool.kv_buffer)], True
    if isinstance(kv_pool, MHATokenToKVPool):
        return [list(kv_pool.k_buffer), list(kv_pool.v_buffer)], False
    raise ConfigError(
        "kv_cache",
        f"unsupported KV cache type for decode offload: {name} (kvfsm's SGLang adapter "
        f"takes MHATokenToKVPool and MLATokenToKVPool, as upstream)",
        SOURCE,
    )


class SGLangDeviceKVPool(LayerBufferKVPool):
    """An SGLang KV pool's per-layer buffers as a kvfsm device pool (no copy, no allocation).

    `size` is the buffers' row count (`size + page_size`: the slots SGLang's allocator can hand out),
    `config` their shape and dtype, `device` theirs (CPU or CUDA)."""

    def __init__(self, kv_pool: Any) -> None:
        planes, is_mla = _buffers(kv_pool)
        try:
            super().__init__(planes, attention="mla" if is_mla else "mha", name=type(kv_pool).__name__)
        except ValueError as exc:
            raise ConfigError("kv_cache", str(exc), SOURCE) from None
        self.kv_pool = kv_pool
