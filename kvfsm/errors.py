"""Typed errors raised by generated machines; a raised error means the machine changed nothing."""

from __future__ import annotations

from typing import Any


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
