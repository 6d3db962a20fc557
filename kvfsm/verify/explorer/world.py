"""The explored world: the bound (`ExplorerConfig`) and one implementation state (`World`).

A World is a SimEngine in checked mode (real CPU pools, copies that land only when an event completes
them, backups that run only when an event runs them) plus the explorer's own per-request bookkeeping:
each request's phase, its re-admissions, and the lengths each ended lifecycle held. Everything here is
copied together when the search branches (kvfsm.verify.explorer.cloning), so it holds no other state.
The phases and the spec's state sets the events, checks and key are written against live here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Optional

import kvfsm.generated.decode_offload as gen
from kvfsm.verify.engine import SimEngine, SimRequest

Event = tuple  # ("admit", i), ("copy", j), ("progress",), ...
Faults = Callable[[SimEngine], None]

# a request's phase in the explorer's own bookkeeping (World.ctl[i][0])
NEW, LIVE, ENDED, RETRACTED = 0, 1, 2, 3
# the machine states in which a lifecycle is live (offload is handled)
_LIVE_STATES = gen.HANDLED["offload"]
# a lifecycle that ended while copies were in flight: it keeps its slots until the last copy ack
_DEFERRED = frozenset(s for s, held in gen.HOLDS.items() if "device_slots" in held) - _LIVE_STATES
# the machine states in which a lifecycle holds its table row
_ROW_HOLDING = frozenset(s for s, held in gen.HOLDS.items() if "table_row" in held)


class BoundInvalid(ValueError):
    """An ExplorerConfig that bounds nothing meaningful (a zero-sized pool, no requests, ...): rejected before
    any world is built, so a bad bound is never reported as an invariant violation."""


@dataclass(frozen=True)
class ExplorerConfig:
    """The bound: requests, pool sizes and per-request budgets (all finite, so the space is finite)."""

    requests: int = 3
    slots: int = 16  # device slots (page 0 is the allocator's padding page)
    page_size: int = 2
    stride: int = 2
    host_slots: int = 8
    backup_queue: int = 1
    prompt_len: int = 3  # every request's prompt (its first token is unique, so hash chains differ)
    prefix_len: int = 2  # each request's protected prefix (clipped to its prompt)
    decodes: int = 1  # decode steps per request (over all its lifecycles)
    speculative: int = 0  # > 0 adds decode_spec i, a decode that over-allocates this many extra slots
    readmits: int = 0  # re-admissions of a retracted request object ...
    readmitters: Optional[int] = None  # ... for the first this-many requests (default: all of them)
    end_kinds: tuple[str, ...] = ("finish", "abort", "retract")
    duplicate_end: bool = True  # end_again i: finish of a request that already ended (B9)
    backup_failures: bool = True  # backup_fail j besides backup j
    batch_offload: bool = True  # offload_batch: one manager.offload_batch over every live request
    rows: Optional[int] = None  # request-table rows (default: one per request, one more per re-admittable one)
    max_context: int = 16
    fenced: bool = False  # the spec's `fences` param: ends under a copy release fenced; adds the event reuse
    stream_ordered: bool = False  # a writer's wait orders it after the copy, which stays in flight (the GPU's case)

    def __post_init__(self) -> None:
        at_least = {
            "requests": 1,
            "slots": 1,
            "page_size": 1,
            "stride": 1,
            "host_slots": 1,
            "backup_queue": 1,
            "prompt_len": 1,
            "prefix_len": 0,
            "decodes": 0,
            "speculative": 0,
            "readmits": 0,
        }
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise BoundInvalid(f"{name}={getattr(self, name)}: must be at least {low}")
        if self.slots < 2 * self.page_size:
            raise BoundInvalid(
                f"slots={self.slots}: must hold the padding page and one more "
                f"(at least {2 * self.page_size} at page_size={self.page_size})"
            )
        if self.stride % self.page_size:
            raise BoundInvalid(f"stride={self.stride}: must be a multiple of page_size={self.page_size}")
        if self.max_context < self.prompt_len + self.decodes + self.speculative:
            raise BoundInvalid(f"max_context={self.max_context}: shorter than prompt_len + decodes + speculative")
        if self.rows is not None and self.rows < 1:
            raise BoundInvalid(f"rows={self.rows}: must be at least 1")

    @property
    def table_rows(self) -> int:
        if self.rows is not None:
            return self.rows
        readmitters = self.requests if self.readmitters is None else min(self.readmitters, self.requests)
        return self.requests + (readmitters if self.readmits else 0)

    def engine(self, trace_path: Optional[str] = None) -> SimEngine:
        return SimEngine(
            page_size=self.page_size,
            stride=self.stride,
            device_slots=self.slots,
            host_slots=self.host_slots,
            rows=self.table_rows,
            max_context=self.max_context,
            backup_queue=self.backup_queue,
            checked=True,
            trace_path=trace_path,
            fenced=self.fenced,
            stream_ordered=self.stream_ordered,
        )

    def describe(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in asdict(self).items())


class World:
    """One implementation state; everything in it is copied together when the search branches."""

    def __init__(
        self, config: ExplorerConfig, faults: Optional[Faults] = None, trace_path: Optional[str] = None
    ) -> None:
        self.config = config
        self.engine = config.engine(trace_path)
        if faults is not None:
            faults(self.engine)
        self.reqs: list[Optional[SimRequest]] = [None] * config.requests
        # per request: [phase, re-admissions left, re-admissions done]
        n = config.requests if config.readmitters is None else config.readmitters
        self.ctl: list[list[int]] = [[NEW, config.readmits if i < n else 0, 0] for i in range(config.requests)]
        # (request index, row) -> (committed, allocated, prefix) when the engine ended that lifecycle
        self.ends: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.checked: tuple = ()  # the pool snapshots whose conservation was last checked

    def req(self, i: int) -> SimRequest:
        """Request i, once its admission created it (an error before)."""
        req = self.reqs[i]
        if req is None:
            raise LookupError(f"r{i} has not been admitted yet")
        return req

    def prompt(self, i: int) -> list[int]:
        return [100_000 + i] + [1000 + j for j in range(self.config.prompt_len - 1)]
