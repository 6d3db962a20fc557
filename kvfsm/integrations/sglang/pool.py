"""SGLang's per-layer KV buffers as a kvfsm device pool, and the copy engine that reads them.

kvfsm's pools keep every plane and layer in one `(planes, layers, slots, heads, dim)` tensor; SGLang's
`MHATokenToKVPool` keeps `k_buffer[l]` and `v_buffer[l]`, `MLATokenToKVPool` `kv_buffer[l]`: separate
allocations of `[size + page_size, heads, dim]` each. Rather than copying them into one tensor,
`SGLangDeviceKVPool` presents the per-layer buffers (`layer_buffers`) with kvfsm's `KVCacheConfig`, and
`LayerwiseCopyEngine` copies plane by plane, layer by layer, into (and out of) a kvfsm `HostKVPool`. It
runs on the CPU, synchronously (a handle is done when submit returns, as upstream's CPU path acks at
`write`). There is no CUDA path: a device pool on CUDA is refused when the pool is built.
"""

from __future__ import annotations

from typing import Any

import torch

from kvfsm.dataplane import CopyEngine, CopyHandle, DeviceKVPool, HostKVPool, KVCacheConfig
from kvfsm.dataplane.copy.base import plan_copy
from kvfsm.dataplane.copy.cpu import DoneHandle
from kvfsm.dataplane.pools.allocator import IndexLike
from kvfsm.errors import ConfigError

from .settings import SOURCE

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _buffers(kv_pool: Any) -> tuple[list[list[torch.Tensor]], bool]:
    """(per plane, the per-layer buffers; is MLA) of an SGLang MHA or MLA pool; anything else: ConfigError."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.unified_memory_pool import UnifiedSWAKVPool

    name = type(kv_pool).__name__
    if isinstance(kv_pool, UnifiedSWAKVPool):
        raise ConfigError("kv_cache", f"{name} (hybrid sliding-window attention) is not supported by kvfsm's SGLang "
                                      f"adapter: its SWA pages would need their own host pool and transfers; use "
                                      f"upstream's DecodeKVCacheOffloadManager for hybrid SWA models", SOURCE)
    if isinstance(kv_pool, MLATokenToKVPool):
        return [list(kv_pool.kv_buffer)], True
    if isinstance(kv_pool, MHATokenToKVPool):
        return [list(kv_pool.k_buffer), list(kv_pool.v_buffer)], False
    raise ConfigError("kv_cache", f"unsupported KV cache type for decode offload: {name} (kvfsm's SGLang adapter "
                                  f"takes MHATokenToKVPool and MLATokenToKVPool, as upstream)", SOURCE)


class SGLangDeviceKVPool(DeviceKVPool):
    """An SGLang KV pool's per-layer buffers as a kvfsm DeviceKVPool (no copy, no allocation).

    `size` is the buffers' row count (`size + page_size`: the slots SGLang's allocator can hand out),
    `config` their shape and dtype. `token_view()` does not exist (the buffers are separate allocations):
    copy with `LayerwiseCopyEngine`."""

    def __init__(self, kv_pool: Any) -> None:  # noqa: D107 (no super().__init__: it would allocate)
        planes, is_mla = _buffers(kv_pool)
        first = planes[0][0]
        shapes = {tuple(b.shape) for plane in planes for b in plane}
        kind = type(kv_pool).__name__
        if len(shapes) != 1 or first.dim() != 3:
            raise ConfigError("kv_cache", f"{kind}: kvfsm needs equal [slots, heads, dim] buffers for every "
                                          f"plane and layer (K and V of one head_dim), got {sorted(shapes)}", SOURCE)
        dtypes = {b.dtype for plane in planes for b in plane}
        if len(dtypes) != 1 or first.dtype not in _DTYPES:
            raise ConfigError("kv_cache", f"{kind} stores {sorted(map(str, dtypes))}; kvfsm's host pools hold "
                                          f"bfloat16, float16 or float32 KV (an fp8 cache is not supported)", SOURCE)
        devices = {b.device for plane in planes for b in plane}
        if devices != {torch.device("cpu")}:
            raise ConfigError("device", f"{kind} lives on {sorted(map(str, devices))}: kvfsm's SGLang adapter "
                                        f"runs on CPU pools only (LayerwiseCopyEngine has no CUDA stream path, and "
                                        f"SGLang's req_to_token on the GPU has no host mirror for kvfsm to read)",
                              SOURCE)
        slots, heads, dim = (int(x) for x in first.shape)
        self.config = KVCacheConfig(num_layers=len(planes[0]), head_dim=dim, kv_heads=heads,
                                    attention="mla" if is_mla else "mha", dtype=first.dtype)
        self.size = slots
        self.device = first.device
        self.planes = planes
        self.kv_pool = kv_pool

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for plane in self.planes for b in plane)

    def token_view(self) -> torch.Tensor:
        raise NotImplementedError("SGLang's KV buffers are one allocation per layer: there is no 5-D token view; "
                                  "copy with kvfsm.integrations.sglang.LayerwiseCopyEngine")

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        return tuple(plane[layer] for plane in self.planes)


class LayerwiseCopyEngine(CopyEngine):
    """Copies between an `SGLangDeviceKVPool` and a kvfsm `HostKVPool`, one (plane, layer) buffer at a time,
    synchronously on the CPU. Indices are checked by kvfsm's `plan_copy` before anything moves."""

    def submit_d2h(self, device_pool: DeviceKVPool, device_indices: IndexLike, host_pool: HostKVPool,
                   host_indices: IndexLike) -> CopyHandle:
        plan = plan_copy("d2h", device_pool, device_indices, host_pool, host_indices)
        if plan.num_tokens:
            host = host_pool.token_view()
            for p, plane in enumerate(_planes(device_pool)):
                for layer, buf in enumerate(plane):
                    host[p, layer].index_copy_(0, plan.host_idx, buf.index_select(0, plan.device_idx))
        return DoneHandle(plan)

    def submit_h2d(self, host_pool: HostKVPool, host_indices: IndexLike, device_pool: DeviceKVPool,
                   device_indices: IndexLike) -> CopyHandle:
        plan = plan_copy("h2d", device_pool, device_indices, host_pool, host_indices)
        if plan.num_tokens:
            host = host_pool.token_view()
            for p, plane in enumerate(_planes(device_pool)):
                for layer, buf in enumerate(plane):
                    buf.index_copy_(0, plan.device_idx, host[p, layer].index_select(0, plan.host_idx))
        return DoneHandle(plan)


def _planes(device_pool: DeviceKVPool) -> list[list[torch.Tensor]]:
    if not isinstance(device_pool, SGLangDeviceKVPool):
        raise TypeError(f"LayerwiseCopyEngine copies SGLangDeviceKVPool buffers, got {type(device_pool).__name__}")
    return device_pool.planes
