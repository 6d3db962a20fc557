"""vLLM's KV offloading (the OffloadingConnector) on spec/offload_chunk.yaml: a drop-in for vLLM 0.34's
CPUOffloadingManager whose chunks each run the generated OffloadChunk machine (docs/vllm.md).

`KvfsmOffloadingManager` and `KvfsmOffloadingSpec` need vLLM (extra `kvfsm[vllm]`) and are imported on first
use, so this package imports without it; `ChunkMisuse` (checked mode's typed error) and `Chunk` do not need it.
"""

from __future__ import annotations

from typing import Any

from kvfsm.integrations.vllm.chunk import Chunk
from kvfsm.integrations.vllm.errors import ChunkMisuse

__all__ = ["Chunk", "ChunkMisuse", "KvfsmOffloadingManager", "KvfsmOffloadingSpec"]


def __getattr__(name: str) -> Any:
    if name == "KvfsmOffloadingManager":
        from kvfsm.integrations.vllm.manager import KvfsmOffloadingManager

        return KvfsmOffloadingManager
    if name == "KvfsmOffloadingSpec":
        from kvfsm.integrations.vllm.spec import KvfsmOffloadingSpec

        return KvfsmOffloadingSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
