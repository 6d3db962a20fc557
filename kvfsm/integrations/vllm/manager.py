"""KvfsmOffloadingManager: vLLM's CPU offload manager with every chunk's lifecycle on the generated machine.

It is a drop-in for vLLM 0.34's `CPUOffloadingManager` (same constructor, same answers, slot ids and events;
docs/vllm.md lists the differences, all under misuse). What it keeps from vLLM is what is not a chunk's
lifecycle: the cache policies (LRU, ARC or an out-of-tree one, through vLLM's CachePolicyFactory) and the
per-request access bookkeeping that orders them, inherited unchanged. What it replaces is every change of a
chunk's state: the store, its completion or rollback, each load's pin and unpin, eviction and reset are events
of the chunk's OffloadChunk machine, whose actions (effects.py) move the slots and the gauges. In checked mode
each call is validated first (checked.py) and a wrong one raises ChunkMisuse with nothing changed.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, OffloadingEvent, OffloadKey, PrepareStoreOutput, ReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingInfo
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvfsm.errors import EventRejected
from kvfsm.generated.offload_chunk import PINNED, READY, STATES, WRITE_PENDING, violated_invariants
from kvfsm.integrations.vllm import checked as chk
from kvfsm.integrations.vllm.chunk import Chunk
from kvfsm.integrations.vllm.effects import ChunkEffects
from kvfsm.integrations.vllm.errors import ChunkMisuse

_MISS, _HIT, _HIT_PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING


class KvfsmOffloadingManager(ChunkEffects, CPUOffloadingManager):
    """vLLM's OffloadingManager for a CPU tier of `num_chunks` slots, on spec/offload_chunk.yaml.

    `checked=True` validates every call against the lifecycle and the calling request's ledger before it
    changes anything (ChunkMisuse on a wrong call); unchecked, it answers exactly as vLLM's manager does.
    """

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: CPUOffloadingInfo | None = None,
        *,
        checked: bool = False,
    ) -> None:
        super().__init__(
            num_chunks,
            cache_policy=cache_policy,
            cache_policy_module_path=cache_policy_module_path,
            enable_events=enable_events,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            info=info,
        )
        self._chunks: dict[bytes, Chunk] = {}
        self.checked = checked
        # called as observer(chunk, event, source, target, transition id) after each chunk transition (tests,
        # coverage); chunks created from then on get it
        self.observer: Any = None

    # --- the lifecycle's reads -------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        chunk = self._chunks.get(key)
        if chunk is None:
            return _MISS
        return _HIT_PENDING if chunk.state == WRITE_PENDING else _HIT

    def chunk_state(self, key: bytes) -> str:
        """The key's lifecycle state: `absent`, `write_pending`, `ready` or `pinned`."""
        chunk = self._chunks.get(key)
        return "absent" if chunk is None else STATES[chunk.state]

    # --- loads -------------------------------------------------------------------------------------------

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        return self._prepare_load(keys, req_context, record_access=True)

    def _prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext, *, record_access: bool
    ) -> CPULoadStoreSpec:
        chunks = self._chunks
        if self.checked:
            access = self._get_request_cache_access(req_context)
            chk.check_prepare_load(chunks, keys, access.finished, access.seen_keys)
        slots = []
        for key in keys:
            chunk = chunks.get(key)
            if chunk is None:
                raise ChunkMisuse("prepare_load", key, "absent", "only a stored chunk can be loaded")
            try:
                chunk.pin()
            except EventRejected as e:
                raise ChunkMisuse("prepare_load", key, e.state, e.reason) from None
            slots.append(chunk.chunk_id)
        if self.checked:
            led = self._ledger(req_context)
            for key in keys:
                led.pins[key] += 1
        if record_access:
            self._record_request_cache_access(keys, req_context, reused_keys=keys)
        return CPULoadStoreSpec(slots)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        chunks = self._chunks
        if self.checked:
            led = self._ledger(req_context)
            chk.check_complete_load(chunks, keys, led)
            for key in keys:
                led.pins[key] -= 1
                led.loaded.add(key)
        for key in keys:
            chunk = chunks.get(key)
            if chunk is None:
                raise ChunkMisuse("complete_load", key, "absent", "no load of this chunk is in flight")
            try:
                chunk.unpin()
            except EventRejected as e:
                raise ChunkMisuse("complete_load", key, e.state, e.reason) from None

    # --- stores ------------------------------------------------------------------------------------------

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        state = self._get_request_cache_access(req_context)
        if self.checked:
            chk.check_prepare_store(self._chunks, keys, state.finished, state.seen_keys)
        if self.counts is not None:
            self._record_accesses(keys, state.counted_keys)
        chunks = self._chunks
        keys_to_store: list[OffloadKey] = []
        ready_existing_keys: list[OffloadKey] = []
        for key in keys:
            chunk = chunks.get(key)
            if chunk is None:
                keys_to_store.append(key)
            elif chunk.state != WRITE_PENDING:
                ready_existing_keys.append(key)

        if self.counts is not None:
            admitted_keys: list[OffloadKey] = []
            for key in keys_to_store:
                if self.counts.get(key, 0) >= self.store_threshold:
                    admitted_keys.append(key)
                elif key not in state.counted_keys:
                    self.stores_skipped_in_current_batch += 1
            keys_to_store = admitted_keys
            state.counted_keys.update(keys)

        new_store_misses = [key for key in keys_to_store if key not in state.store_miss_keys]
        if new_store_misses:
            self._policy.on_store_miss(new_store_misses, req_context)
            state.store_miss_keys.update(new_store_misses)

        recorded_keys = set(keys_to_store)
        recorded_keys.update(ready_existing_keys)
        self._record_request_cache_access(
            (key for key in keys if key in recorded_keys), req_context, reused_keys=ready_existing_keys
        )

        if not keys_to_store:
            return PrepareStoreOutput(keys_to_store=[], store_spec=CPULoadStoreSpec([]), evicted_keys=[])

        self.allocation_sizes_in_current_batch.append(len(keys_to_store))
        num_free = len(self._free_list) + self._num_chunks - self._num_allocated_chunks
        num_chunks_to_evict = len(keys_to_store) - num_free
        to_evict: list[OffloadKey] = []
        if num_chunks_to_evict > 0:
            if num_chunks_to_evict > self._num_evictable_cache_chunks:
                return None
            evicted = self._policy.evict(num_chunks_to_evict, set(keys))
            if evicted is None:
                return None
            for key, chunk in evicted:
                chunk.evict()
                to_evict.append(key)
        if to_evict and self.events is not None:
            self.events.append(OffloadingEvent(keys=to_evict, medium=self.medium, removed=True))

        slots = []
        insert, observer = self._policy.insert, self.observer
        for key in keys_to_store:
            chunk = Chunk(self, key, observer)
            chunk.store()
            chunks[key] = chunk
            slots.append(chunk.chunk_id)
            insert(key, chunk, req_context)
        state.inserted_keys.update(keys_to_store)
        if self.checked:
            led = self._ledger(req_context)
            led.stores.update(keys_to_store)
            led.stored.difference_update(keys_to_store)
        return PrepareStoreOutput(
            keys_to_store=keys_to_store, store_spec=CPULoadStoreSpec(slots), evicted_keys=to_evict
        )

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        chunks = self._chunks
        if self.checked:
            led = self._ledger(req_context)
            chk.check_complete_store(chunks, keys, led)
            led.stores.difference_update(keys)
            led.stored.update(keys)
        done: list[OffloadKey] = []
        for key in keys:
            chunk = chunks.get(key)
            if chunk is not None and chunk.state == WRITE_PENDING:
                if success:
                    chunk.store_done()
                else:
                    chunk.rollback()
                done.append(key)
        if done and self.events is not None:
            if success:
                self.events.append(
                    OffloadingEvent(
                        keys=done, medium=self.medium, removed=False, removal_expected=True, req_context=req_context
                    )
                )
            else:
                self.events.append(OffloadingEvent(keys=done, medium=self.medium, removed=True, metadata_only=True))

    # --- reset -------------------------------------------------------------------------------------------

    def reset_cache(self) -> None:
        for chunk in self._chunks.values():
            chunk.reset()
        self._chunks.clear()
        super().reset_cache()

    # --- checks ------------------------------------------------------------------------------------------

    def _ledger(self, req_context: ReqContext) -> chk.Ledger:
        return chk.ledger(self, self._cache_generation, req_context)

    def audit(self) -> list[str]:
        """Every violation of the tier's invariants now, across chunks: each chunk's spec invariants; no slot
        in two chunks or both in a chunk and free; every slot below capacity; the gauges equal to the counts of
        chunks in their states. Empty when all hold (tests call it after every step)."""
        bad: list[str] = []
        owners: dict[int, bytes] = {}
        pending = evictable = 0
        for key, chunk in self._chunks.items():
            bad += [f"{key.hex()}: {name}" for name in violated_invariants(chunk)]
            if chunk.ctx != key or chunk.state not in (WRITE_PENDING, READY, PINNED):
                bad.append(f"{key.hex()}: indexed in state {chunk.state} under key {chunk.ctx!r}")
            if not 0 <= chunk.chunk_id < self._num_allocated_chunks:
                bad.append(f"{key.hex()}: slot {chunk.chunk_id} outside the {self._num_allocated_chunks} allocated")
            if chunk.chunk_id in owners:
                bad.append(f"slot {chunk.chunk_id} in two chunks: {owners[chunk.chunk_id].hex()} and {key.hex()}")
            owners[chunk.chunk_id] = key
            pending += chunk.state == WRITE_PENDING
            evictable += chunk.state == READY
            if self._policy.get(key) is not chunk:
                bad.append(f"{key.hex()}: the cache policy holds another chunk for it")
        free = set(self._free_list)
        if len(free) != len(self._free_list):
            bad.append("a slot is twice in the free list")
        if free & set(owners):
            bad.append(f"slots both free and in a chunk: {sorted(free & set(owners))}")
        if self._num_allocated_chunks > self._num_chunks:
            bad.append(f"{self._num_allocated_chunks} slots handed out of {self._num_chunks}")
        if (pending, evictable) != (self._num_write_pending_chunks, self._num_evictable_cache_chunks):
            bad.append(
                f"gauges (write pending {self._num_write_pending_chunks}, evictable "
                f"{self._num_evictable_cache_chunks}) differ from the chunks ({pending}, {evictable})"
            )
        return bad


__all__ = ["KvfsmOffloadingManager", "ChunkMisuse"]
