"""KV-cache shape configuration.

A frozen dataclass rather than a pydantic model: the data plane must import on machines that have torch
but not pydantic (the GPU benchmark host), and it needs no parsing beyond a few range checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import torch

Attention = Literal["mha", "mla"]

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accept a torch dtype or one of its common names ("bf16", "float16", ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype!r}; use one of {sorted(set(_DTYPES))}") from None


_ELEMENT_SIZE = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}  # the dtypes __post_init__ accepts


@dataclass(frozen=True)
class KVCacheConfig:
    """Shape of one model's KV cache per token.

    MHA keeps a K and a V plane per layer, each token row `[kv_heads, head_dim]`. MLA keeps one
    compressed latent per layer and token, `[1, head_dim]` with head_dim = kv_lora_rank + rope dim.
    """

    num_layers: int
    head_dim: int
    kv_heads: int = 1
    attention: Attention = "mha"
    dtype: torch.dtype = field(default=torch.bfloat16)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"attention must be 'mha' or 'mla', got {self.attention!r}")
        for name in ("num_layers", "head_dim", "kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.attention == "mla" and self.kv_heads != 1:
            raise ValueError("MLA keeps one latent head per token: kv_heads must be 1")
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"unsupported KV dtype {self.dtype}")

    # ---- derived shapes -------------------------------------------------------------------------
    # Cached (the config is frozen): every copy's planning and sizing asks for these, and each was a chain of
    # property calls (bytes_per_token five deep); cached_property writes the instance's __dict__ directly,
    # which a frozen dataclass allows, and fields-only equality and hashing ignore.
    @cached_property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @cached_property
    def num_planes(self) -> int:
        """2 (K and V) for MHA, 1 (latent) for MLA."""
        return 1 if self.is_mla else 2

    @cached_property
    def token_shape(self) -> tuple[int, int]:
        """Shape of one token's row in one plane of one layer."""
        return (self.kv_heads, self.head_dim)

    @cached_property
    def element_size(self) -> int:
        return _ELEMENT_SIZE[self.dtype]  # a table: copy sizing asks on every submit

    @cached_property
    def row_bytes(self) -> int:
        """Bytes of one token in one plane of one layer (the unit the copy kernels move)."""
        return self.kv_heads * self.head_dim * self.element_size

    @cached_property
    def bytes_per_token(self) -> int:
        """Bytes of one token across all planes and layers."""
        return self.num_planes * self.num_layers * self.row_bytes

    # ---- presets --------------------------------------------------------------------------------
    @classmethod
    def llama3_8b(cls, dtype: torch.dtype | str = torch.bfloat16) -> KVCacheConfig:
        """Llama-3-8B: 32 layers, GQA with 8 KV heads of dim 128 (128 KiB per token in bf16)."""
        return cls(num_layers=32, kv_heads=8, head_dim=128, attention="mha", dtype=parse_dtype(dtype))

    @classmethod
    def deepseek_mla(cls, dtype: torch.dtype | str = torch.bfloat16) -> KVCacheConfig:
        """DeepSeek-V3/R1 MLA: 61 layers, latent 512 + rope 64 = 576 per token and layer."""
        return cls(num_layers=61, kv_heads=1, head_dim=512 + 64, attention="mla", dtype=parse_dtype(dtype))

    @classmethod
    def tiny(cls, attention: Attention = "mha", dtype: torch.dtype | str = torch.bfloat16) -> KVCacheConfig:
        """A few KiB per page, for tests: 3 layers, 2 heads of dim 8 (MLA: one latent of dim 24)."""
        if attention == "mla":
            return cls(num_layers=3, kv_heads=1, head_dim=24, attention="mla", dtype=parse_dtype(dtype))
        return cls(num_layers=3, kv_heads=2, head_dim=8, attention="mha", dtype=parse_dtype(dtype))
