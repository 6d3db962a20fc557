"""Checked mode: each call's keys are validated against the chunk lifecycle and the calling request's own
ledger before anything changes, so a wrong call raises ChunkMisuse naming its first bad key.

The ledger (one per request, kept in its ReqContext) records the stores the request prepared and has not
completed and the loads it pinned and has not completed; it tells a complete_load without its prepare_load
from a second complete_load, and a complete_store of a store the request never prepared from one that another
request's store completes. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfsm.generated.offload_chunk import PINNED, READY, STATES, WRITE_PENDING
from kvfsm.integrations.vllm.chunk import Chunk
from kvfsm.integrations.vllm.errors import ChunkMisuse


@dataclass(slots=True)
class Ledger:
    """What one request holds in the tier: stores it prepared and loads it pinned, not yet completed."""

    owner: object
    generation: int
    stores: set[bytes] = field(default_factory=set)
    stored: set[bytes] = field(default_factory=set)
    pins: Counter[Any] = field(default_factory=Counter)
    loaded: set[bytes] = field(default_factory=set)


def ledger(owner: object, generation: int, req_context: Any) -> Ledger:
    """The request's ledger for this manager and cache generation (a reset starts every ledger afresh)."""
    led = req_context.get_state(Ledger)
    if led is None or led.owner is not owner or led.generation != generation:
        led = Ledger(owner, generation)
        req_context.set_state(led)
    return led


def _state(chunk: Chunk | None) -> str:
    return "absent" if chunk is None else STATES[chunk.state]


def check_prepare_store(
    chunks: Mapping[bytes, Chunk], keys: list[bytes], finished: bool, seen: Collection[bytes]
) -> None:
    once: set[bytes] = set()
    for key in keys:
        if key in once:
            raise ChunkMisuse(
                "prepare_store",
                key,
                _state(chunks.get(key)),
                "the key is offered twice in one call; vLLM's manager would allocate two slots for it and lose one",
            )
        once.add(key)
        if finished and key not in seen:
            raise ChunkMisuse(
                "prepare_store",
                key,
                _state(chunks.get(key)),
                "the request already finished (on_request_finished); no new key may be stored for it",
            )


def check_prepare_load(
    chunks: Mapping[bytes, Chunk], keys: Iterable[bytes], finished: bool, seen: Collection[bytes]
) -> None:
    for key in keys:
        chunk = chunks.get(key)
        if chunk is None or chunk.state not in (READY, PINNED):
            raise ChunkMisuse(
                "prepare_load",
                key,
                _state(chunk),
                "only a stored chunk can be loaded (lookup must have answered HIT under the same "
                "hold of the manager's lock)",
            )
        if finished and key not in seen:
            raise ChunkMisuse(
                "prepare_load",
                key,
                _state(chunk),
                "the request already finished (on_request_finished); it may load nothing more",
            )


def check_complete_load(chunks: Mapping[bytes, Chunk], keys: Iterable[bytes], led: Ledger) -> None:
    for key, n in Counter(keys).items():
        chunk = chunks.get(key)
        if led.pins[key] >= n and chunk is not None and chunk.state == PINNED and chunk.pins >= n:
            continue
        if led.pins[key] == 0 and key in led.loaded:
            why = "a second complete_load of a load already completed; the chunk may be evicted while it is read"
        elif led.pins[key] > 0:
            why = "the call completes more loads of this key than the request has in flight"
        else:
            why = "complete_load without prepare_load: this request pinned no load of the key"
        raise ChunkMisuse("complete_load", key, _state(chunk), why)


def check_complete_store(chunks: Mapping[bytes, Chunk], keys: Iterable[bytes], led: Ledger) -> None:
    once: set[bytes] = set()
    for key in keys:
        chunk = chunks.get(key)
        if key in led.stores and key not in once and chunk is not None and chunk.state == WRITE_PENDING:
            once.add(key)
            continue
        if key in once or key in led.stored:
            why = "the store of this key was already completed"
        else:
            why = "complete_store of a key this request never prepared to store"
        raise ChunkMisuse("complete_store", key, _state(chunk), why)
