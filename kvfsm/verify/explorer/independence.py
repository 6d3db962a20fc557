"""Which events commute: the independence relation the partial-order reduction (sleep sets) relies on.

Two events are independent in a state when running them in either order reaches the same key and neither
changes what the other does. That is decided from each event's *footprint* in the state, written down
from what the engine and the manager touch (kvfsm.verify.engine, kvfsm.runtime.manager):

- a request's own bookkeeping (its SimRequest, row, lifecycle records, `_due_at` hint) for its admit,
  readmit, decode, offload, end and duplicate end, and for every copy or backup of one of its chunks;
- the manager's copy FIFO for an offload with a chunk due (two appends are ordered; the progress check
  pops only copies already completed from the head, so it commutes with an append, whose copy is not);
  the host pool, which such an offload takes from (or finds full: host_full) and progress gives back to
  when it collects backups; the backup worker's queues for backups and progress;
- each pending copy, for its completion and for progress (which observes it);
- the device pages and table rows: admit, readmit and decode allocate, an end and progress may free.
  Allocations commute when the pool holds both, an allocation and a free when the allocation fits without
  the free (pages and rows are renamed in the key, so which one went to whom does not matter), except the
  rows a request that may be re-admitted gave back: the key names those, so the order rows are handed
  out and given back in matters while one of them is involved;
- offload_batch touches everything, and so does reuse;
- in a fenced bound, the allocator's fenced pages and their fences: an end may free pages fenced (in FIFO
  order), an allocation may reclaim or hand them out (its writer then waits on the fences: in the CPU twin
  that completes the copies), a copy's completion passes a fence. All of these are ordered with each other.

Events of one request never commute, nor do two events that may write the FIFO or the worker's queues.
This is a claim about the implementation; tests/verify/test_reduction_soundness.py checks it by running
every pair declared independent in both orders on sampled states, and checks that the reduced search
reaches the same states, coverage and violations as the full one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, cast

from kvfsm.dataplane.copy.cpu import DeferredHandle
from kvfsm.verify.explorer.world import _LIVE_STATES, _ROW_HOLDING, LIVE, RETRACTED, Event, World

_ALL = -1  # a mask that meets every other (offload_batch)


class Footprint:
    """What one event touches: a bit mask of shared objects plus what it allocates or frees."""

    __slots__ = ("mask", "dev", "rows", "frees", "host", "host_frees")

    def __init__(
        self, mask: int, dev: int = 0, rows: int = 0, frees: bool = False, host: int = 0, host_frees: bool = False
    ) -> None:
        self.mask = mask  # requests (bits 0..n-1), FIFO, worker, row order, one bit per pending copy
        self.dev = dev  # device pages it may allocate
        self.rows = rows  # table rows it may allocate
        self.frees = frees  # it may free device pages and rows
        self.host = host  # host slots it may allocate (or find missing: host_full)
        self.host_frees = host_frees  # it may free host slots


def stable_id(w: World, ev: Event) -> tuple:
    """An event's identity that survives other events: a copy by its handle's seq, a backup by its chunk's
    serial (enabled() numbers them by position in their queues, which other completions shift)."""
    kind = ev[0]
    if kind == "copy":
        return ("copy", w.engine.copies.pending[ev[1]].seq)
    if kind in ("backup", "backup_fail"):
        return (kind, w.engine.worker.pending[ev[1]].payload.serial)
    return ev


def footprints(w: World, events: Sequence[Event]) -> tuple[list[Footprint], tuple[int, int, int]]:
    """Each event's footprint in `w`, and the free device pages, rows and host slots conflicts are judged by."""
    e, cfg = w.engine, w.config
    m = e.manager
    fx = m.fx
    n = len(w.reqs)
    fifo, worker, take_order = 1 << n, 1 << (n + 1), 1 << (n + 2)
    fenced = 1 << (3 * n + 3 + len(e.copies.pending)) if cfg.fenced else 0  # past every other bit
    gives = [1 << (n + 3 + i) for i in range(n)]  # request i gives a row back
    # The key names a free row only when a request that may be re-admitted last held it (canonical.py):
    # then the order rows are handed out in decides who gets it, and the order they come back in, where
    # they queue. Two takes are ordered while such a row is free; a give-back of such a row is ordered with
    # every other give-back; give-backs of rows nobody names, and a take with a give-back, commute.
    named = _stale_rows(w)
    takes_ordered = take_order if named and any(r in named for r in getattr(e.req_to_token, "_free", ())) else 0
    every_give = sum(gives)
    ps = cfg.page_size
    index = {id(r): i for i, r in enumerate(w.reqs) if r is not None}

    def owner(chunk) -> int:  # noqa: ANN001 - a manager Chunk
        i = index.get(id(chunk.record.req_ref()), -1)
        return (1 << i) if i >= 0 else (1 << n) - 1  # an owner no request names: all of them

    pending = e.copies.pending
    copy_bit = {h.seq: 1 << (2 * n + 3 + k) for k, h in enumerate(pending)}
    by_handle: dict[int, int] = {}
    for c in fx.copy_fifo:
        seq = cast(DeferredHandle, c.handle).seq  # the explorer's engine copies with DeferredCpuCopyEngine
        by_handle[seq] = by_handle.get(seq, 0) | owner(c)
    jobs = e.worker.pending
    chunk_owners = 0
    for c in (
        *fx.copy_fifo,
        *fx.parked,
        *(j.payload for j in jobs),
        *(j.payload for j in getattr(e.worker, "_done", ())),
    ):
        if c is not None:
            chunk_owners |= owner(c)
    # progress gives back the rows of lifecycles whose release waited for their last copy (chunk owners')
    progress_gives = (
        every_give
        if any(w.ctl[i][1] > 0 for i in range(n) if chunk_owners >> i & 1)
        else sum(g for i, g in enumerate(gives) if chunk_owners >> i & 1)
    )
    out = []
    for ev in events:
        kind = ev[0]
        if kind == "progress":
            # it pops completed copies from the FIFO's head: an offload's append (a copy not yet done) commutes
            fp = Footprint(
                worker | progress_gives | sum(copy_bit.values()) | chunk_owners,
                frees=True,
                host_frees=e.worker.completed() > 0,
            )
        elif kind in ("offload_batch", "reuse") or (kind == "engine_release" and cfg.fenced):
            # engine_release with fences first makes the engine's stream wait on every copy (completing them)
            fp = Footprint(_ALL, dev=1 << 30, rows=1 << 30, frees=True, host=1 << 30, host_frees=True)
        elif kind == "copy":
            h = pending[ev[1]]
            fp = Footprint(copy_bit[h.seq] | by_handle.get(h.seq, (1 << n) - 1) | fenced)
        elif kind in ("backup", "backup_fail"):
            fp = Footprint(worker | owner(jobs[ev[1]].payload))
        else:
            i = ev[1]
            req = w.reqs[i]
            mine = 1 << i
            if kind == "admit":
                fp = Footprint(mine | takes_ordered | fenced, dev=-(-cfg.prompt_len // ps), rows=1)
            elif kind == "readmit":
                fp = Footprint(
                    mine | takes_ordered | fenced,
                    dev=-(-(len(req.origin_input_ids) + len(req.output_ids)) // ps),
                    rows=1,
                )
            elif kind in ("decode", "decode_spec"):
                length = req.kv_committed_len + 1 + (cfg.speculative if kind == "decode_spec" else 0)
                fp = Footprint(mine | fenced, dev=max(0, -(-length // ps) - -(-req.kv_allocated_len // ps)))
            elif kind in ("finish", "abort", "retract", "engine_release"):
                # a retract (or the engine's own release) with re-admissions left leaves its row named (it may
                # come back for it)
                back = kind in ("retract", "engine_release") and w.ctl[i][1] > 0
                fp = Footprint(mine | (every_give if back else gives[i]) | fenced, frees=True)
            elif kind == "offload":
                due = _chunk_due(w, i)
                fp = Footprint(mine | (fifo if due else 0), host=due)
            elif kind == "end_again":
                fp = Footprint(mine)
            else:
                raise ValueError(f"no footprint for event {ev!r}")
        out.append(fp)
    return out, (e.allocator.free_slots // ps, e.req_to_token.free_rows, e.host_pool.free_slots)


def _stale_rows(w: World) -> set[int]:
    """Rows the key names although their lifecycle gave them back: the current record's row of a request
    that may be re-admitted (retracted with re-admissions left, or re-admitted and not yet seen by the
    manager)."""
    m = w.engine.manager
    out = set()
    for i, (phase, left, _) in enumerate(w.ctl):
        if (phase == RETRACTED and left > 0) or phase == LIVE:
            mach = m.machine_of(w.req(i))
            if mach is not None and mach.state not in _ROW_HOLDING:
                out.add(mach.ctx.row)
    return out


def _chunk_due(w: World, i: int) -> int:
    """The host slots offload i may ask for (0: no chunk is due; the whole pool and one more when its
    lifecycle is not yet known to the manager, which admits it first)."""
    req = w.req(i)
    m = w.engine.manager
    mach = m.machine_of(req)
    if mach is None or mach.state not in _LIVE_STATES:
        return w.engine.host_pool.capacity + 1
    rec = mach.ctx
    available = min(len(req.origin_input_ids) + len(req.output_ids) - 1, req.kv_committed_len)
    return max(0, (available - rec.prefill_len - rec.inc_len) // m.stride * m.stride)


def dependent(a: Footprint, b: Footprint, free: tuple[int, int, int]) -> bool:
    """Whether the two events may not commute in the state their footprints were taken in (`free`: the free
    device pages, rows and host slots there)."""
    if a.mask & b.mask:
        return True
    return (
        _conflict(a.dev, b.dev, a.frees, b.frees, free[0])
        or _conflict(a.rows, b.rows, a.frees, b.frees, free[1])
        or _conflict(a.host, b.host, a.host_frees, b.host_frees, free[2])
    )


def _conflict(need_a: int, need_b: int, frees_a: bool, frees_b: bool, free: int) -> bool:
    if need_a and need_b:
        return need_a + need_b > free
    if need_a and frees_b:
        return need_a > free
    if need_b and frees_a:
        return need_b > free
    return False


def child_sleep(
    fps: Sequence[Footprint], asleep: Sequence[bool], explored: Sequence[bool], k: int, free: tuple[int, int, int]
) -> list[int]:
    """The sleep set of the child reached by event k (indices into the state's events): the events asleep
    here or explored here before k, each independent of k. (An event left out because a symmetric one
    stands for it is neither: its own successors are not explored.)"""
    a = fps[k]
    return [
        u
        for u in range(len(fps))
        if u != k and (asleep[u] or (u < k and explored[u])) and not dependent(fps[u], a, free)
    ]


def canon_ids(w: World, events: Sequence[Event], naming) -> list[Optional[tuple]]:  # noqa: ANN001 - a Naming
    """Each event in the key's terms (None when the key does not name it)."""
    return [naming.canon(stable_id(w, ev)) for ev in events]
