"""The typed error of the vLLM manager's checked mode: a wrong call, named before it changes anything."""

from __future__ import annotations

from typing import Any

from kvfsm.errors import LifecycleError


class ChunkMisuse(LifecycleError, AssertionError):
    """A manager call that the chunk lifecycle (spec/offload_chunk.yaml) forbids for one of its keys.

    `call` is the OffloadingManager method, `key` the first offending OffloadKey, `state` that chunk's state
    (`absent` when the key has no chunk) and `reason` what the call would have broken. In checked mode it is
    raised before the call changes anything. It is also an AssertionError because vLLM's own manager reports
    the same calls by failing an assertion, so code written against vLLM's manager still catches it.
    """

    def __init__(self, call: str, key: bytes, state: str, reason: str) -> None:
        self.call, self.key, self.state, self.reason = call, key, state, reason
        super().__init__(f"{call}: key {key.hex()} (chunk {state}): {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.call, self.key, self.state, self.reason)
