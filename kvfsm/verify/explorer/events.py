"""The events the explorer interleaves: which are enabled in a world, and how each runs on the engine.

    admit i | decode i | decode_spec i | offload i | offload_batch | finish i | abort i | retract i |
    engine_release i (the engine releases the request itself, with no copy of it in flight, then tells the
    manager; in a fenced bound also while its copies are in flight, its stream waiting on them first) |
    readmit i | end_again i (finish of a request that already ended) | copy j (complete pending copy j) |
    backup j / backup_fail j (run pending backup j; its store write succeeds / fails) | progress |
    reuse (fenced bounds, while a free page is fenced: another writer takes every free page, waits on the
    fences, writes and frees them; SimEngine.reuse_fenced)

`enabled` lists them in a fixed order (so traces are reproducible); `apply` runs one on the real
engine, checking what that event alone promises (an offload queues one contiguous chunk of committed KV
or changes nothing, B7; a duplicate finish changes nothing, B9). `build` / `replay_events` re-run a
trace from a fresh world, checking every state: the replay-mode search and the counterexample tests run
on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import kvfsm.generated.decode_offload as gen
from kvfsm.verify.engine import SimEngine, SimRequest
from kvfsm.verify.explorer.checks import Violation, _check, _check_chunk, check_world
from kvfsm.verify.explorer.world import _LIVE_STATES, ENDED, LIVE, NEW, RETRACTED, Event, ExplorerConfig, Faults, World


def enabled(w: World) -> list[Event]:
    """Every event the engine may issue now, in a fixed order (so traces are reproducible)."""
    cfg, e = w.config, w.engine
    out: list[Event] = []
    for i, (phase, left, _) in enumerate(w.ctl):
        req = w.reqs[i]
        if phase == NEW:
            out.append(("admit", i))
        elif phase == LIVE:
            assert req is not None  # a live request was admitted
            if req.kv_committed_len < cfg.prompt_len + cfg.decodes:
                out.append(("decode", i))
                if cfg.speculative > 0:
                    out.append(("decode_spec", i))
            out.append(("offload", i))
            out.extend((how, i) for how in cfg.end_kinds if how != "engine_release" or cfg.fenced or _no_copy_of(w, i))
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
    if cfg.fenced and e.allocator.fenced_page_count:
        out.append(("reuse",))
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
    if kind == "reuse":
        e.reuse_fenced()
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
    elif kind == "engine_release":
        e.release_itself(req)
        ctl[0] = RETRACTED if ctl[1] > 0 else ENDED  # SGLang re-admits the requests it retracted
    elif kind in ("finish", "abort", "retract"):
        w.ends[(i, req.req_pool_idx)] = (
            req.kv_committed_len,
            max(req.kv_allocated_len, req.kv_committed_len),
            req.prefix_len,
        )
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
        _check(
            before == after,
            "duplicate_end_is_noop",
            lambda: (
                f"finish of ended r{i}: (device free, host free, "
                f"rows free, protected, releases) {before} -> {after} (B9)"
            ),
        )
        _check(
            mach is None or mach.state == state,
            "duplicate_end_is_noop",
            lambda: f"finish of ended r{i} moved its machine from {gen.STATES[state]} to {mach!r} (B9)",
        )
    else:
        raise ValueError(f"unknown event {ev!r}")


def _no_copy_of(w: World, i: int) -> bool:
    """Whether no device-to-host copy of request i is in flight: when an engine may release it itself
    (SGLang's drain_before_retraction refuses otherwise)."""
    mach = w.engine.manager.machine_of(w.req(i))
    return mach is None or mach.copies == 0


def _offload(w: World, i: int, req: SimRequest) -> None:
    """manager.offload, checked: a chunk continues where the last one ended, covers whole strides of the
    request's committed KV through its own table row; no chunk leaves everything as it was (B7)."""
    e = w.engine
    fx = e.manager.fx
    rec, inc = _offload_progress(w, req)
    n_fifo, host_free = len(fx.copy_fifo), e.host_pool.free_slots
    submitted = e.manager.offload(req)
    if not submitted:
        _check(
            len(fx.copy_fifo) == n_fifo and e.host_pool.free_slots == host_free and (rec is None or rec.inc_len == inc),
            "offload_nothing_changes_nothing",
            lambda: (
                f"r{i}: offload returned False but changed the copy queue {n_fifo} -> {len(fx.copy_fifo)}, "
                f"host free slots {host_free} -> {e.host_pool.free_slots} or offloaded length "
                f"{inc} -> {rec.inc_len if rec else None} (B7)"
            ),
        )
        return
    _check(
        len(fx.copy_fifo) == n_fifo + 1,
        "offload_one_chunk",
        f"r{i}: one offload queued {len(fx.copy_fifo) - n_fifo} copies",
    )
    _check_chunk(w, i, req, rec, inc, fx.copy_fifo[-1])


def _offload_batch(w: World) -> None:
    """manager.offload_batch over every live request (with the engine's batch arrays), checked: at most one
    chunk per request, each as `_offload` checks it; requests without a chunk keep their offloaded length."""
    e = w.engine
    fx = e.manager.fx
    live = [i for i, (phase, _, _) in enumerate(w.ctl) if phase == LIVE]
    reqs = [w.req(i) for i in live]
    before = [_offload_progress(w, req) for req in reqs]
    n_fifo = len(fx.copy_fifo)
    submitted = e.manager.offload_batch(reqs, [r.row for r in reqs], [r.kv_committed_len for r in reqs])
    new = list(fx.copy_fifo)[n_fifo:]
    _check(
        len(new) == submitted, "offload_batch_count", f"offload_batch reported {submitted} chunks but queued {len(new)}"
    )
    by_request = {id(c.record.req_ref()): c for c in new}
    _check(
        len(by_request) == len(new), "offload_batch_one_chunk_each", "offload_batch queued two chunks for one request"
    )
    for i, req, (rec, inc) in zip(live, reqs, before):
        c = by_request.get(id(req))
        if c is not None:
            _check_chunk(w, i, req, rec, inc, c)
        else:
            _check(
                rec is None or rec.inc_len == inc,
                "offload_nothing_changes_nothing",
                lambda: f"r{i}: no chunk in offload_batch, but its offloaded length moved {inc} -> {rec.inc_len}",
            )


def _offload_progress(w: World, req: SimRequest) -> tuple[Any, int]:
    """The request's live lifecycle record (None if it has none yet) and its offloaded length."""
    mach = w.engine.manager.machine_of(req)
    rec = mach.ctx if mach is not None and mach.state in _LIVE_STATES else None
    return rec, (rec.inc_len if rec is not None else 0)


def _pool_counts(e: SimEngine) -> tuple[int, ...]:
    return (
        e.allocator.free_slots,
        e.host_pool.free_slots,
        e.req_to_token.free_rows,
        e.protected.size,
        e.manager.metrics.releases,
    )


def event_label(ev: Event) -> str:
    if len(ev) == 1:
        return ev[0]
    return f"{ev[0]} {'#' if ev[0] in ('copy', 'backup', 'backup_fail') else 'r'}{ev[1]}"


def build(
    config: ExplorerConfig,
    events: Sequence[Event] = (),
    faults: Optional[Faults] = None,
    check: bool = True,
    trace_path: Optional[str] = None,
) -> World:
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
