"""A device KV pool made of an engine's own per-layer buffers (SGLang's `k_buffer[l]`, `v_buffer[l]`).

kvfsm's own pools keep every plane and layer in one `(planes, layers, slots, heads, dim)` tensor, so a
copy kernel addresses any row from one base pointer. Engines such as SGLang allocate one
`[slots, heads, dim]` tensor per plane and layer instead, and the offload manager must copy from those
in place. `LayerBufferKVPool` presents them as a `DeviceKVPool` without copying or allocating KV:
- `gather_rows` / `scatter_rows` move token rows of every plane and layer (what the CPU engines and the
  CUDA engine's torch path use);
- `layer_pointers()` is the table of the buffers' base addresses (int64, on the buffers' device, built
  once: the buffers never move), through which one Triton launch reaches every buffer
  (`triton_kernels.kv_layer_rows_copy`), as SGLang's own `data_ptrs` do for its kernels;
- `token_view()` does not exist: there is no single tensor to view (`NoTokenView`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from .config import KVCacheConfig
from .device_pool import DeviceKVPool

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class NoTokenView(TypeError):
    """The pool's planes and layers are separate allocations: copy through gather/scatter or the pointer
    table (every kvfsm copy engine does), never through a 5-D view."""


class LayerBufferKVPool(DeviceKVPool):
    """Per plane (K, V for MHA; the latent for MLA), one `[slots, heads, dim]` buffer per layer, all of one
    shape, dtype and device, each contiguous. `ValueError` names what differs."""

    def __init__(
        self, planes: Sequence[Sequence[torch.Tensor]], *, attention: str = "mha", name: str = "layer buffers"
    ) -> None:  # no super().__init__: it would allocate
        planes = [list(p) for p in planes]
        expected = 1 if attention == "mla" else 2
        if len(planes) != expected or not planes[0] or len({len(p) for p in planes}) != 1:
            raise ValueError(
                f"{name}: {attention} needs {expected} plane(s) of equally many layer buffers, got "
                f"{[len(p) for p in planes]}"
            )
        first = planes[0][0]
        buffers = [b for plane in planes for b in plane]
        shapes = {tuple(b.shape) for b in buffers}
        if len(shapes) != 1 or first.dim() != 3:
            raise ValueError(f"{name}: every plane and layer needs one [slots, heads, dim] shape, got {sorted(shapes)}")
        dtypes = {b.dtype for b in buffers}
        if len(dtypes) != 1 or first.dtype not in _DTYPES:
            raise ValueError(
                f"{name} stores {sorted(map(str, dtypes))}; kvfsm's host pools hold bfloat16, "
                f"float16 or float32 KV (an fp8 cache is not supported)"
            )
        devices = {b.device for b in buffers}
        if len(devices) != 1:
            raise ValueError(f"{name}: buffers on several devices {sorted(map(str, devices))}")
        if not all(b.is_contiguous() for b in buffers):
            raise ValueError(f"{name}: every layer buffer must be contiguous (token rows at a fixed stride)")
        slots, heads, dim = (int(x) for x in first.shape)
        self.config = KVCacheConfig(
            num_layers=len(planes[0]),
            head_dim=dim,
            kv_heads=heads,
            attention="mla" if attention == "mla" else "mha",
            dtype=first.dtype,
        )
        self.size = slots
        self.device = first.device
        self.planes = planes
        self._pointers: Optional[torch.Tensor] = None

    has_token_view = False

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for plane in self.planes for b in plane)

    def token_view(self) -> torch.Tensor:
        raise NoTokenView("a LayerBufferKVPool's layers are separate allocations: there is no 5-D token view")

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        return tuple(plane[layer] for plane in self.planes)

    def gather_rows(self, idx: torch.Tensor) -> torch.Tensor:
        """`(planes, layers, n, heads, dim)` rows at slots `idx` (on the pool's device), one index_select
        per buffer into one output tensor."""
        c = self.config
        out = torch.empty(
            (c.num_planes, c.num_layers, int(idx.numel()), *c.token_shape), dtype=c.dtype, device=self.device
        )
        for p, plane in enumerate(self.planes):
            for layer, buf in enumerate(plane):
                torch.index_select(buf, 0, idx, out=out[p, layer])
        return out

    def scatter_rows(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        """Write `(planes, layers, n, heads, dim)` rows into slots `idx`."""
        for p, plane in enumerate(self.planes):
            for layer, buf in enumerate(plane):
                buf.index_copy_(0, idx, rows[p, layer])

    def layer_pointers(self) -> torch.Tensor:
        """Base addresses of the buffers, plane-major (`[p * layers + l]`), int64 on the pool's device.
        Made on first use with one host-to-device copy; the caller's stream orders it before its kernels."""
        if self._pointers is None:
            ptrs = torch.tensor([b.data_ptr() for plane in self.planes for b in plane], dtype=torch.int64)
            if self.device.type == "cuda":
                ptrs = ptrs.pin_memory().to(self.device, non_blocking=True)  # pageable memory would sync
            self._pointers = ptrs
        return self._pointers

    @property
    def token_stride(self) -> int:
        """Elements between consecutive slots of one buffer (heads x dim: the buffers are contiguous)."""
        return int(self.planes[0][0].stride(0))
