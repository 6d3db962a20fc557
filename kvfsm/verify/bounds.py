"""The named bounds of `kvfsm check`: each a union of sub-bounds, every one explored exhaustively, whose
transition coverage is unioned. A union reaches every transition of the spec sooner than one bound big
enough to reach them all: a retract-and-readmit with three chunks needs one request and five decodes,
contention needs two or three requests, and their product is far past any budget.

- `ci`: what `.ci/run` explores on every commit (tests/verify/test_ci_bound.py), within 60 s on a 2-core
  machine;
- `default`: what `kvfsm check` explores without bound options, within 5 minutes on the same machine.

Each sub-bound says what it is there for; docs/explorer-coverage.md lists, transition by transition,
which sub-bounds reach it (`kvfsm check --report docs/explorer-coverage.md`, and `--ci` for the CI one).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfsm.verify.explorer import ExplorerConfig


@dataclass(frozen=True)
class SubBound:
    name: str
    config: ExplorerConfig
    why: str


@dataclass(frozen=True)
class Bound:
    name: str
    command: str  # the `kvfsm check` invocation that explores it
    parts: tuple[SubBound, ...]


_CHUNKS = SubBound(
    "three-chunks",
    ExplorerConfig(requests=1, decodes=5),
    "one request, three chunks: two copies in flight, parked chunks, resubmission, backups with more chunks "
    "behind them, every end while copies are in flight",
)
_READMIT_FULL = SubBound(
    "readmit-host-full",
    ExplorerConfig(requests=1, decodes=3, host_slots=2, readmits=1),
    "one request against a one-page host pool, retracted and re-admitted: host full while allocated (the old "
    "lifecycle still holds the page), offloading and inflight",
)
_THREE = SubBound(
    "three-requests",
    ExplorerConfig(requests=3),
    "three requests interleaving admission, offload, batch offload and every end, 16 device slots",
)
_HOST = SubBound(
    "host-contention",
    ExplorerConfig(requests=2, decodes=3, host_slots=2),
    "two requests with two chunks each contending for a one-page host pool",
)

_THREE_HOST = SubBound(
    "three-requests-host",
    ExplorerConfig(requests=3, host_slots=2),
    "three requests contending for a one-page host pool",
)

_ENGINE_RELEASE = SubBound(
    "engine-release",
    ExplorerConfig(requests=1, decodes=3, readmits=1, end_kinds=("finish", "engine_release")),
    "the engine releasing a request itself (SGLang's retraction) while allocated and while its chunks back up, "
    "then re-admitting it",
)

_FENCED_CHUNKS = SubBound(
    "fenced-three-chunks",
    ExplorerConfig(requests=1, decodes=5, fenced=True),
    "fences on (the spec's `fences` param): every end while copies are in flight releases at once, fenced, "
    "and the reuse event writes the fenced slots (waiting on their fences) between the copies' completions",
)
_FENCED_TWO = SubBound(
    "fenced-two-requests",
    ExplorerConfig(requests=2, decodes=2, host_slots=4, fenced=True, stream_ordered=True),
    "fences on, two requests: one request's writes of slots another released fenced, interleaved with the "
    "completions of that request's copies; a writer's wait orders it after the copy and lands nothing (the "
    "GPU's case), so a reused slot is released again while the old copy still reads it",
)

_FENCED_ENGINE_RELEASE = SubBound(
    "fenced-engine-release",
    ExplorerConfig(requests=1, decodes=3, readmits=1, end_kinds=("finish", "engine_release"), fenced=True),
    "fences on, the engine releasing a request itself in every live state (retraction never refused: its stream "
    "waits on the copies in flight first), then re-admitting it",
)

CI = Bound(
    "ci",
    "kvfsm check --ci",
    (
        _CHUNKS,
        _READMIT_FULL,
        _THREE,
        _HOST,
        _THREE_HOST,
        _ENGINE_RELEASE,
        _FENCED_CHUNKS,
        _FENCED_TWO,
        _FENCED_ENGINE_RELEASE,
    ),
)

DEFAULT = Bound(
    "default",
    "kvfsm check",
    (
        *CI.parts,
        SubBound(
            "three-requests-2-decodes",
            ExplorerConfig(requests=3, decodes=2, host_slots=4),
            "three requests with two decodes each over a two-page host pool: every interleaving of three "
            "lifecycles' offloads, copies, backups and ends",
        ),
        SubBound(
            "readmit-3-chunks",
            ExplorerConfig(requests=1, decodes=5, readmits=1),
            "three chunks of one request, retracted and re-admitted: the new lifecycle offloads while the old one "
            "drains",
        ),
        SubBound(
            "readmit-contention",
            ExplorerConfig(requests=2, decodes=2, host_slots=2, readmits=1),
            "two requests, each retracted and re-admitted once (under its old row number or another), "
            "contending for a one-page host pool",
        ),
        SubBound(
            "speculative-queue-2",
            ExplorerConfig(requests=2, decodes=2, host_slots=2, backup_queue=2, speculative=1),
            "speculative over-allocation (decode_spec) and two backups outstanding at once, two requests",
        ),
        SubBound(
            "engine-release-contention",
            ExplorerConfig(requests=2, decodes=2, host_slots=2, readmits=1, end_kinds=("finish", "engine_release")),
            "two requests, finished or released by the engine itself and re-admitted (under the old row number or "
            "another), contending for a one-page host pool",
        ),
        SubBound(
            "speculative-3-chunks",
            ExplorerConfig(requests=1, decodes=5, backup_queue=2, speculative=1),
            "three chunks of one request with speculative over-allocation and two backups outstanding",
        ),
        SubBound(
            "fenced-three-requests",
            ExplorerConfig(requests=3, fenced=True),
            "fences on, three requests over 16 device slots: fenced releases, reuse and copy completions of "
            "three lifecycles interleaved",
        ),
        SubBound(
            "fenced-stream-ordered-chunks",
            ExplorerConfig(requests=1, decodes=5, fenced=True, stream_ordered=True),
            "fences on, a writer's wait landing nothing (the GPU's case): three chunks, each end released fenced, "
            "the reuse writer's slots released again under the copies",
        ),
        SubBound(
            "fenced-stream-ordered-engine-release",
            ExplorerConfig(
                requests=1,
                decodes=3,
                readmits=1,
                end_kinds=("finish", "engine_release"),
                fenced=True,
                stream_ordered=True,
            ),
            "fences on, a wait landing nothing: the engine releasing a request itself after its stream waited, "
            "then re-admitting it while those copies still read its old slots",
        ),
    ),
)

BOUNDS: dict[str, Bound] = {b.name: b for b in (CI, DEFAULT)}

__all__ = ["BOUNDS", "Bound", "CI", "DEFAULT", "SubBound"]
