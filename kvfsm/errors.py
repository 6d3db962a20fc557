"""Typed errors of kvfsm's public surface; a raised error means nothing was changed.

Lifecycle errors come from generated machines and the manager's request checks; `ConfigError` from the
configuration, always before anything is allocated; `InputRejected` (`InputBoundExceeded` past a bound of
kvfsm.input_limits) from the readers of files, variables and traces, before anything is built from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional


class LifecycleError(Exception):
    """Base of every error a lifecycle machine raises."""


class EventRejected(LifecycleError):
    """The spec declares this event an error in this state."""

    def __init__(self, machine: Any, event: str, state: str, reason: str) -> None:
        self.machine, self.event, self.state, self.reason = machine, event, state, reason
        super().__init__(f"event {event!r} rejected in state {state!r} of {machine!r}: {reason}")


class GuardRejected(EventRejected):
    """The event is handled in this state, but none of its guards holds for the current counters."""

    def __init__(self, machine: Any, event: str, state: str, guards: tuple[str, ...]) -> None:
        super().__init__(machine, event, state, f"no guard holds ({', '.join(guards)})")
        self.guards = guards


class RowNotCreated(LifecycleError):
    """A batch of a rows machine (`generated/<machine>_rows.py`) names a row that holds no machine: outside its
    capacity, or never created. Nothing was changed."""

    def __init__(self, machine: Any, what: str, row: int, position: int, capacity: int) -> None:
        self.machine, self.what, self.row, self.position, self.capacity = machine, what, row, position, capacity
        where = "is outside its rows" if not 0 <= row < capacity else "holds no machine (never created)"
        super().__init__(f"{type(machine).__name__}.{what}: row {row} (item {position}) {where}; capacity {capacity}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.machine, self.what, self.row, self.position, self.capacity)


class RowStillLive(LifecycleError):
    """`create` names a row whose machine is not in a terminal state: a new machine there would drop a live
    lifecycle and what it holds. Nothing was changed."""

    def __init__(self, machine: Any, row: int, position: int, state: str) -> None:
        self.machine, self.row, self.position, self.state = machine, row, position, state
        super().__init__(
            f"{type(machine).__name__}.create: row {row} (item {position}) holds a live machine in "
            f"state {state!r}; a row is taken again only once its machine is terminal"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.machine, self.row, self.position, self.state)


class RetractionRefused(LifecycleError):
    """Under the spec's `retraction: fail_closed` policy, retraction is refused while a device-to-host copy is
    tracked (on any TP rank, for `drain_before_retraction`; for the request itself, for `retract`): retracting
    would free device slots a copy still reads. Nothing was changed."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"retraction refused: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.reason,)


class InvalidRequest(LifecycleError):
    """The request cannot be admitted (bad table row, missing fields); nothing was changed."""


class RowInUse(InvalidRequest):
    """A request object names a table row that another live request object holds.

    Admitting it would let one request's end free the other's slots and row (its own end then a
    DoubleFree), so it is refused, in unchecked mode too."""

    def __init__(self, request: str, row: int, holder: str) -> None:
        self.request, self.row, self.holder = request, row, holder
        super().__init__(
            f"request {request!r} names table row {row}, which live request {holder} holds: "
            f"each live request must have its own row (is this a copy of the request object?)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.request, self.row, self.holder)


class RequestFieldInvalid(InvalidRequest):
    """A request field holds a value of the wrong type (a length that is not an integer)."""

    def __init__(self, request: str, field: str, value: Any, protocol: str = "kvfsm.runtime.OffloadRequest") -> None:
        self.request, self.field, self.value, self.protocol = request, field, value, protocol
        super().__init__(
            f"request {request} has {field} = {value!r:.80}; the request protocol {protocol} needs an integer there"
        )


class RequestFieldMissing(InvalidRequest):
    """A request object lacks a field of the request protocol (`kvfsm.runtime.OffloadRequest`)."""

    def __init__(self, request: str, field: str, protocol: str = "kvfsm.runtime.OffloadRequest") -> None:
        self.request, self.field, self.protocol = request, field, protocol
        super().__init__(
            f"request {request} has no attribute {field!r}, a field of the request protocol "
            f"{protocol} that the manager reads"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.request, self.field, self.protocol)


class ConfigError(ValueError):
    """A configuration value is invalid. `field` names it (dotted inside mappings, e.g.
    `storage_extra.master_server_addr`; None when the whole source is unusable), `reason` says why and
    `source` where the value came from (code, a file, the environment). Every problem found is in
    `problems`; `field` and `reason` are the first."""

    def __init__(
        self,
        field: Optional[str],
        reason: str,
        source: str = "OffloadConfig",
        others: Sequence[tuple[Optional[str], str]] = (),
    ) -> None:
        self.field, self.reason, self.source = field, reason, source
        self.problems: tuple[tuple[Optional[str], str], ...] = ((field, reason), *others)
        text = "; ".join(f"{f}: {r}" if f else r for f, r in self.problems)
        super().__init__(f"{source}: {text}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.field, self.reason, self.source, self.problems[1:])


class InputRejected(ValueError):
    """A file or value from outside the engine (a spec, a config file, a KVFSM_* variable, a trace) that
    kvfsm will not read: not UTF-8, not a regular file, or past a bound (`InputBoundExceeded`). `source`
    names it, `line` is 1-based (0 when it concerns the whole source) and `reason` says what is wrong.
    Nothing was built from it and nothing was written."""

    def __init__(self, source: str, line: int, reason: str) -> None:
        self.source, self.line, self.reason = source, line, reason
        super().__init__(f"{source}:{line}: {reason}" if line else f"{source}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.source, self.line, self.reason)


class InputBoundExceeded(InputRejected):
    """An input is past one of its reader's bounds (`kvfsm.input_limits`): `bound` is the bound's name
    (max_bytes, max_depth, max_elements, max_aliases, max_line_bytes) and `limit` its value; `reason`
    ends with both."""

    def __init__(self, source: str, line: int, bound: str, limit: int, reason: str) -> None:
        self.bound, self.limit, self.breach = bound, limit, reason
        super().__init__(source, line, f"{reason} (bound {bound}={limit})")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.source, self.line, self.bound, self.limit, self.breach)
