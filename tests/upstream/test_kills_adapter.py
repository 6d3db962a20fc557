"""Tests written to kill survivors of the `fences-adapter` mutation scope in the SGLang adapter's manager
(docs/mutation.md), over SGLang 0.5.23's own objects (the adapter's code that needs no SGLang is covered in
tests/mutation/test_kills_fences_adapter.py)."""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import harness
from scenarios import ReqSpec, Scenario
from test_adapter_config import build, published
from test_differential import ProbedAdapter

from kvfsm.dataplane.storage.file import storage_key_suffix
from kvfsm.integrations.sglang import DecodeKVCacheOffloadManager

SC = Scenario(
    name="kills",
    page_size=4,
    stride=8,
    requests=tuple(ReqSpec(f"r{i}", tuple(range(100 * i + 1, 100 * i + 11)), decode=20) for i in range(2)),
)


def _started(cls: type, store: str) -> Any:
    run = harness._Run(SC, cls, 0, harness._tp_group_world1(), store)
    for spec in SC.requests:
        run.admit(spec)
    return run


@contextlib.contextmanager
def _first_request_decoded(tokens: int) -> Iterator[tuple[Any, ReqSpec, Any]]:
    """A started run whose first request has decoded `tokens` tokens, with no manager call yet."""
    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = _started(ProbedAdapter, store)
        spec = SC.requests[0]
        req = run.reqs[spec.rid]
        for _ in range(tokens):
            run.decode(spec)
        yield run, spec, req


def _kvfsm_functions_entered(call: Callable[[], Any]) -> tuple[Any, list[str]]:
    """`call()`'s result, and the name of every Python function of kvfsm's package it entered, in order
    (frames of other packages, SGLang's, torch's or a tool's wrapper around kvfsm's functions, are left out)."""
    entered: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and "/kvfsm/" in frame.f_code.co_filename.replace("\\", "/"):
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        out = call()
    finally:
        sys.setprofile(None)
    return out, entered


def test_a_quiet_request_is_answered_by_the_offload_call_alone() -> None:
    """A request with no chunk due, already seen on its row, is answered inside offload_kv_cache: no other
    kvfsm function runs (the lifecycle lookup, the manager, the views), however the call is wrapped."""
    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = _started(ProbedAdapter, store)
        spec = SC.requests[0]
        req = run.reqs[spec.rid]
        run.decode(spec)
        assert run.mgr.offload_kv_cache(req) is False  # first sight: the full path notes it quiet
        run.decode(spec)
        answer, entered = _kvfsm_functions_entered(lambda: run.mgr.offload_kv_cache(req))
        assert answer is False and entered and all("offload_kv_cache" in name for name in entered), entered
        for _ in range(6):
            run.decode(spec)
        assert run.mgr.offload_kv_cache(req) is True  # a chunk due: reserved, submitted at the progress check
        run.mgr.check_offload_progress()  # which notes the request quiet again
        run.decode(spec)
        answer, entered = _kvfsm_functions_entered(lambda: run.mgr.offload_kv_cache(req))
        assert answer is False and all("offload_kv_cache" in name for name in entered), entered
        for s in SC.requests:
            run.mgr.finalize_release_on_finish(run.reqs[s.rid])
        run.probe.close(run.mgr)


def test_a_second_call_before_the_batch_was_submitted_takes_the_next_chunk() -> None:
    """A request called again before its pending chunk was submitted (the next stride already due): the call
    submits the pending batch first, then takes the next chunk (never the pending one again). The copies in flight read as upstream's
    ongoing_offload: serial -> tokens."""
    with _first_request_decoded(9) as (run, spec, req):
        assert run.mgr.offload_kv_cache(req) is True
        assert len(run.mgr.ongoing_offload) == 1 and not run.mgr.manager.fx.copy_fifo  # pending, not submitted
        for _ in range(8):
            run.decode(spec)
        assert run.mgr.offload_kv_cache(req) is True
        fifo = run.mgr.manager.fx.copy_fifo
        assert [(c.start, c.end) for c in fifo] == [(8, 16)] and len(run.mgr.ongoing_offload) == 2
        serials = list(run.mgr.ongoing_offload)  # submits the second chunk first
        assert [(c.start, c.end) for c in fifo] == [(8, 16), (16, 24)] and serials == [c.serial for c in fifo]
        assert [run.mgr.ongoing_offload[s] for s in serials] == [8, 8]
        with pytest.raises(KeyError):
            run.mgr.ongoing_offload[max(serials) + 1]
        run.mgr.check_offload_progress()
        run.settle()
        assert run.mgr.manager.metrics.chunks == 2
        for s in SC.requests:
            run.mgr.finalize_release_on_finish(run.reqs[s.rid])
        run.probe.close(run.mgr)


def test_finishing_a_request_whose_chunk_is_pending_submits_it_first() -> None:
    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = _started(ProbedAdapter, store)
        spec = SC.requests[0]
        req = run.reqs[spec.rid]
        for _ in range(9):
            run.decode(spec)
        assert run.mgr.offload_kv_cache(req) is True
        run.finish(spec)
        run.mgr.finalize_release_on_finish(req)  # its chunk goes first, then the finish waits for its ack
        assert [(c.start, c.end) for c in run.mgr.manager.fx.copy_fifo] == [(8, 16)]
        run.mgr.check_offload_progress()
        run.settle()
        run.mgr.check_offload_progress()
        assert run.mgr.manager.metrics.chunks == 1 and req.kv.req_pool_idx is None
        run.mgr.finalize_release_on_finish(run.reqs[SC.requests[1].rid])
        run.probe.close(run.mgr)


def test_shutdown_runs_once() -> None:
    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = _started(ProbedAdapter, store)
        drains: list[int] = []
        drain = run.mgr.manager.drain
        run.mgr.manager.drain = lambda *a, **k: drains.append(1) or drain(*a, **k)
        run.mgr.release_host_resources()
        run.mgr.release_host_resources()
        assert drains == [1]


def test_the_adapter_keeps_upstreams_attributes_and_is_unchecked_by_default() -> None:
    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = _started(DecodeKVCacheOffloadManager, store)
        mgr = run.mgr
        assert mgr.manager.config.checked is False and mgr.manager.ledger is None
        assert mgr.req_to_token_pool is run.r2t and mgr.token_to_kv_pool_allocator is run.allocator
        assert mgr.tree_cache is run.tree and mgr.kv_cache is run.kv and mgr.tp_group is not None
        assert (mgr.page_size, mgr.offload_stride, mgr.tp_world_size) == (4, 8, 1)
        mgr.manager.close()


class _Deferred(ProbedAdapter):
    """The adapter over the CPU twin of a copy still in flight at the drain (a GPU server meets those at once)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from kvfsm.dataplane import DeferredCpuCopyEngine

        self.deferred = DeferredCpuCopyEngine()
        self.manager.fx.copy_engine = self.deferred


def _drain_with_a_copy_in_flight(retraction: str) -> Any:
    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = harness._Run(
            SC,
            type(
                "A",
                (_Deferred,),
                {"__init__": lambda self, **kw: _Deferred.__init__(self, **kw, retraction=retraction)},
            ),
            0,
            harness._tp_group_world1(),
            store,
        )
        for spec in SC.requests:
            run.admit(spec)
        spec = SC.requests[0]
        for _ in range(9):
            run.decode(spec)
        assert run.mgr.offload_kv_cache(run.reqs[spec.rid]) is True
        run.mgr.check_offload_progress()  # submitted; the deferred copy stays in flight
        try:
            run.mgr.drain_before_retraction()
            return None
        except Exception as exc:  # noqa: BLE001 (the refusal is the result)
            return exc
        finally:
            run.mgr.deferred.complete_all()
            run.mgr.check_offload_progress()
            for s in SC.requests:
                run.mgr.finalize_release_on_finish(run.reqs[s.rid])
            run.probe.close(run.mgr)


def test_the_default_retraction_refuses_a_drain_that_meets_a_copy_and_fenced_never_does() -> None:
    from kvfsm.integrations.sglang import RetractionRefusedError

    assert isinstance(_drain_with_a_copy_in_flight("refuse"), RetractionRefusedError)
    assert _drain_with_a_copy_in_flight("fenced") is None


def test_the_adapter_configures_kvfsm_as_the_server_published(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the adapter hands kvfsm's manager: the retraction policy, and its own host pool (unpinned on a CPU,
    in the published layout), FileStorage (the rank, sizes and dtype of the KV pool) and KV pool view."""
    sc = Scenario(
        name="config-mla", page_size=4, stride=8, pool="mla", requests=(ReqSpec("a", tuple(range(1, 9)), decode=4),)
    )
    with tempfile.TemporaryDirectory() as store, harness.published(sc, 0, store):
        for retraction, policy, fenced in (("refuse", "fail_closed", False), ("fenced", "deferred", True)):
            run = harness._Run(
                sc,
                type(
                    "A",
                    (ProbedAdapter,),
                    {"__init__": lambda self, r=retraction, **kw: ProbedAdapter.__init__(self, **kw, retraction=r)},
                ),
                0,
                harness._tp_group_world1(),
                store,
            )
            cfg = run.mgr.manager.config
            assert (cfg.retraction, cfg.fenced_release, run.mgr.retraction) == (policy, fenced, retraction)
            host = run.mgr.decode_host_mem_pool
            assert host is run.mgr.manager.host_pool and host.pinned is False and host.layout == "layer_first"
            fs = run.mgr.manager.fx.storage
            assert (fs.suffix, fs.dtype, fs.layout) == (
                storage_key_suffix(harness.MODEL, 0, 1, True),
                "float32",
                "layer_first",
            )
            dev = run.mgr.manager.fx.device_pool
            assert dev.kv_pool is run.kv and dev.config.is_mla
            assert run.mgr.settings.page_size == 4
            run.mgr.manager.close()


def test_an_unnamed_served_model_still_configures() -> None:
    with tempfile.TemporaryDirectory() as store, published(SC, store, served_model_name=""):
        mgr = build(DecodeKVCacheOffloadManager, SC)
        assert mgr.settings.model_name == "" and mgr.manager.config.model_name == "model"
        mgr.manager.close()


def test_a_tp_group_of_two_reaches_kvfsms_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two TP ranks, as rank 1 sees them, whose peer always agrees (a reduction over the group returns this
    rank's values): the sizes are checked over the group, the manager reduces its progress over it."""
    import torch
    from sglang.srt.runtime_context import get_parallel

    group = harness._tp_group_world1()
    reductions: list[Any] = []
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None, group=None: reductions.append(group))
    with tempfile.TemporaryDirectory() as store, published(SC, store, tp_size=2):
        get_parallel().override_permanently(tp_rank=1)
        try:
            mgr = build(ProbedAdapter, SC)
            assert (mgr.tp_group, mgr.tp_world_size) == (group, 2)
            assert reductions and all(g is group for g in reductions)  # the sizes, over the group
            assert mgr.manager.consensus.world == 2 and mgr.manager.consensus.group is group
            assert mgr.manager.fx.storage.suffix == storage_key_suffix(harness.MODEL, 1, 2, False)
            assert (mgr.settings.tp_rank, mgr.settings.tp_size) == (1, 2)
            mgr.manager.close()
        finally:
            get_parallel().override_permanently(tp_rank=0)


def test_a_row_the_engine_reused_without_a_drain_waits_for_the_old_lifecycle_then_goes_to_the_new_request() -> None:
    """SGLang frees request a itself while a's copy is in flight (it skipped the drain) and admits c on a's row.
    kvfsm cannot end a's lifecycle before the copy lands, so c is not pinned on the row and nothing of it is
    offloaded; once the copy is acknowledged, c's next call ends a's lifecycle (released_by_engine: nothing freed
    again), pins c on the row, and c runs to its release."""
    from test_adapter_retraction import _engine_release

    sc = Scenario(
        name="row-reuse-without-drain",
        page_size=4,
        stride=8,
        requests=(
            ReqSpec("a", tuple(range(1, 9)), decode=12),
            ReqSpec("b", tuple(range(100, 110)), decode=12),
            ReqSpec("c", tuple(range(300, 306)), decode=12, start=1),
        ),
    )
    with tempfile.TemporaryDirectory() as store, harness.published(sc, 0, store):
        run = harness._Run(sc, _Deferred, 0, harness._tp_group_world1(), store)
        a_spec, b_spec, c_spec = sc.requests
        run.admit(a_spec)
        run.admit(b_spec)
        a = run.reqs["a"]
        for _ in range(9):
            run.decode(a_spec)
        assert run.mgr.offload_kv_cache(a) is True
        run.mgr.check_offload_progress()  # submitted: in flight on the deferred engine
        row = a.kv.req_pool_idx
        a_view = run.mgr._views.view(a)
        _engine_release(run, a)
        run.admit(c_spec)
        c = run.reqs["c"]
        assert c.kv.req_pool_idx == row
        for _ in range(10):
            run.decode(c_spec)  # a chunk due: the call admits c to kvfsm
        assert run.mgr.offload_kv_cache(c) is False  # the row is still a's lifecycle's: nothing of c's is due
        assert a not in run.mgr._views.quiet  # a's early exit went with its row
        assert run.mgr._views.holder(row) is a and run.mgr.manager.machine_of(a_view) is not None
        run.mgr.deferred.complete_all()
        run.mgr.check_offload_progress()
        run.settle()
        assert run.mgr.offload_kv_cache(c) is True
        assert run.mgr._views.holder(row) is c
        assert run.mgr.manager.metrics.engine_releases == 1
        from kvfsm.errors import EventRejected

        with pytest.raises(EventRejected, match="'offload' rejected in state 'draining'"):
            run.mgr.offload_kv_cache(a)  # a Req SGLang released (no row left): the spec refuses its offload
        for spec in (b_spec, c_spec):
            run.finish(spec)
            run.mgr.finalize_release_on_finish(run.reqs[spec.rid])
        run.mgr.deferred.complete_all()
        run.mgr.check_offload_progress()
        run.settle()
        run.mgr.check_offload_progress()
        assert row in run.r2t.free_slots and run.mgr._views.pinned() == []
        run.probe.close(run.mgr)


def test_the_host_pool_takes_the_published_memory_layout() -> None:
    with tempfile.TemporaryDirectory() as store, published(SC, store, hicache_mem_layout="page_first"):
        mgr = build(DecodeKVCacheOffloadManager, SC)
        assert mgr.decode_host_mem_pool.layout == "page_first" and mgr.manager.fx.storage.layout == "page_first"
        mgr.manager.close()


def test_after_a_drain_the_requests_sglang_released_are_ended_and_let_go() -> None:
    """SGLang releases a request itself after the drain; the next call ends its lifecycle (released_by_engine)
    and drops kvfsm's pin on its row, so nothing keeps the Req alive."""
    import gc
    import weakref

    from test_adapter_retraction import _engine_release

    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = _started(ProbedAdapter, store)
        a_spec, b_spec = SC.requests
        for spec in SC.requests:
            run.decode(spec)
            run.mgr.offload_kv_cache(run.reqs[spec.rid])
        run.mgr.drain_before_retraction()
        a = run.reqs.pop(a_spec.rid)
        row = a.kv.req_pool_idx
        _engine_release(run, a)
        gone = weakref.ref(a)
        del a
        run.mgr.check_offload_progress()  # the sweep
        assert run.mgr.manager.metrics.engine_releases == 1 and run.mgr._views.holder(row) is None
        gc.collect()
        assert gone() is None
        run.finish(b_spec)
        run.mgr.finalize_release_on_finish(run.reqs[b_spec.rid])
        run.probe.close(run.mgr)


def test_a_request_that_finished_with_its_chunk_is_not_noted_quiet() -> None:
    """Its last chunk is submitted with the batch and it is released at the ack: no early exit is kept for it."""
    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = _started(ProbedAdapter, store)
        a_spec, b_spec = SC.requests
        a, b = run.reqs[a_spec.rid], run.reqs[b_spec.rid]
        for _ in range(9):
            run.decode(a_spec)
            run.decode(b_spec)
        run.finish(a_spec)
        assert run.mgr.offload_kv_cache(a) is True and run.mgr.offload_kv_cache(b) is True
        run.mgr.check_offload_progress()
        assert a not in run.mgr._views.quiet and b in run.mgr._views.quiet
        run.settle()
        run.mgr.check_offload_progress()
        assert a.kv.req_pool_idx is None  # released at the ack
        run.mgr.finalize_release_on_finish(b)
        run.probe.close(run.mgr)


def test_a_request_on_row_one_is_released_like_any_other() -> None:
    """Row 0 is SGLang's padding row; row 1 is a request's like every row after it."""
    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = harness._Run(SC, ProbedAdapter, 0, harness._tp_group_world1(), store)
        others = run.r2t.alloc_rows(len(run.r2t.free_slots) - 1)  # every row but row 1 taken
        spec = SC.requests[0]
        run.admit(spec)
        req = run.reqs[spec.rid]
        assert req.kv.req_pool_idx == 1
        for _ in range(9):
            run.decode(spec)
        assert run.mgr.offload_kv_cache(req) is True
        run.finish(spec)
        run.mgr.finalize_release_on_finish(req)
        run.mgr.check_offload_progress()
        run.settle()
        run.mgr.check_offload_progress()
        assert req.kv.req_pool_idx is None and 1 in run.r2t.free_slots
        run.r2t.free_slots.extend(others)
        run.probe.close(run.mgr)


def test_the_pinned_requests_are_swept_once_per_drain() -> None:
    """A sweep walks every Req pinned on a row: the first call after a drain runs it, the calls after do not."""
    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = _started(ProbedAdapter, store)
        sweep, sweeps = run.mgr._sweep, []
        run.mgr._sweep = lambda: sweeps.append(1) or sweep()
        run.mgr.drain_before_retraction()
        for _ in range(3):
            for spec in SC.requests:
                run.decode(spec)
                run.mgr.offload_kv_cache(run.reqs[spec.rid])
            run.mgr.check_offload_progress()
        assert sweeps == [1]
        for spec in SC.requests:
            run.mgr.finalize_release_on_finish(run.reqs[spec.rid])
        run.probe.close(run.mgr)


def test_a_quiet_request_readmitted_on_another_row_takes_the_full_path() -> None:
    """SGLang releases a quiet request itself (no drain) and admits the same Req again on another row: its
    next call ends the old lifecycle (released_by_engine) and starts a new one, which offloads its decode again
    from the first chunk (the early exit, made for the old row, does not answer)."""
    from test_adapter_retraction import _engine_release, _readmit

    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = _started(ProbedAdapter, store)
        spec = SC.requests[0]
        a = run.reqs[spec.rid]
        for _ in range(9):
            run.decode(spec)
        assert run.mgr.offload_kv_cache(a) is True
        run.mgr.check_offload_progress()
        run.settle()
        run.mgr.check_offload_progress()
        run.decode(spec)
        assert run.mgr.offload_kv_cache(a) is False and a in run.mgr._views.quiet
        old = a.kv.req_pool_idx
        _engine_release(run, a)
        run.r2t.free_slots.remove(old)  # readmitted on another row
        _readmit(run, spec)
        run.r2t.free_slots.append(old)
        assert a.kv.req_pool_idx != old
        assert run.mgr.offload_kv_cache(a) is True and run.mgr.manager.metrics.engine_releases == 1
        run.mgr.check_offload_progress()
        run.settle()
        for s in SC.requests:
            run.finish(s)
            run.mgr.finalize_release_on_finish(run.reqs[s.rid])
        run.mgr.check_offload_progress()
        run.probe.close(run.mgr)


def test_a_row_whose_last_req_never_started_a_lifecycle_goes_to_the_next_req_and_back_to_sglang() -> None:
    """A request the manager saw before its first token (nothing to offload: kvfsm starts no lifecycle for it)
    is retracted by SGLang, which admits the next request on its row. That request is pinned on the row, as any
    other: it offloads, finishes, and its release gives the row back to SGLang's pool."""
    from test_adapter_retraction import _engine_release

    sc = Scenario(
        name="row-after-a-req-without-lifecycle",
        page_size=4,
        stride=8,
        requests=(
            ReqSpec("a", tuple(range(1, 9)), decode=12),
            ReqSpec("c", tuple(range(300, 306)), decode=12, start=1),
        ),
    )
    with tempfile.TemporaryDirectory() as store, harness.published(sc, 0, store):
        run = harness._Run(sc, ProbedAdapter, 0, harness._tp_group_world1(), store)
        a_spec, c_spec = sc.requests
        run.admit(a_spec)
        a = run.reqs["a"]
        a.output_ids.pop()  # its first token not sampled yet
        assert run.mgr.offload_kv_cache(a) is False
        assert run.mgr.manager.machine_of(run.mgr._views.view(a)) is None
        row = a.kv.req_pool_idx
        run.mgr.drain_before_retraction()
        _engine_release(run, a)  # a stays alive (SGLang's waiting queue holds it)
        run.admit(c_spec)
        c = run.reqs["c"]
        assert c.kv.req_pool_idx == row
        for _ in range(9):
            run.decode(c_spec)
        assert run.mgr.offload_kv_cache(c) is True
        run.mgr.check_offload_progress()
        run.settle()
        run.finish(c_spec)
        run.mgr.finalize_release_on_finish(c)
        run.mgr.check_offload_progress()
        assert c.kv.req_pool_idx is None and row in run.r2t.free_slots
        assert run.mgr.manager.metrics.chunks == 1
        run.probe.close(run.mgr)


class _Unchecked(DecodeKVCacheOffloadManager):
    """The production adapter (unchecked, as SGLang runs it), with the harness's probe."""

    @staticmethod
    def harness_probe() -> harness.Probe:
        from test_differential import _KvfsmProbe

        return _KvfsmProbe()


def test_the_early_exit_never_answers_for_a_row_its_req_left() -> None:
    """The early exit answers what the full path would, even for an engine that hands one row to two live
    Reqs. x is seen on row r before its first token (no lifecycle), then y claims r too and starts r's
    lifecycle; x, with its first token, is answered from that lifecycle's due point and noted quiet on r. x
    leaves r (a call sees it off the row), the engine releases y, and x comes back on r with a whole stride
    committed: its call takes the full path, which admits x and takes its first chunk, instead of answering
    from y's due point."""
    sc = Scenario(
        name="quiet-row-left",
        page_size=4,
        stride=8,
        requests=(ReqSpec("x", tuple(range(1, 11)), decode=12), ReqSpec("y", tuple(range(100, 118)), decode=12)),
    )
    with tempfile.TemporaryDirectory() as store, harness.published(sc, 0, store):
        run = harness._Run(sc, _Unchecked, 0, harness._tp_group_world1(), store)
        x_spec, y_spec = sc.requests
        run.admit(x_spec)
        run.admit(y_spec)
        x, y = run.reqs["x"], run.reqs["y"]
        first = x.output_ids.pop()  # x: nothing sampled yet
        assert run.mgr.offload_kv_cache(x) is False
        row = x.kv.req_pool_idx
        y.kv.req_pool_idx = row  # y claims x's row: its lifecycle starts there (due at 16 + 8)
        assert run.mgr.offload_kv_cache(y) is False
        x.output_ids.append(first)
        assert run.mgr.offload_kv_cache(x) is False  # committed 10: before y's due point
        x.kv.req_pool_idx = None
        assert run.mgr.offload_kv_cache(x) is False  # off the row
        y.kv.req_pool_idx = None  # the engine released y itself
        run.mgr.finalize_release_on_finish(y)
        assert run.mgr.manager.metrics.engine_releases == 1
        x.kv.req_pool_idx = row
        for _ in range(6):
            run.decode(x_spec)  # committed 16: x's first chunk [8, 16) is due
        assert run.mgr.offload_kv_cache(x) is True
        run.mgr.check_offload_progress()
        assert run.mgr.manager.metrics.chunks == 1
        run.finish(x_spec)
        run.mgr.finalize_release_on_finish(x)
        run.settle()
        run.mgr.check_offload_progress()
        run.probe.close(run.mgr)


def test_a_quiet_request_whose_committed_length_is_no_integer_is_refused_naming_it() -> None:
    """The early exit compares the committed length first and checks its type only when that fails: a length that
    is not an integer is RequestFieldInvalid naming kv_committed_len, raised from the comparison's TypeError.
    Nothing changed: with the length restored, the call answers from the early exit as before."""
    from kvfsm.errors import RequestFieldInvalid

    with _first_request_decoded(1) as (run, _, req):
        assert run.mgr.offload_kv_cache(req) is False and req in run.mgr._views.quiet
        good, req.kv.kv_committed_len = req.kv.kv_committed_len, None
        with pytest.raises(RequestFieldInvalid, match="kv_committed_len") as refused:
            run.mgr.offload_kv_cache(req)
        assert isinstance(refused.value.__cause__, TypeError)
        req.kv.kv_committed_len = good
        assert run.mgr.offload_kv_cache(req) is False and req in run.mgr._views.quiet
        for s in SC.requests:
            run.mgr.finalize_release_on_finish(run.reqs[s.rid])
        run.probe.close(run.mgr)


@pytest.mark.parametrize("broken", ["kv_committed_len", "output_ids"])
def test_a_quiet_request_come_due_with_a_bad_field_is_refused_naming_it(broken: str) -> None:
    """Past the early exit, a due request's offloadable length is read from the Req itself: a committed length
    that compares past its due point but is no integer is RequestFieldInvalid, and a missing field is
    RequestFieldMissing, each naming the field and raised from the error of the read that failed."""
    from kvfsm.errors import RequestFieldInvalid, RequestFieldMissing

    with _first_request_decoded(1) as (run, _, req):
        assert run.mgr.offload_kv_cache(req) is False and req in run.mgr._views.quiet
        length, outputs = req.kv.kv_committed_len, req.output_ids
        if broken == "kv_committed_len":  # past its due point, and no integer
            req.kv.kv_committed_len = float(1 << 20)
            error, cause = RequestFieldInvalid, TypeError
        else:  # past its due point, with no outputs to read
            req.kv.kv_committed_len = 1 << 20
            del req.output_ids
            error, cause = RequestFieldMissing, AttributeError
        with pytest.raises(error, match=broken) as refused:
            run.mgr.offload_kv_cache(req)
        assert isinstance(refused.value.__cause__, cause)
        req.kv.kv_committed_len, req.output_ids = length, outputs
        for s in SC.requests:
            run.mgr.finalize_release_on_finish(run.reqs[s.rid])
        run.probe.close(run.mgr)


def test_a_quiet_request_whose_kv_record_was_replaced_is_read_afresh_within_two_checks() -> None:
    """The early exit reads the `ReqKvInfo` a Req held when it was noted quiet. SGLang 0.5.23 replaces a Req's
    record only outside decode; were a decoding Req given a new record (here a copy, which SGLang then
    advances), its entry still expires two progress checks after the chunk falls due at a token an iteration,
    and the chunk is taken from the new record: at most two iterations later than with the record kept."""
    import dataclasses

    def first_chunk_at(replace: bool) -> int:
        with _first_request_decoded(1) as (run, spec, req):
            assert run.mgr.offload_kv_cache(req) is False and req in run.mgr._views.quiet
            if replace:
                req.kv = dataclasses.replace(req.kv)
            accepted = -1
            for t in range(12):
                run.mgr.check_offload_progress()
                run.decode(spec)
                if run.mgr.offload_kv_cache(req):
                    accepted = t
                    break
            run.mgr.check_offload_progress()  # submits the chunk, and notes the request quiet again
            assert run.mgr.manager.metrics.chunks == 1
            assert run.mgr._views.quiet[req].kv is req.kv  # noted on the record the Req holds now
            for s in SC.requests:
                run.mgr.finalize_release_on_finish(run.reqs[s.rid])
            run.mgr.check_offload_progress()
            run.probe.close(run.mgr)
            return accepted

    kept = first_chunk_at(replace=False)
    assert kept >= 0
    assert kept < first_chunk_at(replace=True) <= kept + 2


def test_an_offload_call_after_the_finalize_of_a_pending_request_is_refused_as_the_full_path_refuses_it() -> None:
    """A request finalized while its chunk was pending: the finalize submits the chunk (which notes the request
    quiet again), then ends its lifecycle. A later offload call is not answered by the early exit: it takes the
    full path, which finds the lifecycle ended (the spec's EventRejected), and nothing changes."""
    from kvfsm.errors import EventRejected

    with _first_request_decoded(9) as (run, spec, req):
        assert run.mgr.offload_kv_cache(req) is True  # pending until the next progress check
        run.mgr.finalize_release_on_finish(req)
        assert req not in run.mgr._views.quiet
        chunks = run.mgr.manager.metrics.chunks
        with pytest.raises(EventRejected):
            run.mgr.offload_kv_cache(req)
        assert run.mgr.manager.metrics.chunks == chunks
        run.mgr.check_offload_progress()
        run.settle()
        for s in SC.requests[1:]:
            run.mgr.finalize_release_on_finish(run.reqs[s.rid])
        run.mgr.check_offload_progress()
        run.probe.close(run.mgr)


@pytest.mark.parametrize("past_end", [-5, 0, 10**6, 2**63], ids=["negative", "the-end", "far", "2**63"])
def test_a_req_naming_no_row_of_the_table_is_refused_and_not_kept_alive(past_end: int) -> None:
    """A Req whose req_pool_idx names no row of SGLang's table is refused with InvalidRequest, and the adapter
    keeps no reference to it: nothing is pinned, and the Req is collected once SGLang drops it."""
    import gc
    import weakref

    from kvfsm.errors import InvalidRequest

    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = _started(ProbedAdapter, store)
        spec = SC.requests[0]
        req = run.reqs.pop(spec.rid)
        own_row = req.kv.req_pool_idx
        rows = int(run.r2t.req_to_token.shape[0])
        row = past_end if past_end < 0 else rows + past_end  # a negative row, or one at or past the table's end
        req.kv.req_pool_idx = row
        with pytest.raises(InvalidRequest):
            run.mgr.offload_kv_cache(req)
        assert row not in run.mgr._views._pinned and req not in run.mgr._views.quiet
        gone = weakref.ref(req)
        run.r2t.free_slots.append(own_row)  # SGLang's own release of the row it took at admission
        del req
        gc.collect()
        assert gone() is None
        for s in SC.requests[1:]:
            run.mgr.finalize_release_on_finish(run.reqs[s.rid])
        run.mgr.check_offload_progress()
        run.probe.close(run.mgr)
