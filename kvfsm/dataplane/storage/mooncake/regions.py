"""The host memory registered with a Mooncake client. RDMA-like transports read and write only registered
memory (TCP reads any address); a page inside a registered range is sent in place, any other is staged."""

from __future__ import annotations

import logging
import threading
from typing import Any

from .runner import _Runner

logger = logging.getLogger(__package__)


class Regions:
    """Registered [start, end) address ranges of one client, and the host pools registered whole."""

    def __init__(self, client: Any, runner: _Runner, op_timeout_s: float, lock: threading.Lock) -> None:
        self.client, self.runner, self.op_timeout_s, self.lock = client, runner, op_timeout_s, lock
        self.ranges: list[tuple[int, int]] = []
        self.pools: set[int] = set()  # id() of host pools registered whole

    def covers(self, addr: int, nbytes: int) -> bool:
        return any(s <= addr and addr + nbytes <= e for s, e in self.ranges)

    def register(self, addr: int, nbytes: int, strict: bool = False) -> bool:
        """Register [addr, addr + nbytes) unless a registered range covers it. A refusal raises when `strict`,
        else is logged and answered False (the caller stages or fails that page)."""
        if self.covers(addr, nbytes):
            return True
        client = self.client
        status, rc = self.runner.call(lambda: client.register_buffer(addr, nbytes), self.op_timeout_s)
        if status != "ok" or rc != 0:
            if strict:
                raise RuntimeError(f"Mooncake register_buffer({nbytes} bytes) failed: {status} {rc}")
            logger.warning("Mooncake register_buffer(%d bytes) failed: %s %s", nbytes, status, rc)
            return False
        with self.lock:
            self.ranges.append((addr, addr + nbytes))
        return True

    def unregister(self, addr: int) -> None:
        """Undo the registration that starts at `addr` (before that memory is freed); nothing if none does."""
        with self.lock:
            if not any(s == addr for s, _ in self.ranges):
                return
            self.ranges = [r for r in self.ranges if r[0] != addr]
        client = self.client
        self.runner.call(lambda: client.unregister_buffer(addr), self.op_timeout_s)

    def forget(self, addrs: list[int]) -> None:
        """Drop the ranges starting at `addrs`, which the caller unregistered on the client itself."""
        with self.lock:
            self.ranges = [r for r in self.ranges if r[0] not in addrs]
