"""`explore(jobs=N)`: each BFS level's states are expanded by N worker processes, in contiguous chunks of
the frontier; the caller merges their children in frontier order, so the states, edges, coverage, sleep
sets and first violation are those of the one-process search.

Workers are forked when the search starts, so they see the caller's monkeypatches and `faults` hook
without pickling them. A worker rebuilds each state it expands from its trace (a few events' work,
against the several copies its expansion makes) and sends back, per child key, the first trace to it
and the intersection of the sleep sets it arrived with; never a world.
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Optional

from kvfsm.verify.explorer.checks import Violation, _describe
from kvfsm.verify.explorer.expand import CopyDiverged, Expander, Found, Item

_X: Optional[Expander] = None  # the forked workers' expander (set before the fork)
_CHUNKS_PER_JOB = 4  # chunks per worker and level: small enough to balance uneven states


class _Failure(Violation):
    """A worker's failure, carried back as plain values (the exception itself may not pickle)."""

    def __init__(self, name: str, detail: str, text: str) -> None:
        super().__init__(name, detail)
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _init() -> None:
    import torch

    torch.set_num_threads(1)  # the pools are tiny: one thread per process


def _expand_chunk(items: list[tuple[tuple, tuple, frozenset, Optional[frozenset]]]) -> tuple:
    """Expand one chunk: (counters, coverage, children by key in arrival order, failure or None)."""
    x = _X
    assert x is not None
    x.coverage = set()
    for k in x.counters():
        setattr(x, k, 0)
    children: dict[tuple, list] = {}

    def offer(key: tuple, naming: Any, world: Any, trace: tuple, hist: tuple, sleep: frozenset) -> None:
        got = children.get(key)
        if got is None:
            children[key] = [trace, sleep]
        else:
            got[1] &= sleep

    failure: Optional[tuple[Any, ...]] = None
    try:
        for trace, key, sleep, only in items:
            x.expand(Item(None, trace, key, trace, None, only, sleep), sleep, offer)
    except Found as found:
        name, detail = _describe(found.exc)
        failure = ("found", found.trace, found.hist, name, detail, repr(found.exc))
    except CopyDiverged as why:
        failure = ("diverged", str(why))
    return x.counters(), x.coverage, [(k, t, s) for k, (t, s) in children.items()], failure


class Pool:
    """The worker processes of one search."""

    def __init__(self, x: Expander, jobs: int) -> None:
        global _X
        self.x, self.jobs = x, jobs
        _X = Expander(x.config, x.faults, x.mode, x.symmetry, x.por, x.orbits, x.validate_every)
        try:
            self._pool = multiprocessing.get_context("fork").Pool(jobs, initializer=_init)
        finally:
            _X = None

    def expand(self, frontier: list[Item], visited: dict[tuple, frozenset], level: Any) -> None:
        """Expand every frontier item in the workers and merge the children into `level`, in order;
        raises Found (with the first failure in frontier order) or CopyDiverged like the one-process search."""
        tasks = [(it.trace, it.key, it.sleep if it.only is not None else visited[it.key], it.only) for it in frontier]
        size = max(1, -(-len(tasks) // (self.jobs * _CHUNKS_PER_JOB)))
        chunks = [tasks[i : i + size] for i in range(0, len(tasks), size)]
        for counters, coverage, children, failure in self._pool.imap(_expand_chunk, chunks):
            self.x.add(counters, coverage)
            if failure is not None and failure[0] == "diverged":
                raise CopyDiverged(failure[1])
            for key, trace, sleep in children:
                level.offer(key, None, None, trace, trace, sleep)
            if failure is not None:
                _, trace, hist, name, detail, text = failure
                raise Found(trace, hist, _Failure(name, detail, text))

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()
