"""State canonicalisation: the key the search deduplicates states by.

`canonical_key` is the engine's whole bookkeeping with record names and serials replaced by request
positions, and device pages, host pages and table rows renamed in order of first use (free ones are
interchangeable: only their number counts), so interleavings that leave the same state up to which
physical page went to whom meet. Requests are interchangeable too (symmetry=False turns that off): the
key is taken in the request order that sorts their local states, the smallest hash among orders that
tie. Attributes a fault adds to records or chunks are part of the key, so a fault's side state is not
merged away.

Equal keys must mean equal futures, or the set of keys reached depends on which world of a key the search
happens to keep (which the partial-order reduction changes). So the key leaves out what nothing reads again
but the allocators' free-list order would leak into: the device slots of a chunk whose copy progress has
already seen, the row of a lifecycle that gave it back (unless its request may still be re-admitted, when
the manager compares it); and it keeps the order in which named free rows will be handed out.

`canonical` also returns the `Naming` the key was taken under (request positions, chunk and copy
numbers), so that the partial-order reduction can store sleep sets in the key's own terms: two worlds
with one key may name the same request, chunk or copy differently.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Optional, cast

from kvfsm.dataplane.copy.cpu import DeferredHandle
from kvfsm.verify.explorer.checks import _Snap
from kvfsm.verify.explorer.world import _DEFERRED, _ROW_HOLDING, LIVE, RETRACTED, World


class Naming:
    """How a key names a world's requests, chunks and copies: request index -> position, chunk serial ->
    number, copy handle seq -> number (its first chunk's). `canon` turns a world-local event id
    (kvfsm.verify.explorer.independence.stable_id) into the key's terms, None for what the key does not name."""

    __slots__ = ("pos", "chunk", "handle", "rep")

    def __init__(self, pos: Sequence[int], chunk: dict[int, int], handle: dict[int, int]) -> None:
        self.pos, self.chunk, self.handle = pos, chunk, handle
        # request index -> the smallest index it can be swapped with without changing the key (itself
        # unless the world is symmetric in them): their events lead to children with equal keys
        self.rep: Sequence[int] = range(len(pos))

    def canon(self, sid: tuple) -> Optional[tuple]:
        kind = sid[0]
        if len(sid) == 1:
            return sid
        if kind == "copy":
            n = self.handle.get(sid[1])
        elif kind in ("backup", "backup_fail"):
            n = self.chunk.get(sid[1])
        else:
            n = self.pos[sid[1]]
        return None if n is None else (kind, n)


def canonical_key(w: World, snap: Optional[_Snap] = None, symmetry: bool = True) -> tuple:
    """The state key the search deduplicates by (see `canonical`)."""
    return canonical(w, snap, symmetry)[0]


def canonical(w: World, snap: Optional[_Snap] = None, symmetry: bool = True) -> tuple[tuple, Naming]:
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
            local += (
                req.kv_committed_len,
                req.kv_allocated_len,
                req.done,
                req.req_pool_idx is None,
                mach.snapshot() if mach is not None else None,
                tuple(mine.get(i, ())),
            )
        sig.append(hash(local))
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(sig[i], []).append(i)
    ordered = [groups[h] for h in sorted(groups)]
    if all(len(g) == 1 for g in ordered):
        return _key(w, s, [g[0] for g in ordered])
    best: Optional[tuple[tuple, Naming]] = None
    ties: list[list[int]] = []  # the orders that give the best key
    for parts in itertools.product(*(itertools.permutations(g) for g in ordered)):
        order = [i for part in parts for i in part]
        got = _key(w, s, order)
        if best is None or hash(got[0]) < hash(best[0]):
            best, ties = got, [order]
        elif hash(got[0]) == hash(best[0]) and got[0] == best[0]:
            ties.append(order)
    assert best is not None  # the product above has at least one order
    if len(ties) > 1:  # automorphisms: request ties[0][k] plays other[k]; orbits by union-find
        root = list(range(n))

        def find(i: int) -> int:
            while root[i] != i:
                i = root[i]
            return i

        for other in ties[1:]:
            for a, b in zip(ties[0], other):
                ra, rb = find(a), find(b)
                if ra != rb:
                    root[max(ra, rb)] = min(ra, rb)
        best[1].rep = [find(i) for i in range(n)]
    return best


def _key(w: World, s: _Snap, order: list[int]) -> tuple[tuple, Naming]:
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

    reqs: list[tuple[Any, ...]] = []
    for i in order:
        req = w.reqs[i]
        if req is None:
            reqs.append(tuple(w.ctl[i]))
            continue
        alloc = max(req.kv_allocated_len, req.kv_committed_len)
        r = req.req_pool_idx
        held = (
            dev(s.table[r][: -(-alloc // ps) * ps])
            if w.ctl[i][0] == LIVE and isinstance(r, int) and 0 <= r < len(s.table)
            else ()
        )
        reqs.append(
            (tuple(w.ctl[i]), row(r), req.kv_committed_len, req.kv_allocated_len, len(req.output_ids), req.done, held)
        )

    def rec_row(rec: Any) -> Any:
        # A lifecycle that gave its row back names it only where the manager still compares it: the
        # current record of a request that may be re-admitted (DecodeOffloadManager._readmitted tells a
        # re-admission by the row the request holds next). Elsewhere the number is stale, and whether it
        # coincides with a row handed out since depends on the free list's order, which the key omits.
        if rec.machine.state in _ROW_HOLDING:
            return row(rec.row)
        i = s.index_of(rec)
        if i < 0 or s.current.get(id(rec)) != i:
            return None
        phase, left, _ = w.ctl[i]
        return row(rec.row) if (phase == RETRACTED and left > 0) or phase == LIVE else None

    recs = []
    for rec in records:
        deferred: tuple[Any, ...] = ()
        if rec.machine.state in _DEFERRED:
            ended = w.ends.get((s.index_of(rec), rec.row))
            n = -(-ended[1] // ps) * ps if ended else 0
            deferred = (ended, dev(s.table[rec.row][:n]))
        recs.append(
            (
                label[id(rec)],
                rec.machine.snapshot(),
                rec_row(rec),
                rec.inc_len,
                rec.end_lengths,
                rec.req is None,
                deferred,
                _extras(rec),
            )
        )
    chunk_no: dict[int, int] = {}

    def chunk(c: Any, copying: bool = False) -> tuple:
        # the device slots only while the copy is in the FIFO: once progress has seen it complete nothing
        # reads them again, and whether they coincide with pages handed out since depends on the order
        # the allocator's free list happens to be in (a key naming them would not determine the future)
        chunk_no[c.serial] = len(chunk_no)
        return (
            label[id(c.record)],
            c.start,
            c.end,
            dev(s.dev_idx[id(c)]) if copying else (),
            hst(s.host_idx[id(c)]),
            _extras(c),
        )

    # a copy's state: landed, or (a stream-ordered twin's wait) already read its source, or neither
    fifo = tuple((chunk(c, True), c.handle.done(), getattr(c.handle, "ran", False)) for c in s.copies)
    parked = tuple(chunk(c) for c in s.parked)
    pending = tuple(chunk(c) for c in s.pending)
    collected = tuple((chunk(j.payload), j.ok) for j in s.done_jobs)
    ledger: tuple[Any, ...] = ()
    led = m.ledger
    if led is not None:
        ledger = (
            tuple(sorted((pmap.setdefault(p, len(pmap)), by_key.get(o, o)) for p, o in led.device_owner.items())),
            tuple(
                sorted(
                    (pmap.setdefault(p, len(pmap)), tuple(sorted(chunk_no.get(x, -1) for x in r)))
                    for p, r in led.device_readers.items()
                    if r
                )
            ),
            tuple(sorted((hmap.setdefault(p, len(hmap)), chunk_no.get(x, -1)) for p, x in led.host_owner.items())),
        )
    # fenced free pages, in the order they are handed out, each with the copies (by number) its fence waits for
    fenced: tuple[Any, ...] = ()
    fence_of = getattr(e.allocator, "_page_fence", {})
    held_fence = getattr(e.allocator, "_held_fence", None)
    if fence_of or held_fence:
        copy_no = {id(c.handle): chunk_no[c.serial] for c in s.copies}

        def copies_of(f: Any) -> tuple[int, ...]:
            return tuple(sorted(copy_no.get(id(h), -1) for h in f._handles if not h.done()))

        fenced = tuple((pmap.setdefault(p, len(pmap)), copies_of(fence_of[p])) for p in e.allocator._fenced_pages)
        # allocated pages still carrying the unpassed fence they were handed out with (freed, they keep it)
        carrying = [(p, f) for p, f in (held_fence or {}).items() if not f.passed()]
        if carrying:
            fenced += (-1,) + tuple(sorted((pmap.setdefault(p, len(pmap)), copies_of(f)) for p, f in carrying))
    # pools: which named pages are allocated, how many allocated pages nobody names (a leak), how many free
    alloc_named = tuple(sorted(pmap[p] for p, a in enumerate(s.alloc) if a and p in pmap))
    halloc_named = tuple(sorted(hmap[p] for p, a in enumerate(s.halloc) if a and p in hmap))
    rows_named = tuple(sorted(rmap[r] for r, a in enumerate(s.rows_alloc) if a and r in rmap))
    rows_next = tuple(rmap.get(r, -1) for r in s.rows_free)  # when each named free row is handed out
    key = (
        tuple(reqs),
        tuple(recs),
        fifo,
        parked,
        pending,
        collected,
        len(e.copies.pending),
        len(m.fx.parked),
        e.worker.outstanding(),
        alloc_named,
        sum(s.alloc) - len(alloc_named),
        len(s.free),
        halloc_named,
        sum(s.halloc) - len(halloc_named),
        len(s.hfree),
        rows_named,
        sum(s.rows_alloc) - len(rows_named),
        e.req_to_token.free_rows,
        e.protected.size,
        ledger,
        rows_next,
        fenced,
    )
    handle: dict[int, int] = {}
    for c in s.copies:
        handle.setdefault(cast(DeferredHandle, c.handle).seq, chunk_no[c.serial])
    return key, Naming([pos[i] for i in range(len(w.reqs))], chunk_no, handle)


def _extras(obj: Any) -> tuple:
    """Attributes an object carries beyond its dataclass fields (state a fault keeps on the side)."""
    names = getattr(type(obj), "__dataclass_fields__", None)
    d = getattr(obj, "__dict__", None)
    if names is None or d is None or len(d) == len(names):
        return ()
    return tuple(
        sorted(
            (k, v if isinstance(v, (bool, int, float, str, type(None))) else type(v).__name__)
            for k, v in d.items()
            if k not in names
        )
    )
