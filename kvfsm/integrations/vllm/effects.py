"""The actions of spec/offload_chunk.yaml: the slot pool, the cache policy's evictability and the tier's gauges.

A mixin of the manager: it works on the manager's own fields, named as vLLM's CPUOffloadingManager names them
(`_num_allocated_chunks`, `_free_list`, `_num_evictable_cache_chunks`, `_num_write_pending_chunks`, `_policy`,
and `_chunks`, kvfsm's index of live chunks), so vLLM's gauges and capacity check read exactly what the
machines did. Slots are handed out as vLLM does: fresh ones in order (0, 1, 2, ...), then the free list, last
freed first. Nothing here imports vLLM.
"""

from __future__ import annotations

from typing import Any

from kvfsm.integrations.vllm.chunk import Chunk


class ChunkEffects:
    """OffloadChunkEffects for every chunk of one tier (the actions' docs are in the spec)."""

    _num_chunks: int
    _num_allocated_chunks: int
    _free_list: list[int]
    _num_evictable_cache_chunks: int
    _num_write_pending_chunks: int
    _policy: Any
    _chunks: dict[bytes, Chunk]

    def allocate_slot(self, m: Chunk, arg: Any) -> None:
        if self._num_allocated_chunks < self._num_chunks:
            m.chunk_id = self._num_allocated_chunks
            self._num_allocated_chunks += 1
        else:
            m.chunk_id = self._free_list.pop()
        self._num_write_pending_chunks += 1

    def publish(self, m: Chunk, arg: Any) -> None:
        self._num_write_pending_chunks -= 1
        self._num_evictable_cache_chunks += 1
        self._policy.mark_evictable(m.ctx)

    def roll_back(self, m: Chunk, arg: Any) -> None:
        self._num_write_pending_chunks -= 1
        self._policy.remove(m.ctx)
        del self._chunks[m.ctx]
        self._free_list.append(m.chunk_id)

    def protect(self, m: Chunk, arg: Any) -> None:
        self._policy.mark_non_evictable(m.ctx)
        self._num_evictable_cache_chunks -= 1

    def pin_slot(self, m: Chunk, arg: Any) -> None:
        return

    def unprotect(self, m: Chunk, arg: Any) -> None:
        self._num_evictable_cache_chunks += 1
        self._policy.mark_evictable(m.ctx)

    def free_evicted_slot(self, m: Chunk, arg: Any) -> None:
        # the policy has already taken the chunk out of its lists (it chose it)
        self._num_evictable_cache_chunks -= 1
        del self._chunks[m.ctx]
        self._free_list.append(m.chunk_id)

    def drop_idle_slot(self, m: Chunk, arg: Any) -> None:
        return  # the reset rebuilds the pool whole once every chunk is dropped

    def drop_busy_slot(self, m: Chunk, arg: Any) -> None:
        return  # as drop_idle_slot; the connector fences the slot (the spec's fence rule)
