"""Bounded exhaustive exploration of the *implementation* (issue 5, part 3).

Breadth-first over every interleaving of engine events for N requests over a SimEngine in checked mode
(real CPU pools, a DeferredCpuCopyEngine whose copies land only when an event completes them, in any
order, and a SteppedBackupWorker whose backups run only when an event runs them, in any order):

    admit i | decode i | decode_spec i | offload i | finish i | abort i | retract i | readmit i |
    end_again i (a duplicate finish of an ended request) | copy j (complete pending copy j) |
    backup j / backup_fail j (run pending backup j; its store write succeeds / fails) | progress

Every reached state is checked (see `check_world`): checked mode's ledger and spec invariants (raised as
exceptions by the manager), pool conservation, ownership of device pages, rows, protected size and host
slots, machine counters against the chunks really in flight, the KV content of live device slots, of
completed host copies and of stored pages against kv_value(writer, position), and at quiescent states
(nothing live, nothing in flight) full pools. Because the search is breadth-first, the first violation
found has a shortest event trace; it is printed and can be written as a runnable pytest file.

To branch, a state is deep-copied (`mode="copy"`, the default: about 5x faster than re-executing the
prefix) with three fix-ups copy.deepcopy cannot do: closures (a backup job's write(), FaultyStorage's
predicate) are copied with their cells, locks are made new, weak references point at the copied referent,
and the manager's id()-keyed record table is re-keyed to the copied request objects. `mode="replay"`
re-executes every prefix from a fresh engine instead; tests check both modes reach the same states.
States are deduplicated by `canonical_key`, the engine's whole bookkeeping with serial numbers and
record names replaced by request indices (so two interleavings that leave the same state meet).
"""

from __future__ import annotations

import copy
import itertools
import resource
import threading
import time
import types
import weakref
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

import generated.decode_offload as gen
from kvfsm.verify.engine import SimEngine, SimRequest, kv_value

Event = tuple  # ("admit", i), ("copy", j), ("progress",), ...

NEW, LIVE, ENDED, RETRACTED = 0, 1, 2, 3
_PHASES = ("new", "live", "ended", "retracted")
_HOLDING = frozenset(s for s, held in gen.HOLDS.items() if "device_slots" in held)


class Violation(AssertionError):
    """An invariant of the explored implementation failed (or an event raised); `name` says which."""

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
    speculative: int = 0  # > 0 adds decode_spec i, which over-allocates this many extra slots
    readmits: int = 1  # re-admissions of a retracted request object
    end_kinds: tuple[str, ...] = ("finish", "abort", "retract")
    duplicate_end: bool = True  # one end_again (a second finish) per ended request
    backup_failures: bool = True  # backup_fail j besides backup j
    rows: Optional[int] = None  # request-table rows (default: one per request, plus one to re-admit)
    max_context: int = 16

    @property
    def table_rows(self) -> int:
        return self.rows if self.rows is not None else self.requests + (1 if self.readmits else 0)

    def engine(self, trace_path: Optional[str] = None) -> SimEngine:
        return SimEngine(page_size=self.page_size, stride=self.stride, device_slots=self.slots,
                         host_slots=self.host_slots, rows=self.table_rows, max_context=self.max_context,
                         backup_queue=self.backup_queue, checked=True, trace_path=trace_path)

    def describe(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in asdict(self).items())


# --- the explored world: engine + the explorer's own per-request bookkeeping ------------------------------
class World:
    """One implementation state. Everything in it is copied together when the search branches."""

    def __init__(self, config: ExplorerConfig, faults: Optional[Callable[[SimEngine], None]] = None) -> None:
        self.config = config
        self.engine = config.engine()
        if faults is not None:
            faults(self.engine)
        self.reqs: list[Optional[SimRequest]] = [None] * config.requests
        # per request: [phase, readmissions used, duplicate end used]
        self.ctl: list[list[int]] = [[NEW, 0, 0] for _ in range(config.requests)]
        # (request index, row) -> (committed, allocated, prefix) when the engine ended that lifecycle
        self.ends: dict[tuple[int, int], tuple[int, int, int]] = {}

    def prompt(self, i: int) -> list[int]:
        return [100_000 + i] + [1000 + j for j in range(self.config.prompt_len - 1)]


def enabled(w: World) -> list[Event]:
    """Every event the engine may issue now (a fixed order, so traces are reproducible)."""
    cfg, e = w.config, w.engine
    out: list[Event] = []
    for i, (phase, readmits, dup) in enumerate(w.ctl):
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
            if phase == RETRACTED and readmits < cfg.readmits:
                out.append(("readmit", i))
            if cfg.duplicate_end and not dup:
                out.append(("end_again", i))
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
        e.manager.offload(req)
    elif kind in ("finish", "abort", "retract"):
        w.ends[(i, req.req_pool_idx)] = (req.kv_committed_len, max(req.kv_allocated_len, req.kv_committed_len),
                                         req.prefix_len)
        e.end(req, kind)
        ctl[0] = RETRACTED if kind == "retract" else ENDED
    elif kind == "readmit":
        if e.admit(req.rid, 0, req=req) is not None:
            ctl[0] = LIVE
            ctl[1] += 1
    elif kind == "end_again":
        before = _pool_counts(e)
        mach = e.manager.machine_of(req)
        state = mach.state if mach is not None else None
        e.manager.finalize(req)
        ctl[2] = 1
        if ctl[0] == RETRACTED:
            ctl[0] = ENDED  # a retracted request finished while queued is never re-admitted
        after = _pool_counts(e)
        _check(before == after, "duplicate_end_is_noop", lambda: f"finish of ended r{i}: {before} -> {after} "
               "(device free, host free, rows free, protected, releases)")
        _check(mach is None or mach.state == state, "duplicate_end_is_noop",
               lambda: f"finish of ended r{i} moved its machine from {gen.STATES[state]} to {mach!r}")
    else:
        raise ValueError(f"unknown event {ev!r}")


def _pool_counts(e: SimEngine) -> tuple[int, ...]:
    return (e.allocator.free_slots, e.host_pool.free_slots, e.req_to_token.free_rows, e.protected.size,
            e.manager.metrics.releases)


def event_label(ev: Event) -> str:
    return ev[0] if len(ev) == 1 else f"{ev[0]} {'r' if ev[0] not in ('copy', 'backup', 'backup_fail') else '#'}{ev[1]}"


# --- invariants ----------------------------------------------------------------------------------------
def _chunks(e: SimEngine) -> tuple[list, list, list]:
    fx = e.manager.fx
    backups = [j.payload for j in e.worker.pending] + [j.payload for j in getattr(e.worker, "_done", ())]
    return list(fx.copy_fifo), list(fx.parked), backups


def _records(w: World, chunk_lists: Iterable[list]) -> list:
    """Every lifecycle record the manager still knows: each request's current one, then those only chunks
    reach (ended lifecycles whose release or host slots wait for in-flight work), in a canonical order."""
    m = w.engine.manager
    seen: dict[int, Any] = {}
    for req in w.reqs:
        if req is not None:
            mach = m.machine_of(req)
            if mach is not None:
                seen.setdefault(id(mach.ctx), mach.ctx)
    for chunks in chunk_lists:
        for c in chunks:
            seen.setdefault(id(c.record), c.record)
    return list(seen.values())


def _req_index(w: World, rec: Any) -> int:
    req = rec.req_ref()
    for i, r in enumerate(w.reqs):
        if r is req:
            return i
    return -1


def check_world(w: World) -> None:
    """Every invariant, on the pools themselves (not on the manager's view of them)."""
    e, cfg = w.engine, w.config
    ps = cfg.page_size
    m = e.manager
    e.allocator.check_conservation()
    e.host_pool.check_conservation()
    e.req_to_token.check_conservation()
    copies, parked, backups = _chunks(e)
    records = _records(w, (copies, parked, backups))

    # machines: spec invariants, counters equal to the chunks each lifecycle really has in flight
    count: dict[int, list[int]] = {}
    for k, chunks in enumerate((copies, parked, backups)):
        for c in chunks:
            count.setdefault(id(c.record), [0, 0, 0])[k] += 1
    for rec in records:
        mach = rec.machine
        bad = gen.violated_invariants(mach)
        _check(not bad, "spec_invariants", lambda: f"{mach!r} violates {', '.join(bad)}")
        _check([mach.copies, mach.parked, mach.backups] == count.get(id(rec), [0, 0, 0]), "counters_match_chunks",
               lambda: f"{mach!r} but chunks in flight (copies, parked, backups) = {count.get(id(rec), [0, 0, 0])}")
    for i, req in enumerate(w.reqs):
        if w.ctl[i][0] == LIVE:
            mach = m.machine_of(req)
            # after a re-admission the manager starts the new lifecycle lazily (at its next call)
            _check(mach is None or mach.state in gen.HANDLED["offload"] or w.ctl[i][1] > 0,
                   "live_request_live_machine", lambda: f"r{i} is live but its machine is {mach!r}")

    # device pages, rows and protected size: owned by live requests and by lifecycles whose release waits
    # for their last copy (state finished), each page by one holder, and nothing else allocated.
    table = e.req_to_token.req_to_token
    holders: list[tuple[str, int, int, int, int, int]] = []  # (name, request index, row, committed, alloc, prefix)
    for i, req in enumerate(w.reqs):
        if w.ctl[i][0] == LIVE:
            holders.append((f"r{i}", i, req.req_pool_idx, req.kv_committed_len,
                            max(req.kv_allocated_len, req.kv_committed_len), req.prefix_len))
    finished = set()
    for rec in records:
        if rec.machine.state in _HOLDING and rec.machine.state not in gen.HANDLED["offload"]:
            i = _req_index(w, rec)
            ended = w.ends.get((i, rec.row))
            _check(ended is not None, "deferred_release_known", f"{rec.key} holds its slots but was never ended")
            finished.add((i, rec.row))
            holders.append((f"{rec.key} (release deferred)", i, rec.row, *ended))
    for k in [k for k in w.ends if k not in finished]:
        del w.ends[k]
    pages: list[int] = []
    for name, i, row, committed, alloc, _ in holders:
        _check(isinstance(row, int) and 0 <= row < e.req_to_token.rows and e.req_to_token.is_allocated(row),
               "holder_has_row", f"{name} row {row!r}")
        n = -(-alloc // ps)
        pages += [s // ps for s in table[row, 0:n * ps:ps].tolist()]
    _check(len(set(pages)) == len(pages), "no_shared_device_page",
           lambda: f"holders {holders} share pages {sorted(p for p in set(pages) if pages.count(p) > 1)}")
    if pages:
        mask = e.allocator._allocated[torch.tensor(pages, dtype=torch.int64)].tolist()
        _check(all(mask), "live_slot_not_free",
               lambda: f"free pages {[p for p, ok in zip(pages, mask) if not ok]} are held by {holders} (B1/B2)")
    used = e.allocator.capacity - e.allocator.free_slots
    _check(used == len(pages) * ps, "device_accounting",
           lambda: f"{used} device slots allocated, holders own {len(pages) * ps} (leak B3/B5, or double free)")
    _check(e.req_to_token.rows - e.req_to_token.free_rows == len(holders), "row_accounting",
           lambda: f"{e.req_to_token.rows - e.req_to_token.free_rows} rows allocated, {len(holders)} holders")
    protected = sum(h[5] for h in holders)
    _check(e.protected.size == protected, "protected_accounting",
           f"protected size {e.protected.size} != {protected} held (B3/B4)")

    # KV content: every committed position of every holder holds its writer's value (a reused or
    # overwritten slot shows up here at once)
    dev = e.device_pool.token_view()
    for name, i, row, committed, _, _ in holders:
        if committed:
            got = dev[0, 0, table[row, :committed], 0, 0].tolist()
            serial = w.reqs[i].serial
            want = [kv_value(serial, p) for p in range(committed)]
            _check(got == want, "device_kv_content", lambda: f"{name} device KV {got} != {want} (B1)")

    # host slots: exactly the chunks between their copy and the collection of their backup
    host: list[int] = []
    for c in itertools.chain(copies, parked, backups):
        host += c.host_indices.tolist()
    _check(len(set(host)) == len(host), "no_shared_host_slot", "two chunks hold one host slot")
    hused = e.host_pool.capacity - e.host_pool.free_slots
    _check(hused == len(host), "host_accounting",
           lambda: f"{hused} host slots allocated, chunks hold {len(host)} (leak, or double free B10)")
    if m.ledger is not None:
        _check(m.ledger.host_pages() * ps == len(host), "ledger_host_pages",
               f"ledger {m.ledger.host_pages()} host pages, chunks {len(host) // ps}")
    hview = e.host_pool.token_view()
    for c in itertools.chain(copies, parked, backups):
        if c.handle is not None and c.handle.done():
            got = hview[0, 0, c.host_indices, 0, 0].tolist()
            serial = c.record.req_ref().serial
            want = [kv_value(serial, p) for p in range(c.start, c.end)]
            _check(got == want, "host_kv_content",
                   lambda: f"completed copy of {c.record.key} [{c.start}, {c.end}) holds {got}, wrote {want} (B2/B15)")

    # storage: a page reported stored is in storage and holds its writer's KV (B13)
    pages_in_store = e.store.pages
    for h, (key, pos) in m.fx.stored.items():
        _check(h in pages_in_store, "stored_means_in_storage", f"{key} page at {pos} marked stored, not in storage (B13)")
        i = int(key.split("#", 1)[0][1:])
        got = _page_values(pages_in_store[h], e.kv, ps)
        want = [kv_value(w.reqs[i].serial, pos + j) for j in range(ps)]
        _check(got == want, "storage_kv_content", lambda: f"{key} page at {pos} stored {got}, wrote {want}")

    # quiescent: nothing live, nothing in flight -> every pool full, nothing protected (B3, B5, B8)
    if not any(c[0] == LIVE for c in w.ctl) and m.idle():
        _check(e.allocator.free_slots == e.allocator.capacity, "teardown_device_full",
               f"{e.allocator.capacity - e.allocator.free_slots} device slots never returned")
        _check(e.host_pool.free_slots == e.host_pool.capacity, "teardown_host_full",
               f"{e.host_pool.capacity - e.host_pool.free_slots} host slots never returned")
        _check(e.req_to_token.free_rows == e.req_to_token.rows, "teardown_rows_free", "a request row was never returned")
        _check(e.protected.size == 0, "teardown_protected_zero", f"protected size {e.protected.size} after teardown")
        if m.ledger is not None:
            _check(not m.ledger.device_readers and not m.ledger.host_owner and not m.ledger.device_owner,
                   "teardown_ledger_empty", "the ledger still lists owners or readers")


def _page_values(page: torch.Tensor, kv: Any, page_size: int) -> list[float]:
    x = page.contiguous().view(kv.dtype).view(kv.num_planes, kv.num_layers, page_size, -1)
    first = x[0, 0, :, 0]
    if not bool((x == first.view(1, 1, -1, 1)).all()):
        return [float("nan")] * page_size
    return first.tolist()


# --- canonical state key ---------------------------------------------------------------------------------
def canonical_key(w: World) -> tuple:
    """The whole bookkeeping of engine, manager and pools, with serials and record names replaced by
    request indices. Two worlds with equal keys behave identically from here on (up to those names)."""
    e = w.engine
    m = e.manager
    fx = m.fx
    copies, parked, backups = _chunks(e)
    records = _records(w, (copies, parked, backups))
    label: dict[int, tuple] = {}
    by_key: dict[str, tuple] = {}
    nth: dict[int, int] = {}
    for rec in records:
        i = _req_index(w, rec)
        mach = m.machine_of(w.reqs[i]) if i >= 0 else None
        if mach is not None and mach.ctx is rec:
            lab = (i, 0)
        else:
            nth[i] = nth.get(i, 0) + 1
            lab = (i, nth[i])
        label[id(rec)] = lab
        by_key[rec.key] = lab
    chunk_no: dict[int, int] = {}

    def chunk(c: Any) -> tuple:
        chunk_no[c.serial] = len(chunk_no)
        return (label[id(c.record)], c.start, c.end, tuple(c.device_indices.tolist()), tuple(c.host_indices.tolist()))

    fifo = tuple((chunk(c), c.handle.done()) for c in copies)
    park = tuple(chunk(c) for c in parked)
    pending = tuple(chunk(j.payload) for j in e.worker.pending)
    done = tuple((chunk(j.payload), j.ok) for j in getattr(e.worker, "_done", ()))
    recs = tuple((label[id(r)], r.machine.snapshot(), r.row, r.inc_len, r.end_lengths, r.req is None)
                 for r in records)
    table = e.req_to_token.req_to_token
    ps = w.config.page_size
    reqs = []
    for i, req in enumerate(w.reqs):
        if req is None:
            reqs.append(tuple(w.ctl[i]))
            continue
        row = req.req_pool_idx
        n = -(-max(req.kv_allocated_len, req.kv_committed_len) // ps) * ps
        slots = tuple(table[row, :n].tolist()) if w.ctl[i][0] == LIVE and isinstance(row, int) else ()
        reqs.append((tuple(w.ctl[i]), row, req.kv_committed_len, req.kv_allocated_len, len(req.output_ids),
                     req.done, slots))
    # rows held by deferred releases: their slots (the only other readers of the table)
    deferred = []
    for rec in records:
        if rec.machine.state in _HOLDING and rec.machine.state not in gen.HANDLED["offload"]:
            ended = w.ends.get((_req_index(w, rec), rec.row))
            n = -(-ended[1] // ps) * ps if ended else 0
            deferred.append((label[id(rec)], ended, tuple(table[rec.row, :n].tolist())))
    free_pages, allocated = e.allocator.snapshot()
    hfree, hallocated = e.host_pool.allocator.snapshot()
    rows = e.req_to_token
    led = m.ledger
    ledger = ()
    if led is not None:
        ledger = (tuple(sorted((p, by_key.get(o, o)) for p, o in led.device_owner.items())),
                  tuple(sorted((p, tuple(sorted(chunk_no.get(s, -s) for s in r))) for p, r in led.device_readers.items() if r)),
                  tuple(sorted((p, chunk_no.get(s, -s)) for p, s in led.host_owner.items())))
    return (tuple(reqs), recs, tuple(deferred), fifo, park, pending, done, len(e.copies.pending),
            len(fx.parked), e.worker.outstanding(),
            tuple(free_pages.tolist()), tuple(allocated.tolist()), tuple(e.allocator._ever_allocated.tolist()),
            tuple(hfree.tolist()), tuple(hallocated.tolist()),
            tuple(rows._free), tuple(rows._allocated), e.protected.size, ledger)


# --- branching: deep copy with fix-ups ------------------------------------------------------------------
_LOCK_TYPES = {type(threading.Lock()): threading.Lock, type(threading.RLock()): threading.RLock}


def _copy_function(f: types.FunctionType, memo: dict) -> types.FunctionType:
    if f.__closure__ is None:
        return f  # module-level function or lambda without captured state: shared
    cells = []
    for c in f.__closure__:
        new = memo.get(id(c))
        if new is None:
            try:
                new = types.CellType(copy.deepcopy(c.cell_contents, memo))
            except ValueError:  # an empty cell
                new = types.CellType()
            memo[id(c)] = new
            memo.setdefault(id(memo), []).append(c)  # keep the original alive while ids are memo keys
        cells.append(new)
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__, copy.deepcopy(f.__defaults__, memo), tuple(cells))
    g.__kwdefaults__ = copy.deepcopy(f.__kwdefaults__, memo)
    g.__dict__.update(copy.deepcopy(f.__dict__, memo))
    return g


def _copy_weakref(r: weakref.ref, memo: dict) -> weakref.ref:
    obj = r()
    if obj is None:
        return r
    return weakref.ref(copy.deepcopy(obj, memo))  # callbacks are re-made by _fix_records


_DISPATCH = {types.FunctionType: _copy_function, weakref.ref: _copy_weakref,
             **{t: (lambda x, memo, make=make: make()) for t, make in _LOCK_TYPES.items()}}


def clone(w: World) -> World:
    """An independent copy of a world (engine, pools, manager, requests, pending copies and backups)."""
    d = copy._deepcopy_dispatch  # type: ignore[attr-defined]
    saved = {t: d.get(t) for t in _DISPATCH}
    d.update(_DISPATCH)
    try:
        memo: dict = {id(w.config): w.config, id(w.engine.config): w.engine.config, id(w.engine.kv): w.engine.kv}
        new = copy.deepcopy(w, memo)
    finally:
        for t, f in saved.items():
            if f is None:
                d.pop(t, None)
            else:
                d[t] = f
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


def build(config: ExplorerConfig, events: Sequence[Event] = (),
          faults: Optional[Callable[[SimEngine], None]] = None, check: bool = True) -> World:
    """A fresh world after `events` (checking every invariant after each one when `check`)."""
    w = World(config, faults)
    if check:
        check_world(w)
    for ev in events:
        apply(w, ev)
        if check:
            check_world(w)
    return w


def replay_events(config: ExplorerConfig, events: Sequence[Event],
                  faults: Optional[Callable[[SimEngine], None]] = None) -> World:
    """Re-run a trace from scratch, checking every state; raises the first Violation (or engine error)."""
    w = World(config, faults)
    check_world(w)
    for n, ev in enumerate(events, 1):
        try:
            apply(w, ev)
            check_world(w)
        except Violation as exc:
            raise Violation(exc.name, f"after event {n} {ev!r}: {exc.detail}") from exc
    return w


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
    depth: int = 0  # longest shortest-trace to a reached state
    complete: bool = False  # every reachable state (within max_depth) was expanded
    seconds: float = 0.0
    peak_rss_mib: float = 0.0
    max_frontier: int = 0
    coverage: set[int] = field(default_factory=set)
    violation: Optional[Counterexample] = None
    keys: Optional[set] = None


def _violation(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, Violation):
        return exc.name, exc.detail
    return type(exc).__name__, str(exc)


def explore(config: ExplorerConfig = ExplorerConfig(), *, max_depth: Optional[int] = None,
            faults: Optional[Callable[[SimEngine], None]] = None, mode: str = "copy",
            max_states: Optional[int] = None, keep_keys: bool = False,
            on_level: Optional[Callable[[int, int, int], None]] = None) -> ExploreResult:
    """Breadth-first search over every interleaving; stops at the first (hence shortest) violation.

    faults: called on every freshly built SimEngine (apply a mutant to its instances); class-level
    monkeypatches applied by the caller are seen as well. on_level(depth, states, frontier) reports progress.
    """
    if mode not in ("copy", "replay"):
        raise ValueError(f"mode must be 'copy' or 'replay', got {mode!r}")
    t0 = time.perf_counter()
    res = ExploreResult(config)
    visited: set = set()

    def finish() -> ExploreResult:
        res.seconds = time.perf_counter() - t0
        res.peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        res.states = len(visited)
        if keep_keys:
            res.keys = visited
        return res

    try:
        root = build(config, faults=faults)
    except Exception as exc:  # noqa: BLE001 - any failure is the report
        res.violation = Counterexample((), *_violation(exc), repr(exc))
        return finish()
    visited.add(canonical_key(root))
    frontier: deque[tuple[Optional[World], tuple[Event, ...]]] = deque([(root, ())])
    depth = 0
    while frontier:
        if max_depth is not None and depth >= max_depth:
            return finish()
        if on_level is not None:
            on_level(depth, len(visited), len(frontier))
        res.max_frontier = max(res.max_frontier, len(frontier))
        nxt: deque = deque()
        while frontier:
            parent, trace = frontier.popleft()
            if mode == "replay":
                parent = build(config, trace, faults, check=False)
            events = enabled(parent)
            for n, ev in enumerate(events):
                if mode == "replay":
                    child = parent if n == len(events) - 1 else build(config, trace, faults, check=False)
                else:
                    child = parent if n == len(events) - 1 else clone(parent)
                res.edges += 1
                try:
                    apply(child, ev)
                    check_world(child)
                    key = canonical_key(child)
                except Exception as exc:  # noqa: BLE001 - any failure is the report
                    res.coverage |= child.engine.manager.coverage
                    res.depth = depth + 1
                    res.violation = Counterexample(trace + (ev,), *_violation(exc), repr(exc))
                    return finish()
                res.coverage |= child.engine.manager.coverage
                if key in visited:
                    continue
                visited.add(key)
                if max_states is not None and len(visited) >= max_states:
                    res.depth = depth + 1
                    return finish()
                nxt.append((child if mode == "copy" else None, trace + (ev,)))
        frontier = nxt
        depth += 1
        if frontier:
            res.depth = depth
    res.complete = True
    return finish()


# --- reporting ------------------------------------------------------------------------------------------
def counterexample_test(config: ExplorerConfig, cx: Counterexample, name: str = "explorer_counterexample") -> str:
    """A runnable pytest file that replays the shortest trace; it fails while the bug exists."""
    events = ",\n".join(f"    {ev!r}" for ev in cx.events)
    fields = ", ".join(f"{k}={v!r}" for k, v in asdict(config).items())
    detail = cx.detail.replace('"""', "'''")
    return f'''"""Shortest counterexample found by `kvfsm check` ({len(cx.events)} events).

Violation: {cx.name}: {detail}

Replays the events on a fresh SimEngine with the same bound, checking every invariant after each one.
It fails while the bug exists and passes once it is fixed.
"""

from kvfsm.verify.explorer import ExplorerConfig, replay_events

CONFIG = ExplorerConfig({fields})

EVENTS = [
{events}{"," if cx.events else ""}
]


def test_{name}() -> None:
    replay_events(CONFIG, EVENTS)
'''


__all__ = ["Counterexample", "ExploreResult", "ExplorerConfig", "Violation", "World", "apply", "build",
           "canonical_key", "check_world", "clone", "counterexample_test", "enabled", "event_label", "explore",
           "replay_events"]
