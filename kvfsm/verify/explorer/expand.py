"""Expanding one state: run each event its sleep set leaves, on a copy of the state, and check and key each
child. The sequential search (kvfsm.verify.explorer.search) and the --jobs workers
(kvfsm.verify.explorer.parallel) share it, so they run the same edges.

Branching (`mode`): "copy" pickles the state once (cloning.Snapshot) and thaws one copy per child;
"clone" pickles and unpickles per child (the pre-issue-19 search, kept to measure against); "replay"
rebuilds every child from the root by re-executing its trace. Events that most likely change nothing
run on the state itself, after the others, and so does the last event: the key decides whether they
did. In copy and clone mode every `validate_every`-th copy is checked against re-executing its events
from scratch; a copy that fails or diverges raises CopyDiverged and the search starts over in replay mode.

With `por` (partial-order reduction by sleep sets, Godefroid 1996) an event is not run where the sleep
set says an independent event explored before it leads to the same child (independence.py says which
events commute); every state is still reached, only edges into already reached states are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from kvfsm.verify.explorer.canonical import Naming, canonical, canonical_key
from kvfsm.verify.explorer.checks import check_world
from kvfsm.verify.explorer.cloning import Snapshot, clone
from kvfsm.verify.explorer.events import apply, build, enabled
from kvfsm.verify.explorer.independence import canon_ids, child_sleep, footprints, stable_id
from kvfsm.verify.explorer.world import _LIVE_STATES, ENDED, Event, ExplorerConfig, Faults, World

EMPTY: frozenset = frozenset()
_QUEUED = ("copy", "backup", "backup_fail")  # events named by a queue position, not a request
MODES = ("copy", "clone", "replay")


class CopyDiverged(Exception):
    """A copied state could not be made, or differs from re-executing its events: use replay mode."""


class Found(Exception):
    """An invariant failed on an edge: the BFS trace to it, the events really executed, the failure."""

    def __init__(self, trace: tuple, hist: tuple, exc: BaseException) -> None:
        super().__init__(repr(exc))
        self.trace, self.hist, self.exc = trace, hist, exc


@dataclass
class Item:
    """A state waiting to be expanded: its world (None: rebuild it from `trace`), the shortest trace to it,
    its key, the events really executed on the world, and the key's naming of it (None: recompute).
    A re-expansion (`only` set) runs just those events, with its own sleep set."""

    world: Optional[World]
    trace: tuple
    key: tuple
    hist: tuple
    naming: Optional[Naming] = None
    only: Optional[frozenset] = None
    sleep: frozenset = EMPTY


@dataclass
class Expander:
    """The search's settings and the counters every expansion adds to."""

    config: ExplorerConfig
    faults: Optional[Faults] = None
    mode: str = "copy"
    symmetry: bool = True
    por: bool = True
    orbits: bool = True
    validate_every: int = 64
    edges: int = 0  # events run
    pruned: int = 0  # events the sleep sets left unrun
    mirrored: int = 0  # events left unrun because a symmetric request's event stands for them
    copies: int = 0  # states copied (or rebuilt, in replay mode) to branch
    snapshots: int = 0  # states pickled once for their children (copy mode)
    in_place: int = 0  # events run on their parent without a copy (guessed no-ops)
    mispredicted: int = 0  # of those, events that were not no-ops (the parent was rebuilt)
    validated: int = 0  # copied states checked against re-executing their events
    coverage: set[int] = field(default_factory=set)

    def counters(self) -> dict[str, int]:
        return {
            k: getattr(self, k)
            for k in ("edges", "pruned", "mirrored", "copies", "snapshots", "in_place", "mispredicted", "validated")
        }

    def add(self, counters: dict[str, int], coverage: set[int]) -> None:
        for k, v in counters.items():
            setattr(self, k, getattr(self, k) + v)
        self.coverage |= coverage

    def expand(
        self,
        item: Item,
        sleep: frozenset,
        offer: Callable[[tuple, Optional[Naming], Optional[World], tuple, tuple, frozenset], None],
    ) -> None:
        """Run the state's events; offer(key, naming, world, trace, hist, sleep) each child that is not the
        state itself. Raises Found at the first violation, CopyDiverged when copying cannot be trusted."""
        cfg, faults, mode = self.config, self.faults, self.mode
        parent, trace, parent_key, hist, naming = item.world, item.trace, item.key, item.hist, item.naming
        if parent is None:
            parent = build(cfg, trace, faults, check=False)
            hist, naming = trace, None
        base_hist = hist  # what a thawed snapshot of the parent has run (it is taken before any guess)
        events = enabled(parent)
        orbits = self.orbits and self.symmetry
        if (self.por or orbits) and naming is None:
            naming = canonical(parent, None, self.symmetry)[1]
        # an event of a request the world is symmetric in with a smaller one: that one's event stands for it
        rep = naming.rep if naming is not None else ()  # set above whenever orbits holds
        mirrored = [orbits and len(ev) == 2 and ev[0] not in _QUEUED and rep[ev[1]] != ev[1] for ev in events]
        if self.por:
            ids = canon_ids(parent, events, naming)
            asleep = [cid in sleep for cid in ids]
            explored = [not (a or m) for a, m in zip(asleep, mirrored)]
            stable = [stable_id(parent, ev) for ev in events]
            fps, free = footprints(parent, events)
            run = [k for k in range(len(events)) if explored[k] and (item.only is None or ids[k] in item.only)]
            self.pruned += sum(asleep)
        else:
            run = [k for k in range(len(events)) if not mirrored[k]]
        self.mirrored += sum(mirrored)
        guessed = [k for k in run if _likely_noop(parent, events[k])]
        order = [k for k in run if k not in guessed] + guessed
        first_guess = len(order) - len(guessed)
        snapshot: Optional[Snapshot] = None
        for n, k in enumerate(order):
            ev = events[k]
            in_place = n >= first_guess
            if in_place or n == len(order) - 1:
                child = parent
                self.in_place += in_place
            else:
                child, snapshot = self._branch(parent, trace, snapshot)
            child_hist = (hist if child is parent or mode != "replay" else trace) + (ev,)
            self.edges += 1
            try:
                apply(child, ev)
                key, child_naming = canonical(child, check_world(child), self.symmetry)
            except Exception as exc:  # noqa: BLE001 - any failure is the report
                self.coverage |= child.engine.manager.coverage
                raise Found(trace + (ev,), child_hist, exc) from exc
            self.coverage |= child.engine.manager.coverage
            if (
                mode != "replay"
                and child is not parent
                and self.validate_every
                and self.copies % self.validate_every == 0
            ):
                again = build(cfg, child_hist, faults, check=False)
                if canonical_key(again, None, self.symmetry) != key:
                    raise CopyDiverged(f"a copied state diverged from re-executing its {len(child_hist)} events")
                self.validated += 1
            if in_place:
                if key == parent_key:
                    hist = child_hist  # a no-op: the parent is still the parent
                    continue
                self.mispredicted += 1
                if n < len(order) - 1:  # the parent became a child: rebuild it for the other events
                    if snapshot is not None:
                        parent, hist = snapshot.thaw(), base_hist
                    else:
                        parent = build(cfg, trace, faults, check=False)
                        hist = trace
            if key == parent_key:
                continue  # a self-loop adds no trace the state's own expansion does not cover
            child_sleep_ids = EMPTY
            if self.por:
                got = (child_naming.canon(stable[u]) for u in child_sleep(fps, asleep, explored, k, free))
                child_sleep_ids = frozenset(c for c in got if c is not None)
            offer(key, child_naming, child if mode != "replay" else None, trace + (ev,), child_hist, child_sleep_ids)

    def _branch(self, parent: World, trace: tuple, snapshot: Optional[Snapshot]) -> tuple[World, Optional[Snapshot]]:
        """A fresh copy of the parent to run one event on (and the snapshot to take the next from)."""
        self.copies += 1
        if self.mode == "replay":
            return build(self.config, trace, self.faults, check=False), snapshot
        try:
            if self.mode == "clone":
                return clone(parent), snapshot
            if snapshot is None:
                snapshot = Snapshot(parent)
                self.snapshots += 1
            return snapshot.thaw(), snapshot
        except Exception as exc:  # noqa: BLE001 - anything pickling cannot copy
            raise CopyDiverged(f"a state could not be copied ({exc!r})") from exc


def _likely_noop(w: World, ev: Event) -> bool:
    """A guess (never trusted: the key decides) that `ev` changes nothing the key sees."""
    kind = ev[0]
    e = w.engine
    fx = e.manager.fx
    if kind == "progress":
        head_done = bool(fx.copy_fifo) and fx.copy_fifo[0].handle.done()
        return not head_done and e.worker.completed() == 0 and not (fx.parked and e.worker.room() > 0)
    if kind == "end_again":
        return w.ctl[ev[1]][0] == ENDED
    if kind == "offload":
        req = w.reqs[ev[1]]
        mach = e.manager.machine_of(req)
        if mach is None or mach.state not in _LIVE_STATES:
            return False
        rec = mach.ctx
        available = min(len(req.origin_input_ids) + len(req.output_ids) - 1, req.kv_committed_len)
        n = (available - rec.prefill_len - rec.inc_len) // e.manager.stride * e.manager.stride
        return n <= 0 or e.host_pool.free_slots < n
    return False
