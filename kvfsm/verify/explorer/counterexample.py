"""The report of a violation: `counterexample_test` writes its shortest trace as a runnable pytest file.

The file imports only the public vocabulary (`ExplorerConfig`, `replay_events` from
kvfsm.verify.explorer), so it keeps working wherever the explorer's internals move; it fails while
the bug exists and passes once it is fixed.
"""

from __future__ import annotations

from dataclasses import asdict

from kvfsm.verify.explorer.events import event_label
from kvfsm.verify.explorer.search import Counterexample
from kvfsm.verify.explorer.world import ExplorerConfig


def counterexample_test(config: ExplorerConfig, cx: Counterexample, name: str = "explorer_counterexample") -> str:
    """A runnable pytest file that replays the shortest trace; it fails while the bug exists."""
    events = "".join(f"    {ev!r},  # {n}. {event_label(ev)}\n" for n, ev in enumerate(cx.events, 1))
    fields = ",\n    ".join(f"{k}={v!r}" for k, v in asdict(config).items())
    detail = cx.detail.replace('"""', "'''").replace("\\", "\\\\")
    return f'''"""Shortest counterexample found by the bounded explorer (`kvfsm check`): {len(cx.events)} events.

Violation: {cx.name}: {detail}

The test replays the events on a fresh SimEngine with the same bound and checks every invariant after each
one: it fails while the bug exists and passes once it is fixed.
"""

from kvfsm.verify.explorer import ExplorerConfig, replay_events

CONFIG = ExplorerConfig(
    {fields},
)

EVENTS = [
{events}]


def test_{name}() -> None:
    replay_events(CONFIG, EVENTS)
'''
