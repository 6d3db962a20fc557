"""The invariants every explored state must satisfy, computed on the pools themselves.

`check_world` reads the world once into a `_Snap` (plain lists from the engine's tensors and the
manager's queues; the canonical key is computed from the same read) and checks pool conservation,
ownership of device pages, rows, protected size and host slots, machine counters against the chunks
really in flight, the KV content of held device slots, completed host copies and stored pages against
kv_value(writer, position), and at quiescent states full pools and an empty ledger. `_check_chunk` is
what every chunk an offload event queues must satisfy. A failure raises `Violation`, named for the
counterexample report.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import kvfsm.generated.decode_offload as gen
from kvfsm.verify.engine import SimRequest, kv_value
from kvfsm.verify.explorer.world import _DEFERRED, _LIVE_STATES, LIVE, World


class Violation(AssertionError):
    """An invariant of the explored implementation failed; `name` says which."""

    def __init__(self, name: str, detail: str) -> None:
        self.name, self.detail = name, detail
        super().__init__(f"{name}: {detail}")


def _check(cond: bool, name: str, detail: Any = "") -> None:
    if not cond:
        raise Violation(name, detail() if callable(detail) else str(detail))


def _describe(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, Violation):
        return exc.name, exc.detail
    return type(exc).__name__, str(exc)


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
        # the order free rows are handed out in (the pool's FIFO; it has no public view of it): whether a
        # re-admitted request gets its old row number back depends on it (DecodeOffloadManager._readmitted)
        self.rows_free = tuple(getattr(e.req_to_token, "_free", ()))
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
                assert req is not None  # a live request was admitted
                out.append(
                    (
                        f"r{i}",
                        i,
                        req.req_pool_idx,
                        req.kv_committed_len,
                        max(req.kv_allocated_len, req.kv_committed_len),
                        req.prefix_len,
                    )
                )
        for rec in self.records:
            if rec.machine.state in _DEFERRED:
                i = self.index_of(rec)
                ended = w.ends.get((i, rec.row))
                if ended is None:
                    raise Violation("deferred_release_known", f"{rec.key} holds its slots but never ended")
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
        _check(
            [mach.copies, mach.parked, mach.backups] == count.get(id(rec), [0, 0, 0]),
            "counters_match_chunks",
            lambda: f"{mach!r} but chunks in flight (copies, parked, backups) = {count.get(id(rec), [0, 0, 0])}",
        )
    for i, req in enumerate(w.reqs):
        if w.ctl[i][0] == LIVE:
            assert req is not None  # a live request was admitted
            mach = m.machine_of(req)
            # after a re-admission the manager starts the new lifecycle lazily, at its next call
            _check(
                mach is None or mach.state in _LIVE_STATES or w.ctl[i][2] > 0,
                "live_request_live_machine",
                lambda: f"r{i} is live but its machine is {mach!r}",
            )

    # device pages, rows and protected size: each page held by one holder, and nothing else allocated
    holders = s.holders(w)
    for end in [end for end in w.ends if end not in {(h[1], h[2]) for h in holders}]:
        del w.ends[end]  # released lifecycles
    pages: list[int] = []
    for name, _i, row, _committed, alloc, _ in holders:
        if not (isinstance(row, int) and 0 <= row < len(s.rows_alloc) and s.rows_alloc[row]):
            raise Violation("holder_has_row", f"{name} row {row!r}")
        pages += [slot // ps for slot in s.table[row][0 : -(-alloc // ps) * ps : ps]]
    held = set(pages)
    _check(
        len(held) == len(pages),
        "no_shared_device_page",
        lambda: f"holders {holders} share pages {sorted(p for p in held if pages.count(p) > 1)}",
    )
    _check(
        all(s.alloc[p] for p in pages),
        "live_slot_not_free",
        lambda: f"free pages {[p for p in pages if not s.alloc[p]]} are held by {holders} (B1/B2)",
    )
    used = sum(s.alloc)
    _check(
        used == len(pages),
        "device_accounting",
        lambda: f"{used * ps} device slots allocated, holders own {len(pages) * ps} (leak B3/B5/B8, or B11/B12)",
    )
    _check(
        sum(s.rows_alloc) == len(holders),
        "row_accounting",
        lambda: f"{sum(s.rows_alloc)} rows allocated, {len(holders)} holders (leak B8)",
    )
    protected = sum(h[5] for h in holders)
    _check(
        e.protected.size == protected,
        "protected_accounting",
        f"protected size {e.protected.size} != {protected} held (B3/B4)",
    )

    # KV content: every committed position of every holder holds its writer's value
    if holders:
        dev = e.device_pool.token_view()[0, 0, :, 0, 0].tolist()
        for name, i, row, committed, _, _ in holders:
            assert row is not None  # holder_has_row held above
            serial = w.req(i).serial
            got = [dev[slot] for slot in s.table[row][:committed]]
            want = [kv_value(serial, p) for p in range(committed)]
            _check(got == want, "device_kv_content", lambda: f"{name} device KV {got} != written {want} (B1)")

    # host slots: exactly the chunks between their copy and the collection of their backup
    host = [h for c in s.chunks for h in s.host_idx[id(c)]]
    _check(len(set(host)) == len(host), "no_shared_host_slot", "two chunks hold one host slot")
    hused = sum(s.halloc) * ps
    _check(
        hused == len(host),
        "host_accounting",
        lambda: f"{hused} host slots allocated, chunks hold {len(host)} (leak B3, or double free B10)",
    )
    if m.ledger is not None:
        _check(
            m.ledger.host_pages() * ps == len(host),
            "ledger_host_pages",
            f"ledger {m.ledger.host_pages()} host pages, chunks {len(host) // ps}",
        )
    done = [c for c in s.chunks if c.handle is not None and c.handle.done()]
    if done:
        hv = e.host_pool.token_view()[0, 0, :, 0, 0].tolist()
        for c in done:
            got = [hv[h] for h in s.host_idx[id(c)]]
            want = [kv_value(c.record.req_ref().serial, p) for p in range(c.start, c.end)]
            _check(
                got == want,
                "host_kv_content",
                lambda: f"completed copy of {c.record.key} [{c.start}, {c.end}) holds {got}, wrote {want} (B2/B15)",
            )

    # storage: a page reported stored is in storage and holds its writer's KV (B13)
    assert e.store is not None  # the explorer's engine keeps its in-memory store
    in_store = e.store.pages
    for h, (key, pos) in m.fx.stored.items():
        _check(h in in_store, "stored_means_in_storage", f"{key} page at {pos} marked stored, not in storage (B13)")
        i = int(key.split("#", 1)[0][1:])
        got = _page_values(in_store[h], e.kv, ps)
        want = [kv_value(w.req(i).serial, pos + j) for j in range(ps)]
        _check(got == want, "storage_kv_content", lambda: f"{key} page at {pos} stored {got}, wrote {want}")

    # quiescent: nothing live, nothing in flight -> every pool full, nothing protected (B3, B5, B8)
    if not s.chunks and not any(c[0] == LIVE for c in w.ctl) and m.idle():
        _check(used == 0, "teardown_device_full", f"{used * ps} device slots never returned")
        _check(hused == 0, "teardown_host_full", f"{hused} host slots never returned")
        _check(not any(s.rows_alloc), "teardown_rows_free", "a request row was never returned")
        _check(e.protected.size == 0, "teardown_protected_zero", f"protected size {e.protected.size} after teardown")
        if m.ledger is not None:
            _check(
                not m.ledger.device_readers and not m.ledger.host_owner and not m.ledger.device_owner,
                "teardown_ledger_empty",
                "the ledger still lists owners or readers",
            )
    return s


def _page_values(page: torch.Tensor, kv: Any, page_size: int) -> list[float]:
    x = page.contiguous().view(kv.dtype).view(kv.num_planes, kv.num_layers, page_size, -1)
    first = x[0, 0, :, 0]
    if not bool((x == first.view(1, 1, -1, 1)).all()):
        return [float("nan")] * page_size
    return first.tolist()


# --- what every chunk an offload event queues must satisfy ------------------------------------------------
def _check_chunk(w: World, i: int, req: SimRequest, rec: Any, inc: int, c: Any) -> None:
    e = w.engine
    new = c.record
    start = new.prefill_len + (inc if new is rec else 0)
    stride = e.manager.stride
    _check(
        c.start == start
        and c.end > c.start
        and (c.end - c.start) % stride == 0
        and new.prefill_len + new.inc_len == c.end,
        "offload_contiguous",
        lambda: (
            f"r{i}: chunk [{c.start}, {c.end}) but the next chunk starts at {start} (stride {stride}), "
            f"offloaded length now {new.inc_len} after prefill {new.prefill_len}"
        ),
    )
    _check(
        c.end <= min(req.kv_committed_len, len(req.origin_input_ids) + len(req.output_ids) - 1),
        "offload_committed_only",
        lambda: f"r{i}: chunk [{c.start}, {c.end}) beyond committed KV {req.kv_committed_len}",
    )
    row = e.req_to_token.req_to_token[req.req_pool_idx, c.start : c.end].tolist()
    _check(
        c.device_indices.tolist() == row,
        "offload_own_slots",
        lambda: f"r{i}: chunk [{c.start}, {c.end}) reads slots {c.device_indices.tolist()}, its row maps {row}",
    )
    tokens = (list(req.origin_input_ids) + list(req.output_ids))[c.start : c.end]
    _check(list(c.tokens) == tokens, "offload_tokens", lambda: f"r{i}: chunk tokens {c.tokens} != {tokens}")
