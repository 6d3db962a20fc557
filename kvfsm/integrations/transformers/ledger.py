"""`SwapLedger`: checked mode's block ledger (who holds each host block, which device blocks are under a copy).

Kept apart from the manager because it is pure bookkeeping over block ids: it raises `CheckedModeError`
on a reused, double-freed or foreign block and never touches tensors or the engine.
"""

from __future__ import annotations

from kvfsm.runtime.ledger import CheckedModeError


class SwapLedger:
    """Every host block is free or held by one request; no device block is freed, restored into or copied
    while a copy of it is in flight; a restore writes only blocks the engine gave this request alone."""

    def __init__(self) -> None:
        self.host_owner: dict[int, str] = {}
        self.in_flight: dict[int, tuple[str, str]] = {}  # device block -> (request key, direction)

    def copy_started(self, key: str, event: str, direction: str, device_blocks: list[int],
                     host_blocks: list[int]) -> None:
        for b in device_blocks:
            if b in self.in_flight:
                other, d = self.in_flight[b]
                raise CheckedModeError(key, event, b, f"device block already under an in-flight {d} copy of {other} (B2)")
        for h in host_blocks:
            owner = self.host_owner.get(h)
            if direction == "d2h" and owner is not None:
                raise CheckedModeError(key, event, h, f"host block already held by {owner} (host double alloc)")
            if direction == "h2d" and owner != key:
                raise CheckedModeError(key, event, h, f"restoring from a host block held by {owner}, not this request")
        if direction == "d2h":
            for h in host_blocks:
                self.host_owner[h] = key
        for b in device_blocks:
            self.in_flight[b] = (key, direction)

    def copy_aborted(self, key: str, direction: str, device_blocks: list[int], host_blocks: list[int]) -> None:
        for b in device_blocks:
            self.in_flight.pop(b, None)
        if direction == "d2h":
            for h in host_blocks:
                if self.host_owner.get(h) == key:
                    del self.host_owner[h]

    def copy_done(self, device_blocks: list[int]) -> None:
        for b in device_blocks:
            self.in_flight.pop(b, None)

    def release_device(self, key: str, event: str, device_blocks: list[int]) -> None:
        for b in device_blocks:
            if b in self.in_flight:
                other, d = self.in_flight[b]
                raise CheckedModeError(key, event, b, f"freeing a device block an in-flight {d} copy of {other} still uses (B2)")

    def free_host(self, key: str, event: str, host_blocks: list[int]) -> None:
        for h in host_blocks:
            if self.host_owner.get(h) != key:
                raise CheckedModeError(key, event, h, f"freeing a host block held by {self.host_owner.get(h)}, "
                                                      "not this request (host double free, B10)")
        for h in host_blocks:
            del self.host_owner[h]
