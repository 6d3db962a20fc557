"""offload_batch: one call per decode batch makes exactly the transitions a loop of offload() makes.

Two SimEngines run the same random workload, one offloading with a loop of `offload(req)`, the other with
one `offload_batch(reqs, rows, committed)` per step; every observable must agree (chunks, machine states,
metrics, pool occupancy, host page contents, stored keys). Then the batch's own rejections: each leaves
every pool, machine and metric as it was.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

import kvfsm.generated.decode_offload as spec_gen
from kvfsm.errors import EventRejected, RequestFieldMissing
from kvfsm.runtime.protocols import describe, offloadable_tokens
from kvfsm.verify.engine import SimEngine, SimRequest


def batch_arrays(engine: SimEngine) -> tuple[list[SimRequest], np.ndarray, np.ndarray]:
    reqs = list(engine.live)
    rows = np.array([r.req_pool_idx for r in reqs], dtype=np.int64)
    committed = np.array([r.kv_committed_len for r in reqs], dtype=np.int64)
    return reqs, rows, committed


def observe(engine: SimEngine) -> dict[str, Any]:
    """Everything a test can see of the manager, in a comparable form (no object identities)."""
    fx = engine.manager.fx
    chunks = [
        (c.record.rid, c.start, c.end, tuple(c.tokens), c.device_indices.tolist(), c.handle.done())
        for c in fx.copy_fifo
    ]
    states = sorted(
        (rec.rid, spec_gen.STATES[rec.machine.state], rec.inc_len, rec.last_hash)
        for rec in engine.manager._records.values()
    )
    return {
        "chunks": chunks,
        "states": states,
        "metrics": engine.manager.metrics.as_dict(),
        "host_free": engine.host_pool.free_slots,
        "device_free": engine.allocator.free_slots,
        "stored": sorted(fx.stored.items()),
        "rows": engine.req_to_token.free_rows,
    }


def snapshot(engine: SimEngine) -> tuple[Any, ...]:
    """State a rejected call must leave untouched (pools, machines, metrics, queued copies)."""
    return (
        observe(engine),
        engine.host_pool.allocator.snapshot()[0].tolist(),
        engine.allocator.snapshot()[0].tolist(),
        len(engine.copies.pending),
    )


def reserve_due(engine: SimEngine, req: SimRequest) -> Any:
    """`reserve_due` as the SGLang adapter calls it: the row and offloadable length read from the request."""
    available = offloadable_tokens(req.origin_input_ids, req.output_ids, req.kv_committed_len)
    return engine.manager.reserve_due(req, req.req_pool_idx, available)  # type: ignore[arg-type]


def run_workload(
    batched: bool, seed: int, steps: int = 60, engine: SimEngine | None = None, reserved: str = "", **engine_kw: Any
) -> list[dict[str, Any]]:
    """A random workload (every ending, retraction under memory pressure) to teardown; on `engine` if given.
    `reserved`: each step's offloads as `reserve_offload` ("offload") or `reserve_due` ("due") per request,
    then one `submit_reserved`."""
    rng = random.Random(seed)
    e = engine if engine is not None else SimEngine(**engine_kw)
    log = []
    serial = 0
    for _ in range(steps):
        if len(e.live) < e.rows and rng.random() < 0.4:
            serial += 1
            e.admit(f"r{serial}", rng.randint(1, 12), prefix_len=rng.randint(0, 2))
        for req in list(e.live):
            if not e.decode(req, speculative=rng.randint(0, 1)):
                e.end(req, "retract")
        if batched:
            reqs, rows, committed = batch_arrays(e)
            n = e.manager.offload_batch(reqs, rows, committed)
            del reqs  # records live as long as their request objects: hold none the loop would not
        elif reserved:
            reserve = e.manager.reserve_offload if reserved == "offload" else lambda r: reserve_due(e, r)
            reservations = [r for r in map(reserve, list(e.live)) if r is not None]
            n = e.manager.submit_reserved(reservations)
            del reservations
        else:
            n = sum(e.manager.offload(r) for r in list(e.live))
        if rng.random() < 0.6:  # a loop's copies are separate handles, a batch's one: land all or none
            e.copies.complete_all()
        if rng.random() < 0.5 and e.worker.pending:
            e.worker.run(0)
        e.manager.check_progress()
        if e.live and rng.random() < 0.15:
            e.end(rng.choice(e.live), rng.choice(["finish", "abort", "retract"]))
        obs = observe(e)
        obs["submitted"] = n
        log.append(obs)
    for req in list(e.live):
        e.end(req)
    for _ in range(200):
        if e.manager.idle():
            break
        e.copies.complete_all()
        e.worker.run_all()
        e.manager.check_progress()
    e.check_teardown()
    return log


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page_size,stride,host_slots", [(1, 0, 12), (2, 0, 16), (2, 4, 8), (4, 0, 64)])
def test_batch_equals_loop(seed: int, page_size: int, stride: int, host_slots: int) -> None:
    kw = dict(page_size=page_size, stride=stride, host_slots=host_slots, device_slots=96, rows=5, max_context=48)
    loop = run_workload(False, seed, **kw)
    batch = run_workload(True, seed, **kw)
    for step, (a, b) in enumerate(zip(loop, batch)):
        assert a == b, f"step {step}: loop and batch diverge"
    assert sum(o["submitted"] for o in batch) > 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page_size,stride,host_slots", [(1, 0, 12), (2, 0, 16), (2, 4, 8), (4, 0, 64)])
@pytest.mark.parametrize("reserve", ["offload", "due"])
def test_reserved_then_submitted_equals_loop(
    seed: int, page_size: int, stride: int, host_slots: int, reserve: str
) -> None:
    """reserve_offload (or reserve_due, with the row and length read from the request) per request (host
    pages in call order, host_full at once) then one submit_reserved per step: the transitions, chunks, pages
    and keys of the loop of offload() calls (the SGLang adapter's path)."""
    kw = dict(page_size=page_size, stride=stride, host_slots=host_slots, device_slots=96, rows=5, max_context=48)
    loop = run_workload(False, seed, **kw)
    reserved = run_workload(False, seed, reserved=reserve, **kw)
    for step, (a, b) in enumerate(zip(loop, reserved)):
        assert a == b, f"step {step}: loop and reserved diverge"
    assert sum(o["submitted"] for o in reserved) > 0
    assert any(o["metrics"]["host_full_retries"] for o in reserved) or host_slots > 16


def _three_with_a_chunk_due() -> tuple[SimEngine, list[SimRequest]]:
    """Three admitted requests (seen by the manager before anything was due), each with a chunk due now."""
    e = SimEngine(page_size=2, host_slots=32, device_slots=96, rows=4)
    reqs = [e.admit(f"r{i}", 5) for i in range(3)]
    assert not any(e.manager.offload(r) for r in reqs)  # admitted, nothing due yet
    for _ in range(3):
        for r in reqs:
            e.decode(r)
    return e, reqs


def test_a_reservation_holds_host_pages_and_nothing_else_until_submitted() -> None:
    e, reqs = _three_with_a_chunk_due()
    before = observe(e)
    got = [e.manager.reserve_offload(r) for r in reqs]
    assert all(r is not None and r.tokens == 4 for r in got)
    after = observe(e)
    assert after["host_free"] == before["host_free"] - 12  # pages taken now...
    assert {k: v for k, v in after.items() if k != "host_free"} == {k: v for k, v in before.items() if k != "host_free"}
    assert [r.pages for r in got] == sorted([r.pages for r in got])  # ...in call order
    assert e.manager.submit_reserved(got) == 3
    assert len(e.copies.pending) == 1 and [c.record.rid for c in e.manager.fx.copy_fifo] == ["r0", "r1", "r2"]


def test_a_row_outside_the_table_has_no_due_point() -> None:
    """due_at is a hint read from a request's own row field: a row the table does not have (past its end, or
    negative) is "none known", never an IndexError or the hint of the row a negative index wraps to."""
    e, reqs = _three_with_a_chunk_due()
    assert e.manager.offload_batch(reqs) == 3
    hints = [e.manager.due_at(r.req_pool_idx) for r in reqs]
    assert all(h > 0 for h in hints)
    assert [e.manager.due_at(row) for row in (4, 5, 1 << 40, -1, -2, -4, -5)] == [-1] * 7


def test_a_stale_reservation_gives_its_pages_back() -> None:
    e = SimEngine(page_size=2, host_slots=32, device_slots=96, rows=4)
    a, b = e.admit("a", 5), e.admit("b", 5)
    for _ in range(3):
        e.decode(a), e.decode(b)
    free = e.host_pool.free_slots
    ra, rb = e.manager.reserve_offload(a), e.manager.reserve_offload(b)
    assert e.manager.offload(a) is True  # a's lifecycle moved on through another call
    e.end(b, "abort")  # b's ended
    assert e.manager.submit_reserved([ra, rb]) == 0
    assert e.host_pool.free_slots == free - 4  # only a's own offload() holds pages
    assert [c.record.rid for c in e.manager.fx.copy_fifo] == ["a"]


def test_reserve_due_is_reserve_offload_when_the_caller_holds_no_current_lifecycle() -> None:
    """reserve_due trusts the caller's row and length only for the request's current, offloadable lifecycle on
    that row; otherwise it is reserve_offload: a row the lifecycle does not hold, an ended lifecycle (the spec's
    EventRejected), a request never admitted (admitted now)."""
    e, (a, b, c) = _three_with_a_chunk_due()
    free = e.host_pool.free_slots
    available = offloadable_tokens(a.origin_input_ids, a.output_ids, a.kv_committed_len)
    # on b's row the caller's row and length are not trusted: a's own row and length decide, as reserve_offload's
    got = e.manager.reserve_due(a, b.req_pool_idx, available + 2 * e.manager.stride)
    want = e.manager.reserve_offload(a)
    assert got is not None and want is not None
    assert (got.record, got.tokens, got.inc_len, len(got.pages)) == (want.record, want.tokens, want.inc_len, 2)
    assert e.host_pool.free_slots == free - 8  # each call took a's chunk, as reserve_offload would
    row = b.req_pool_idx
    e.end(b, "abort")
    ended = e.manager.machine_of(b).ctx
    fits = ended.prefill_len + ended.inc_len + e.manager.stride  # one stride: the host pool has room for it
    free = e.host_pool.free_slots
    for given in (0, row):  # another row, and the row its ended lifecycle held
        with pytest.raises(EventRejected):
            e.manager.reserve_due(b, given, fits)
    assert e.host_pool.free_slots == free  # nothing taken for the ended lifecycle
    new = e.admit("new", 5)
    for _ in range(3):
        e.decode(new)
    got = e.manager.reserve_due(new, new.req_pool_idx, 1 << 20)  # never seen: admitted, its chunk read from it
    assert got is not None and got.tokens == 4 and e.manager.machine_of(new) is not None


def test_reserve_due_takes_the_length_it_is_given() -> None:
    """The caller's `available` decides the chunk (whole strides past the offloaded prefix): one stride short
    of it, nothing is due and the next due point is recorded."""
    e, (a, _, _) = _three_with_a_chunk_due()
    start = e.manager.machine_of(a).ctx.prefill_len
    assert e.manager.reserve_due(a, a.req_pool_idx, start + 1) is None
    assert e.manager.due_at(a.req_pool_idx) == start + e.manager.stride
    got = e.manager.reserve_due(a, a.req_pool_idx, start + 2 * e.manager.stride)
    assert got is not None and got.tokens == 2 * e.manager.stride
    free = e.host_pool.free_slots
    with pytest.raises(TypeError):
        e.manager.reserve_due(a, a.req_pool_idx, float(start + 4 * e.manager.stride))  # type: ignore[arg-type]
    assert e.host_pool.free_slots == free  # nothing taken


def test_another_managers_reservation_is_refused() -> None:
    """Two managers whose counts of reservations would agree: each refuses the other's, nothing changed."""
    e1, (a1, _, _) = _three_with_a_chunk_due()
    e2, (a2, _, _) = _three_with_a_chunk_due()
    r1, r2 = e1.manager.reserve_offload(a1), e2.manager.reserve_offload(a2)
    assert r1 is not None and r2 is not None and r1.serial != r2.serial
    before = snapshot(e2)
    with pytest.raises(ValueError, match="another manager's"):
        e2.manager.submit_reserved([r2, r1])
    assert snapshot(e2) == before
    assert e2.manager.submit_reserved([r2]) == 1 and e1.manager.submit_reserved([r1]) == 1


def test_a_lifecycle_reserved_twice_before_its_submit_is_copied_once_and_its_second_pages_go_back() -> None:
    """A caller that reserves a request's chunk twice before submitting (against the contract) gets two
    reservations of the same tokens; the batch copies them once, as one `offload` would, and the second
    reservation's host pages go back."""
    e, (a, b, _) = _three_with_a_chunk_due()
    free = e.host_pool.free_slots
    first, second, other = (e.manager.reserve_offload(a), e.manager.reserve_offload(a), e.manager.reserve_offload(b))
    assert first is not None and second is not None and other is not None
    assert (second.tokens, second.inc_len) == (first.tokens, first.inc_len) and second.pages != first.pages
    assert e.manager.submit_reserved([first, second, other]) == 2
    chunks = [(c.record.rid, c.start, c.end, tuple(c.host_pages)) for c in e.manager.fx.copy_fifo]
    start = e.manager.machine_of(a).ctx.prefill_len
    assert chunks == [
        (a.rid, start, start + first.tokens, tuple(first.pages)),
        (b.rid, *chunks[1][1:3], tuple(other.pages)),
    ]
    assert e.manager.machine_of(a).copies == 1
    assert e.host_pool.free_slots == free - (len(first.pages) + len(other.pages)) * e.page_size
    e.settle()
    for req in list(e.live):
        e.end(req)
    e.settle()
    e.check_teardown()  # the second reservation's page was not kept, nor freed twice


def test_a_batch_whose_copy_is_refused_changes_nothing_and_stays_due() -> None:
    e, reqs = _three_with_a_chunk_due()
    before = snapshot(e)
    got = [e.manager.reserve_offload(r) for r in reqs]
    submit = e.manager.fx.copy_engine.submit_d2h

    def refuse(*args: Any) -> Any:
        raise RuntimeError("copy engine refused the batch")

    e.manager.fx.copy_engine.submit_d2h = refuse
    with pytest.raises(RuntimeError, match="refused the batch"):
        e.manager.submit_reserved(got)
    assert snapshot(e) == before
    e.manager.fx.copy_engine.submit_d2h = submit
    with pytest.raises(ValueError, match="submitted already"):  # its pages went back: a retry must reserve again
        e.manager.submit_reserved(got)
    assert snapshot(e) == before
    again = [e.manager.reserve_offload(r) for r in reqs]
    assert e.manager.submit_reserved(again) == 3


def test_a_reservation_is_submitted_once() -> None:
    """Once submitted, a reservation's pages are its chunk's: submitting it again, or twice in one batch, is
    refused before anything changes (giving its pages back would free a chunk's host pages under its copy)."""
    e, (a, b, c) = _three_with_a_chunk_due()
    ra, rb = e.manager.reserve_offload(a), e.manager.reserve_offload(b)
    assert ra is not None and rb is not None
    before = snapshot(e)
    with pytest.raises(ValueError, match=f"reservation {rb.serial} of .* submitted already"):
        e.manager.submit_reserved([ra, rb, rb])
    assert snapshot(e) == before
    assert e.manager.submit_reserved([ra, rb]) == 2
    free, fifo = e.host_pool.free_slots, len(e.manager.fx.copy_fifo)
    rc = e.manager.reserve_offload(c)
    assert rc is not None
    with pytest.raises(ValueError, match=f"reservation {ra.serial} of .* submitted already"):
        e.manager.submit_reserved([rc, ra])
    assert e.host_pool.free_slots == free - len(rc.pages) * e.page_size  # ra's pages still its chunk's
    assert len(e.manager.fx.copy_fifo) == fifo and e.manager.submit_reserved([rc]) == 1
    e.settle()
    for req in list(e.live):
        e.end(req)
    e.settle()
    e.check_teardown()


def test_chunks_of_one_call_share_one_copy_and_land_bit_exact() -> None:
    e = SimEngine(page_size=2, host_slots=32, device_slots=96, rows=4)
    reqs = [e.admit(f"r{i}", 5) for i in range(4)]
    for _ in range(3):
        for r in reqs:
            e.decode(r)
    assert e.manager.offload_batch(*batch_arrays(e)) == 4
    chunks = list(e.manager.fx.copy_fifo)
    assert len({id(c.handle) for c in chunks}) == 1 and len(e.copies.pending) == 1
    e.copies.complete_all()
    assert all(e.host_page_ok(c) for c in chunks)
    e.manager.check_progress()
    assert [spec_gen.STATES[e.manager.machine_of(r).state] for r in reqs] == ["inflight"] * 4


def test_arrays_only_choose_which_requests_are_examined() -> None:
    e = SimEngine(page_size=2, host_slots=32, device_slots=96, rows=4)
    a, b = e.admit("a", 4), e.admit("b", 4)
    for _ in range(4):
        e.decode(a), e.decode(b)
    reqs, rows, committed = batch_arrays(e)
    assert e.manager.offload_batch(reqs, rows, committed) == 2  # first sight: examined, admitted, offloaded
    for _ in range(4):
        e.decode(a), e.decode(b)
    reqs, rows, committed = batch_arrays(e)
    # Stale (too small) lengths: nobody is examined, nothing is offloaded yet (never too much).
    assert e.manager.offload_batch(reqs, rows, committed * 0) == 0
    # Inflated lengths: both are examined, but each chunk ends at what the request itself has committed.
    assert e.manager.offload_batch(reqs, rows, committed + 100) == 2
    for c in e.manager.fx.copy_fifo:
        assert c.end <= c.record.req_ref().kv_committed_len
    # Without arrays every request is examined (the loop's behaviour).
    for _ in range(2):
        e.decode(a), e.decode(b)
    assert e.manager.offload_batch(reqs) == 2


def test_host_full_applies_in_call_order() -> None:
    e = SimEngine(page_size=2, host_slots=4, device_slots=96, rows=4)
    assert e.host_pool.capacity == 4  # room for two of the three 2-token chunks
    reqs = [e.admit(f"r{i}", 2) for i in range(3)]
    for _ in range(3):
        for r in reqs:
            e.decode(r)
    assert e.manager.offload_batch(*batch_arrays(e)) == 2  # 2 of the 3 chunks fit
    assert e.manager.metrics.host_full_retries == 1
    assert [spec_gen.STATES[e.manager.machine_of(r).state] for r in reqs] == ["offloading", "offloading", "allocated"]


def test_unadmitted_and_released_rows_are_skipped() -> None:
    e = SimEngine(page_size=2, host_slots=32, device_slots=96, rows=4)
    r = e.admit("a", 4)
    for _ in range(3):
        e.decode(r)
    ghost = SimRequest("ghost", [1, 2, 3])
    ghost.output_ids = [5]
    ghost.req_pool_idx = None
    rows = np.array([r.req_pool_idx, -1])
    assert e.manager.offload_batch([r, ghost], rows, np.array([r.kv_committed_len, 0])) == 1


@pytest.mark.parametrize("bad", ["length", "row_range", "float", "cuda_like", "finished", "duplicate"])
def test_rejected_batch_changes_nothing(bad: str) -> None:
    e = SimEngine(page_size=2, host_slots=32, device_slots=96, rows=4)
    reqs = [e.admit(f"r{i}", 4) for i in range(3)]
    for _ in range(4):
        for r in reqs:
            e.decode(r)
    e.manager.offload(reqs[2])
    e.end(reqs[2], "finish")  # copy in flight: release deferred, machine 'finished'
    live, rows, committed = batch_arrays(e)
    before = snapshot(e)
    if bad == "length":
        with pytest.raises(ValueError, match="kv_committed_lens"):
            e.manager.offload_batch(live, rows, committed[:1])
    elif bad == "row_range":
        with pytest.raises(ValueError, match="req_pool_indices"):
            e.manager.offload_batch(live, rows + 100, committed)
    elif bad == "float":
        with pytest.raises(ValueError, match="integers"):
            e.manager.offload_batch(live, rows.astype(float), committed)
    elif bad == "cuda_like":
        with pytest.raises(ValueError, match="integers"):
            e.manager.offload_batch(live, rows.reshape(1, -1), committed)
    elif bad == "finished":
        finished = reqs[2]
        rows2 = np.append(rows, e.manager.machine_of(finished).ctx.row)
        with pytest.raises(EventRejected):
            e.manager.offload_batch(live + [finished], rows2, np.append(committed, finished.kv_committed_len))
    else:
        with pytest.raises(ValueError, match="twice"):
            e.manager.offload_batch(live + live[:1], np.append(rows, rows[:1]), np.append(committed, committed[:1]))
    assert snapshot(e) == before


def test_cpu_tensors_accepted_device_tensors_refused() -> None:
    e = SimEngine(page_size=2, host_slots=32, device_slots=96, rows=4)
    r = e.admit("a", 4)
    for _ in range(3):
        e.decode(r)
    rows = torch.tensor([r.req_pool_idx])
    assert e.manager.offload_batch([r], rows, torch.tensor([r.kv_committed_len])) == 1
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CPU"):
            e.manager.offload_batch([r], rows.cuda(), torch.tensor([r.kv_committed_len]))


def test_failed_submission_frees_the_host_slots_and_fires_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfsm.dataplane import CopyError

    e = SimEngine(page_size=2, host_slots=8, device_slots=96, rows=4)
    reqs = [e.admit(f"r{i}", 4) for i in range(3)]
    assert e.manager.offload_batch(*batch_arrays(e)) == 0  # first sight: admitted, nothing due yet
    for _ in range(6):
        for r in reqs:
            e.decode(r)
    before = snapshot(e)

    def broken(*args: Any) -> None:
        raise CopyError("the copy engine refused the batch")

    monkeypatch.setattr(e.copies, "submit_d2h", broken)
    with pytest.raises(CopyError):
        e.manager.offload_batch(*batch_arrays(e))  # 4+4+4 tokens > 8 host slots: the fallback path too
    assert snapshot(e) == before


@pytest.mark.parametrize("batched", [False, True])
def test_a_table_row_not_in_page_order_is_copied_token_by_token(batched: bool) -> None:
    """Chunk pages are read as whole device pages only when each starts a page; a row whose slots are in
    another order (here the two slots of its first page swapped) is gathered token by token, and the
    host pages still hold each position's KV."""
    e = SimEngine(page_size=2, host_slots=32, device_slots=96, rows=4)
    r = e.admit("a", 1)
    table = e.req_to_token.req_to_token
    table[r.req_pool_idx, :2] = table[r.req_pool_idx, :2].flip(0).clone()
    e._write_kv(r, 0, 1)  # position 0's KV, now at the slot the row names
    for _ in range(2):
        e.decode(r)
    submitted = e.manager.offload_batch(*batch_arrays(e)) if batched else int(e.manager.offload(r))
    assert submitted == 1
    chunk = e.manager.fx.copy_fifo[0]
    assert chunk.device_indices.tolist() == table[r.req_pool_idx, :2].tolist()
    e.copies.complete_all()
    assert e.host_page_ok(chunk)
    e.end(r)
    while not e.manager.idle():
        e.copies.complete_all()
        e.worker.run_all()
        e.manager.check_progress()
    e.check_teardown()  # release found the row's pages from its (swapped) page starts


def test_finalize_batch_checks_every_request_before_it_ends_any() -> None:
    """A request lacking a protocol field is refused with RequestFieldMissing naming it and the field, and the
    batch ends no lifecycle, not even those before it."""
    e, (a, b, c) = _three_with_a_chunk_due()
    del b.kv_allocated_len
    with pytest.raises(RequestFieldMissing) as info:
        e.manager.finalize_batch([a, b, c])
    assert info.value.field == "kv_allocated_len" and info.value.request == describe(b)
    assert isinstance(info.value.__cause__, AttributeError)  # from the read that failed
    assert [spec_gen.STATES[e.manager.machine_of(r).state] for r in (a, b, c)] == ["allocated"] * 3


def test_finalize_batch_leaves_each_ended_row_with_no_due_point() -> None:
    e, reqs = _three_with_a_chunk_due()
    rows = [r.req_pool_idx for r in reqs]
    assert all(e.manager.due_at(row) >= 0 for row in rows)
    for r in reqs:
        r.done = True
        e.live.remove(r)
    e.manager.finalize_batch(reqs)
    assert [e.manager.due_at(row) for row in rows] == [-1, -1, -1]
    assert e.manager.metrics.releases == 3


def test_finalize_batch_of_a_request_admitted_again_ends_its_new_lifecycle() -> None:
    """A request object whose lifecycle ended and which the engine admitted again (a retraction) is its new
    lifecycle's in a batch too: the batch then goes request by request, as finalize does, and frees both."""
    e = SimEngine(page_size=2, stride=2, device_slots=64, host_slots=32, rows=2, checked=False)
    r, other = e.admit("a", 4), e.admit("b", 4)
    for _ in range(3):
        e.decode(r)
        e.decode(other)
        e.manager.offload_batch([r, other])  # both live in the manager: only r's readmission takes the loop
    e.end(r, "retract")
    e.settle()  # its copies land: the retracted lifecycle gives its row back
    first = e.manager.machine_of(r)
    assert e.admit("a", 0, req=r) is r
    e.decode(r)
    for q in (r, other):
        q.done = True
        e.live.remove(q)
    e.manager.finalize_batch([other, r])
    assert e.manager.machine_of(r) is not first
    assert spec_gen.STATES[e.manager.machine_of(r).state] == "released"
    assert e.manager.metrics.releases == 3  # the retracted lifecycle, then both finished ones
    e.settle()
    e.check_teardown()
