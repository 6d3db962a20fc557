"""The search: breadth-first over every interleaving of events, stopping at the first violation.

Breadth-first, so the first violation has a shortest event trace (re-executed from scratch to confirm
it; `Counterexample` holds it). Each state is expanded by kvfsm.verify.explorer.expand (branching,
checks, keys, sleep sets); `jobs` > 1 expands each level's states in worker processes
(kvfsm.verify.explorer.parallel), merging their children in frontier order, so the states, edges,
coverage and first violation are the ones of `jobs=1`. Tests check every branching mode and the
reductions reach the same states, and a copy-mode search starts over in replay mode if a copy ever
fails or diverges from re-execution.

Partial-order reduction (`por`, on by default): sleep sets with state matching. Each reached key keeps
the intersection of the sleep sets it was reached with in its own level; a key reached again in a later
level with a sleep set missing some of the kept events is re-expanded for just those (`reexpanded`), so
the reduction never depends on which path reached a state first. Every state is still reached at the
depth of its shortest trace; edges into reached states are what it saves (tests/verify/
test_reduction_soundness.py; bench/explorer_speed.py measures each technique).
"""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional

from kvfsm.verify.explorer.canonical import Naming, canonical
from kvfsm.verify.explorer.checks import _describe, check_world
from kvfsm.verify.explorer.events import build, event_label
from kvfsm.verify.explorer.expand import EMPTY, MODES, CopyDiverged, Expander, Found, Item
from kvfsm.verify.explorer.world import Event, ExplorerConfig, Faults, World


@dataclass
class Counterexample:
    events: tuple[Event, ...]
    name: str
    detail: str
    exception: str

    def lines(self) -> list[str]:
        return [f"{n:3d}. {event_label(ev)}" for n, ev in enumerate(self.events, 1)]


@dataclass
class ExploreResult:
    config: ExplorerConfig
    states: int = 0
    edges: int = 0  # events run
    depth: int = 0  # the longest shortest trace to a reached state
    complete: bool = False  # every reachable state (within max_depth) was expanded
    seconds: float = 0.0
    peak_rss_mib: float = 0.0
    max_frontier: int = 0
    pruned: int = 0  # events the sleep sets left unrun (partial-order reduction)
    mirrored: int = 0  # events left unrun because a symmetric request's event stands for them (orbits)
    reexpanded: int = 0  # states expanded again for events a later, smaller sleep set wakes
    copies: int = 0  # states copied (or rebuilt, in replay mode) to branch
    snapshots: int = 0  # states pickled once for their children (copy mode)
    in_place: int = 0  # events run on their parent without a copy (guessed no-ops)
    mispredicted: int = 0  # of those, events that were not no-ops (the parent was rebuilt)
    validated: int = 0  # copied states checked against re-executing their events
    mode: str = "copy"  # how states were branched
    por: bool = True
    symmetry: bool = True
    orbits: bool = True
    jobs: int = 1
    fallback: Optional[str] = None  # why a copy-mode search started over in replay mode
    coverage: set[int] = field(default_factory=set)
    violation: Optional[Counterexample] = None
    keys: Optional[dict] = None  # keep_keys: every reached key -> the depth it was first reached at

    @property
    def states_per_second(self) -> float:
        return self.states / self.seconds if self.seconds else 0.0


def peak_rss_mib() -> float:
    """This process's own peak resident memory: its address space's high-water mark (Linux VmHWM). Not
    ru_maxrss, which Linux carries from a parent into a child it starts (fork or vfork, then exec): a search
    run in a child of a large process (pytest) would report the parent's peak."""
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def explore(
    config: ExplorerConfig = ExplorerConfig(),
    *,
    max_depth: Optional[int] = None,
    faults: Optional[Faults] = None,
    mode: str = "copy",
    max_states: Optional[int] = None,
    keep_keys: bool = False,
    on_level: Optional[Callable[[int, int, int], None]] = None,
    validate_every: int = 64,
    symmetry: bool = True,
    por: bool = True,
    orbits: bool = True,
    jobs: int = 1,
) -> ExploreResult:
    """Breadth-first search over every interleaving; stops at the first (hence shortest) violation.

    faults: called on every freshly built SimEngine (to patch its instances); class-level monkeypatches
    applied by the caller are seen as well (by --jobs workers too: they are forked). on_level(depth,
    states, frontier) reports progress. mode: how a state is branched ("copy", "clone" or "replay", see
    kvfsm.verify.explorer.expand). symmetry=False keeps states that differ only by which request is which
    apart (for faults that single out one request); por=False runs every edge (no sleep sets).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    t0 = time.perf_counter()
    args = (config, max_depth, faults, max_states, keep_keys, on_level, validate_every, symmetry, por, orbits, jobs, t0)
    with _quiet_runtime():
        try:
            return _explore(mode, *args)
        except CopyDiverged as why:
            res = _explore("replay", *args)
            res.fallback = str(why)
            return res


@contextlib.contextmanager
def _quiet_runtime() -> Iterator[None]:
    """The explorer fails backups on purpose (backup_fail j); the runtime's WARNING for each one is noise
    here (failures are what the checks report, as exceptions)."""
    log = logging.getLogger("kvfsm.runtime")
    level = log.level
    log.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        log.setLevel(level)


def _explore(
    mode: str,
    config: ExplorerConfig,
    max_depth: Optional[int],
    faults: Optional[Faults],
    max_states: Optional[int],
    keep_keys: bool,
    on_level: Optional[Callable[[int, int, int], None]],
    validate_every: int,
    symmetry: bool,
    por: bool,
    orbits: bool,
    jobs: int,
    t0: float,
) -> ExploreResult:
    res = ExploreResult(config, mode=mode, por=por, symmetry=symmetry, orbits=orbits and symmetry, jobs=jobs)
    x = Expander(config, faults, mode, symmetry, por, orbits, validate_every)
    visited: dict[tuple, frozenset] = {}  # key -> the sleep set it is expanded with (EMPTY without por)
    depths: Optional[dict[tuple, int]] = {} if keep_keys else None

    def finish() -> ExploreResult:
        for k, v in x.counters().items():
            setattr(res, k, v)
        res.coverage = x.coverage
        res.seconds = time.perf_counter() - t0
        res.peak_rss_mib = peak_rss_mib()
        res.states = len(visited)
        if depths is not None:
            res.keys = depths
        return res

    def fail(trace: tuple, exc: BaseException) -> ExploreResult:
        res.violation = Counterexample(trace, *_describe(exc), repr(exc))
        return finish()

    try:
        root = World(config, faults)
        root_key, naming = canonical(root, check_world(root), symmetry)
    except Exception as exc:  # noqa: BLE001 - any failure is the report
        return fail((), exc)
    visited[root_key] = EMPTY
    if depths is not None:
        depths[root_key] = 0
    frontier = [Item(root if mode != "replay" else None, (), root_key, (), naming)]
    pool = None
    if jobs > 1:
        from kvfsm.verify.explorer.parallel import Pool

        pool = Pool(x, jobs)
    try:
        depth = 0
        while frontier:
            if max_depth is not None and depth >= max_depth:
                return finish()
            if on_level is not None:
                on_level(depth, len(visited), len(frontier))
            res.max_frontier = max(res.max_frontier, len(frontier))
            level = _Level(visited, por, max_states, depths)
            try:
                if pool is None:
                    for item in frontier:
                        x.expand(item, item.sleep if item.only is not None else visited[item.key], level.offer)
                else:
                    pool.expand(frontier, visited, level)
            except Found as found:
                res.depth = depth + 1
                events = _shortest(config, faults, found.trace, found.hist)
                if events is None and mode != "replay":
                    raise CopyDiverged(
                        "a violation in a copied state does not happen when its events are re-executed"
                    ) from found.exc
                return fail(events or found.hist, found.exc)
            except _Full:
                res.depth = depth + 1
                return finish()
            frontier = level.close()
            res.reexpanded += level.reexpanded
            depth += 1
            if level.fresh:
                res.depth = depth
        res.complete = True
        return finish()
    finally:
        if pool is not None:
            pool.close()


class _Full(Exception):
    """max_states reached."""


class _Level:
    """The children of one BFS level, merged in frontier order: a key first reached here becomes an item
    of the next level (its first arrival's world and trace) expanded with the intersection of every sleep
    set it arrives with here; a key reached in an earlier level and arriving here with a sleep set that
    lacks some of its kept events is re-expanded for those events (on the world of the first arrival that
    lacked some, or rebuilt from this level's first trace to it)."""

    def __init__(
        self,
        visited: dict[tuple, frozenset],
        por: bool,
        max_states: Optional[int],
        depths: Optional[dict[tuple, int]] = None,
    ) -> None:
        self.visited, self.por, self.max_states, self.depths = visited, por, max_states, depths
        self.fresh: dict[tuple, Item] = {}
        self.revisits: dict[tuple, Item] = {}
        self.reexpanded = 0

    def offer(
        self, key: tuple, naming: Optional[Naming], world: Optional[World], trace: tuple, hist: tuple, sleep: frozenset
    ) -> None:
        kept = self.visited.get(key)
        if kept is None:
            self.visited[key] = sleep
            self.fresh[key] = Item(world, trace, key, hist, naming)
            if self.depths is not None:
                self.depths[key] = len(trace)
            if self.max_states is not None and len(self.visited) >= self.max_states:
                raise _Full
        elif not self.por or not kept:
            return
        elif key in self.fresh:
            self.visited[key] = kept & sleep
        else:
            seen = self.revisits.get(key)
            if seen is None:
                # the first arrival that may wake kept events keeps its world for the re-expansion
                self.revisits[key] = Item(world if kept - sleep else None, trace, key, hist, naming, sleep=sleep)
            else:
                if seen.world is None and world is not None and kept - sleep:
                    seen.world, seen.trace, seen.hist, seen.naming = world, trace, hist, naming
                seen.sleep &= sleep

    def close(self) -> list[Item]:
        """The next frontier: the keys first reached here, then the re-expansions."""
        items = list(self.fresh.values())
        for key, item in self.revisits.items():
            kept = self.visited[key]
            missing = kept - item.sleep
            if missing:
                self.visited[key] = kept & item.sleep
                if item.world is None:
                    item.hist, item.naming = item.trace, None
                item.only = missing
                items.append(item)
                self.reexpanded += 1
        return items


def _reproduces(config: ExplorerConfig, faults: Optional[Faults], events: Sequence[Event]) -> bool:
    try:
        build(config, events, faults)
    except Exception:  # noqa: BLE001
        return True
    return False


def _shortest(config: ExplorerConfig, faults: Optional[Faults], trace: tuple, hist: tuple) -> Optional[tuple]:
    """The BFS trace if re-running it from scratch fails; else the exact history (a no-op run in place
    changed something the key does not see); None if neither fails when re-run."""
    if _reproduces(config, faults, trace):
        return trace
    if hist != trace and _reproduces(config, faults, hist):
        return hist
    return None
