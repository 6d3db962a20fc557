"""The storage protocol: what the runtime needs of an L3 store, and what every backend shares.

`StorageBackend` is the protocol the runtime depends on (same shape as SGLang's HiCacheStorage batch
API): batch_set reports success per page, batch_get returns None for anything it cannot vouch for, and
batch_exists is the length of the stored prefix (pages are chained by hash, so only a prefix is usable).
A backend may also offer `batch_set_from_host(keys, host_pool, host_indices)`, which the backup worker
prefers: the store gathers the pages itself (FileStorage in one copy, Mooncake zero-copy). Keys carry a
deployment suffix (`storage_key_suffix`), like SGLang's HiCacheFile backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class StorageBackend(Protocol):
    """Page-keyed L3 store."""

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Store each page under its key; one success flag per page (a False page is not stored)."""
        ...

    def batch_get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """The stored uint8 page per key, or None when missing or not intact."""
        ...

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored (stops at the first missing one)."""
        ...


def store_host_pages(store: StorageBackend, keys: Sequence[str], host_pool: Any, slots: Any) -> list[bool]:
    """The pages at `slots` of `host_pool` into `store`, one success flag a key: a store that gathers pages
    itself (`batch_set_from_host`) is given the slots, any other the pages' bytes, one tensor a page. The
    backup worker, a store process and each shard of a sharded store all write through here. `host_pool` is a
    `HostKVPool`, or in a store process the pages staged for it (what `get_pages_bytes` reads)."""
    direct = getattr(store, "batch_set_from_host", None)
    if direct is not None:
        return list(direct(keys, host_pool, slots))
    return list(store.batch_set(keys, list(host_pool.get_pages_bytes(slots).unbind(0))))


def _check_batch(keys: Sequence[str], pages: Sequence[torch.Tensor]) -> None:
    if len(keys) != len(pages):
        raise ValueError(f"{len(keys)} keys but {len(pages)} pages")
    for p in pages:
        if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8:
            raise ValueError("pages must be uint8 tensors (HostKVPool.get_pages_bytes rows)")


def storage_key_suffix(model_name: str = "", tp_rank: int = 0, tp_size: int = 1, is_mla: bool = False) -> str:
    """SGLang HiCacheFile's per-deployment key suffix (`HiCacheFile.__init__`'s `config_suffix`, without
    pipeline or context parallelism): `_{model}_{tp_rank}_{tp_size}`, or `_{model}` for MLA, "/" -> "-"."""
    model = "-".join(model_name.split("/")) if model_name else ""
    return f"_{model}" if is_mla else f"_{model}_{tp_rank}_{tp_size}"


@dataclass
class StorageStats:
    writes_ok: int = 0
    writes_skipped: int = 0  # key already stored (content-addressed: same key, same bytes)
    writes_failed: int = 0
    reads_ok: int = 0
    reads_missing: int = 0
    reads_corrupt: int = 0
    reads_unverified: int = 0  # of reads_ok: pages no checksum vouches for (FileStorage: SGLang-written, no sidecar)
