"""Bounded exhaustive exploration of the *implementation* (issue 5, part 3).

Breadth-first over every interleaving of engine events for N requests over a SimEngine in checked mode
(real CPU pools, a DeferredCpuCopyEngine whose copies land only when an event completes them, in any
order, and a SteppedBackupWorker whose backups run only when an event runs them, in any order):

    admit i | decode i | decode_spec i | offload i | finish i | abort i | retract i | readmit i |
    end_again i (finish of a request that already ended) | copy j (complete pending copy j) |
    backup j / backup_fail j (run pending backup j; its store write succeeds / fails) | progress

Every reached state is checked (`check_world`): checked mode's ledger and spec invariants (raised as
exceptions by the manager), pool conservation, ownership of device pages, rows, protected size and host
slots, machine counters against the chunks really in flight, the KV content of held device slots, of
completed host copies and of stored pages against kv_value(writer, position), and at quiescent states
(nothing live, nothing in flight) full pools and an empty ledger. The search is breadth-first, so the
first violation has a shortest event trace; `counterexample_test` writes it as a runnable pytest file.

Branching copies a state with `clone` (a pickle round trip that also copies closures, re-makes locks,
keeps tensors that view a bytearray views of the copied bytearray and re-points weak references; the
manager's id()-keyed record table is then re-keyed), about 1.6x cheaper than re-executing a 22-event
prefix; `mode="replay"` re-executes every prefix from a fresh engine instead. Tests check both modes
reach the same states, and a copy-mode search checks every 64th copy against re-execution and starts
over in replay mode if a copy ever fails or diverges. States are deduplicated by `canonical_key`: the
engine's whole bookkeeping with record names and serials replaced by request positions, and device pages,
host pages and table rows renamed in order of first use (free ones are interchangeable), so interleavings
that leave the same state up to which physical page went to whom meet; requests are interchangeable too
(symmetry=False turns that off). Attributes a fault adds to records or chunks are part of the key. Events
that most likely change nothing (a progress check with nothing to observe, an offload with nothing to
offload, a duplicate finish) run on the parent itself instead of a copy; the key decides whether they did.

Default bound (3 requests x 16 slots, page 2, stride 2, 8 host slots, backup queue 1, prompt 3, one decode
each): 1315 states, 12968 events, depth 22, about 34 s and 261 MiB peak RSS on one core.
"""

from __future__ import annotations

import io
import itertools
import marshal
import pickle
import re
import resource
import sys
import threading
import time
import types
import weakref
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

import generated.decode_offload as gen
from kvfsm.verify.engine import SimEngine, SimRequest, kv_value

Event = tuple  # ("admit", i), ("copy", j), ("progress",), ...
Faults = Callable[[SimEngine], None]

NEW, LIVE, ENDED, RETRACTED = 0, 1, 2, 3
_LIVE_STATES = gen.HANDLED["offload"]
# a lifecycle that ended while copies were in flight: it keeps its slots until the last copy ack
_DEFERRED = frozenset(s for s, held in gen.HOLDS.items() if "device_slots" in held) - _LIVE_STATES


class Violation(AssertionError):
    """An invariant of the explored implementation failed; `name` says which."""

    def __init__(self, name: str, detail: str) -> None:
        self.name, self.detail = name, detail
        super().__init__(f"{name}: {detail}")


def _check(cond: bool, name: str, detail: Any = "") -> None:
    if not cond:
        raise Violation(name, detail() if callable(detail) else str(detail))


# --- configuration -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExplorerConfig:
    """The bound: requests, pool sizes and per-request budgets (all finite, so the space is finite)."""

    requests: int = 3
    slots: int = 16  # device slots (page 0 is the allocator's padding page)
    page_size: int = 2
    stride: int = 2
    host_slots: int = 8
    backup_queue: int = 1
    prompt_len: int = 3  # every request's prompt (its first token is unique, so hash chains differ)
    prefix_len: int = 2  # each request's protected prefix (clipped to its prompt)
    decodes: int = 1  # decode steps per request (over all its lifecycles)
    speculative: int = 0  # > 0 adds decode_spec i, a decode that over-allocates this many extra slots
    readmits: int = 0  # re-admissions of a retracted request object ...
    readmitters: Optional[int] = None  # ... for the first this-many requests (default: all of them)
    end_kinds: tuple[str, ...] = ("finish", "abort", "retract")
    duplicate_end: bool = True  # end_again i: finish of a request that already ended (B9)
    backup_failures: bool = True  # backup_fail j besides backup j
    batch_offload: bool = True  # offload_batch: one manager.offload_batch over every live request
    rows: Optional[int] = None  # request-table rows (default: one per request, one more per re-admittable one)
    max_context: int = 16

    @property
    def table_rows(self) -> int:
        if self.rows is not None:
            return self.rows
        readmitters = self.requests if self.readmitters is None else min(self.readmitters, self.requests)
        return self.requests + (readmitters if self.readmits else 0)

    def engine(self, trace_path: Optional[str] = None) -> SimEngine:
        return SimEngine(page_size=self.page_size, stride=self.stride, device_slots=self.slots,
                         host_slots=self.host_slots, rows=self.table_rows, max_context=self.max_context,
                         backup_queue=self.backup_queue, checked=True, trace_path=trace_path)

    def describe(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in asdict(self).items())


# --- the explored world: engine + the explorer's own per-request bookkeeping ------------------------------
class World:
    """One implementation state; everything in it is copied together when the search branches."""

    def __init__(self, config: ExplorerConfig, faults: Optional[Faults] = None,
                 trace_path: Optional[str] = None) -> None:
        self.config = config
        self.engine = config.engine(trace_path)
        if faults is not None:
            faults(self.engine)
        self.reqs: list[Optional[SimRequest]] = [None] * config.requests
        # per request: [phase, re-admissions left, re-admissions done]
        n = config.requests if config.readmitters is None else config.readmitters
        self.ctl: list[list[int]] = [[NEW, config.readmits if i < n else 0, 0] for i in range(config.requests)]
        # (request index, row) -> (committed, allocated, prefix) when the engine ended that lifecycle
        self.ends: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.checked: tuple = ()  # the pool snapshots whose conservation was last checked

    def prompt(self, i: int) -> list[int]:
        return [100_000 + i] + [1000 + j for j in range(self.config.prompt_len - 1)]


def enabled(w: World) -> list[Event]:
    """Every event the engine may issue now, in a fixed order (so traces are reproducible)."""
    cfg, e = w.config, w.engine
    out: list[Event] = []
    for i, (phase, left, _) in enumerate(w.ctl):
        req = w.reqs[i]
        if phase == NEW:
            out.append(("admit", i))
        elif phase == LIVE:
            if req.kv_committed_len < cfg.prompt_len + cfg.decodes:
                out.append(("decode", i))
                if cfg.speculative > 0:
                    out.append(("decode_spec", i))
            out.append(("offload", i))
            out.extend((how, i) for how in cfg.end_kinds)
        else:
            if phase == RETRACTED and left > 0:
                out.append(("readmit", i))
            if cfg.duplicate_end:
                out.append(("end_again", i))
    if cfg.batch_offload and sum(phase == LIVE for phase, _, _ in w.ctl) > 1:
        out.append(("offload_batch",))
    out.extend(("copy", j) for j in range(len(e.copies.pending)))
    for j in range(len(e.worker.pending)):
        out.append(("backup", j))
        if cfg.backup_failures:
            out.append(("backup_fail", j))
    out.append(("progress",))
    return out


def apply(w: World, ev: Event) -> None:
    """Execute one event on the real engine; exceptions propagate (the caller reports them)."""
    kind = ev[0]
    e, cfg = w.engine, w.config
    if kind == "progress":
        e.manager.check_progress()
        return
    if kind == "offload_batch":
        _offload_batch(w)
        return
    if kind == "copy":
        e.copies.complete(e.copies.pending[ev[1]])
        return
    if kind in ("backup", "backup_fail"):
        job = e.worker.pending[ev[1]]
        if kind == "backup_fail":
            e.fail_writes.update(job.payload.hashes)
        try:
            e.worker.run(ev[1])
        finally:
            e.fail_writes.clear()
        return
    i = ev[1]
    ctl, req = w.ctl[i], w.reqs[i]
    if kind == "admit":
        req = SimRequest(f"r{i}", w.prompt(i), min(cfg.prefix_len, cfg.prompt_len))
        if e.admit(req.rid, cfg.prompt_len, req.prefix_len, req=req) is not None:
            w.reqs[i] = req
            ctl[0] = LIVE
    elif kind == "decode":
        e.decode(req)
    elif kind == "decode_spec":
        e.decode(req, cfg.speculative)
    elif kind == "offload":
        _offload(w, i, req)
    elif kind in ("finish", "abort", "retract"):
        w.ends[(i, req.req_pool_idx)] = (req.kv_committed_len, max(req.kv_allocated_len, req.kv_committed_len),
                                         req.prefix_len)
        e.end(req, kind)
        # without re-admissions left a retracted request is just an ended one
        ctl[0] = RETRACTED if kind == "retract" and ctl[1] > 0 else ENDED
    elif kind == "readmit":
        if e.admit(req.rid, 0, req=req) is not None:
            ctl[0] = LIVE
            ctl[1] -= 1
            ctl[2] += 1
    elif kind == "end_again":
        before = _pool_counts(e)
        mach = e.manager.machine_of(req)
        state = mach.state if mach is not None else None
        e.manager.finalize(req)
        if ctl[0] == RETRACTED:
            ctl[0] = ENDED  # a retracted request finished while queued is never re-admitted
        after = _pool_counts(e)
        _check(before == after, "duplicate_end_is_noop", lambda: f"finish of ended r{i}: (device free, host free, "
               f"rows free, protected, releases) {before} -> {after} (B9)")
        _check(mach is None or mach.state == state, "duplicate_end_is_noop",
               lambda: f"finish of ended r{i} moved its machine from {gen.STATES[state]} to {mach!r} (B9)")
    else:
        raise ValueError(f"unknown event {ev!r}")


def _offload(w: World, i: int, req: SimRequest) -> None:
    """manager.offload, checked: a chunk continues where the last one ended, covers whole strides of the
    request's committed KV through its own table row; no chunk leaves everything as it was (B7)."""
    e = w.engine
    fx = e.manager.fx
    rec, inc = _offload_progress(w, req)
    n_fifo, host_free = len(fx.copy_fifo), e.host_pool.free_slots
    submitted = e.manager.offload(req)
    if not submitted:
        _check(len(fx.copy_fifo) == n_fifo and e.host_pool.free_slots == host_free and
               (rec is None or rec.inc_len == inc), "offload_nothing_changes_nothing",
               lambda: f"r{i}: offload returned False but changed the copy queue {n_fifo} -> {len(fx.copy_fifo)}, "
                       f"host free slots {host_free} -> {e.host_pool.free_slots} or offloaded length "
                       f"{inc} -> {rec.inc_len if rec else None} (B7)")
        return
    _check(len(fx.copy_fifo) == n_fifo + 1, "offload_one_chunk",
           f"r{i}: one offload queued {len(fx.copy_fifo) - n_fifo} copies")
    _check_chunk(w, i, req, rec, inc, fx.copy_fifo[-1])


def _offload_batch(w: World) -> None:
    """manager.offload_batch over every live request (with the engine's batch arrays), checked: at most one
    chunk per request, each as `_offload` checks it; requests without a chunk keep their offloaded length."""
    e = w.engine
    fx = e.manager.fx
    live = [i for i, (phase, _, _) in enumerate(w.ctl) if phase == LIVE]
    reqs = [w.reqs[i] for i in live]
    before = [_offload_progress(w, req) for req in reqs]
    n_fifo = len(fx.copy_fifo)
    submitted = e.manager.offload_batch(reqs, [r.req_pool_idx for r in reqs], [r.kv_committed_len for r in reqs])
    new = list(fx.copy_fifo)[n_fifo:]
    _check(len(new) == submitted, "offload_batch_count",
           f"offload_batch reported {submitted} chunks but queued {len(new)}")
    by_request = {id(c.record.req_ref()): c for c in new}
    _check(len(by_request) == len(new), "offload_batch_one_chunk_each", "offload_batch queued two chunks for one request")
    for i, req, (rec, inc) in zip(live, reqs, before):
        c = by_request.get(id(req))
        if c is not None:
            _check_chunk(w, i, req, rec, inc, c)
        else:
            _check(rec is None or rec.inc_len == inc, "offload_nothing_changes_nothing",
                   lambda: f"r{i}: no chunk in offload_batch, but its offloaded length moved {inc} -> {rec.inc_len}")


def _offload_progress(w: World, req: SimRequest) -> tuple[Any, int]:
    """The request's live lifecycle record (None if it has none yet) and its offloaded length."""
    mach = w.engine.manager.machine_of(req)
    rec = mach.ctx if mach is not None and mach.state in _LIVE_STATES else None
    return rec, (rec.inc_len if rec is not None else 0)


def _check_chunk(w: World, i: int, req: SimRequest, rec: Any, inc: int, c: Any) -> None:
    e = w.engine
    new = c.record
    start = new.prefill_len + (inc if new is rec else 0)
    stride = e.manager.stride
    _check(c.start == start and c.end > c.start and (c.end - c.start) % stride == 0 and
           new.prefill_len + new.inc_len == c.end, "offload_contiguous",
           lambda: f"r{i}: chunk [{c.start}, {c.end}) but the next chunk starts at {start} (stride {stride}), "
                   f"offloaded length now {new.inc_len} after prefill {new.prefill_len}")
    _check(c.end <= min(req.kv_committed_len, len(req.origin_input_ids) + len(req.output_ids) - 1),
           "offload_committed_only",
           lambda: f"r{i}: chunk [{c.start}, {c.end}) beyond committed KV {req.kv_committed_len}")
    row = e.req_to_token.req_to_token[req.req_pool_idx, c.start:c.end].tolist()
    _check(c.device_indices.tolist() == row, "offload_own_slots",
           lambda: f"r{i}: chunk [{c.start}, {c.end}) reads slots {c.device_indices.tolist()}, its row maps {row}")
    tokens = (list(req.origin_input_ids) + list(req.output_ids))[c.start:c.end]
    _check(list(c.tokens) == tokens, "offload_tokens", lambda: f"r{i}: chunk tokens {c.tokens} != {tokens}")


def _pool_counts(e: SimEngine) -> tuple[int, ...]:
    return (e.allocator.free_slots, e.host_pool.free_slots, e.req_to_token.free_rows, e.protected.size,
            e.manager.metrics.releases)


def event_label(ev: Event) -> str:
    if len(ev) == 1:
        return ev[0]
    return f"{ev[0]} {'#' if ev[0] in ('copy', 'backup', 'backup_fail') else 'r'}{ev[1]}"


# --- one read of the world's bookkeeping: what the checks and the key are computed from ----------------------
class _Snap:
    """Plain-Python lists read once from the engine's tensors and the manager's queues."""

    def __init__(self, w: World) -> None:
        e = w.engine
        m = e.manager
        fx = m.fx
        self.ps = w.config.page_size
        self.copies = list(fx.copy_fifo)
        self.parked = list(fx.parked)
        self.pending = [j.payload for j in e.worker.pending]
        self.done_jobs = list(getattr(e.worker, "_done", ()))
        self.backups = self.pending + [j.payload for j in self.done_jobs]
        self.chunks = self.copies + self.parked + self.backups
        self.table = e.req_to_token.req_to_token.tolist()
        free, alloc = e.allocator.snapshot()
        hfree, halloc = e.host_pool.allocator.snapshot()
        self.free, self.alloc = tuple(free.tolist()), tuple(alloc.tolist())
        self.hfree, self.halloc = tuple(hfree.tolist()), tuple(halloc.tolist())
        self.rows_alloc = tuple(e.req_to_token.is_allocated(r) for r in range(e.req_to_token.rows))
        # every lifecycle record still known: each request's current one, then those only chunks reach
        # (ended lifecycles waiting for in-flight work), in a canonical order
        self.current: dict[int, int] = {}  # id(record) -> request index
        recs: dict[int, Any] = {}
        for i, req in enumerate(w.reqs):
            if req is not None:
                mach = m.machine_of(req)
                if mach is not None:
                    self.current[id(mach.ctx)] = i
                    recs.setdefault(id(mach.ctx), mach.ctx)
        for c in self.chunks:
            recs.setdefault(id(c.record), c.record)
        self.records = list(recs.values())
        self.req_index = {id(r): i for i, r in enumerate(w.reqs) if r is not None}
        self.dev_idx = {id(c): c.device_indices.tolist() for c in self.chunks}
        self.host_idx = {id(c): c.host_indices.tolist() for c in self.chunks}

    def index_of(self, rec: Any) -> int:
        return self.req_index.get(id(rec.req_ref()), -1)

    def holders(self, w: World) -> list[tuple[str, int, Optional[int], int, int, int]]:
        """(name, request index, row, committed, allocated, prefix) of everyone who holds device slots: the
        live requests and the lifecycles whose release waits for their last copy."""
        out = []
        for i, req in enumerate(w.reqs):
            if w.ctl[i][0] == LIVE:
                out.append((f"r{i}", i, req.req_pool_idx, req.kv_committed_len,
                            max(req.kv_allocated_len, req.kv_committed_len), req.prefix_len))
        for rec in self.records:
            if rec.machine.state in _DEFERRED:
                i = self.index_of(rec)
                ended = w.ends.get((i, rec.row))
                _check(ended is not None, "deferred_release_known", f"{rec.key} holds its slots but never ended")
                out.append((f"{rec.key} (release deferred)", i, rec.row, *ended))
        return out


# --- invariants ----------------------------------------------------------------------------------------
def check_world(w: World, snap: Optional[_Snap] = None) -> _Snap:
    """Every invariant, on the pools themselves (not on the manager's view of them); returns the snapshot."""
    s = snap or _Snap(w)
    e, ps, m = w.engine, s.ps, w.engine.manager
    pools = (s.free, s.alloc, s.hfree, s.halloc, s.rows_alloc)
    if pools != w.checked:  # conservation is a function of these alone
        e.allocator.check_conservation()
        e.host_pool.check_conservation()
        e.req_to_token.check_conservation()
        w.checked = pools

    # machines: spec invariants, counters equal to the chunks each lifecycle really has in flight
    count: dict[int, list[int]] = {}
    for k, chunks in enumerate((s.copies, s.parked, s.backups)):
        for c in chunks:
            count.setdefault(id(c.record), [0, 0, 0])[k] += 1
    for rec in s.records:
        mach = rec.machine
        bad = gen.violated_invariants(mach)
        _check(not bad, "spec_invariants", lambda: f"{mach!r} violates {', '.join(bad)}")
        _check([mach.copies, mach.parked, mach.backups] == count.get(id(rec), [0, 0, 0]), "counters_match_chunks",
               lambda: f"{mach!r} but chunks in flight (copies, parked, backups) = {count.get(id(rec), [0, 0, 0])}")
    for i, req in enumerate(w.reqs):
        if w.ctl[i][0] == LIVE:
            mach = m.machine_of(req)
            # after a re-admission the manager starts the new lifecycle lazily, at its next call
            _check(mach is None or mach.state in _LIVE_STATES or w.ctl[i][2] > 0,
                   "live_request_live_machine", lambda: f"r{i} is live but its machine is {mach!r}")

    # device pages, rows and protected size: each page held by one holder, and nothing else allocated
    holders = s.holders(w)
    for k in [k for k in w.ends if k not in {(h[1], h[2]) for h in holders}]:
        del w.ends[k]  # released lifecycles
    pages: list[int] = []
    for name, i, row, committed, alloc, _ in holders:
        _check(isinstance(row, int) and 0 <= row < len(s.rows_alloc) and s.rows_alloc[row], "holder_has_row",
               f"{name} row {row!r}")
        pages += [slot // ps for slot in s.table[row][0:-(-alloc // ps) * ps:ps]]
    held = set(pages)
    _check(len(held) == len(pages), "no_shared_device_page",
           lambda: f"holders {holders} share pages {sorted(p for p in held if pages.count(p) > 1)}")
    _check(all(s.alloc[p] for p in pages), "live_slot_not_free",
           lambda: f"free pages {[p for p in pages if not s.alloc[p]]} are held by {holders} (B1/B2)")
    used = sum(s.alloc)
    _check(used == len(pages), "device_accounting",
           lambda: f"{used * ps} device slots allocated, holders own {len(pages) * ps} (leak B3/B5/B8, or B11/B12)")
    _check(sum(s.rows_alloc) == len(holders), "row_accounting",
           lambda: f"{sum(s.rows_alloc)} rows allocated, {len(holders)} holders (leak B8)")
    protected = sum(h[5] for h in holders)
    _check(e.protected.size == protected, "protected_accounting",
           f"protected size {e.protected.size} != {protected} held (B3/B4)")

    # KV content: every committed position of every holder holds its writer's value
    if holders:
        dev = e.device_pool.token_view()[0, 0, :, 0, 0].tolist()
        for name, i, row, committed, _, _ in holders:
            serial = w.reqs[i].serial
            got = [dev[slot] for slot in s.table[row][:committed]]
            want = [kv_value(serial, p) for p in range(committed)]
            _check(got == want, "device_kv_content", lambda: f"{name} device KV {got} != written {want} (B1)")

    # host slots: exactly the chunks between their copy and the collection of their backup
    host = [h for c in s.chunks for h in s.host_idx[id(c)]]
    _check(len(set(host)) == len(host), "no_shared_host_slot", "two chunks hold one host slot")
    hused = sum(s.halloc) * ps
    _check(hused == len(host), "host_accounting",
           lambda: f"{hused} host slots allocated, chunks hold {len(host)} (leak B3, or double free B10)")
    if m.ledger is not None:
        _check(m.ledger.host_pages() * ps == len(host), "ledger_host_pages",
               f"ledger {m.ledger.host_pages()} host pages, chunks {len(host) // ps}")
    done = [c for c in s.chunks if c.handle is not None and c.handle.done()]
    if done:
        hv = e.host_pool.token_view()[0, 0, :, 0, 0].tolist()
        for c in done:
            got = [hv[h] for h in s.host_idx[id(c)]]
            want = [kv_value(c.record.req_ref().serial, p) for p in range(c.start, c.end)]
            _check(got == want, "host_kv_content",
                   lambda: f"completed copy of {c.record.key} [{c.start}, {c.end}) holds {got}, wrote {want} (B2/B15)")

    # storage: a page reported stored is in storage and holds its writer's KV (B13)
    in_store = e.store.pages
    for h, (key, pos) in m.fx.stored.items():
        _check(h in in_store, "stored_means_in_storage", f"{key} page at {pos} marked stored, not in storage (B13)")
        i = int(key.split("#", 1)[0][1:])
        got = _page_values(in_store[h], e.kv, ps)
        want = [kv_value(w.reqs[i].serial, pos + j) for j in range(ps)]
        _check(got == want, "storage_kv_content", lambda: f"{key} page at {pos} stored {got}, wrote {want}")

    # quiescent: nothing live, nothing in flight -> every pool full, nothing protected (B3, B5, B8)
    if not s.chunks and not any(c[0] == LIVE for c in w.ctl) and m.idle():
        _check(used == 0, "teardown_device_full", f"{used * ps} device slots never returned")
        _check(hused == 0, "teardown_host_full", f"{hused} host slots never returned")
        _check(not any(s.rows_alloc), "teardown_rows_free", "a request row was never returned")
        _check(e.protected.size == 0, "teardown_protected_zero", f"protected size {e.protected.size} after teardown")
        if m.ledger is not None:
            _check(not m.ledger.device_readers and not m.ledger.host_owner and not m.ledger.device_owner,
                   "teardown_ledger_empty", "the ledger still lists owners or readers")
    return s


def _page_values(page: torch.Tensor, kv: Any, page_size: int) -> list[float]:
    x = page.contiguous().view(kv.dtype).view(kv.num_planes, kv.num_layers, page_size, -1)
    first = x[0, 0, :, 0]
    if not bool((x == first.view(1, 1, -1, 1)).all()):
        return [float("nan")] * page_size
    return first.tolist()


# --- canonical state key ---------------------------------------------------------------------------------
def canonical_key(w: World, snap: Optional[_Snap] = None, symmetry: bool = True) -> tuple:
    """The whole bookkeeping of engine, manager and pools, with record names and serials replaced by
    request positions, and device pages, host pages and rows renamed in order of first use (free pages and
    free rows are interchangeable: only their number counts). Equal keys: equal futures, up to names.

    symmetry: requests are interchangeable too (they differ only in their tokens): the key is the one of
    the request order that sorts their local states, the smallest hash among orders that tie."""
    s = snap or _Snap(w)
    n = len(w.reqs)
    if not symmetry or n < 2:
        return _key(w, s, list(range(n)))
    # a request's local state, without its index: the requests' order in the key is sorted by it
    mine: dict[int, list[int]] = {}
    for k, chunks in enumerate((s.copies, s.parked, s.backups)):
        for c in chunks:
            mine.setdefault(s.index_of(c.record), [0, 0, 0])[k] += 1
    sig = []
    for i, req in enumerate(w.reqs):
        local: tuple = tuple(w.ctl[i])
        if req is not None:
            mach = w.engine.manager.machine_of(req)
            local += (req.kv_committed_len, req.kv_allocated_len, req.done, req.req_pool_idx is None,
                      mach.snapshot() if mach is not None else None, tuple(mine.get(i, ())))
        sig.append(hash(local))
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(sig[i], []).append(i)
    ordered = [groups[h] for h in sorted(groups)]
    if all(len(g) == 1 for g in ordered):
        return _key(w, s, [g[0] for g in ordered])
    best: Optional[tuple] = None
    for parts in itertools.product(*(itertools.permutations(g) for g in ordered)):
        key = _key(w, s, [i for part in parts for i in part])
        if best is None or hash(key) < hash(best):
            best = key
    return best


def _key(w: World, s: _Snap, order: list[int]) -> tuple:
    e, m, ps = w.engine, w.engine.manager, s.ps
    pos = {i: k for k, i in enumerate(order)}
    label: dict[int, tuple] = {}
    by_key: dict[str, tuple] = {}
    nth: dict[int, int] = {}
    current = sorted((r for r in s.records if id(r) in s.current), key=lambda r: pos[s.current[id(r)]])
    records = current + [r for r in s.records if id(r) not in s.current]
    for rec in records:
        i = s.index_of(rec)
        p = pos.get(i, -1)
        if s.current.get(id(rec)) == i:
            lab = (p, 0)
        else:
            nth[p] = nth.get(p, 0) + 1
            lab = (p, nth[p])
        label[id(rec)] = lab
        by_key[rec.key] = lab
    pmap: dict[int, int] = {}  # device page -> name
    hmap: dict[int, int] = {}  # host page -> name
    rmap: dict[Any, int] = {}  # row -> name

    def dev(slots: Sequence[int]) -> tuple:
        return tuple((pmap.setdefault(x // ps, len(pmap)), x % ps) for x in slots)

    def hst(slots: Sequence[int]) -> tuple:
        return tuple((hmap.setdefault(x // ps, len(hmap)), x % ps) for x in slots)

    def row(r: Any) -> Any:
        return rmap.setdefault(r, len(rmap)) if isinstance(r, int) else r

    reqs = []
    for i in order:
        req = w.reqs[i]
        if req is None:
            reqs.append(tuple(w.ctl[i]))
            continue
        alloc = max(req.kv_allocated_len, req.kv_committed_len)
        r = req.req_pool_idx
        held = (dev(s.table[r][:-(-alloc // ps) * ps]) if w.ctl[i][0] == LIVE and isinstance(r, int)
                and 0 <= r < len(s.table) else ())
        reqs.append((tuple(w.ctl[i]), row(r), req.kv_committed_len, req.kv_allocated_len, len(req.output_ids),
                     req.done, held))
    recs = []
    for rec in records:
        deferred = ()
        if rec.machine.state in _DEFERRED:
            ended = w.ends.get((s.index_of(rec), rec.row))
            n = -(-ended[1] // ps) * ps if ended else 0
            deferred = (ended, dev(s.table[rec.row][:n]))
        recs.append((label[id(rec)], rec.machine.snapshot(), row(rec.row), rec.inc_len, rec.end_lengths,
                     rec.req is None, deferred, _extras(rec)))
    chunk_no: dict[int, int] = {}

    def chunk(c: Any) -> tuple:
        chunk_no[c.serial] = len(chunk_no)
        return (label[id(c.record)], c.start, c.end, dev(s.dev_idx[id(c)]), hst(s.host_idx[id(c)]), _extras(c))

    fifo = tuple((chunk(c), c.handle.done()) for c in s.copies)
    parked = tuple(chunk(c) for c in s.parked)
    pending = tuple(chunk(c) for c in s.pending)
    collected = tuple((chunk(j.payload), j.ok) for j in s.done_jobs)
    ledger = ()
    led = m.ledger
    if led is not None:
        ledger = (tuple(sorted((pmap.setdefault(p, len(pmap)), by_key.get(o, o)) for p, o in led.device_owner.items())),
                  tuple(sorted((pmap.setdefault(p, len(pmap)), tuple(sorted(chunk_no.get(x, -1) for x in r)))
                               for p, r in led.device_readers.items() if r)),
                  tuple(sorted((hmap.setdefault(p, len(hmap)), chunk_no.get(x, -1))
                               for p, x in led.host_owner.items())))
    # pools: which named pages are allocated, how many allocated pages nobody names (a leak), how many free
    alloc_named = tuple(sorted(pmap[p] for p, a in enumerate(s.alloc) if a and p in pmap))
    halloc_named = tuple(sorted(hmap[p] for p, a in enumerate(s.halloc) if a and p in hmap))
    rows_named = tuple(sorted(rmap[r] for r, a in enumerate(s.rows_alloc) if a and r in rmap))
    return (tuple(reqs), tuple(recs), fifo, parked, pending, collected, len(e.copies.pending), len(m.fx.parked),
            e.worker.outstanding(), alloc_named, sum(s.alloc) - len(alloc_named), len(s.free),
            halloc_named, sum(s.halloc) - len(halloc_named), len(s.hfree),
            rows_named, sum(s.rows_alloc) - len(rows_named), e.req_to_token.free_rows, e.protected.size, ledger)


def _extras(obj: Any) -> tuple:
    """Attributes an object carries beyond its dataclass fields (state a fault keeps on the side)."""
    names = getattr(type(obj), "__dataclass_fields__", None)
    d = getattr(obj, "__dict__", None)
    if names is None or d is None or len(d) == len(names):
        return ()
    return tuple(sorted((k, v if isinstance(v, (bool, int, float, str, type(None))) else type(v).__name__)
                        for k, v in d.items() if k not in names))


# --- branching: a pickle round trip that copies closures, locks, weak references and shared memory -------
_CODE: dict[int, tuple[types.CodeType, bytes]] = {}  # id(code) -> (code, marshal.dumps(code))
_CODE_LOADED: dict[bytes, types.CodeType] = {}
_LOCKS = {type(threading.Lock()): threading.Lock, type(threading.RLock()): threading.RLock}
_COUNT_RE = re.compile(r"count\((-?\d+)\)")


class CloneError(RuntimeError):
    """The world holds something `clone` cannot copy faithfully; explore with mode="replay" instead."""


class _Region:
    """One block of memory (a tensor storage, a bytearray, an ndarray's buffer), pickled once however many
    objects view it: a tensor made with torch.frombuffer(bytearray) stays a view of the copied bytearray."""

    __slots__ = ("start", "nbytes", "data", "ba", "base")

    def __init__(self, start: int, nbytes: int, data: Callable[[], bytes]) -> None:
        self.start, self.nbytes, self.data = start, nbytes, data

    def __reduce__(self) -> tuple:
        return (_rebuild_region, (self.data(),))


def _rebuild_region(data: bytes) -> _Region:
    r = _Region(0, len(data), lambda: b"")
    r.ba = bytearray(data)
    r.base = torch.frombuffer(r.ba, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return r


def _rebuild_tensor(r: _Region, offset: int, dtype: torch.dtype, size: tuple, stride: tuple) -> torch.Tensor:
    return torch.empty(0, dtype=dtype).set_(r.base.untyped_storage(), offset, size, stride)


def _rebuild_ndarray(r: _Region, offset: int, dtype: Any, shape: tuple, strides: tuple) -> Any:
    import numpy as np
    return np.ndarray(shape, dtype=dtype, buffer=r.ba, offset=offset, strides=strides)


class _Unpickler(pickle.Unpickler):
    def __init__(self, f: io.BytesIO, shared: dict[int, Any]) -> None:
        super().__init__(f)
        self.shared = shared

    def persistent_load(self, pid: Any) -> Any:
        kind, x = pid
        return x.ba if kind == "bytearray" else self.shared[x]


def _rebuild_function(code: bytes, module: str, name: str, defaults: Any, kwdefaults: Any,
                      cells: Optional[tuple]) -> types.FunctionType:
    c = _CODE_LOADED.get(code)
    if c is None:
        c = _CODE_LOADED[code] = marshal.loads(code)
    f = types.FunctionType(c, sys.modules[module].__dict__, name, defaults,
                           None if cells is None else tuple(types.CellType(x) for x in cells))
    f.__kwdefaults__ = kwdefaults
    return f


class _Pickler(pickle.Pickler):
    def __init__(self, f: io.BytesIO, shared: dict[int, Any]) -> None:
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.shared = shared
        self.regions: list[_Region] = []
        self.by_value: list[tuple[int, int]] = []  # ndarrays copied by value: nothing else may view them

    def check_aliasing(self) -> None:
        for lo, hi in self.by_value:
            for r in self.regions:
                if lo < r.start + r.nbytes and r.start < hi:
                    raise CloneError("an ndarray that owns its memory is also viewed by a tensor or bytearray; "
                                     "explore with mode='replay'")

    def _region(self, start: int, nbytes: int, data: Callable[[], bytes], what: str) -> tuple[_Region, int]:
        """The region holding [start, start + nbytes) and the offset into it; the first object seen defines it."""
        for r in self.regions:
            if r.start <= start and start + nbytes <= r.start + r.nbytes:
                return r, start - r.start
            if start < r.start + r.nbytes and r.start < start + nbytes:
                raise CloneError(f"{what} partly overlaps memory another object views; explore with mode='replay'")
        r = _Region(start, nbytes, data)
        self.regions.append(r)
        return r, 0

    def persistent_id(self, obj: Any) -> Any:
        # shared objects; and bytearrays, which never reach reducer_override (the C pickler saves them
        # directly): a tensor made with torch.frombuffer(bytearray) and the bytearray stay one block of memory
        if id(obj) in self.shared:
            return ("shared", id(obj))
        if type(obj) is not bytearray or not obj:
            return None
        import numpy as np
        start = np.frombuffer(obj, dtype=np.uint8).ctypes.data
        r, off = self._region(start, len(obj), lambda obj=obj: bytes(obj), "a bytearray")
        if off or r.nbytes != len(obj):
            raise CloneError("a bytearray lies inside memory another object defined first")
        return ("bytearray", r)

    def reducer_override(self, obj: Any) -> Any:  # noqa: C901 - one branch per kind of object
        t = type(obj)
        if t is torch.Tensor:
            if obj.device.type != "cpu" or obj.requires_grad:
                raise CloneError(f"cannot copy a {obj.device} tensor (requires_grad={obj.requires_grad})")
            st = obj.untyped_storage()
            if st.nbytes() == 0:
                return (_empty_tensor, (obj.dtype, tuple(obj.size())))
            raw = torch.empty(0, dtype=torch.uint8).set_(st)
            r, off = self._region(st.data_ptr(), st.nbytes(), lambda raw=raw: raw.numpy().tobytes(), "a tensor")
            item = obj.element_size()
            if off % item:
                raise CloneError("a tensor views memory at an offset that is not a multiple of its element size")
            return (_rebuild_tensor,
                    (r, off // item + obj.storage_offset(), obj.dtype, tuple(obj.size()), obj.stride()))
        if t.__module__ == "numpy" and t.__name__ == "ndarray":
            root = obj
            while getattr(root, "base", None) is not None and type(root.base).__name__ == "ndarray":
                root = root.base
            base = root.base
            if base is None or obj.size == 0:
                if obj.size:
                    at = obj.__array_interface__["data"][0]
                    self.by_value.append((at, at + obj.nbytes))
                return NotImplemented  # owns its memory: copied by value
            start = obj.__array_interface__["data"][0]
            if isinstance(base, torch.Tensor) and base.device.type == "cpu" and base.untyped_storage().nbytes():
                st = base.untyped_storage()
                raw = torch.empty(0, dtype=torch.uint8).set_(st)
                r, off = self._region(st.data_ptr(), st.nbytes(), lambda raw=raw: raw.numpy().tobytes(), "a tensor")
            elif isinstance(base, bytearray) and base:
                import numpy as np
                at = np.frombuffer(base, dtype=np.uint8).ctypes.data
                r, off = self._region(at, len(base), lambda base=base: bytes(base), "a bytearray")
            else:
                return NotImplemented  # a view of memory nothing else here shares: copied by value
            return (_rebuild_ndarray, (r, start - r.start, obj.dtype, obj.shape, obj.strides))
        if t is types.FunctionType:
            if obj.__closure__ is None and getattr(sys.modules.get(obj.__module__), obj.__qualname__, None) is obj:
                return NotImplemented  # importable: pickled by reference
            # a closure or a lambda: its code by value, its module by name, its cells copied
            module = obj.__globals__.get("__name__")
            if getattr(sys.modules.get(module), "__dict__", None) is not obj.__globals__:
                raise CloneError(f"cannot copy function {obj.__qualname__}: its globals are no module's")
            code = _CODE.get(id(obj.__code__))
            if code is None:
                code = _CODE[id(obj.__code__)] = (obj.__code__, marshal.dumps(obj.__code__))
            cells = None if obj.__closure__ is None else tuple(c.cell_contents for c in obj.__closure__)
            return (_rebuild_function, (code[1], module, obj.__name__, obj.__defaults__, obj.__kwdefaults__, cells))
        if t is weakref.ReferenceType:
            return (weakref.ref, (obj(),))  # the callback is re-made by _fix_records
        if t in _LOCKS:
            return (_LOCKS[t], ())
        if t is itertools.count:
            match = _COUNT_RE.fullmatch(repr(obj))
            if match:
                return (itertools.count, (int(match.group(1)),))
        if t is threading.Thread or t is types.GeneratorType:
            raise CloneError(f"cannot copy a {t.__name__}; explore with mode='replay'")
        return NotImplemented


def _empty_tensor(dtype: torch.dtype, size: tuple) -> torch.Tensor:
    return torch.empty(size, dtype=dtype)


def clone(w: World) -> World:
    """An independent copy of a world (engine, pools, manager, requests, pending copies and backups)."""
    # immutable: the configs, and the pages in the in-memory store (it copies pages in and out)
    shared = {id(o): o for o in (w.config, w.engine.config, w.engine.kv, *w.engine.store.pages.values())}
    buf = io.BytesIO()
    pickler = _Pickler(buf, shared)
    pickler.dump(w)
    pickler.check_aliasing()
    buf.seek(0)
    new = _Unpickler(buf, shared).load()
    _fix_records(new)
    return new


def _fix_records(w: World) -> None:
    """The manager keys its records by id(request): re-key them by the copied request objects."""
    records = w.engine.manager._records
    fixed = {}
    for rec in records.values():
        req = rec.req_ref()
        if req is None:
            continue
        key = id(req)
        rec.req_ref = weakref.ref(req, lambda _r, k=key, t=records: t.pop(k, None))
        fixed[key] = rec
    records.clear()
    records.update(fixed)


def build(config: ExplorerConfig, events: Sequence[Event] = (), faults: Optional[Faults] = None,
          check: bool = True, trace_path: Optional[str] = None) -> World:
    """A fresh world after `events`, checking every invariant after each one (when `check`)."""
    w = World(config, faults, trace_path)
    if check:
        check_world(w)
    for n, ev in enumerate(events, 1):
        apply(w, ev) if not check else _step(w, ev, n)
    return w


def _step(w: World, ev: Event, n: int) -> None:
    try:
        apply(w, ev)
        check_world(w)
    except Violation as exc:
        raise Violation(exc.name, f"after event {n} {ev!r}: {exc.detail}") from exc


def replay_events(config: ExplorerConfig, events: Sequence[Event], faults: Optional[Faults] = None) -> World:
    """Re-run a trace from scratch, checking every state; raises the first Violation (or engine error)."""
    return build(config, events, faults)


# --- the search -----------------------------------------------------------------------------------------
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


def _describe(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, Violation):
        return exc.name, exc.detail
    return type(exc).__name__, str(exc)


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


# --- reporting ------------------------------------------------------------------------------------------
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


__all__ = ["Counterexample", "ExploreResult", "ExplorerConfig", "Violation", "World", "apply", "build",
           "canonical_key", "check_world", "clone", "counterexample_test", "enabled", "event_label", "explore",
           "replay_events"]
