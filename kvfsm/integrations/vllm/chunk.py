"""One offloaded chunk: the generated OffloadChunk machine plus the slot id the workers copy by.

It is also the chunk object vLLM's cache policies hold (their `ChunkStatus`): they read `ref_cnt` and
`is_ready`, which here are views of the machine's state and pin count, so no second copy of either exists.
"""

from __future__ import annotations

from typing import Any

from kvfsm.generated.offload_chunk import ABSENT, PINNED, READY, WRITE_PENDING, OffloadChunkMachine


class Chunk(OffloadChunkMachine):
    """A chunk key's machine (`ctx` is the key) and its CPU slot (`chunk_id`, -1 until the store allocates it)."""

    __slots__ = ("chunk_id",)

    def __init__(self, fx: Any, key: bytes, observer: Any = None) -> None:
        # OffloadChunkMachine.__init__'s fields, set here without the extra call: one Chunk per stored key
        # (mypy sees the generated base as Any, so not its __slots__: kvfsm.generated is found at run time)
        self.state, self.writes, self.pins = ABSENT, 0, 0  # type: ignore[misc]
        self.fx, self.ctx, self.observer = fx, key, observer  # type: ignore[misc]
        self.chunk_id = -1

    @property
    def ref_cnt(self, _pending: int = WRITE_PENDING) -> int:
        """vLLM's reference count: -1 while the store is pending, else the loads in flight."""
        return -1 if self.state == _pending else self.pins

    @property
    def is_ready(self, _ready: tuple[int, int] = (READY, PINNED)) -> bool:
        return self.state in _ready
