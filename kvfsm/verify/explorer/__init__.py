"""Bounded exhaustive exploration of the *implementation*: the public vocabulary.

Breadth-first over every interleaving of engine events for N requests over a SimEngine in checked mode,
checking every invariant in every reached state; the first violation has a shortest event trace, which
`counterexample_test` writes as a runnable pytest file. This module only names what callers use; the
engine behind it is one concern per module:

- `world`: the bound (ExplorerConfig), one implementation state (World), the request phases;
- `events`: enabled() and apply(): the events and how each runs; build() / replay_events() re-run a trace;
- `checks`: the invariants (check_world, Violation) over one read of the bookkeeping (_Snap);
- `canonical`: canonical_key, the state key the search deduplicates by (with request symmetry), and the
  Naming it was taken under;
- `cloning`: clone() and Snapshot, the hand-written pickler that branches a world;
- `independence`: which events commute (the footprints the partial-order reduction decides by);
- `expand`: expanding one state (branching, checks, keys, sleep sets), shared by the search and its workers;
- `search`: explore() and its result, the shortest Counterexample; `parallel`: its --jobs workers;
- `counterexample`: counterexample_test(), the runnable pytest file for a Counterexample.

To replace a piece in a test, patch it where it is looked up (states are branched in `expand`, which
calls `Snapshot`, `clone` and `build`), not here.
"""

from kvfsm.verify.explorer.canonical import canonical_key
from kvfsm.verify.explorer.checks import Violation, _describe as _describe, check_world
from kvfsm.verify.explorer.cloning import CloneError, Snapshot, clone
from kvfsm.verify.explorer.counterexample import counterexample_test
from kvfsm.verify.explorer.events import apply, build, enabled, event_label, replay_events
from kvfsm.verify.explorer.search import Counterexample, ExploreResult, explore
from kvfsm.verify.explorer.world import ENDED, LIVE, NEW, RETRACTED, BoundInvalid, Event, ExplorerConfig, Faults, World

# `_describe` (exception -> (violation name, detail)) is re-exported for kvfsm.verify.coverage's fuzzer.
__all__ = [
    "BoundInvalid",
    "CloneError",
    "Counterexample",
    "ENDED",
    "Event",
    "ExploreResult",
    "ExplorerConfig",
    "Faults",
    "LIVE",
    "NEW",
    "RETRACTED",
    "Snapshot",
    "Violation",
    "World",
    "apply",
    "build",
    "canonical_key",
    "check_world",
    "clone",
    "counterexample_test",
    "enabled",
    "event_label",
    "explore",
    "replay_events",
]
