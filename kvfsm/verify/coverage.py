"""Transition coverage: which declared transitions the implementation really took.

The manager records the id of every transition its machines take in `manager.coverage`; the explorer
unions them over every edge it runs (ExploreResult.coverage) and `fuzz` over a long random walk. A
`CoverageReport` sets those sets against the spec's declared transitions and names what was never
exercised; `STANDARD_BOUNDS` are the smallest explorer bounds that together exercise every declared
transition (one request with three chunks; one request against a one-page host pool; two requests
contending for it; one request the engine releases itself), which the test suite enforces in seconds. The named bounds `kvfsm check` explores
(kvfsm.verify.bounds: ci, default) are bigger unions of the same kind.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from kvfsm.spec import CompiledSpec, Transition, load_spec
from kvfsm.verify.explorer import (
    LIVE,
    NEW,
    Counterexample,
    ExplorerConfig,
    Faults,
    World,
    _describe,
    apply,
    check_world,
    enabled,
    explore,
)
from kvfsm.verify.replay import default_spec_path

# Small bounds whose explorations together take every declared transition (a few seconds in all).
STANDARD_BOUNDS: tuple[ExplorerConfig, ...] = (
    ExplorerConfig(requests=1, decodes=5),  # three chunks: two copies in flight, parking, resubmission
    ExplorerConfig(requests=1, decodes=3, host_slots=2),  # host full while offloading / in flight
    ExplorerConfig(requests=2, host_slots=2),  # host full while another request holds it
    ExplorerConfig(requests=1, decodes=3, end_kinds=("finish", "engine_release")),  # the engine's own release
    ExplorerConfig(requests=1, decodes=5, fenced=True),  # fences: every end under a copy released fenced
    ExplorerConfig(requests=1, decodes=3, end_kinds=("finish", "engine_release"), fenced=True),  # and the engine's
)


@dataclass
class CoverageReport:
    spec: CompiledSpec
    sources: dict[str, set[int]]  # source name -> transition ids it exercised

    @property
    def covered(self) -> set[int]:
        return set().union(*self.sources.values()) if self.sources else set()

    @property
    def missing(self) -> list[Transition]:
        covered = self.covered
        return [t for t in self.spec.transitions if t.id not in covered]

    @property
    def complete(self) -> bool:
        return not self.missing

    def fraction(self, source: Optional[str] = None) -> str:
        got = self.covered if source is None else self.sources[source]
        declared = {t.id for t in self.spec.transitions}
        return f"{len(got & declared)}/{len(declared)}"

    def rows(self) -> list[tuple[str, str, str]]:
        """(T<id>, label, the sources that exercised it) per declared transition."""
        return [
            (f"T{t.id}", t.label, ", ".join(name for name, ids in self.sources.items() if t.id in ids) or "-")
            for t in self.spec.transitions
        ]

    def table(self):  # a rich Table (imported lazily: the library has no hard dependency on rich here)
        from rich.table import Table

        tab = Table(title=f"transition coverage {self.fraction()} ({self.spec.path})")
        tab.add_column("id", justify="right")
        tab.add_column("transition")
        tab.add_column("exercised by")
        for tid, label, by in self.rows():
            tab.add_row(tid, label, by if by != "-" else "[red]never[/red]")
        return tab


def report(sources: dict[str, set[int]], spec: CompiledSpec | None = None) -> CoverageReport:
    return CoverageReport(spec or load_spec(default_spec_path()), {k: set(v) for k, v in sources.items()})


def explorer_coverage(
    bounds: Sequence[ExplorerConfig] = STANDARD_BOUNDS, max_depth: Optional[int] = None, faults: Optional[Faults] = None
) -> dict[str, set[int]]:
    """Explore each bound completely; {"explorer <bound>": transition ids}. A violation raises AssertionError."""
    out: dict[str, set[int]] = {}
    for cfg in bounds:
        res = explore(cfg, max_depth=max_depth, faults=faults)
        if res.violation is not None:
            raise AssertionError(
                f"explorer found a violation at {cfg.describe()}: {res.violation.name}: {res.violation.detail}"
            )
        key = (
            f"explorer requests={cfg.requests} decodes={cfg.decodes} host_slots={cfg.host_slots} "
            f"readmits={cfg.readmits}"
        )
        if cfg.end_kinds != ExplorerConfig().end_kinds:
            key += f" ends={'/'.join(cfg.end_kinds)}"
        out[key + (" fenced" if cfg.fenced else "")] = set(res.coverage)
    return out


@dataclass
class FuzzResult:
    steps: int = 0
    episodes: int = 0
    seconds: float = 0.0
    coverage: set[int] = field(default_factory=set)
    violation: Optional[Counterexample] = None


# how much likelier an event is chosen than an end of a request (so lifecycles get long)
_WEIGHTS = {
    "finish": 0.15,
    "abort": 0.15,
    "retract": 0.15,
    "engine_release": 0.15,
    "end_again": 0.1,
    "progress": 2.0,
    "copy": 1.5,
}


def fuzz(
    config: ExplorerConfig = ExplorerConfig(decodes=3, readmits=1, host_slots=4),
    steps: int = 3000,
    seed: int = 0,
    faults: Optional[Faults] = None,
    weights: Optional[dict[str, float]] = None,
    on_step: Optional[Callable[[int], None]] = None,
) -> FuzzResult:
    """A random walk over the explorer's events (every invariant checked after each), restarted whenever
    every request has ended and nothing is in flight; its coverage complements the bounded exploration.
    Episodes alternate the spec's `fences` param (the config's, then the other), so both release paths run;
    a violation's `detail` names the episode's `fenced`."""
    rng = random.Random(seed)
    w_of = {**_WEIGHTS, **(weights or {})}
    res = FuzzResult()
    t0 = time.perf_counter()
    world = World(config, faults)
    trace: list = []
    res.episodes = 1
    for n in range(steps):
        events = enabled(world)
        ev = rng.choices(events, weights=[w_of.get(e[0], 1.0) for e in events])[0]
        trace.append(ev)
        try:
            apply(world, ev)
            check_world(world)
        except Exception as exc:  # noqa: BLE001 - any failure is the report
            name, detail = _describe(exc)
            res.violation = Counterexample(tuple(trace), name, f"{detail} (fenced={world.config.fenced})", repr(exc))
            break
        finally:
            res.coverage |= world.engine.manager.coverage
        res.steps = n + 1
        if on_step is not None:
            on_step(n)
        if all(c[0] not in (NEW, LIVE) for c in world.ctl) and world.engine.manager.idle():
            world.engine.manager.close()
            world = World(dataclasses.replace(config, fenced=not world.config.fenced), faults)
            trace = []
            res.episodes += 1
    res.seconds = time.perf_counter() - t0
    return res


__all__ = ["CoverageReport", "FuzzResult", "STANDARD_BOUNDS", "explorer_coverage", "fuzz", "report"]
