"""The search: breadth-first over every interleaving of events, stopping at the first violation.

Breadth-first, so the first violation has a shortest event trace (re-executed from scratch to confirm
it; `Counterexample` holds it). Branching copies a state with `clone` (kvfsm.verify.explorer.cloning);
`mode="replay"` re-executes every prefix from a fresh engine instead. Tests check both modes reach the
same states, and a copy-mode search checks every `validate_every`-th copy against re-execution and
starts over in replay mode if a copy ever fails or diverges. Events that most likely change nothing (a
progress check with nothing to observe, an offload with nothing to offload, a duplicate finish) run on
the parent itself instead of a copy; the canonical key decides whether they did.

Default bound (3 requests x 16 slots, page 2, stride 2, 8 host slots, backup queue 1, prompt 3, one decode
each): 1399 states, 14555 events, depth 18; about 12 s (copy mode; 6.6 s in replay mode, see
kvfsm.verify.explorer.cloning) and 268 MiB peak RSS on one core.
"""

from __future__ import annotations

import resource
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from kvfsm.verify.explorer.canonical import canonical_key
from kvfsm.verify.explorer.checks import _describe, check_world
from kvfsm.verify.explorer.cloning import clone
from kvfsm.verify.explorer.events import apply, build, enabled, event_label
from kvfsm.verify.explorer.world import _LIVE_STATES, ENDED, Event, ExplorerConfig, Faults, World


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
    edges: int = 0
    depth: int = 0  # the longest shortest trace to a reached state
    complete: bool = False  # every reachable state (within max_depth) was expanded
    seconds: float = 0.0
    peak_rss_mib: float = 0.0
    max_frontier: int = 0
    copies: int = 0  # states copied (or rebuilt, in replay mode) to branch
    in_place: int = 0  # events run on their parent without a copy (guessed no-ops)
    mispredicted: int = 0  # of those, events that were not no-ops (the parent was rebuilt)
    validated: int = 0  # copied states checked against re-executing their events
    mode: str = "copy"  # how states were branched
    fallback: Optional[str] = None  # why a copy-mode search started over in replay mode
    coverage: set[int] = field(default_factory=set)
    violation: Optional[Counterexample] = None
    keys: Optional[set] = None


class _CopyDiverged(Exception):
    pass


def explore(config: ExplorerConfig = ExplorerConfig(), *, max_depth: Optional[int] = None,
            faults: Optional[Faults] = None, mode: str = "copy", max_states: Optional[int] = None,
            keep_keys: bool = False, on_level: Optional[Callable[[int, int, int], None]] = None,
            validate_every: int = 64, symmetry: bool = True) -> ExploreResult:
    """Breadth-first search over every interleaving; stops at the first (hence shortest) violation.

    faults: called on every freshly built SimEngine (to patch its instances); class-level monkeypatches
    applied by the caller are seen as well. on_level(depth, states, frontier) reports progress.
    In copy mode every `validate_every`-th copied child is checked against re-executing its events from
    scratch; when a copy fails or diverges, the search starts over in replay mode (result.fallback says why).
    symmetry=False keeps states that differ only by which request is which apart (for faults that single
    out one request).
    """
    if mode not in ("copy", "replay"):
        raise ValueError(f"mode must be 'copy' or 'replay', got {mode!r}")
    t0 = time.perf_counter()
    try:
        return _explore(config, max_depth, faults, mode, max_states, keep_keys, on_level, validate_every, symmetry,
                        t0)
    except _CopyDiverged as why:
        res = _explore(config, max_depth, faults, "replay", max_states, keep_keys, on_level, validate_every,
                       symmetry, t0)
        res.fallback = str(why)
        return res


def _explore(config: ExplorerConfig, max_depth: Optional[int], faults: Optional[Faults], mode: str,
             max_states: Optional[int], keep_keys: bool, on_level: Optional[Callable[[int, int, int], None]],
             validate_every: int, symmetry: bool, t0: float) -> ExploreResult:
    res = ExploreResult(config)
    res.mode = mode
    visited: set = set()

    def finish() -> ExploreResult:
        res.seconds = time.perf_counter() - t0
        res.peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        res.states = len(visited)
        if keep_keys:
            res.keys = visited
        return res

    def fail(trace: tuple, exc: BaseException) -> ExploreResult:
        res.violation = Counterexample(trace, *_describe(exc), repr(exc))
        return finish()

    try:
        root = World(config, faults)
        visited.add(canonical_key(root, check_world(root), symmetry))
    except Exception as exc:  # noqa: BLE001 - any failure is the report
        return fail((), exc)
    # (world or None in replay mode, shortest trace to it, its key, the events really executed on it)
    frontier: deque = deque([(root, (), next(iter(visited)), ())])
    depth = 0
    while frontier:
        if max_depth is not None and depth >= max_depth:
            return finish()
        if on_level is not None:
            on_level(depth, len(visited), len(frontier))
        res.max_frontier = max(res.max_frontier, len(frontier))
        nxt: deque = deque()
        while frontier:
            parent, trace, parent_key, hist = frontier.popleft()
            if parent is None:
                parent = build(config, trace, faults, check=False)
                hist = trace
            events = enabled(parent)
            # Events that most likely change nothing run on the parent itself, last (no copy): when the key
            # did not change the parent is still itself; when it did, it is a child and the parent is rebuilt.
            inplace = [ev for ev in events if _likely_noop(parent, ev)]
            copied = [ev for ev in events if ev not in inplace]
            for n, ev in enumerate(copied + inplace):
                in_place = n >= len(copied)
                if in_place or n == len(events) - 1:
                    child = parent
                    res.in_place += in_place
                elif mode == "copy":
                    try:
                        child = clone(parent)
                    except Exception as exc:  # noqa: BLE001 - anything pickling cannot copy
                        raise _CopyDiverged(f"a state could not be copied ({exc!r})") from exc
                    res.copies += 1
                else:
                    child = build(config, trace, faults, check=False)
                    res.copies += 1
                child_hist = (hist if child is parent or mode == "copy" else trace) + (ev,)
                res.edges += 1
                try:
                    apply(child, ev)
                    key = canonical_key(child, check_world(child), symmetry)
                except Exception as exc:  # noqa: BLE001 - any failure is the report
                    res.coverage |= child.engine.manager.coverage
                    res.depth = depth + 1
                    events = _shortest(config, faults, trace + (ev,), child_hist)
                    if events is None and mode == "copy":
                        raise _CopyDiverged("a violation in a copied state does not happen when its events are "
                                            "re-executed") from exc
                    return fail(events or child_hist, exc)
                res.coverage |= child.engine.manager.coverage
                if mode == "copy" and child is not parent and validate_every and res.copies % validate_every == 0:
                    again = build(config, child_hist, faults, check=False)
                    if canonical_key(again, None, symmetry) != key:
                        raise _CopyDiverged(f"a copied state diverged from re-executing its {len(child_hist)} events")
                    res.validated += 1
                if in_place:
                    if key == parent_key:
                        hist = child_hist  # a no-op: the parent is still the parent
                        continue
                    res.mispredicted += 1
                    if n < len(events) - 1:  # the parent became a child: rebuild it for the other events
                        parent = build(config, trace, faults, check=False)
                        hist = trace
                if key in visited:
                    continue
                visited.add(key)
                nxt.append((child if mode == "copy" else None, trace + (ev,), key, child_hist))
                if max_states is not None and len(visited) >= max_states:
                    res.depth = depth + 1
                    return finish()
        frontier = nxt
        depth += 1
        if frontier:
            res.depth = depth
    res.complete = True
    return finish()


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
