"""One offloaded chunk: the generated OffloadChunk machine plus the slot id the workers copy by.

It is also the chunk object vLLM's cache policies hold (their `ChunkStatus`): they read `ref_cnt` and
`is_ready`, which here are views of the machine's state and pin count, so no second copy of either exists.
"""

from __future__ import annotations

from typing import Any

from kvfsm.generated.offload_chunk import PINNED, READY, WRITE_PENDING, OffloadChunkMachine


class Chunk(OffloadChunkMachine):
    """A chunk key's machine (`ctx` is the key) and its CPU slot (`chunk_id`, -1 until the store allocates it)."""

    __slots__ = ("chunk_id",)

    def __init__(self, fx: Any, key: bytes, observer: Any = None) -> None:
        super().__init__(fx, key, observer)
        self.chunk_id = -1

    @property
    def ref_cnt(self) -> int:
        """vLLM's reference count: -1 while the store is pending, else the loads in flight."""
        return -1 if self.state == WRITE_PENDING else self.pins

    @property
    def is_ready(self) -> bool:
        return self.state == READY or self.state == PINNED
