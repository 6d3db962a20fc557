"""The production configurations of the stateful suite: what test_production_matrix.py and
test_production_mutants.py run.

`ProductionMachine` is the stateful machine of test_manager_machine.py (it subclasses `ManagerMachine` and
keeps its rules: admit with rid reuse, decode with speculative over-allocation, whole scheduler steps with
a loop of offload() or one offload_batch with or without the batch arrays, offload, copy completions in
any order, backup runs with injected failures, progress checks, finish / abort / retract, duplicate end
calls, re-admission of retracted request objects), re-implemented over every production part instead of
SimEngine's fixed deferred engine and stepped worker, plus `serving_loop` (scheduler iterations as a server
runs them: decode all, one offload_batch, some completions, a progress check), `plant_fault`, `wait_backups`
and `mutate_ended` (below):

- copy engines: CpuCopyEngine and DeferredCpuCopyEngine built by the manager from `copy_backend`,
  ThreadCpuCopyEngine passed in (no config value selects it), CudaCopyEngine built from
  `copy_backend="cuda"` (GPU runs only; the engine's KV writes are asynchronous and each offload call finds
  the compute stream busy for 2 ms, so copies are really in flight when the progress check looks);
  the host pool is always the one the manager builds from `host_pool_bytes` and `host_layout`;
- backup workers: SteppedBackupWorker (a rule runs any queued jobs, several together through `run_jobs`,
  the batched path), ThreadBackupWorker built by the manager (batch_limit 1024) and InlineBackupWorker
  below (kvfsm ships none: the minimal BackupWorker an engine could hand in, running every queued job at
  flush(), at the end of each progress check, batched through `run_jobs`);
- storage: MemoryStorage passed in; FileStorage and MooncakeStorage built by the manager itself from
  `OffloadConfig` (storage_backend, storage_dir / storage_extra, model name, TP rank and size), closed by
  `manager.close()`; the faulty variant wraps the same store (built with `kvfsm.runtime.build.storage_factory`,
  the manager's own code) in `FaultyStorage`, whose page failures then replace the observer's;
- TP 1 or 2: two ranks in one process, each its own pools, manager, copy engine, worker and store (keys
  carry the rank), driven by identical scheduler decisions; their progress checks run on two threads (rank
  0 on the scheduler's, rank 1 on its own) that meet in a barrier standing in for the MIN all-reduce (the
  real ProgressConsensus.agree runs over it), and each rank's copies and backups complete at its own time;
- checked (the manager's slot ledger, spec invariants after every transition, batch events item by item)
  or unchecked (the production path: generated batch events, several completions per progress check).

Faults at page granularity inside batched store calls: some pages of one call fail (the observer, or
FaultyStorage), the store raises before or after writing, or answers short (writes and reports one page
fewer). Which page gets which fault is a function of its key (planted by rules, or a per-example rate), so
both TP ranks see the same outcome per chunk whatever their batching. Engine-side mutation: between the
end of a request and its deferred release the engine resets its fields, fills them with garbage, or reuses
the object for a new request (new prompt, serial and row).

After every rule `Shadow` (one per rank) is compared with the pools, the manager's metrics and the store.
The shadow is an independent model built only from what the test did (admissions, slot growth, ends) and
what the data plane was asked to do (every copy submission, every copy's landing, every store call, every
device/host/row/protected-size free, observed by wrapping those objects' methods): which request owns which
device pages and table row, which chunk holds which host pages, which copies have landed, what each store
call wrote and answered. It checks, at the moment each happens, that a release frees exactly the pages,
row and protected size the lifecycle owned (whatever the engine did to the request object since), never
under a copy that has not landed; that host pages are freed once, whole chunks, after their copy landed
and no backup still reads them; that every page a store call is given carries the key of the page it
holds and the KV its writer wrote; and after every rule: conservation (free + owned = capacity, pools
and protected size), no double ownership, that every lifecycle whose copies were all acknowledged is
released, the gauges (copies and backups in flight; host pages held, which OffloadMetrics has no gauge
for, is the host pool's own count) and counters equal to the shadow's truth (and to the checked ledger's
in checked mode), every page marked stored was confirmed by the store and reads back equal to what the
device held when it was offloaded, and with two ranks identical frees, metrics and stored pages on both.
The one thing read from the manager is how many chunks it has acknowledged (its copy FIFO's length, the
checked ledger's view), and that is checked against the truth: never a copy that has not landed, at least
every copy that had landed (and said so) before the progress check; it is checked again right after each
progress check, while copies submitted just before may still be running.

With a copy or backup thread the state after a rule depends on the threads' timing; hypothesis needs the
choice of rules to depend only on its own earlier choices, so there every rule stays enabled (`when`), a
failure is reported as found (not shrunk, not saved), and faults are planted only for chunks no rank has
queued a backup for yet.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import queue
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

import test_manager_machine as tm
from test_manager_machine import check, page_values
from timing import backups_settled, measure, scaled

import kvfsm.dataplane.copy.cpu as cpu_copy
import kvfsm.runtime.backup as backup_mod
from kvfsm.dataplane import (
    KVCacheConfig,
    ReqToTokenPool,
    ThreadCpuCopyEngine,
    TokenSlotAllocator,
    page_hashes,
    wait_fences,
)
from kvfsm.dataplane.pools.allocator import PageSlots
from kvfsm.dataplane.pools.device_pool import DeviceKVPool
from kvfsm.dataplane.storage import FaultyStorage, MemoryStorage
from kvfsm.runtime import DecodeOffloadManager, OffloadConfig, SimplePrefixCache, SteppedBackupWorker
from kvfsm.runtime.backup import BackupWorker
from kvfsm.runtime.build import close_storage, storage_factory
from kvfsm.runtime.tp import ProgressConsensus
from kvfsm.verify.engine import SCRATCH_WRITER, SimRequest, kv_value

# --- configurations ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    copy: str  # "cpu" | "deferred" | "thread" | "cuda"
    worker: str  # "inline" | "stepped" | "thread"
    storage: str  # "memory" | "file" | "mooncake"
    faulty: bool  # the store behind FaultyStorage
    tp: int  # 1 or 2 ranks
    checked: bool
    examples: int = 10  # CI examples (deep: DEEP_FACTOR times more)
    steps: int = 200  # rule steps per example
    # OffloadConfig.fenced_release: an end under a copy releases its slots at once, fenced; the engine takes
    # slots with alloc_fenced and waits on their fences before writing, and a scratch writer reuses fenced ones
    fenced: bool = False

    @property
    def id(self) -> str:
        return (
            f"{self.copy}-{self.worker}-{self.storage}{'+faulty' if self.faulty else ''}-tp{self.tp}-"
            f"{'checked' if self.checked else 'unchecked'}{'-fenced' if self.fenced else ''}"
        )

    @property
    def gpu(self) -> bool:
        return self.copy == "cuda"

    @property
    def timing_dependent(self) -> bool:
        """Copies or backups complete on threads of their own, at their own time."""
        return self.copy in ("thread", "cuda") or self.worker == "thread"


# --- a backup worker an engine could hand in -----------------------------------------------------------


class InlineBackupWorker(BackupWorker):
    """Runs every queued job on the scheduler thread at flush() (the end of each progress check), the jobs
    of one flush batched through `run_jobs` (one store call for all their pages); collected at the next
    progress check, in submission order."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._todo: list[Any] = []
        self._done: deque = deque()

    def _enqueue(self, job: Any) -> None:
        self._todo.append(job)

    def flush(self) -> None:
        jobs, self._todo = self._todo, []
        if jobs:
            backup_mod.run_jobs(jobs)  # looked up at the call (a mutant test may replace it)
            self._done.extend(jobs)

    def completed(self) -> int:
        return len(self._done)

    def _pop_done(self) -> Any:
        return self._done.popleft()


# --- TP: two ranks in one process ---------------------------------------------------------------------


class ThreadGroup:
    """all_reduce(MIN) between rank threads through a barrier (what gloo/NCCL do across processes). The
    barrier's timeout is a hang guard: 60 s of the reference machine, in this machine's seconds now."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.timeout = scaled(60)
        self.barrier = threading.Barrier(world, timeout=self.timeout)
        self.slots: list[Any] = [None] * world
        self.rank_of: dict[int, int] = {}

    def all_reduce(self, t: torch.Tensor) -> None:
        rank = self.rank_of[threading.get_ident()]
        self.slots[rank] = t.clone()
        self.barrier.wait()
        t.copy_(torch.stack(self.slots).min(dim=0).values)
        self.barrier.wait()


class RankThread:
    """A TP rank's own thread: runs what it is given (its progress checks), reports the exception or None."""

    def __init__(self, group: ThreadGroup, r: int) -> None:
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, args=(group, r), name=f"tp-rank-{r}", daemon=True)
        self._thread.start()

    def _loop(self, group: ThreadGroup, r: int) -> None:
        group.rank_of[threading.get_ident()] = r
        while True:
            fn = self._todo.get()
            if fn is None:
                return
            try:
                fn()
                self._done.put(None)
            except BaseException as exc:  # noqa: BLE001
                group.barrier.abort()
                self._done.put(exc)

    def submit(self, fn: Callable[[], Any]) -> None:
        self._todo.put(fn)

    def result(self, timeout: float) -> Optional[BaseException]:
        try:
            return self._done.get(timeout=timeout)
        except queue.Empty:
            return violation(
                "tp_progress", f"timed out: a rank's progress check did not return in {timeout:.0f} s ({measure(0)})"
            )

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(scaled(10))  # a daemon thread: at worst it is left behind


def patch_all_reduce(mp: Any) -> None:
    """torch.distributed.all_reduce over a ThreadGroup goes to the group (anything else as before)."""
    real = torch.distributed.all_reduce

    def all_reduce(t: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        if isinstance(group, ThreadGroup):
            return group.all_reduce(t)
        return real(t, op=op, group=group, async_op=async_op)

    mp.setattr(torch.distributed, "all_reduce", all_reduce)


# --- copy landings: the truth about which copies have moved their bytes --------------------------------

_SHADOWS: dict[int, Shadow] = {}  # id(host pool) -> the shadow of its rank


def patch_landing_probe(mp: Any) -> None:
    """Every CPU copy engine performs a copy through cpu.run_plan (at submit, on its thread, or when a test
    completes it): after it ran, the rank's shadow marks the copy landed and checks the bytes it moved.
    Idempotent: a second round of examples in the same test patches again, and a probe wrapped in a probe
    reported every landing twice (the `copy_landed_unsubmitted` seen in CI whenever a configuration needed a
    second round)."""
    real = cpu_copy.run_plan
    if getattr(real, "landing_probe", False):
        return

    def run_plan(plan: Any) -> None:
        real(plan)
        shadow = _SHADOWS.get(id(plan.host_pool))
        if shadow is not None and plan.direction == "d2h":
            shadow.on_landed(tuple(plan.host_idx.tolist()))

    run_plan.landing_probe = True  # type: ignore[attr-defined]
    mp.setattr(cpu_copy, "run_plan", run_plan)


# --- faults ---------------------------------------------------------------------------------------------

FAULT_KINDS = ("fail", "raise_before", "raise_after", "short")


class Faults:
    """Which page key gets which store fault: planted by rules, else a per-example rate (decided by the key,
    so every rank and every batching of a chunk sees the same outcome)."""

    def __init__(self, rate: int) -> None:
        self.rate = rate  # per 1000 keys
        self.planted: dict[str, str] = {}

    def kind(self, key: str) -> Optional[str]:
        got = self.planted.get(key)
        if got is not None:
            return got or None
        v = int(key[:6], 16)
        return FAULT_KINDS[(v >> 12) % len(FAULT_KINDS)] if v % 1000 < self.rate else None

    def fails(self, key: str) -> bool:
        return self.kind(key) == "fail"


# --- the shadow ledger ------------------------------------------------------------------------------------


def violation(name: str, detail: str) -> tm.InvariantViolation:
    return tm.InvariantViolation(name, detail)


class Life:
    """One lifecycle of one request object, as the engine (the test) made it."""

    __slots__ = (
        "lid",
        "req",
        "serial",
        "row",
        "prefix",
        "prefill",
        "pages",
        "prefix_pages",
        "lock",
        "ended",
        "dev_freed",
        "row_freed",
        "prot_freed",
        "next_start",
        "chunks",
        "protected",
        "fenced",
    )

    def __init__(self, lid: int, req: SimRequest, row: int, page_size: int) -> None:
        self.lid, self.req, self.serial, self.row = lid, req, req.serial, row
        self.prefix = 0
        self.protected = False  # its prefix is counted in the protected size
        self.prefill = len(req.origin_input_ids) // page_size * page_size
        self.pages: dict[int, int] = {}  # own device page -> token position of its first slot
        self.prefix_pages: set[int] = set()  # the matched prefix's pages: the prefix cache's, locked by `lock`
        self.lock: Any = None
        self.ended = self.dev_freed = self.row_freed = self.prot_freed = False
        self.fenced = False  # its device pages went back fenced (maybe while its copies still read them)
        self.next_start = self.prefill
        self.chunks: list[SChunk] = []

    def __repr__(self) -> str:
        return f"Life({self.req.rid}#{self.serial}.{self.lid} row {self.row})"


class SChunk:
    """One chunk as the data plane saw it: a run of one request's positions in one copy submission."""

    __slots__ = (
        "life",
        "serial",
        "start",
        "end",
        "host_pages",
        "device_pages",
        "keys",
        "handle",
        "landed",
        "acked",
        "attempts",
        "writing",
        "freed",
        "seq",
    )

    def __init__(
        self, life: Life, start: int, end: int, host_pages: list[int], device_pages: set[int], keys: list[str], seq: int
    ) -> None:
        self.life, self.serial, self.start, self.end = life, life.serial, start, end
        self.host_pages, self.device_pages, self.keys = host_pages, device_pages, keys
        self.handle: Any = None
        self.landed = self.acked = self.freed = False
        self.attempts: list[bool] = []
        self.writing = 0
        self.seq = seq

    @property
    def ok(self) -> bool:
        return bool(self.attempts) and self.attempts[-1]

    def __repr__(self) -> str:
        return f"SChunk({self.life!r} [{self.start}, {self.end}))"


class Shadow:
    """The independent model of one rank (see the module docstring). Methods named on_* are called by the
    wrapped data plane (any thread); `check()` after every rule (the scheduler thread)."""

    def __init__(self, rank: Rank) -> None:
        self.rank = rank
        self.ps = rank.ps
        self.lock = threading.RLock()
        self.errors: list[str] = []  # violations seen inside wrapped calls (possibly on other threads)
        self.lives: dict[int, Life] = {}  # id(request object) -> its current lifecycle
        self.all_lives: list[Life] = []
        self.device_owner: dict[int, Life] = {}
        self.row_owner: dict[int, Life] = {}
        self.host_owner: dict[int, SChunk] = {}
        self.chunks: list[SChunk] = []  # submission order
        self.pending_copies: dict[tuple[int, ...], list[SChunk]] = {}  # host slots -> chunks, until landed
        self.releasing: Optional[Life] = None
        self.batch_releasing: list[Life] = []  # lifecycles whose pages one batched free released, rows still held
        self.engine_freeing = False
        self.scratch_freeing = False  # the scratch writer (reuse_fenced) gives back what it took
        self.evicting: Optional[Life] = None  # the lifecycle whose unlocked prefix the prefix cache evicts next
        self.acked = 0  # chunks acknowledged (a FIFO prefix of self.chunks)
        self.ack_floor = 0  # at least this many must be acknowledged (landed before the last progress check)
        self.collected_ok_pages = 0
        self.collected_failed = 0
        self.marked_ok: dict[str, tuple[int, int]] = {}  # key -> (writer serial, position) of chunks stored ok
        self.verified: dict[str, tuple[str, int]] = {}  # stored-index entries already read back
        self.duplicates = 0  # end calls on an ended lifecycle (the manager must ignore each)
        # device and host frees, in order (TP comparison): device slots, or, with fenced release, whose positions
        # (which pages an allocation returns then depends on each rank's copy timing: see Rank.grow)
        self.log: list[tuple[str, tuple[Any, ...]]] = []
        self.stats: dict[str, int] = {}
        self._lids = itertools.count(1)
        self._seq = itertools.count()
        self._stash = threading.local()  # host slots the manager just read bytes of (batch_set path)
        self._previous: dict[int, Optional[Life]] = {}  # id(request) -> its lifecycle before the admission

    # --- helpers --------------------------------------------------------------------------------------
    def fail(self, name: str, detail: str) -> None:
        with self.lock:
            self.errors.append(f"rank {self.rank.r}: {name}: {detail}")

    def count(self, what: str, n: int = 1) -> None:
        self.stats[what] = self.stats.get(what, 0) + n

    def value(self, serial: int, pos: int) -> float:
        return self.rank.value(serial, pos)

    def want(self, serial: int, start: int, n: int) -> torch.Tensor:
        return torch.tensor([self.value(serial, p) for p in range(start, start + n)], dtype=torch.float32)

    # --- what the engine does ---------------------------------------------------------------------------
    def admit(self, req: SimRequest, row: int) -> Life:
        with self.lock:
            life = Life(next(self._lids), req, row, self.ps)
            self._previous[id(req)] = self.lives.get(id(req))
            other = self.row_owner.get(row)
            if other is not None:
                self.fail("row_handed_out_twice", f"row {row} given to {req!r} while {other!r} owns it")
            self.row_owner[row] = life
            self.lives[id(req)] = life
            self.all_lives.append(life)
            return life

    def protect(self, life: Life) -> None:
        """The engine matched the request's prefix and locked it: those pages are the prefix cache's now."""
        with self.lock:
            life.prefix, life.protected, life.lock = life.req.prefix_len, True, life.req.lock
            for page, pos in list(life.pages.items()):
                if pos < life.prefix:
                    del life.pages[page]
                    life.prefix_pages.add(page)

    def abandon(self, life: Life) -> None:
        """Admission failed (no device room): the engine freed the row itself."""
        with self.lock:
            self.row_owner.pop(life.row, None)
            previous = self._previous.pop(id(life.req), None)
            if previous is None:
                self.lives.pop(id(life.req), None)
            else:
                self.lives[id(life.req)] = previous
            self.all_lives.remove(life)

    def grew(self, life: Life, slots: list[int], start: int) -> None:
        ps = self.ps
        self.check_no_reader(slots, f"{life!r}'s write")
        with self.lock:
            for k in range(0, len(slots), ps):
                page = slots[k] // ps
                other = self.device_owner.get(page)
                if other is not None:
                    self.fail("device_page_handed_out_twice", f"page {page} given to {life!r} while {other!r} owns it")
                self.device_owner[page] = life
                life.pages[page] = start + k

    def check_no_reader(self, slots: list[int], who: str) -> None:
        """About to be written (after the writer waited on the fences its allocation returned): no copy that
        has not landed may still read these pages (premature reuse of a page released fenced, B1/B2). On a
        CPU engine a fence's wait completes its copy; the CUDA engine's wait is the stream's, not the host's
        (the copy may still be in flight, ordered before the write on the GPU), so only the CPU ones check."""
        if self.rank.cfg.copy == "cuda":
            return
        pages = {s // self.ps for s in slots}
        reading = [c for c in self.unlanded() if c.device_pages & pages]
        if reading:
            self.fail(
                "reuse_under_copy",
                f"{who} into pages {sorted(pages)} while {reading} still copy from them "
                "(a fenced page handed out, or written, before its fence passed or was waited on)",
            )

    def ended(self, req: SimRequest) -> Optional[Life]:
        """The engine ends the request (finish, abort, retract); returns its lifecycle if it was live."""
        life = self.lives.get(id(req))
        if life is None or life.ended:
            self.duplicates += 1
            return None
        life.ended = True
        return life

    def current(self, req: SimRequest) -> Optional[Life]:
        return self.lives.get(id(req))

    # --- copies ------------------------------------------------------------------------------------------
    def on_submit(self, device_slots: list[int], host_slots: list[int]) -> list[SChunk]:
        """A d2h copy submission: split it into per-request chunks by device-page owner and check each."""
        ps = self.ps
        with self.lock:
            if len(device_slots) != len(host_slots):
                self.fail("copy_shape", f"{len(device_slots)} device slots, {len(host_slots)} host slots")
                return []
            runs: list[tuple[Life, int, int]] = []  # (life, first index, end index) in the submission
            for j, s in enumerate(device_slots):
                life = self.device_owner.get(s // ps)
                if life is None:
                    self.fail("copy_reads_unowned_slot", f"device slot {s} (page {s // ps}) belongs to no request")
                    return []
                if runs and runs[-1][0] is life and runs[-1][2] == j:
                    runs[-1] = (life, runs[-1][1], j + 1)
                else:
                    runs.append((life, j, j + 1))
            chunks = []
            seen: set[int] = set()
            for life, a, b in runs:
                if id(life) in seen:
                    self.fail("chunk_split", f"{life!r} appears twice in one copy")
                seen.add(id(life))
                req = life.req
                page0 = device_slots[a] // ps
                start = life.pages.get(page0, -1) + device_slots[a] % ps
                positions = [life.pages[device_slots[j] // ps] + device_slots[j] % ps for j in range(a, b)]
                end = start + (b - a)
                if life.ended:
                    self.fail("offload_after_end", f"{life!r} copies [{start}, {end}) after it ended (B1, B6)")
                if positions != list(range(start, end)) or start % ps or (end - start) % self.rank.stride:
                    self.fail("chunk_positions", f"{life!r} copies positions {positions} (stride {self.rank.stride})")
                if start != life.next_start:
                    self.fail(
                        "offload_contiguous",
                        f"{life!r} chunk [{start}, {end}) but the next one starts at {life.next_start} (B7)",
                    )
                committed = req.kv_committed_len
                if end > min(committed, len(req.origin_input_ids) + len(req.output_ids) - 1):
                    self.fail("chunk_committed", f"{life!r} chunk [{start}, {end}) past committed {committed}")
                host = host_slots[a:b]
                pages = [host[k] // ps for k in range(0, len(host), ps)]
                if host != [p * ps + k for p in pages for k in range(ps)]:
                    self.fail("host_whole_pages", f"{life!r} host slots {host} are not whole pages in order")
                for p in pages:
                    if p in self.host_owner:
                        self.fail(
                            "host_page_held_twice",
                            f"host page {p} given to {life!r} while {self.host_owner[p]!r} holds it",
                        )
                tokens = list(req.origin_input_ids) + list(req.output_ids)
                keys = page_hashes(tokens[:end], ps)[start // ps : end // ps] if end <= len(tokens) else []
                c = SChunk(life, start, end, pages, {device_slots[j] // ps for j in range(a, b)}, keys, next(self._seq))
                for p in pages:
                    self.host_owner[p] = c
                life.next_start = end
                life.chunks.append(c)
                self.chunks.append(c)
                chunks.append(c)
            self.pending_copies[tuple(host_slots)] = chunks
            return chunks

    def on_submit_failed(self, host_slots: list[int], chunks: list[SChunk]) -> None:
        with self.lock:
            self.pending_copies.pop(tuple(host_slots), None)
            for c in chunks:
                for p in c.host_pages:
                    self.host_owner.pop(p, None)
                c.life.chunks.remove(c)
                c.life.next_start = c.start
                self.chunks.remove(c)

    def on_landed(self, host_slots: tuple[int, ...]) -> None:
        with self.lock:
            chunks = self.pending_copies.pop(host_slots, None)
            if chunks is None:
                self.fail(
                    "copy_landed_unsubmitted",
                    f"a copy into host slots {list(host_slots)[:8]} landed twice or was never submitted",
                )
                return
            self._landed(chunks)

    def _landed(self, chunks: list[SChunk]) -> None:
        tv = self.rank.host_pool.token_view()
        for c in chunks:
            c.landed = True
            idx = torch.tensor([p * self.ps + k for p in c.host_pages for k in range(self.ps)])
            got = tv[:, :, idx].to(torch.float32)
            want = self.want(c.serial, c.start, c.end - c.start).view(1, 1, -1, 1, 1)
            if not bool((got == want).all()):
                self.fail("host_page_content", f"{c!r} landed {got[0, 0, :, 0, 0].tolist()} (B2, B15)")

    def refresh_landed(self) -> None:
        """The CUDA engine's copies land on the GPU: one has landed once its completion event has (the torch
        backend then scatters on the host when done() first sees it, which this does as the manager would).
        Every check that asks "has this copy landed?" (a device free, a host free, a store call) refreshes
        first: the answer must be the event's at the moment of the free or write, not at the last progress
        check, or a copy that landed in between (the manager's own done() saw it) reads as a free under a
        copy (a false B2 seen once on the H200)."""
        if self.rank.cfg.copy != "cuda":
            return
        with self.lock:
            for key, chunks in list(self.pending_copies.items()):
                h = chunks[0].handle if chunks else None
                if h is not None and h.event.query():
                    if h.backend == "torch":
                        h.done()
                    del self.pending_copies[key]
                    self._landed(chunks)

    def unlanded(self) -> list[SChunk]:
        with self.lock:
            return [c for cs in self.pending_copies.values() for c in cs]

    # --- frees --------------------------------------------------------------------------------------------
    def on_device_free(self, slots: list[int], fence: Any = None) -> None:
        ps = self.ps
        self.refresh_landed()
        with self.lock:
            pages = sorted({s // ps for s in slots})
            by_slot = not self.rank.cfg.fenced
            if by_slot:
                self.log.append(("device_free", tuple(sorted(slots))))
            if self.scratch_freeing:
                if not by_slot:
                    self.log.append(("device_free", ("scratch", len(slots))))
                return
            if fence is not None and not self.rank.cfg.fenced:
                self.fail("fenced_free_unfenced", f"pages {pages} freed fenced without fenced_release")
            evicting, self.evicting = self.evicting, None
            if not by_slot:
                owner = (evicting or self.device_owner.get(pages[0])) if pages else None
                where = tuple(sorted(owner.pages.get(p, -1) for p in pages)) if owner is not None else ()
                self.log.append(
                    (
                        "device_free",
                        (owner.serial if owner is not None else None, evicting is not None, len(slots), where),
                    )
                )
            if evicting is not None:  # the prefix cache evicts an unlocked prefix: exactly its pages
                if set(pages) != evicting.prefix_pages:
                    self.fail(
                        "prefix_eviction",
                        f"{evicting!r}: the prefix cache evicted {pages}, its prefix held "
                        f"{sorted(evicting.prefix_pages)}",
                    )
                for p in pages:
                    if self.device_owner.get(p) is evicting:
                        del self.device_owner[p]
                evicting.prefix_pages = set()
                return
            owners = {id(self.device_owner.get(p)): self.device_owner.get(p) for p in pages}
            # One release frees its own pages in one call; the releases of one batch event may share one call
            # (OffloadEffects.release_request_each), each still freeing exactly its own pages, before any of their
            # rows and locks go back
            if None in owners.values() or not owners or (len(owners) > 1 and self.batch_releasing):
                self.fail(
                    "release_owner",
                    f"frees pages {pages} of {list(owners.values())} (B9, B11, B12: a page "
                    f"freed twice or one no request owns)",
                )
                for p in pages:
                    self.device_owner.pop(p, None)
                return
            if len(slots) != len(pages) * ps:
                self.fail(
                    "release_slots", f"{list(owners.values())!r}: {len(slots)} slots for {len(pages)} pages (B11, B12)"
                )
            for life in owners.values():
                own = [p for p in pages if self.device_owner.get(p) is life]
                if not life.ended:
                    self.fail("release_live", f"{life!r} released while live (premature reuse, B1)")
                if set(own) & life.prefix_pages:
                    self.fail(
                        "release_prefix_pages",
                        f"{life!r} freed pages {sorted(set(own) & life.prefix_pages)} of "
                        "its matched prefix, which the prefix cache owns (B16)",
                    )
                if set(own) != set(life.pages):
                    self.fail(
                        "release_exact",
                        f"{life!r} freed pages {own}, owned {sorted(life.pages)} (B5, B8; "
                        f"lengths read from a request the engine changed?)",
                    )
                if fence is not None and any(c.device_pages & set(own) for c in self.unlanded()):
                    self.count("fenced_free_under_copy")
                life.fenced = fence is not None
                for p in own:
                    del self.device_owner[p]
                life.dev_freed = True
            if len(owners) == 1:
                (self.releasing,) = owners.values()
            else:  # each becomes the release in progress when its row goes back (on_row_free)
                self.batch_releasing = list(owners.values())

    def after_device_free(self, slots: list[int], fence: Any = None) -> None:
        """A free has happened: every freed page a copy still reads must now wait in the allocator's fenced
        FIFO under a fence that covers each such copy, whatever the free passed (a plain free of a reused page
        keeps the fence it was handed out with: the device_slots fence rule). That fence is what the page's
        next writer will be given to wait on, so this is the B2 property itself, checked on the allocator."""
        self.refresh_landed()
        with self.lock:
            pages = sorted({s // self.ps for s in slots})
            fence_of = self.rank.allocator._page_fence
            for p in pages:
                reading = [c for c in self.unlanded() if p in c.device_pages and not c.handle.done()]
                if not reading:
                    continue
                kept = fence_of.get(p)
                owner = "the scratch writer" if self.scratch_freeing else f"page {p}'s last owner"
                if kept is None and fence is None:
                    self.fail(
                        "free_under_copy",
                        f"{owner} freed page {p} while {reading} still copy from it, and it went back unfenced (B2)",
                    )
                    continue
                missed = [c for c in reading if kept is None or not kept.covers(c.handle)]
                if missed:
                    self.fail(
                        "fence_misses_copy",
                        f"{owner} freed page {p}: the fence it goes back with misses "
                        f"{missed}, which still copy from it (B2: the device_slots fence rule)",
                    )

    def on_row_free(self, row: int) -> None:
        with self.lock:
            life = self.row_owner.pop(row, None)
            if self.engine_freeing:
                return
            if life is None:
                self.fail("row_free", f"row {row} freed, owned by nobody (double release, B9)")
                return
            if self.releasing is None and any(life is b for b in self.batch_releasing):
                self.releasing = life  # its pages went in a batch's one free
                self.batch_releasing = [b for b in self.batch_releasing if b is not life]
            if life is not self.releasing and self.releasing is None and life.ended and not life.pages:
                life.dev_freed, self.releasing = True, life  # owns no page of its own: its release frees none
            if life is not self.releasing or not life.dev_freed:
                self.fail("row_free", f"row {row} of {life!r} freed outside its release (B8, B9)")
            life.row_freed = True

    def on_unlock(self, lock: Any) -> None:
        """The manager unlocks a matched prefix: only in its lifecycle's release, after the device pages and
        the row, with that lifecycle's own lock. The prefix cache then evicts the pages (on_device_free)."""
        with self.lock:
            life = self.releasing
            if life is None or life.prot_freed or not life.row_freed:
                self.fail("protected_release", f"prefix lock {lock!r} unlocked outside a release (B4)")
                return
            if lock is not life.lock:
                self.fail(
                    "protected_release",
                    f"{life!r} unlocked {lock!r}, it locked {life.lock!r} "
                    "(B3, B4; read from a request the engine changed?)",
                )
            life.prot_freed = True
            self.releasing = None
            self.evicting = life if lock is not None else None

    def on_host_free(self, pages: list[int]) -> None:
        self.refresh_landed()
        with self.lock:
            self.log.append(("host_free", tuple(pages)))
            chunks: dict[int, SChunk] = {}
            for p in pages:
                c = self.host_owner.pop(p, None)
                if c is None:
                    self.fail("host_free", f"host page {p} freed, held by no chunk (host double free, B10)")
                    continue
                chunks[id(c)] = c
            given = set(pages)
            for c in chunks.values():
                if not set(c.host_pages) <= given:
                    self.fail("host_free_whole", f"{c!r}: only part of its host pages freed")
                    for p in c.host_pages:
                        self.host_owner.pop(p, None)
                if not c.landed:
                    self.fail(
                        "host_free_before_landed", f"{c!r} host pages freed before its copy landed (done() lied?)"
                    )
                if c.writing:
                    self.fail("host_free_under_backup", f"{c!r} host pages freed while a store call still reads them")
                c.freed = True
                if c.ok:
                    self.collected_ok_pages += len(c.keys)
                    for j, k in enumerate(c.keys):
                        self.marked_ok[k] = (c.serial, c.start + j * self.ps)
                else:
                    self.collected_failed += 1

    # --- store calls ----------------------------------------------------------------------------------
    def stash(self, slots: list[int]) -> None:
        self._stash.slots = slots

    def take_stash(self) -> Optional[list[int]]:
        slots = getattr(self._stash, "slots", None)
        self._stash.slots = None
        return slots

    def store_begin(
        self, keys: list[str], slots: Optional[list[int]], pages: Optional[torch.Tensor]
    ) -> list[tuple[SChunk, list[int]]]:
        """A store call starts: attribute its pages to chunks and check each page's key and bytes."""
        ps, kv = self.ps, self.rank.kv
        self.refresh_landed()
        if slots is None or len(slots) != len(keys) * ps:
            self.fail("store_call_slots", f"store call of {len(keys)} keys with host slots {slots}")
            return []
        with self.lock:
            groups: list[tuple[SChunk, list[int]]] = []
            for i, key in enumerate(keys):
                hp = slots[i * ps] // ps
                c = self.host_owner.get(hp)
                if c is None:
                    self.fail(
                        "store_reads_free_host_page",
                        f"key {key[:12]} written from host page {hp}, held by no chunk (use after free)",
                    )
                    continue
                if not groups or groups[-1][0] is not c:
                    groups.append((c, []))
                groups[-1][1].append(i)
                j = c.host_pages.index(hp)
                if j >= len(c.keys) or c.keys[j] != key:
                    self.fail("store_key", f"{c!r} page {j}: key {key[:12]} is not the hash of its prefix")
                if not c.landed:
                    self.fail("store_before_landed", f"{c!r} backed up before its copy landed (done() lied?)")
                if pages is not None:
                    got = page_values(pages[i], kv, ps)
                    want = self.want(c.serial, c.start + j * ps, ps)
                    if not bool(torch.equal(got, want)):
                        self.fail(
                            "store_write_content",
                            f"{c!r} page {j}: writes {got.tolist()} under a valid key, the device held {want.tolist()}",
                        )
            for c, _ in groups:
                c.writing += 1
            self.count("store_calls")
            if len(groups) > 1:
                self.count("store_calls_multi_chunk")
            return groups

    def store_end(self, groups: list[tuple[SChunk, list[int]]], results: Optional[list[bool]], n_keys: int) -> None:
        with self.lock:
            whole = results is not None and len(results) == n_keys
            for c, idx in groups:
                c.writing -= 1
                c.attempts.append(whole and all(results[i] for i in idx))  # type: ignore[index]
            kind = (
                "raised"
                if results is None
                else "short"
                if not whole
                else "mixed_outcomes"
                if len(set(results)) > 1
                else None
            )
            if kind is not None:
                self.count(f"store_{kind}")
                if len(groups) > 1:  # inside one batched call of several chunks
                    self.count(f"batched_store_{kind}")
                    if kind == "mixed_outcomes" and len({c.attempts[-1] for c, _ in groups}) > 1:
                        self.count("batched_store_chunks_split")  # some of its chunks stored, others failed

    # --- the checks after every rule -----------------------------------------------------------------
    def check_acks(self) -> int:
        """Acknowledgements: the manager's copy FIFO is what it has not acknowledged yet (the checked ledger's
        view), bounded by the truth: never a copy that has not landed, always what had landed before the
        last progress check. Returns the chunks acknowledged (also run right after each progress check)."""
        r = self.rank
        self.refresh_landed()
        with self.lock:
            acked = len(self.chunks) - len(r.manager.fx.copy_fifo)
            check(
                self.acked <= acked <= len(self.chunks),
                "ack_monotone",
                lambda: f"rank {r.r}: {acked} chunks acknowledged, {self.acked} before, {len(self.chunks)} submitted",
            )
            for c in self.chunks[self.acked : acked]:
                check(
                    c.landed,
                    "ack_before_landed",
                    lambda: f"rank {r.r}: {c!r} acknowledged before its copy landed (a done() that lies)",
                )
                c.acked = True
            self.acked = acked
            check(
                acked >= self.ack_floor,
                "ack_landed_copies",
                lambda: (
                    f"rank {r.r}: {acked} chunks acknowledged, {self.ack_floor} had landed before the progress check"
                ),
            )
            return acked

    def check(self) -> None:
        r = self.rank
        m = r.manager
        ps = self.ps
        self.refresh_landed()
        with self.lock:
            if self.errors:
                raise violation(self.errors[0].split(": ")[1], "; ".join(self.errors[:3]))
            r.allocator.check_conservation()
            r.host_pool.check_conservation()
            r.table.check_conservation()
            check(
                r.allocator.capacity - r.allocator.free_slots == ps * len(self.device_owner),
                "device_conservation",
                lambda: (
                    f"rank {r.r}: {r.allocator.capacity - r.allocator.free_slots} device slots allocated, the "
                    f"shadow's requests own {ps * len(self.device_owner)}"
                ),
            )
            held = r.host_pool.capacity - r.host_pool.free_slots
            check(
                held == ps * len(self.host_owner),
                "host_conservation",
                lambda: (
                    f"rank {r.r}: {held} host slots allocated, the shadow's chunks hold {ps * len(self.host_owner)}"
                ),
            )
            check(
                r.table.rows - r.table.free_rows == len(self.row_owner),
                "row_conservation",
                lambda: f"rank {r.r}: {r.table.rows - r.table.free_rows} rows allocated, owned {len(self.row_owner)}",
            )
            protected = sum(life.prefix for life in self.all_lives if life.protected and not life.prot_freed)
            check(
                r.protected.size == protected,
                "protected_conservation",
                lambda: f"rank {r.r}: protected size {r.protected.size}, the shadow's lifecycles {protected}",
            )
            for life in self.all_lives:
                if life.dev_freed and not (life.row_freed and life.prot_freed):
                    raise violation(
                        "partial_release",
                        f"rank {r.r}: {life!r} freed its device pages but not its row or protected size",
                    )
            acked = self.check_acks()
            for life in self.all_lives:
                if life.ended and not life.dev_freed and all(c.acked for c in life.chunks):
                    raise violation(
                        "release_due",
                        f"rank {r.r}: {life!r} ended and all its copies were "
                        "acknowledged, but it still holds its device pages (B8: a leak)",
                    )
                if life.dev_freed and not life.fenced and not all(c.acked for c in life.chunks):
                    raise violation(
                        "release_early", f"rank {r.r}: {life!r} released before all its copies were acknowledged (B2)"
                    )
            # Metrics against the truth.
            mt = m.metrics
            in_copy = len(self.chunks) - acked
            holding = sum(1 for c in self.chunks if not c.freed)
            check(
                mt.copies_in_flight == in_copy,
                "gauge_copies_in_flight",
                lambda: f"rank {r.r}: copies_in_flight {mt.copies_in_flight}, {in_copy} chunks unacknowledged",
            )
            check(
                mt.copies_in_flight + mt.backups_in_flight == holding,
                "gauge_backups_in_flight",
                lambda: (
                    f"rank {r.r}: copies {mt.copies_in_flight} + backups {mt.backups_in_flight} in flight, "
                    f"{holding} chunks hold host pages"
                ),
            )
            check(mt.chunks == len(self.chunks), "metric_chunks", lambda: f"{mt.chunks} != {len(self.chunks)}")
            tokens = sum(c.end - c.start for c in self.chunks)
            check(
                mt.offloaded_tokens == tokens, "metric_offloaded_tokens", lambda: f"{mt.offloaded_tokens} != {tokens}"
            )
            check(
                mt.stored_pages == self.collected_ok_pages,
                "metric_stored_pages",
                lambda: (
                    f"rank {r.r}: stored_pages {mt.stored_pages}, the store confirmed {self.collected_ok_pages} "
                    "pages of collected chunks (B13)"
                ),
            )
            check(
                mt.backup_failures == self.collected_failed,
                "metric_backup_failures",
                lambda: f"rank {r.r}: backup_failures {mt.backup_failures}, {self.collected_failed} chunks failed",
            )
            released = sum(1 for life in self.all_lives if life.dev_freed)
            check(mt.releases == released, "metric_releases", lambda: f"{mt.releases} != {released}")
            check(
                mt.ignored_duplicate_releases == self.duplicates,
                "metric_ignored_duplicates",
                lambda: f"rank {r.r}: {mt.ignored_duplicate_releases} ignored, {self.duplicates} duplicate end calls",
            )
            if m.ledger is not None:  # checked mode: the ledger agrees with the shadow
                readers = set().union(*m.ledger.device_readers.values()) if m.ledger.device_readers else set()
                check(len(readers) == in_copy, "ledger_copies", lambda: f"ledger readers {len(readers)} != {in_copy}")
                check(
                    m.ledger.host_pages() == len(self.host_owner),
                    "ledger_host_pages",
                    lambda: f"ledger {m.ledger.host_pages()} host pages, shadow {len(self.host_owner)}",
                )
                owned = len(m.ledger.device_owner)
                check(
                    owned <= len(self.device_owner),
                    "ledger_device_pages",
                    lambda: f"ledger owns {owned} device pages, the engine handed out {len(self.device_owner)}",
                )
            todo = [(h, e) for h, e in m.fx.stored.items() if self.verified.get(h) != e]
            for h, (key, pos) in todo:
                got = self.marked_ok.get(h)
                check(
                    got is not None and got[1] == pos,
                    "stored_means_confirmed",
                    lambda: f"rank {r.r}: {key} page at {pos} marked stored; the store confirmed {got} (B13)",
                )
        if todo:  # read back outside the lock (a store call may be running on the worker thread)
            pages = r.store.batch_get([h for h, _ in todo])
            for (h, (key, pos)), page in zip(todo, pages):
                serial, _ = self.marked_ok[h]
                check(
                    page is not None,
                    "stored_means_in_storage",
                    lambda: f"rank {r.r}: {key} page at {pos} marked stored, not in the store (B13)",
                )
                got = page_values(page, r.kv, ps)
                check(
                    bool(torch.equal(got, self.want(serial, pos, ps))),
                    "stored_page_content",
                    lambda: f"rank {r.r}: {key} page at {pos} reads back {got.tolist()}",
                )
                self.verified[h] = (key, pos)

    def quiescent(self) -> None:
        """After the drain: nothing owned, nothing in flight, every lifecycle fully released."""
        r = self.rank
        check(
            not self.device_owner and not self.row_owner and not self.host_owner,
            "teardown_shadow_empty",
            lambda: (
                f"rank {r.r}: still owned: device {len(self.device_owner)} pages, rows {list(self.row_owner)}, "
                f"host {len(self.host_owner)} pages"
            ),
        )
        check(
            all(life.dev_freed and life.row_freed and life.prot_freed for life in self.all_lives),
            "teardown_released",
            "a lifecycle was never released",
        )
        check(
            all(c.freed for c in self.chunks) and not self.pending_copies, "teardown_chunks", "a chunk never finished"
        )
        check(
            r.allocator.free_slots == r.allocator.capacity
            and r.host_pool.free_slots == r.host_pool.capacity
            and r.table.free_rows == r.table.rows
            and r.protected.size == 0,
            "teardown_pools_full",
            lambda: f"rank {r.r}: pools not full",
        )


# --- one rank: its pools, its manager, its parts ------------------------------------------------------


@dataclass
class Sizes:
    page_size: int
    stride: int
    device_pages: int
    host_pages: int
    rows: int
    backup_queue: int
    host_layout: str
    max_context: int = 32


class Rank:
    """One TP rank: pools, manager (built from an OffloadConfig as an engine builds it), copy engine,
    backup worker and store of the configuration, all observed by this rank's Shadow."""

    def __init__(
        self,
        cfg: Config,
        sizes: Sizes,
        r: int,
        group: Optional[ThreadGroup],
        faults: Faults,
        workdir: str,
        mooncake_addr: Optional[tuple[str, str]],
        model: str,
    ) -> None:
        self.cfg, self.r = cfg, r
        self.ps, self.stride = sizes.page_size, sizes.stride
        self.kv = KVCacheConfig(num_layers=2, kv_heads=1, head_dim=2, attention="mha", dtype=torch.float32)
        device = "cuda" if cfg.copy == "cuda" else "cpu"
        slots = sizes.device_pages * self.ps
        self.device_pool = DeviceKVPool.create(self.kv, slots, device)
        self.allocator = TokenSlotAllocator(slots, self.ps)
        self.table = ReqToTokenPool(sizes.rows, sizes.max_context)
        self.protected = SimplePrefixCache(self.allocator)
        self.max_context = sizes.max_context
        q = sizes.backup_queue
        extra: dict[str, Any] = {}
        backend = {"memory": "none", "file": "file", "mooncake": "mooncake"}[cfg.storage]
        if cfg.storage == "mooncake":
            assert mooncake_addr is not None
            # A pure client (no memory of its own), as a serving engine of a Mooncake cluster: the pages live
            # in the segment of the test's peer client (tests/stateful/test_production_matrix.py).
            extra = dict(
                master_server_addr=mooncake_addr[0],
                metadata_server=mooncake_addr[1],
                global_segment_size=0,
                local_buffer_size=8 << 20,
                op_timeout_s=5.0,
                setup_timeout_s=15.0,
                close_timeout_s=5.0,
                read_pool_bytes=4 << 20,
            )
        self.config = OffloadConfig(
            page_size=self.ps,
            offload_stride=sizes.stride,
            host_pool_bytes=sizes.host_pages * self.ps * self.kv.bytes_per_token,
            host_layout=sizes.host_layout,
            copy_backend={"thread": "cpu"}.get(cfg.copy, cfg.copy),
            storage_backend=backend,
            storage_dir=os.path.join(workdir, "store"),
            storage_extra=extra,
            model_name=model,
            backup_queue_size=q,
            checked=cfg.checked,
            fenced_release=cfg.fenced,
        )
        self.inner_store: Any = None
        storage: Any = None
        if cfg.storage == "memory":
            storage = MemoryStorage()
        if cfg.faulty:
            # The store the manager would build (its own factory), behind the fault injector.
            inner = storage if storage is not None else storage_factory(self.config, self.device_pool, r, cfg.tp)()
            self.inner_store = inner
            storage = FaultyStorage(inner, fail_writes=faults.fails)
        copy_engine = ThreadCpuCopyEngine() if cfg.copy == "thread" else None
        worker = {"inline": InlineBackupWorker, "stepped": SteppedBackupWorker}.get(cfg.worker)
        self.manager = DecodeOffloadManager(
            self.config,
            device_pool=self.device_pool,
            allocator=self.allocator,
            req_to_token=self.table,
            prefix_cache=self.protected,
            copy_engine=copy_engine,
            storage=storage,
            backup_worker=worker(q) if worker is not None else None,
            tp_rank=r,
            tp_size=cfg.tp,
        )
        if group is not None:
            consensus = ProgressConsensus(None)
            consensus.group, consensus.world = group, group.world  # the real agree(), over the thread group
            self.manager.consensus = consensus
        fx = self.manager.fx
        self.host_pool, self.copy_engine, self.worker, self.store = fx.host_pool, fx.copy_engine, fx.worker, fx.storage
        self.faults = faults
        self.shadow = Shadow(self)
        self._observe()

    def value(self, serial: int, pos: int) -> float:
        """The KV this rank writes at a position (ranks differ, so a page stored under another rank's key shows)."""
        v = kv_value(serial, pos)
        return v if self.r == 0 else -v

    # --- observation -------------------------------------------------------------------------------------
    def _observe(self) -> None:
        """Wrap (on these instances) every free, the copy submission and the store: the shadow sees each call
        before the real one runs."""
        sh, ps = self.shadow, self.ps
        _SHADOWS[id(self.host_pool)] = sh
        _before(
            self.allocator,
            "free",
            lambda idx, fence=None: sh.on_device_free(_slots(idx), fence),
            after=lambda idx, fence=None: sh.after_device_free(_slots(idx), fence),
        )
        _before(self.table, "free", lambda row: sh.on_row_free(int(row)))
        _before(self.protected, "unlock", sh.on_unlock)
        _before(self.host_pool, "free_pages", lambda pages: sh.on_host_free([int(p) for p in pages]))
        _before(self.host_pool, "free", lambda idx: sh.on_host_free(sorted({s // ps for s in _slots(idx)})))
        get_bytes = self.host_pool.get_pages_bytes
        self._get_bytes = get_bytes

        def get_pages_bytes(idx: Any) -> torch.Tensor:
            sh.stash(_slots(idx))
            return get_bytes(idx)

        self.host_pool.get_pages_bytes = get_pages_bytes  # type: ignore[method-assign]
        submit = self.copy_engine.submit_d2h

        def submit_d2h(device_pool: Any, device_indices: Any, host_pool: Any, host_indices: Any) -> Any:
            dev, host = _slots(device_indices), _slots(host_indices)
            chunks = sh.on_submit(dev, host)
            try:
                handle = submit(device_pool, device_indices, host_pool, host_indices)
            except BaseException:
                sh.on_submit_failed(host, chunks)
                raise
            for c in chunks:
                c.handle = handle
            return handle

        self.copy_engine.submit_d2h = submit_d2h  # type: ignore[method-assign]
        self._observe_store(self.store)

    def _observe_store(self, store: Any) -> None:
        """Wrap the store the manager writes to: attribute and check every call, inject the key's faults."""
        sh, faults, ps = self.shadow, self.faults, self.ps
        observer_fails = not self.cfg.faulty  # with FaultyStorage, page failures are its job
        get_bytes = self._get_bytes

        def decide(keys: list[str]) -> tuple[Optional[str], list[int]]:
            kinds = [faults.kind(k) for k in keys]
            failed = [i for i, k in enumerate(kinds) if k == "fail"] if observer_fails else []
            for kind in ("raise_before", "raise_after", "short"):
                if kind in kinds:
                    return kind, failed
            return None, failed

        def run(
            keys: list[str],
            slots: Optional[list[int]],
            pages: Optional[torch.Tensor],
            call: Callable[[list[int]], list[bool]],
        ) -> list[bool]:
            """call(indices) writes the pages at those indices of this call and returns their results."""
            keys = list(keys)
            groups = sh.store_begin(keys, slots, pages)
            results: Optional[list[bool]] = None
            try:
                kind, failed = decide(keys)
                if kind == "raise_before":
                    raise OSError("injected: store down before writing")
                todo = [i for i in range(len(keys)) if i not in failed]
                if kind == "short":
                    todo = todo[:-1] if todo and todo[-1] == len(keys) - 1 else todo
                got = call(todo) if todo else []
                answer = [False] * len(keys)
                for i, ok in zip(todo, got):
                    answer[i] = bool(ok)
                if kind == "raise_after":
                    raise OSError("injected: store raised after writing")
                if kind == "short":
                    answer = answer[:-1]
                results = answer
                return answer
            finally:
                sh.store_end(groups, results, len(keys))

        inner_set = store.batch_set

        def batch_set(keys: Any, pages: Any) -> list[bool]:
            stacked = torch.stack(list(pages)) if len(pages) else None
            return run(
                keys, sh.take_stash(), stacked, lambda idx: inner_set([keys[i] for i in idx], [pages[i] for i in idx])
            )

        store.batch_set = batch_set
        inner_from_host = getattr(store, "batch_set_from_host", None)
        if inner_from_host is not None:

            def batch_set_from_host(keys: Any, host_pool: Any, host_indices: Any) -> list[bool]:
                slots = _slots(host_indices)
                try:
                    pages = get_bytes(torch.tensor(slots, dtype=torch.int64)) if slots else None
                except Exception as exc:
                    sh.fail("store_reads_unallocated_host_page", f"store call for host slots {slots[:8]}: {exc!r}")
                    raise

                def call(idx: list[int]) -> list[bool]:
                    sub = torch.tensor([slots[i * ps + k] for i in idx for k in range(ps)], dtype=torch.int64)
                    return inner_from_host([keys[i] for i in idx], host_pool, sub)

                return run(keys, slots, pages, call)

            store.batch_set_from_host = batch_set_from_host

    # --- the engine: admission, decode, end ------------------------------------------------------------
    def write_kv(self, req: SimRequest, start: int, end: int) -> None:
        slots = self.table.read_host(req.req_pool_idx, start, end)
        if self.manager.ledger is not None:  # checked mode: a reused page's fence passed or was waited on
            self.manager.ledger.device_write(req.rid, slots.tolist())
        dev = self.device_pool.device
        if dev.type == "cuda":  # the engine's KV write, on the compute stream, without waiting for it
            pos = torch.arange(start, end, dtype=torch.float32, device=dev)
            values = ((req.serial % 4096) * 4096 + 1 + pos) * (1 if self.r == 0 else -1)
            idx = slots.pin_memory().to(dev, non_blocking=True)
        else:
            values = torch.tensor([self.value(req.serial, p) for p in range(start, end)], dtype=torch.float32)
            idx = slots
        self.device_pool.token_view()[:, :, idx] = values.view(1, 1, -1, 1, 1)

    def busy(self) -> None:
        """Before an offload call: the decode step's compute is still running on the GPU (2 ms), so the
        copies ordered after it are in flight when the progress check right after looks (a done() that lies
        is then visible). Nothing on the CPU."""
        if self.device_pool.device.type == "cuda":
            torch.cuda._sleep(4_000_000)

    def grow(self, req: SimRequest, length: int) -> bool:
        """Slots for positions [0, length) in whole pages (the engine's allocation; the shadow sees each page)."""
        ps = self.ps
        have = -(-req.kv_allocated_len // ps) * ps
        need = -(-length // ps) * ps
        if need > self.table.max_context:
            return False
        if need > have:
            # Fenced release: pages released fenced may come last, and the writer's stream waits on their fences.
            # Whether alloc_fenced succeeds depends only on counts, the same on every TP rank; which pages it
            # returns depends on this rank's copy timing (a fence that passed by the free puts its pages on the
            # plain list), so TP ranks' slots may differ from then on (Shadow.log compares positions instead).
            if self.cfg.fenced:
                got = self.allocator.alloc_fenced(need - have)
                new, fences = got if got is not None else (None, ())
            else:
                new, fences = self.allocator.alloc(need - have), ()
            if new is None:
                return False
            self.table.write(req.req_pool_idx, have, new)
            wait_fences(fences)
            self.shadow.grew(self.shadow.current(req), new.tolist(), have)
        req.kv_allocated_len = max(req.kv_allocated_len, length)
        return True

    def admit(self, req: SimRequest) -> bool:
        """Prefill (or re-admit) a request object; False when there is no row or no device room."""
        row = self.table.alloc()
        if row is None:
            return False
        req.req_pool_idx, req.kv_allocated_len, req.kv_committed_len = row, 0, 0
        life = self.shadow.admit(req, row)
        if not self.grow(req, len(req.origin_input_ids) + len(req.output_ids)):
            self.shadow.engine_freeing = True
            try:
                self.table.free(row)
            finally:
                self.shadow.engine_freeing = False
            self.shadow.abandon(life)
            req.req_pool_idx = None
            return False
        req.kv_committed_len = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
        self.write_kv(req, 0, req.kv_committed_len)
        if not req.output_ids:
            req.output_ids.append(7)
        self.protected.lock_prompt_prefix(req, self.table)
        self.shadow.protect(life)
        req.done = False
        return True

    def decode(self, req: SimRequest, speculative: int) -> bool:
        pos = req.kv_committed_len
        if not self.grow(req, pos + 1 + speculative):
            return False
        self.write_kv(req, pos, pos + 1)
        req.kv_committed_len = pos + 1
        req.output_ids.append(7 + len(req.output_ids) % 5)
        return True

    def reuse_fenced(self) -> int:
        """Another writer of the device pool (a prefill the manager does not track) takes every free page,
        the fenced ones last, waits on their fences, writes its own KV into them and gives them back: the
        write a fenced release allows. The copies still reading them must land what their requests wrote
        (the landing probe's host_page_content). Returns the slots it wrote."""
        got = self.allocator.alloc_fenced(self.allocator.free_slots)
        if got is None or not len(got[0]):
            return 0
        slots, fences = got
        wait_fences(fences)
        listed = slots.tolist()
        self.shadow.check_no_reader(listed, "the scratch writer's write")
        led = self.manager.ledger
        if led is not None:  # it owns the pages while it writes them, then releases them
            led.claim_device(SCRATCH_WRITER, "reuse", listed)
            led.device_write(SCRATCH_WRITER, listed)
        self.device_pool.token_view()[:, :, slots] = 0.0  # no request's value (every one is >= 1 or <= -1)
        if led is not None:
            led.release_device(SCRATCH_WRITER, "reuse", listed)
        self.shadow.scratch_freeing = True
        try:
            self.allocator.free(slots)
        finally:
            self.shadow.scratch_freeing = False
        return len(listed)

    def end(self, req: SimRequest, how: str) -> None:
        req.done = True
        self.shadow.ended(req)
        {"finish": self.manager.finalize, "abort": self.manager.abort, "retract": self.manager.retract}[how](req)

    # --- completions ------------------------------------------------------------------------------------
    def copies_pending(self) -> list[Any]:
        """Handles of copies not yet landed (deferred: what the test may complete; thread/cuda: may wait on)."""
        if self.cfg.copy == "deferred":
            return self.copy_engine.pending
        seen, out = set(), []
        for c in self.shadow.unlanded():
            if c.handle is not None and id(c.handle) not in seen:
                seen.add(id(c.handle))
                out.append(c.handle)
        return out

    def complete(self, handle: Any) -> None:
        if self.cfg.copy == "deferred":
            self.copy_engine.complete(handle)
        else:
            handle.wait()

    def run_backups(self, picks: list[int]) -> int:
        """Stepped worker: take the queued jobs at these indices (in this order) and run them as one batch."""
        pending = self.worker.pending
        chosen = []
        for i in picks:
            if pending:
                chosen.append(pending.pop(i % len(pending)))
        if len(chosen) == 1:
            chosen[0].run()
        elif chosen:
            backup_mod.run_jobs(chosen)
        self.worker._done.extend(chosen)
        return len(chosen)

    def backups_pending(self) -> int:
        return len(self.worker.pending) if self.cfg.worker == "stepped" else 0

    def drain_step(self) -> None:
        """Let every copy land and every queued backup run (teardown)."""
        for h in self.copies_pending():
            self.complete(h)
        if self.cfg.worker == "stepped":
            while self.worker.pending:
                self.run_backups([0, 0, 0])
        elif self.cfg.worker == "thread":
            backups_settled(self.worker)

    def close(self) -> None:
        _SHADOWS.pop(id(self.host_pool), None)
        with contextlib.suppress(Exception):
            self.manager.close()  # stops the worker; closes the store the manager built
        if self.inner_store is not None:
            with contextlib.suppress(Exception):
                close_storage(self.inner_store)
        if isinstance(self.copy_engine, ThreadCpuCopyEngine):
            self.copy_engine.close()


def _before(obj: Any, name: str, see: Callable[..., None], after: Optional[Callable[..., None]] = None) -> None:
    """obj.name(x, ...) now calls see(x, ...) first, and after(x, ...) once it returned (an instance
    attribute: other instances keep the class's method); a fenced free passes its fence on."""
    real = getattr(obj, name)

    def wrapped(x: Any, *more: Any, **kw: Any) -> Any:
        see(x, *more, **kw)
        out = real(x, *more, **kw)
        if after is not None:
            after(x, *more, **kw)
        return out

    setattr(obj, name, wrapped)


def _slots(idx: Any) -> list[int]:
    if isinstance(idx, PageSlots):
        return idx.slots.tolist()
    if isinstance(idx, torch.Tensor):
        return idx.reshape(-1).tolist()
    return [int(i) for i in idx]


# --- the machine --------------------------------------------------------------------------------------

_serials = itertools.count(1_000_000)  # serials of requests the engine reuses objects for (content only)


def when(state: Optional[Callable[[Any], Any]], config: Optional[Callable[[Any], Any]] = None) -> Callable[[Any], bool]:
    """A rule's precondition: the machine is set up, `config` holds, and `state` holds unless the
    configuration is timing-dependent. With a copy or backup thread the state after a rule depends on
    the threads' timing, and hypothesis needs the rules it may choose to depend only on its own earlier
    choices (else FlakyStrategyDefinition): there every rule of the configuration stays enabled, and one
    that finds nothing to do does nothing."""

    def pre(self: Any) -> bool:
        if self.e is None or (config is not None and not config(self)):
            return False
        return state is None or self.cfg.timing_dependent or bool(state(self))

    return pre


def _step(fn: Callable) -> Callable:
    """ManagerMachine's rule-step counter, also counting each rule (`rule:<name>` in the run's EVENTS)."""
    inner = tm._step(fn)

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._count(f"rule:{fn.__name__}")
        return inner(self, *args, **kwargs)

    return wrapper


class LReq:
    """One request as the scheduler sees it: one request object per rank (same rid, prompt, serial)."""

    def __init__(self, reqs: list[SimRequest]) -> None:
        self.reqs = reqs

    @property
    def rid(self) -> str:
        return self.reqs[0].rid

    def __repr__(self) -> str:
        return repr(self.reqs[0])


class ProductionMachine(tm.ManagerMachine):
    """ManagerMachine's rules over one production configuration (set by the test: `cfg`, `mooncake`,
    `workdir`), checked against the shadow ledger after every rule."""

    cfg: Config = Config("deferred", "stepped", "memory", True, 1, True)
    mooncake: Optional[tuple[str, str]] = None
    workdir: str = tempfile.gettempdir()
    bucket = "production"

    def __init__(self) -> None:
        super().__init__()
        self.ranks: list[Rank] = []
        self.group: Optional[ThreadGroup] = None
        self.live: list[LReq] = []
        self.retracted: list[LReq] = []  # type: ignore[assignment]
        self.ended: list[LReq] = []  # type: ignore[assignment]
        self.dir: Optional[str] = None
        self.rank_threads: list[RankThread] = []
        self.faults = Faults(0)
        # Prompt ids per example: the page keys (and so the faults they decide) replay with the example.
        self._prompt_ids = itertools.count(1)

    # --- set-up ------------------------------------------------------------------------------------
    # (sampled_from lists start with the value hypothesis shrinks to: an interesting one, since the first,
    # simplest example of a run takes it)
    @initialize(
        page_size=st.sampled_from([2, 2, 4]),
        stride_pages=st.sampled_from([1, 1, 2]),
        device_pages=st.integers(12, 20),
        host_pages=st.integers(4, 6),
        rows=st.integers(3, 4),
        backup_queue=st.sampled_from([2, 1, 3]),
        layout=st.sampled_from(["layer_first", "page_first"]),
        fault_rate=st.sampled_from([150, 60, 300, 0]),
    )
    def setup(
        self,
        page_size: int,
        stride_pages: int,
        device_pages: int,  # type: ignore[override]
        host_pages: int,
        rows: int,
        backup_queue: int,
        layout: str,
        fault_rate: int,
    ) -> None:
        cfg = self.cfg
        self.ps = page_size
        self.faults = Faults(fault_rate)
        self.dir = tempfile.mkdtemp(prefix="kvfsm-matrix-", dir=self.workdir)
        sizes = Sizes(page_size, stride_pages * page_size, device_pages, host_pages, rows, backup_queue, layout)
        self.group = ThreadGroup(cfg.tp) if cfg.tp > 1 else None
        model = f"matrix/{os.path.basename(self.dir)}"
        for r in range(cfg.tp):
            self.ranks.append(Rank(cfg, sizes, r, self.group, self.faults, self.dir, self.mooncake, model))
        self.e = self.ranks[0]  # type: ignore[assignment]  # ManagerMachine's "set up" marker

    # --- helpers ------------------------------------------------------------------------------------
    def _all(self, results: list[Any], what: str) -> Any:
        """The ranks made the same decision (identical pools and calls must give identical answers)."""
        check(all(x == results[0] for x in results), "tp_identical_decisions", lambda: f"{what}: {results}")
        return results[0] if results else None

    def _new(self, rid: str, prompt_len: int, prefix_len: int) -> LReq:
        prompt = [100_000 + next(self._prompt_ids)] + [1000 + i for i in range(prompt_len - 1)]
        reqs = [SimRequest(rid, list(prompt), min(prefix_len, prompt_len)) for _ in self.ranks]
        for q in reqs[1:]:
            q.serial = reqs[0].serial
        lr = LReq(reqs)
        self.all_reqs.append(lr)
        return lr

    def _admit_lreq(self, lr: LReq) -> bool:
        ok = self._all([rank.admit(q) for rank, q in zip(self.ranks, lr.reqs)], f"admit {lr!r}")
        if ok:
            self.live.append(lr)
        return ok

    def _end_lreq(self, lr: LReq, how: str) -> None:
        self.live.remove(lr)
        for rank, q in zip(self.ranks, lr.reqs):
            rank.end(q, how)
        if how == "retract":
            self.retracted.append(lr)
        else:
            self.ended.append(lr)
            del self.ended[:-8]

    def _decode_lreq(self, lr: LReq, speculative: int) -> bool:
        ok = self._all(
            [
                rank.decode(q, speculative) or (speculative > 0 and rank.decode(q, 0))
                for rank, q in zip(self.ranks, lr.reqs)
            ],
            f"decode {lr!r}",
        )
        if not ok:
            q = lr.reqs[0]
            at_limit = -(-(q.kv_committed_len + 1) // self.ps) * self.ps > self.ranks[0].max_context
            self._end_lreq(lr, "finish" if at_limit else "retract")
        return ok

    def _progress(self) -> None:
        """check_progress on every rank (TP: in threads meeting in the all-reduce)."""
        for rank in self.ranks:
            rank.shadow.refresh_landed()
        floor = min(_landed_prefix(rank.shadow) for rank in self.ranks)
        for rank in self.ranks:
            rank.shadow.ack_floor = max(rank.shadow.ack_floor, floor)
        if self.group is None:
            self.ranks[0].manager.check_progress()
            self.ranks[0].shadow.check_acks()  # at once: a lying done() is visible while the copy still runs
            return
        # Rank 0 on this thread, the others on their own (persistent) threads: they meet in the all-reduce.
        group = self.group
        group.rank_of[threading.get_ident()] = 0
        if not self.rank_threads:
            self.rank_threads = [RankThread(group, r) for r in range(1, len(self.ranks))]
        for t, rank in zip(self.rank_threads, self.ranks[1:]):
            t.submit(rank.manager.check_progress)
        errors: list[BaseException] = []
        try:
            self.ranks[0].manager.check_progress()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            group.barrier.abort()
        for t in self.rank_threads:
            got = t.result(2 * group.timeout)
            if got is not None:
                errors.append(got)
                group.barrier.abort()
        if group.barrier.broken:
            group.barrier.reset()
        if errors:
            raise errors[0]
        for rank in self.ranks:
            rank.shadow.check_acks()

    # --- rules (ManagerMachine's, over every rank) --------------------------------------------------
    @rule(
        rid=st.sampled_from(tm.RIDS),
        prompt_len=st.integers(1, 12),
        prefix_len=st.integers(0, 4),
        reuse=st.integers(0, 2),
        count=st.integers(1, 2),
    )
    @_step
    def admit(self, rid: str, prompt_len: int, prefix_len: int, reuse: int, count: int) -> None:
        if reuse == 0 and self.ended:
            rid = self._pick(self.ended, prompt_len).rid
        for k in range(count):
            self._admit_lreq(
                self._new(rid if k == 0 else self._pick(tm.RIDS, prompt_len + k), prompt_len + k, prefix_len)
            )

    @precondition(when(lambda self: self.live))
    @rule(i=st.integers(0, 7), n=st.integers(1, 4), speculative=st.integers(0, 3))
    @_step
    def decode(self, i: int, n: int, speculative: int) -> None:
        if not self.live:
            return
        lr = self._pick(self.live, i)
        for _ in range(n):
            if not self._decode_lreq(lr, speculative):
                break

    @precondition(when(lambda self: self.live))
    @rule(
        speculative=st.integers(0, 2),
        offload=st.sampled_from(["none", "loop", "batch", "batch_no_arrays"]),
        progress=st.booleans(),
    )
    @_step
    def scheduler_step(self, speculative: int, offload: str, progress: bool) -> None:
        for lr in list(self.live):
            self._decode_lreq(lr, speculative)
        live = list(self.live)
        got = []
        for r, rank in enumerate(self.ranks):
            reqs = [lr.reqs[r] for lr in live]
            rank.busy()
            if offload == "loop":
                got.append([rank.manager.offload(q) for q in reqs])
            elif offload == "batch":
                got.append(
                    rank.manager.offload_batch(reqs, [q.req_pool_idx for q in reqs], [q.kv_committed_len for q in reqs])
                )
            elif offload == "batch_no_arrays":
                got.append(rank.manager.offload_batch(reqs))
        self._all(got, f"offload ({offload})")
        del live
        if progress:
            self._progress()

    @precondition(when(lambda self: self.live))
    @rule(iterations=st.integers(1, 4), speculative=st.integers(0, 1), land=st.integers(0, 3), skew=st.integers(0, 1))
    @_step
    def serving_loop(self, iterations: int, speculative: int, land: int, skew: int) -> None:
        """Scheduler iterations as a server runs them: decode every live request, one offload_batch with the
        batch arrays, let up to `land` copies land and `land` queued backups run (each rank at its own
        pace), check progress."""
        for _ in range(iterations):
            for lr in list(self.live):
                self._decode_lreq(lr, speculative)
            got = []
            for r, rank in enumerate(self.ranks):
                reqs = [lr.reqs[r] for lr in self.live]
                rank.busy()
                got.append(
                    rank.manager.offload_batch(reqs, [q.req_pool_idx for q in reqs], [q.kv_committed_len for q in reqs])
                )
                del reqs
            self._all(got, "offload_batch")
            for r, rank in enumerate(self.ranks):
                n = land + (skew if r else 0)
                if self.cfg.copy == "deferred":
                    for h in rank.copies_pending()[:n]:
                        rank.complete(h)
                if self.cfg.worker == "stepped" and n:
                    rank.run_backups([0] * n)
            self._progress()

    @precondition(when(lambda self: self.live))
    @rule(i=st.integers(0, 7))
    @_step
    def offload(self, i: int) -> None:
        if not self.live:
            return
        lr = self._pick(self.live, i)
        for rank in self.ranks:
            rank.busy()
        self._all([rank.manager.offload(q) for rank, q in zip(self.ranks, lr.reqs)], f"offload {lr!r}")

    @precondition(
        when(lambda self: any(rank.copies_pending() for rank in self.ranks), lambda self: self.cfg.copy != "cpu")
    )
    @rule(i=st.integers(0, 7), n=st.integers(1, 3), skew=st.integers(0, 2))
    @_step
    def complete_copies(self, i: int, n: int, skew: int) -> None:
        """Land n pending copies starting at a random one (any order); each rank at its own time (skew)."""
        for r, rank in enumerate(self.ranks):
            for _ in range(n + r * skew if r else n):
                pending = rank.copies_pending()
                if not pending:
                    break
                rank.complete(self._pick(pending, i + r * skew))

    @precondition(
        when(lambda self: any(rank.backups_pending() for rank in self.ranks), lambda self: self.cfg.worker == "stepped")
    )
    @rule(
        i=st.integers(0, 7),
        k=st.integers(1, 3),
        skew=st.integers(0, 2),
        fault=st.sampled_from(["none", "none", "none", "fail", "fail_last", "raise_before", "raise_after", "short"]),
    )
    @_step
    def run_backup(self, i: int, k: int, skew: int, fault: str) -> None:
        """Run k queued backups as one batched store call (TP: FIFO, each rank at its own pace); the fault
        hits the first job's chunk (every page, or its last page only)."""
        # TP: each rank runs its queue FIFO at its own pace; the most advanced rank's next job is one no rank
        # has run yet, so the fault hits it on every rank.
        first = min((rank.worker.pending for rank in self.ranks), key=len)
        if fault != "none" and first:
            hashes = first[0 if self.group else i % len(first)].payload.hashes
            kind = "fail" if fault == "fail_last" else fault
            for h in hashes[-1:] if fault == "fail_last" else hashes:
                self.faults.planted[h] = kind
        for r, rank in enumerate(self.ranks):
            if self.group is not None:
                rank.run_backups([0] * (k + (skew if r else 0)))
            else:
                rank.run_backups([i + j * 3 for j in range(k)])

    @precondition(when(None, lambda self: self.cfg.worker == "thread"))
    @rule(full=st.booleans())
    @_step
    def wait_backups(self, full: bool) -> None:
        """Give the backup threads time: all of them until idle, or a moment."""
        if full:
            for rank in self.ranks:
                backups_settled(rank.worker)
        else:
            time.sleep(0.001)

    @precondition(when(None, lambda self: self.cfg.worker != "stepped"))
    @rule(i=st.integers(0, 15), kind=st.sampled_from(FAULT_KINDS), every=st.booleans())
    @_step
    def plant_fault(self, i: int, kind: str, every: bool) -> None:
        """A fault for a chunk whose copy is not acknowledged yet (so no rank has queued its backup, whatever
        its threads do meanwhile); its keys decide it on every rank."""
        waiting = [c for c in self.ranks[0].shadow.chunks if not c.acked and c.keys]
        if waiting:
            c = self._pick(waiting, i)
            for h in c.keys if every else c.keys[-1:]:
                self.faults.planted[h] = kind

    @precondition(when(None))
    @rule()
    @_step
    def progress(self) -> None:
        self._progress()

    @precondition(when(lambda self: self.live or self.ended or self.retracted))
    @rule(i=st.integers(0, 7), how=st.sampled_from(["finish", "finish", "abort", "retract"]), again=st.integers(0, 2))
    @_step
    def end(self, i: int, how: str, again: int) -> None:
        if self.live and (again or not (self.ended or self.retracted)):
            self._end_lreq(self._pick(self.live, i), how)
        elif self.ended or self.retracted:
            self._duplicate_end(i, how)

    def engine_release(self, i: int) -> None:  # not a rule here (shadows ManagerMachine's)
        """The engine releasing a request itself is ManagerMachine's rule and the explorer's event; this
        machine's ranks end requests only through the manager (their shadow ledgers model that path)."""
        raise NotImplementedError

    @precondition(
        when(lambda self: any(rank.allocator.fenced_page_count for rank in self.ranks), lambda self: self.cfg.fenced)
    )
    @rule()
    @_step
    def reuse_fenced(self) -> None:
        """A writer the manager does not track reuses every free page, the fenced ones with their fences
        waited on (Rank.reuse_fenced)."""
        self._count("reused_fenced_slots", self._all([rank.reuse_fenced() for rank in self.ranks], "reuse_fenced"))

    @precondition(when(lambda self: self.retracted))
    @rule(i=st.integers(0, 7))
    @_step
    def readmit(self, i: int) -> None:
        """Re-admit a retracted request object (same object: a new lifecycle), preferably one whose old
        lifecycle's release still waits for a copy."""
        if not self.retracted:
            return
        deferred_ones = [lr for lr in self.retracted if self._deferred(lr)]
        lr = self._pick(deferred_ones or self.retracted, i)
        deferred = bool(deferred_ones)
        admitted = self._admit_lreq(lr)
        if deferred and not admitted:
            # A deferred release holds its pages, so the pool is usually full when such a request returns
            # (re-admission then succeeded in 1 of 114 and 8 of 132 tries in two instrumented runs, and whole
            # runs of the matrix never reached it). The scheduler makes room as SGLang's does, keeping lr's own
            # copy in flight: the other copies land, a progress check frees what they held, and live requests
            # no copy reads are retracted (their pages free at once).
            self._land_all_but(lr)
            self._progress()
            while True:
                deferred = self._deferred(lr)  # still, as lr comes back (a copy thread may have landed it)
                admitted = self._admit_lreq(lr)
                if admitted or (idle := self._idle_live()) is None:
                    break
                self._end_lreq(idle, "retract")
        if admitted:
            self.retracted.remove(lr)
            self._count("readmitted_while_release_deferred" if deferred else "readmitted")

    @precondition(when(lambda self: self.ended))
    @rule(i=st.integers(0, 7), kind=st.sampled_from(["reset", "garbage", "reuse"]))
    @_step
    def mutate_ended(self, i: int, kind: str) -> None:
        """The engine resets or reuses an ended request object, maybe before its deferred release: the
        manager must still free exactly what the lifecycle owned."""
        if not self.ended:
            return
        deferred = [lr for lr in self.ended if self._deferred(lr)]
        lr = self._pick(deferred or self.ended, i)
        self._count(f"mutated_{kind}{'_while_release_deferred' if deferred else ''}")
        for q in lr.reqs:
            if kind == "reset":
                q.kv_committed_len = q.kv_allocated_len = q.prefix_len = 0
                q.req_pool_idx = None
            elif kind == "garbage":
                q.kv_committed_len += 5
                q.kv_allocated_len = q.kv_committed_len + 9
                q.prefix_len += 3
                q.req_pool_idx = -1
        if kind == "reuse":  # a new request in the old object: new rid, prompt, serial, prefix, row
            self.ended.remove(lr)
            prompt = [100_000 + next(self._prompt_ids)] + [1000 + k for k in range(len(lr.reqs[0].origin_input_ids))]
            serial = next(_serials)
            for q in lr.reqs:
                q.rid, q.origin_input_ids, q.output_ids, q.serial = f"{q.rid}'", list(prompt), [], serial
                q.prefix_len = min(1, len(prompt))
                q.kv_committed_len = q.kv_allocated_len = 0
                q.req_pool_idx = None
            if not self._admit_lreq(lr):
                self.ended.append(lr)  # no room: stays a released object, ends again as a duplicate

    def _land_all_but(self, lr: LReq) -> None:
        """Land every pending copy on every rank except those reading lr's current lifecycle."""
        for rank, q in zip(self.ranks, lr.reqs):
            keep = {id(c.handle) for c in rank.shadow.unlanded() if c.life.req is q}
            for handle in rank.copies_pending():
                if id(handle) not in keep:
                    rank.complete(handle)

    def _idle_live(self) -> Optional[LReq]:
        """A live request no copy reads (retracting it frees its pages at once), or None."""
        reading = {id(c.life.req) for c in self.ranks[0].shadow.unlanded()}
        return next((lr for lr in self.live if id(lr.reqs[0]) not in reading), None)

    def _deferred(self, lr: LReq) -> bool:
        life = self.ranks[0].shadow.current(lr.reqs[0])
        return life is not None and life.ended and not life.dev_freed

    def _duplicate_end(self, i: int, how: str) -> None:
        pool = self.ended + self.retracted
        lr = self._pick(pool, i)
        if lr in self.retracted and how != "retract":
            self.retracted.remove(lr)
            self.ended.append(lr)
        before = [
            (r.allocator.free_slots, r.host_pool.free_slots, r.table.free_rows, r.protected.size, len(r.shadow.log))
            for r in self.ranks
        ]
        for rank, q in zip(self.ranks, lr.reqs):
            rank.end(q, how)
        after = [
            (r.allocator.free_slots, r.host_pool.free_slots, r.table.free_rows, r.protected.size, len(r.shadow.log))
            for r in self.ranks
        ]
        check(before == after, "duplicate_end_is_noop", lambda: f"{how} of ended {lr!r}: {before} -> {after}")

    # --- invariants ---------------------------------------------------------------------------------
    @invariant()
    @tm._inv
    def invariants(self) -> None:
        self._check_all()

    def _check_all(self) -> None:
        for rank in self.ranks:
            rank.shadow.check()
        if len(self.ranks) > 1:
            self._tp_identical()

    def _tp_identical(self) -> None:
        """The ranks freed the same (Shadow.log: the same slots; with fenced release, the same lifecycles'
        positions), have the same metrics and stored the same pages (B14)."""
        a, b = self.ranks[0], self.ranks[1]
        la, lb = a.shadow.log, b.shadow.log
        if la != lb:
            k = next((k for k, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
            raise violation("tp_identical_frees", f"free #{k} differs: {la[k : k + 1]} vs {lb[k : k + 1]} (B14)")
        ma, mb = a.manager.metrics.as_dict(), b.manager.metrics.as_dict()
        check(ma == mb, "tp_identical_metrics", lambda: f"{ma} vs {mb}")
        sa, sb = sorted(a.manager.fx.stored), sorted(b.manager.fx.stored)
        check(sa == sb, "tp_identical_stored", lambda: f"stored pages differ ({len(sa)} vs {len(sb)})")

    # unused parent invariants (they read SimEngine): everything is in Shadow.check
    def ownership(self) -> None: ...
    def machines(self) -> None: ...
    def chunks(self) -> None: ...
    def storage(self) -> None: ...
    def pools_conserved(self) -> None: ...

    # --- teardown -----------------------------------------------------------------------------------
    def teardown(self) -> None:
        try:
            if self.e is not None and self._ok:
                try:
                    self._drain_and_check()
                except BaseException as exc:
                    self._note_failure("teardown", exc)
                    raise
        finally:
            for t in self.rank_threads:
                t.close()
            for rank in self.ranks:
                rank.close()
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)

    def _drain_and_check(self) -> None:
        for lr in list(self.live):
            self._end_lreq(lr, "finish")
        for _ in range(2000):
            self._check_all()
            if all(rank.manager.idle() for rank in self.ranks):
                break
            for rank in self.ranks:
                rank.drain_step()
            self._progress()
        else:
            raise violation("teardown_drains", "the managers never became idle")
        self._check_all()
        for lr in self.retracted + self.ended:  # duplicate calls on everything free nothing more
            for rank, q in zip(self.ranks, lr.reqs):
                rank.end(q, "abort")
        self._check_all()
        for rank in self.ranks:
            rank.shadow.quiescent()
            ledger = rank.manager.ledger
            check(
                ledger is None or not (ledger.device_owner or ledger.device_readers or ledger.host_owner),
                "ledger_empty",
                "the checked ledger still has owners",
            )
            # Every page marked stored, read back through the store, is what its writer's device held.
            keys = list(rank.manager.fx.stored)
            for h, page in zip(keys, rank.store.batch_get(keys) if keys else []):
                serial, pos = rank.shadow.marked_ok[h]
                check(page is not None, "read_back", f"rank {rank.r}: page {h[:12]} missing")
                check(
                    bool(torch.equal(page_values(page, rank.kv, self.ps), rank.shadow.want(serial, pos, self.ps))),
                    "read_back_content",
                    f"rank {rank.r}: page {h[:12]} at {pos}",
                )
        sh = self.ranks[0].shadow
        for what, n in sh.stats.items():
            self._count(what, n)
        mt = self.ranks[0].manager.metrics.as_dict()
        for k in (
            "chunks",
            "stored_pages",
            "backup_failures",
            "parked_chunks",
            "host_full_retries",
            "releases",
            "fenced_releases",
        ):
            self._count(k, mt[k])
        self._count("steps", self.steps)
        self._count("examples")
        if self.ranks[0].manager.coverage:
            tm.COVERAGE.setdefault(self.cfg.id, set()).update(self.ranks[0].manager.coverage)


def _landed_prefix(sh: Shadow) -> int:
    """Chunks at the head of the submission order whose copies have landed and whose handles say so (what
    the next progress check must acknowledge at least: a threaded copy lands a moment before its future is
    marked done)."""
    with sh.lock:
        n = sh.acked
        while (
            n < len(sh.chunks) and sh.chunks[n].landed and (sh.chunks[n].handle is None or sh.chunks[n].handle.done())
        ):
            n += 1
        return n
