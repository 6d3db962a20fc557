"""Tests written to kill survivors of `make mutate` in the runtime manager, effects and ledger (docs/mutation.md)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvfsm.dataplane import SlotFence
from kvfsm.errors import InvalidRequest, RequestFieldInvalid
from kvfsm.integrations.sglang.objects import AllocatorView
from kvfsm.runtime import DecodeOffloadManager
from kvfsm.runtime.ledger import SlotLedger
from kvfsm.verify.engine import SimEngine, SimRequest


def _due(e: SimEngine, rid: str, prompt: int = 5, steps: int = 4) -> SimRequest:
    """A request the manager has seen (admitted, nothing due yet), then decoded `steps` tokens."""
    req = e.admit(rid, prompt)
    assert req is not None
    assert not e.manager.offload(req)
    for _ in range(steps):
        assert e.decode(req)
    return req


# --- reserve_offload / submit_reserved: the two-phase path ------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 2])
def test_a_submit_whose_reservations_all_went_stale_submits_no_copy(page_size: int) -> None:
    """Reservations whose lifecycles moved on give their pages back and start no copy: the copy engine sees
    no empty submission and the call answers 0, on every page size."""
    e = SimEngine(page_size=page_size, host_slots=32, device_slots=96, rows=4)
    a, b = _due(e, "a"), _due(e, "b")
    ra, rb = e.manager.reserve_offload(a), e.manager.reserve_offload(b)
    assert ra is not None and rb is not None
    e.end(a, "abort")
    e.end(b, "abort")
    pending, free = len(e.copies.pending), e.host_pool.free_slots
    assert e.manager.submit_reserved([ra, rb]) == 0
    assert len(e.copies.pending) == pending and not e.manager.fx.copy_fifo
    assert e.host_pool.free_slots == free + ra.tokens + rb.tokens
    e.settle()
    e.check_teardown()


@pytest.mark.parametrize("stride", [2, 4])
def test_due_at_names_the_committed_length_of_the_next_whole_stride(stride: int) -> None:
    """due_at(row) is the committed length at which the next chunk is due, before and after a chunk, also when
    the engine's committed length runs ahead of its sampled tokens (nothing is offloaded past the last one)."""
    e = SimEngine(page_size=2, stride=stride, host_slots=32, device_slots=96, rows=4)
    req = e.admit("a", 5)  # prefill 4 (whole pages), committed 5: nothing due yet
    assert req is not None
    assert e.manager.reserve_offload(req) is None
    row = req.req_pool_idx
    assert e.manager.due_at(row) == 4 + stride
    while not e.manager.offload(req):
        assert e.decode(req)
    assert e.manager.due_at(row) == 4 + 2 * stride
    for _ in range(stride - 1):
        assert e.decode(req)
    # The engine reports the KV of every sampled token committed: only up to the last sampled token has KV
    # that may be copied, one short of the next stride, so nothing is due yet and the hint stays.
    req.kv_committed_len = len(req.origin_input_ids) + len(req.output_ids)
    assert req.kv_committed_len >= e.manager.due_at(row)
    assert e.manager.reserve_offload(req) is None
    assert e.manager.due_at(row) == 4 + 2 * stride
    req.kv_committed_len -= 1
    assert e.decode(req)
    assert e.manager.offload(req)
    assert e.manager.due_at(row) == 4 + 3 * stride


@pytest.mark.parametrize("committed", [-2, 0, 9])
def test_a_request_naming_a_row_past_the_table_is_refused_whatever_its_lengths(committed: int) -> None:
    """A request whose row field names no row of the table is refused as such (InvalidRequest, nothing taken),
    whatever lengths it reports: the row past the last one reads no hint."""
    e = SimEngine(page_size=2, host_slots=32, device_slots=96, rows=4)
    req = SimRequest("ghost", [1, 2, 3, 4, 5])
    req.output_ids = [7]
    req.req_pool_idx, req.kv_committed_len, req.kv_allocated_len = e.rows, committed, 6
    free = e.host_pool.free_slots
    for call in (e.manager.reserve_offload, e.manager.offload):
        with pytest.raises(InvalidRequest, match="not an allocated row"):
            call(req)
    assert e.host_pool.free_slots == free and e.manager.machine_of(req) is None


@pytest.mark.parametrize("path", ["offload", "reserve_offload", "offload_batch"])
def test_a_live_request_whose_length_turns_into_a_float_is_reported_from_its_type_error(path: str) -> None:
    """A length that stops being an integer mid-lifecycle is RequestFieldInvalid raised from the TypeError that
    found it (the traceback shows where), with nothing taken."""
    e = SimEngine(page_size=2, host_slots=32, device_slots=96, rows=4)
    req = _due(e, "a")
    req.kv_committed_len = float(req.kv_committed_len)
    free = e.host_pool.free_slots
    call: Any = {
        "offload": e.manager.offload,
        "reserve_offload": e.manager.reserve_offload,
        "offload_batch": lambda r: e.manager.offload_batch([r]),
    }[path]
    with pytest.raises(RequestFieldInvalid) as err:
        call(req)
    assert isinstance(err.value.__cause__, TypeError)
    assert e.host_pool.free_slots == free and not e.manager.fx.copy_fifo


# --- _copy_slots: an engine allocator that only frees (SGLang's, through AllocatorView) ---------------------


class _SegmentAllocator:
    """What AllocatorView calls of SGLang's paged allocator, over a kvfsm allocator (CPU)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.page_size, self.device = inner, inner.page_size, torch.device("cpu")

    def free_segment(self, slots: torch.Tensor, start_pos: int = 0) -> None:
        self.inner.free(slots)


@pytest.mark.parametrize("batched", [False, True])
def test_chunks_over_an_allocator_view_land_bit_exact(batched: bool) -> None:
    """With SGLang's allocator (AllocatorView: page size, slot count and frees only) and a request table on
    the CPU, whole-page chunks are copied page by page and the host pages hold exactly the device KV."""
    e = SimEngine(page_size=2, host_slots=32, device_slots=96, rows=4)
    e.manager.close()
    e.manager = DecodeOffloadManager(
        e.config,
        device_pool=e.device_pool,
        allocator=AllocatorView(_SegmentAllocator(e.allocator), e.device_slots),
        req_to_token=e.req_to_token,
        prefix_cache=e.protected,
        host_pool=e.host_pool,
        copy_engine=e.copies,
        storage=e.storage,
        backup_worker=e.worker,
    )
    reqs = [_due(e, f"r{i}") for i in range(2)]
    got = e.manager.offload_batch(reqs) if batched else sum(e.manager.offload(r) for r in reqs)
    assert got == 2
    chunks = list(e.manager.fx.copy_fifo)
    e.copies.complete_all()
    assert [c.record.rid for c in chunks] == ["r0", "r1"] and all(e.host_page_ok(c) for c in chunks)
    for r in reqs:
        e.end(r)
    e.settle()
    e.check_teardown()


# --- OffloadEffects.request_slots --------------------------------------------------------------------------


def test_a_live_requests_own_slots_are_its_pages_from_its_prefix_to_its_allocated_length() -> None:
    """request_slots of a live request (not yet ended) reads its current lengths: every slot of its pages past
    the matched prefix, up to what it has allocated, each once (what a release would free)."""
    e = SimEngine(page_size=2, host_slots=32, device_slots=96, rows=4)
    req = e.admit("a", 6, prefix_len=2)
    assert req is not None
    assert e.decode(req, speculative=2)
    e.manager.offload(req)  # the manager sees it (admitted)
    machine = e.manager.machine_of(req)
    assert machine is not None
    rec = machine.ctx
    assert rec.end_lengths is None
    want = e.req_to_token.read_host(req.req_pool_idx, 2, -(-req.kv_allocated_len // 2) * 2).tolist()
    assert e.manager.fx.request_slots(rec).tolist() == want and len(want) == 8


# --- the ledger: a page the engine freed after its stream waited ---------------------------------------------


class _Copy:
    """A copy handle that has not landed (a GPU copy whose event the host has not seen)."""

    def done(self) -> bool:
        return False

    def wait_stream(self, stream: object | None = None) -> None:
        pass


def test_a_page_the_engine_freed_after_waiting_is_rewritten_through_many_reuses_without_another_wait() -> None:
    """Pages the engine released itself after its stream waited on their copies (released_by_engine_fenced) are
    written only on that ordered stream: however often they are reused and released while the copy still runs,
    checked mode accepts every later write without a new wait."""
    ledger = SlotLedger(page_size=2)
    copy = _Copy()
    ledger.copy_started("a#1", 1, [0, 1], [0, 1], copy)
    fence = SlotFence([copy])
    fence.mark_waited()  # fence_copies_in_flight made the engine's stream wait
    ledger.release_device("a#1", "released_by_engine_fenced", [0, 1], fence)
    for writer in ("b#2", "c#3", "d#4", "e#5"):
        ledger.claim_device(writer, "alloc", [0, 1])
        ledger.device_write(writer, [0, 1])
        ledger.release_device(writer, "release", [0, 1])
    assert fence.waits == 1 and not fence.passed()
    assert ledger.device_fence[0] == ((fence, 0),)
