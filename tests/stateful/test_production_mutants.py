"""The production matrix bites: for each of its dimensions, realistic bugs injected with `monkeypatch`, and
proof that the stateful run over the configuration that exercises the dimension FAILS (with the check
expected to see it first), as tests/stateful/test_mutants.py does for the bug catalog.

Each mutant runs `ProductionMachine` (tests/stateful/production.py) over one configuration of
test_production_matrix.py, derandomized, without an example database or shrinking, until the first
failure; it must fail inside the machine's steps, with one of the named checks (an invariant of the
shadow ledger, or the typed error a guard raised: a harness that crashes does not count as a catch).
`test_zz_every_dimension_bites` then asserts every dimension has at least one mutant, and every mutant
that ran was caught.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings

import test_manager_machine as tm
from catalog_faults import b1, b2, b3_host, b5, b8, b10, b13, b15
from production import Config
from test_production_matrix import CONFIGS, matrix_mooncake, run_config  # noqa: F401 (the fixture)

import kvfsm.runtime.backup as backup_mod
import kvfsm.runtime.build as build
from kvfsm.dataplane import TokenSlotAllocator
from kvfsm.dataplane.copy.cpu import DeferredHandle, _FutureHandle
from kvfsm.dataplane.fences import SlotFence
from kvfsm.dataplane.storage import FileStorage
from kvfsm.runtime.backup import Job, ThreadBackupWorker
from kvfsm.runtime.effects import OffloadEffects
from kvfsm.runtime.manager import DecodeOffloadManager
from kvfsm.runtime.tp import ProgressConsensus

CFG = {c.id: c for c in CONFIGS}


def _wrap(mp: pytest.MonkeyPatch, cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    mp.setattr(cls, name, make(getattr(cls, name)))


# --- copy engines -----------------------------------------------------------------------------------------


def deferred_done_lies(mp: pytest.MonkeyPatch) -> None:
    """DeferredHandle.done() answers True before the copy has run."""
    mp.setattr(DeferredHandle, "done", lambda self: True)


def thread_done_lies(mp: pytest.MonkeyPatch) -> None:
    """The threaded engine's handle reports done as soon as the copy is queued (future not consulted)."""
    mp.setattr(_FutureHandle, "done", lambda self: True)


def cuda_done_lies(mp: pytest.MonkeyPatch) -> None:
    """CudaCopyHandle.done() answers True without querying the event."""
    from kvfsm.dataplane.copy.cuda import CudaCopyHandle

    mp.setattr(CudaCopyHandle, "done", lambda self: True)


# --- backup workers and batching --------------------------------------------------------------------------


def batch_outcome_rotated(mp: pytest.MonkeyPatch) -> None:
    """A batched store call's per-page results are handed to the chunks shifted by one (chunk i gets chunk
    i+1's outcome)."""

    def make(orig: Callable) -> Callable:
        def _write_backups(self: Any, chunks: list) -> list:
            out = orig(self, chunks)
            return out[1:] + out[:1] if len(out) > 1 else out

        return _write_backups

    _wrap(mp, OffloadEffects, "_write_backups", make)


def run_jobs_reversed(mp: pytest.MonkeyPatch) -> None:
    """run_jobs gives the jobs of a batch their results in reverse order."""
    real = backup_mod.run_jobs

    def run_jobs(jobs: list) -> None:
        if len(jobs) > 1 and all(j.write_many is not None and j.write_many == jobs[0].write_many for j in jobs):
            try:
                results = jobs[0].write_many([j.payload for j in jobs])
            except Exception:
                results = None
            if results is not None and len(results) == len(jobs):
                for job, res in zip(jobs, reversed(results)):
                    job.results = tuple(res)
                return
        real(jobs)

    mp.setattr(backup_mod, "run_jobs", run_jobs)


def thread_worker_publishes_early(mp: pytest.MonkeyPatch) -> None:
    """The backup thread publishes a batch as completed before it has written it."""

    def _loop(self: Any) -> None:
        while True:
            with self._wake:
                while not self._todo:
                    self._wake.wait()
                jobs = []
                while self._todo and self._todo[0] is not None and len(jobs) < self.batch_limit:
                    jobs.append(self._todo.popleft())
                if not jobs:
                    self._todo.popleft()
                    return
            self._done.extend(jobs)  # the bug: visible to completed() before the write
            backup_mod.run_jobs(jobs)

    mp.setattr(ThreadBackupWorker, "_loop", _loop)


# --- storage ----------------------------------------------------------------------------------------------


def file_from_host_shifted(mp: pytest.MonkeyPatch) -> None:
    """FileStorage.batch_set_from_host gathers the pages one off: every page of a call is written under the
    next page's key (garbage under valid keys)."""

    def batch_set_from_host(self: Any, keys: Any, host_pool: Any, host_indices: Any) -> list[bool]:
        data = host_pool.get_pages_bytes(host_indices).numpy()
        return self._write(keys, np.roll(data, 1, axis=0) if len(keys) > 1 else data)

    mp.setattr(FileStorage, "batch_set_from_host", batch_set_from_host)


def factory_drops_tp_rank(mp: pytest.MonkeyPatch) -> None:
    """The manager builds its FileStorage without the TP rank: every rank's pages get rank 0's keys."""
    real = build.FileStorage
    mp.setattr(build, "FileStorage", lambda *a, tp_rank=0, **kw: real(*a, tp_rank=0, **kw))


def page_outcome_any(mp: pytest.MonkeyPatch) -> None:
    """A chunk counts as stored when any of its pages was (mixed outcomes inside a call read as success)."""
    mp.setattr(Job, "ok", property(lambda self: self.error is None and any(self.results)))


def short_answer_tolerated(mp: pytest.MonkeyPatch) -> None:
    """A store answering fewer results than pages is not detected: the last chunk gets the results there are."""

    def _write_backups(self: Any, chunks: list) -> list:
        storage, host_pool = self.storage, self.host_pool
        keys = [h for chunk in chunks for h in chunk.hashes]
        slots = host_pool.page_slots([p for chunk in chunks for p in chunk.host_pages])
        direct = getattr(storage, "batch_set_from_host", None)
        ok = (
            list(direct(keys, host_pool, slots))
            if direct is not None
            else list(storage.batch_set(keys, list(host_pool.get_pages_bytes(slots).unbind(0))))
        )
        out, at = [], 0
        for chunk in chunks:  # the bug: no check that len(ok) == len(keys)
            n = (chunk.end - chunk.start) // self.page_size
            out.append(ok[at : at + n])
            at += n
        return out

    mp.setattr(OffloadEffects, "_write_backups", _write_backups)


def raising_store_assumed_written(mp: pytest.MonkeyPatch) -> None:
    """A store call that raises is taken as written (the exception is logged, the pages assumed stored)."""

    def run(self: Any) -> None:
        try:
            self.results = tuple(self.write(self.payload))
        except Exception:
            self.error, self.results = None, (True,) * len(self.payload.hashes)

    mp.setattr(Job, "run", run)


# --- TP ---------------------------------------------------------------------------------------------------


def no_consensus(mp: pytest.MonkeyPatch) -> None:
    """ProgressConsensus.agree returns this rank's own counts (no MIN all-reduce)."""
    mp.setattr(ProgressConsensus, "agree", lambda self, *counts: counts)


# --- the engine changes an ended request object before its deferred release ------------------------------


def release_reads_current_lengths(mp: pytest.MonkeyPatch) -> None:
    """Lengths are not frozen at the end: a deferred release frees what the request object says then."""
    mp.setattr(OffloadEffects, "freeze_lengths", lambda self, m, arg: None)


def release_reads_current_row(mp: pytest.MonkeyPatch) -> None:
    """A deferred release frees the row the request object names then (when it names one)."""

    def make(orig: Callable) -> Callable:
        def release_request(self: Any, m: Any, arg: Any) -> None:
            rec = m.ctx
            row = rec.req.req_pool_idx
            if isinstance(row, int) and row >= 0:
                rec.row = row
            orig(self, m, arg)

        return release_request

    _wrap(mp, OffloadEffects, "release_request", make)


def release_reads_current_prefix(mp: pytest.MonkeyPatch) -> None:
    """A release frees from the prefix length the request object names then, not the one it matched."""

    def make(orig: Callable) -> Callable:
        def release_request(self: Any, m: Any, arg: Any) -> None:
            m.ctx.prefix_len = int(m.ctx.req.prefix_len)
            orig(self, m, arg)

        return release_request

    _wrap(mp, OffloadEffects, "release_request", make)


# --- metrics ----------------------------------------------------------------------------------------------


def gauge_stale_after_offload(mp: pytest.MonkeyPatch) -> None:
    """copies_in_flight is derived only by check_progress (stale after every offload until then)."""

    def make(orig: Callable) -> Callable:
        def _submit(self: Any, due: list, *more: Any) -> int:  # (the host pages reserved for them, if any)
            before = self.metrics.copies_in_flight
            try:
                return orig(self, due, *more)
            finally:
                self.metrics.copies_in_flight = before

        return _submit

    _wrap(mp, DecodeOffloadManager, "_submit", make)


def gauge_forgets_parked(mp: pytest.MonkeyPatch) -> None:
    """backups_in_flight counts the worker's jobs but not the chunks parked for room in its queue."""

    def make(orig: Callable) -> Callable:
        def check_progress(self: Any) -> None:
            orig(self)
            self.metrics.backups_in_flight = self.fx.worker.outstanding()

        return check_progress

    _wrap(mp, DecodeOffloadManager, "check_progress", make)


def gauge_never_decremented(mp: pytest.MonkeyPatch) -> None:
    """copies_in_flight only ever goes up (a gauge updated on submit, never on acknowledgement)."""

    def make(orig: Callable) -> Callable:
        def check_progress(self: Any) -> None:
            before = self.metrics.copies_in_flight
            orig(self)
            self.metrics.copies_in_flight = max(before, self.metrics.copies_in_flight)

        return check_progress

    _wrap(mp, DecodeOffloadManager, "check_progress", make)


def stored_pages_counts_chunks(mp: pytest.MonkeyPatch) -> None:
    """metrics.stored_pages counts stored chunks, not pages."""

    def make(orig: Callable) -> Callable:
        def mark_stored_each(self: Any, items: list) -> None:
            before = self.metrics.stored_pages
            orig(self, items)
            self.metrics.stored_pages = before + len(items)

        return mark_stored_each

    _wrap(mp, OffloadEffects, "mark_stored_each", make)


# --- fenced release ---------------------------------------------------------------------------


def writer_skips_the_wait(mp: pytest.MonkeyPatch) -> None:
    """The engine writes pages alloc_fenced handed out without waiting on their fences (#21's named fault)."""
    import production

    mp.setattr(production, "wait_fences", lambda fences, stream=None: None)


def fence_misses_the_copies(mp: pytest.MonkeyPatch) -> None:
    """A fenced release tags the slots with an empty fence (one that has always passed), not their copies."""

    def release_request_fenced_each(self: Any, items: list) -> None:
        for m, _ in items:
            self._release(m.ctx, SlotFence([]))
            self.metrics.fenced_releases += 1

    mp.setattr(OffloadEffects, "release_request_fenced_each", release_request_fenced_each)


def fenced_pages_without_fences(mp: pytest.MonkeyPatch) -> None:
    """alloc_fenced hands out fenced pages but forgets their fences (the writer has nothing to wait on)."""

    def make(orig: Callable) -> Callable:
        def alloc_pages_fenced(self: Any, k: int) -> Any:
            got = orig(self, k)
            return None if got is None else (got[0], ())

        return alloc_pages_fenced

    _wrap(mp, TokenSlotAllocator, "alloc_pages_fenced", make)


# --- the table ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutant:
    dimension: str
    config: str
    inject: Callable[[pytest.MonkeyPatch], None]
    expect: tuple[str, ...]  # checks that may see it first


U = "deferred-stepped-memory+faulty-tp1-unchecked"
F = "deferred-stepped-memory-tp2-unchecked-fenced"
FC = "deferred-stepped-memory+faulty-tp1-checked-fenced"
MUTANTS: dict[str, Mutant] = {
    # copy engines: a done() that lies, a copy that moves nothing
    "deferred-done-lies": Mutant(
        "copy engine", U, deferred_done_lies, ("ack_before_landed", "host_free_before_landed", "store_before_landed")
    ),
    "thread-done-lies": Mutant(
        "copy engine",
        "thread-thread-file-tp1-unchecked",
        thread_done_lies,
        (
            "ack_before_landed",
            "store_before_landed",
            "store_write_content",
            "host_free_before_landed",
            "free_under_copy",
            "host_page_content",
            "stored_page_content",
        ),
    ),
    "cuda-done-lies": Mutant(
        "copy engine",
        "cuda-thread-file-tp1-unchecked",
        cuda_done_lies,
        (
            "ack_before_landed",
            "store_before_landed",
            "store_write_content",
            "host_free_before_landed",
            "free_under_copy",
        ),
    ),
    "copy-moves-nothing-B15": Mutant(
        "copy engine", "cpu-inline-memory+faulty-tp1-unchecked", b15, ("host_page_content",)
    ),
    # backup workers with batching on: outcomes attributed to the wrong chunk, completions published early
    "batch-outcome-rotated-inline": Mutant(
        "backup worker",
        "cpu-inline-memory+faulty-tp1-unchecked",
        batch_outcome_rotated,
        ("stored_means_confirmed", "metric_stored_pages", "metric_backup_failures", "stored_means_in_storage"),
    ),
    "batch-outcome-rotated-thread": Mutant(
        "backup worker",
        "thread-thread-file-tp1-unchecked",
        batch_outcome_rotated,
        (
            "stored_means_confirmed",
            "metric_stored_pages",
            "metric_backup_failures",
            "stored_means_in_storage",
            "stored_page_content",
        ),
    ),
    "run-jobs-reversed-stepped": Mutant(
        "backup worker",
        U,
        run_jobs_reversed,
        ("stored_means_confirmed", "metric_stored_pages", "metric_backup_failures", "stored_means_in_storage"),
    ),
    "thread-worker-publishes-early": Mutant(
        "backup worker",
        "thread-thread-file-tp1-unchecked",
        thread_worker_publishes_early,
        # racy by nature: whichever consequence of host pages freed under
        # a running backup shows first
        (
            "host_free_under_backup",
            "store_reads_free_host_page",
            "store_reads_unallocated_host_page",
            "store_write_content",
            "store_key",
            "host_page_content",
            "metric_stored_pages",
            "metric_backup_failures",
            "stored_means_confirmed",
            "stored_means_in_storage",
            "stored_page_content",
        ),
    ),
    # storage built from OffloadConfig, page-granular outcomes inside batches
    "file-from-host-shifted": Mutant(
        "storage",
        "thread-thread-file-tp1-unchecked",
        file_from_host_shifted,
        ("stored_page_content", "read_back_content"),
    ),
    "factory-drops-tp-rank": Mutant(
        "storage", "deferred-stepped-file-tp2-unchecked", factory_drops_tp_rank, ("stored_page_content",)
    ),
    "mixed-outcome-read-as-success": Mutant(
        "page faults",
        "cpu-inline-memory+faulty-tp1-unchecked",
        page_outcome_any,
        ("stored_means_confirmed", "metric_stored_pages", "metric_backup_failures"),
    ),
    "short-answer-tolerated": Mutant(
        "page faults",
        "thread-stepped-memory+faulty-tp1-unchecked",
        short_answer_tolerated,
        ("stored_means_confirmed", "metric_stored_pages", "metric_backup_failures"),
    ),
    "raising-store-assumed-written": Mutant(
        "page faults",
        "cpu-thread-memory+faulty-tp1-checked",
        raising_store_assumed_written,
        ("stored_means_confirmed", "metric_stored_pages", "metric_backup_failures"),
    ),
    # TP
    "tp-no-consensus": Mutant(
        "tp",
        "deferred-stepped-file-tp2-unchecked",
        no_consensus,
        ("tp_identical_frees", "tp_identical_decisions", "tp_identical_metrics", "tp_identical_stored"),
    ),
    # unchecked mode: the shadow ledger alone catches catalog bugs
    "B2-unchecked": Mutant("unchecked shadow", U, b2, ("free_under_copy", "release_early")),
    "B5-unchecked": Mutant("unchecked shadow", U, b5, ("release_exact",)),
    "B8-unchecked": Mutant(
        "unchecked shadow", U, b8, ("release_due", "partial_release", "row_conservation", "protected_release")
    ),
    "B1-unchecked": Mutant(
        "unchecked shadow", U, b1, ("release_live", "release_owner", "device_conservation", "DoubleFree")
    ),
    "B3-host-unchecked": Mutant(
        "unchecked shadow",
        U,
        b3_host,
        ("host_conservation", "teardown_drains", "ledger_host_pages", "gauge_backups_in_flight"),
    ),
    "B10-unchecked": Mutant("unchecked shadow", U, b10, ("host_free", "DoubleFree")),
    "B13-unchecked": Mutant("unchecked shadow", U, b13, ("stored_means_confirmed", "metric_stored_pages")),
    # the engine resets or reuses an ended request object before its deferred release
    "release-reads-current-lengths": Mutant(
        "request mutation",
        U,
        release_reads_current_lengths,
        ("release_owner", "release_exact", "DoubleFree", "PartialPage", "row_free"),
    ),
    "release-reads-current-row": Mutant(
        "request mutation",
        U,
        release_reads_current_row,
        ("release_owner", "release_exact", "release_live", "row_free", "partial_release"),
    ),
    "release-reads-current-prefix": Mutant(
        "request mutation",
        U,
        release_reads_current_prefix,
        ("protected_release", "ValueError", "DoubleFree", "release_exact", "release_prefix_pages", "release_owner"),
    ),
    # metrics against the ledger's truth
    "gauge-stale-after-offload": Mutant("metrics", U, gauge_stale_after_offload, ("gauge_copies_in_flight",)),
    "gauge-forgets-parked": Mutant(
        "metrics", "deferred-stepped-memory+faulty-tp1-checked", gauge_forgets_parked, ("gauge_backups_in_flight",)
    ),
    "gauge-never-decremented": Mutant(
        "metrics", "thread-inline-memory-tp2-unchecked", gauge_never_decremented, ("gauge_copies_in_flight",)
    ),
    "stored-pages-counts-chunks": Mutant(
        "metrics", "cpu-inline-file+faulty-tp2-checked", stored_pages_counts_chunks, ("metric_stored_pages",)
    ),
    # fenced release: the writer must wait on the fences, and a fence must cover the copies that still read
    "writer-skips-the-wait": Mutant("fenced release", F, writer_skips_the_wait, ("reuse_under_copy",)),
    "writer-skips-the-wait-checked": Mutant(
        "fenced release", FC, writer_skips_the_wait, ("CheckedModeError", "reuse_under_copy")
    ),
    "fence-misses-the-copies": Mutant("fenced release", F, fence_misses_the_copies, ("fence_misses_copy",)),
    "fenced-pages-without-fences": Mutant("fenced release", F, fenced_pages_without_fences, ("reuse_under_copy",)),
}
DIMENSIONS = (
    "copy engine",
    "backup worker",
    "storage",
    "page faults",
    "tp",
    "unchecked shadow",
    "request mutation",
    "metrics",
    "fenced release",
)
REPORT: dict[str, dict[str, Any]] = {}

MUTANT_SETTINGS = dict(
    max_examples=1000 if tm.DEEP else 400,
    stateful_step_count=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=(Phase.explicit, Phase.generate),
)


def _params() -> list[Any]:
    return [
        pytest.param(mid, id=mid, marks=[pytest.mark.gpu] if CFG[m.config].gpu else []) for mid, m in MUTANTS.items()
    ]


@pytest.mark.parametrize("mid", _params())
def test_production_mutant_is_caught(
    mid: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    mutant = MUTANTS[mid]
    cfg: Config = CFG[mutant.config]
    mooncake = request.getfixturevalue("matrix_mooncake") if cfg.storage == "mooncake" else None
    bucket = f"pmutant:{mid}"
    mutant.inject(monkeypatch)
    t0 = time.perf_counter()
    error: Optional[BaseException] = None
    try:
        run_config(cfg, monkeypatch, tmp_path, mooncake, bucket, settings(**MUTANT_SETTINGS))
    except BaseException as exc:  # noqa: BLE001 - any failure is the catch; which one is checked below
        error = exc
    finally:
        monkeypatch.undo()
    first = tm.FIRST_FAILURE.get(bucket)
    REPORT[mid] = {
        "dimension": mutant.dimension,
        "config": cfg.id,
        "caught": error is not None,
        "first": first,
        "steps": tm.STEPS.get(bucket, 0),
        "seconds": time.perf_counter() - t0,
    }
    print(
        f"\n{mid} ({cfg.id}): {'caught' if error else 'SURVIVED'} after {tm.STEPS.get(bucket, 0)} steps, "
        f"{time.perf_counter() - t0:.1f} s: {first}"
    )
    assert error is not None, f"mutant {mid} survived {tm.STEPS.get(bucket, 0)} steps of {cfg.id}"
    assert first is not None, f"mutant {mid}: failure outside the machine's steps: {error!r}"
    assert first["check"] in mutant.expect, (
        f"mutant {mid} was first seen by {first['check']!r}, not one of {mutant.expect}: {first['exc']}"
    )


def test_zz_every_dimension_bites() -> None:
    assert set(m.dimension for m in MUTANTS.values()) == set(DIMENSIONS)
    if not REPORT:
        pytest.skip("no production mutant ran in this session")
    assert all(r["caught"] for r in REPORT.values()), [k for k, r in REPORT.items() if not r["caught"]]
    ran = {r["dimension"] for r in REPORT.values()}
    if len(REPORT) == sum(1 for m in MUTANTS.values() if not CFG[m.config].gpu):
        assert ran == set(DIMENSIONS), f"dimensions without a caught mutant: {set(DIMENSIONS) - ran}"
