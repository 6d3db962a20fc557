"""The SGLang adapter's batch path: `offload_kv_cache(req)` answers at once, its chunk joins the iteration's
batch, and the batch is submitted as one copy; a call with no chunk due does constant work.

Over SGLang 0.5.23's own objects (the differential harness). The batch path must be invisible to SGLang:
every scenario of the differential test, the intended differences included, gives the same record when each
accepted chunk is submitted at its own call (`CallByCall`, the adapter before batching) as when the
iteration's chunks are submitted together.
"""

from __future__ import annotations

import gc
import sys
import tempfile
from typing import Any

import pytest

import harness
from scenarios import SCENARIOS, ReqSpec, Scenario
from test_differential import INTENDED, ProbedAdapter, _run

SC = Scenario(
    name="batch",
    page_size=4,
    stride=8,
    requests=tuple(ReqSpec(f"r{i}", tuple(range(100 * i + 1, 100 * i + 11)), decode=20) for i in range(4)),
)


class CallByCall(ProbedAdapter):
    """The adapter with every accepted chunk submitted by its own call (one copy and event per request)."""

    def offload_kv_cache(self, req: Any) -> bool:
        accepted = super().offload_kv_cache(req)
        self._flush()
        return accepted


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.name)
def test_batched_submission_is_invisible_to_sglang(sc: Scenario) -> None:
    if sc.name in INTENDED and sc.tp > 1 and sc.rank_host_ratio:
        pytest.skip("refused at construction (TPMismatch): nothing runs")
    batched, single = _run(sc, ProbedAdapter), harness.run_scenario(sc, CallByCall)
    assert harness.diff_runs(batched, single) == []
    assert [r.final for r in batched] == [r.final for r in single]


class _Counting(ProbedAdapter):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.copies = 0
        engine = self.manager.fx.copy_engine
        submit = engine.submit_d2h

        def counted(*args: Any) -> Any:
            self.copies += 1
            return submit(*args)

        engine.submit_d2h = counted


def _started(cls: type, store: str, sc: Scenario = SC) -> Any:
    run = harness._Run(sc, cls, 0, harness._tp_group_world1(), store)
    for spec in sc.requests:
        run.admit(spec)
    return run


def test_an_iterations_chunks_are_one_copy_submitted_at_the_next_progress_check() -> None:
    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = _started(_Counting, store)
        accepted_at = []
        for t in range(1, 12):
            run.mgr.check_offload_progress()
            copies = run.mgr.copies
            answers = []
            for spec in SC.requests:
                run.decode(spec)
                answers.append(run.mgr.offload_kv_cache(run.reqs[spec.rid]))
            assert run.mgr.copies == copies  # nothing submitted by the calls themselves
            if any(answers):
                assert all(answers) and run.mgr.has_inflight_device_transfer()
                assert len(run.mgr.ongoing_offload) == len(SC.requests)  # the idle check counts accepted chunks
                accepted_at.append(t)
                run.mgr.check_offload_progress()
                assert run.mgr.copies == copies + 1  # the whole iteration: one copy
            run.settle()
        assert accepted_at and run.mgr.manager.metrics.chunks == len(SC.requests) * len(accepted_at)
        for spec in SC.requests:
            run.finish(spec)
            run.mgr.finalize_release_on_finish(run.reqs[spec.rid])
        run.probe.close(run.mgr)


def test_a_call_with_no_chunk_due_makes_no_call_at_all() -> None:
    """The early exit runs no Python function and no torch op: only the adapter's own frame and one dict
    lookup (every call the profiler sees, by name)."""
    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = _started(ProbedAdapter, store)
        spec = SC.requests[0]
        req = run.reqs[spec.rid]
        run.decode(spec)
        assert run.mgr.offload_kv_cache(req) is False  # first sight: the full path, which notes it quiet
        assert req in run.mgr._views.quiet
        run.decode(spec)
        calls: list[str] = []

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                calls.append(frame.f_code.co_qualname)
            elif event == "c_call":
                calls.append(f"{getattr(arg, '__module__', None) or ''}.{arg.__qualname__}")

        sys.setprofile(profile)
        try:
            answer = run.mgr.offload_kv_cache(req)
        finally:
            sys.setprofile(None)
        assert answer is False
        # the adapter's frame and the quiet dict's get; then the profiler's own removal
        assert calls == ["DecodeKVCacheOffloadManager.offload_kv_cache", ".dict.get", "sys.setprofile"], calls
        run.mgr.finalize_release_on_finish(req)
        assert req not in run.mgr._views.quiet
        for other in SC.requests[1:]:
            run.mgr.finalize_release_on_finish(run.reqs[other.rid])
        run.probe.close(run.mgr)


def test_a_refused_batch_gives_its_host_pages_back_and_still_releases_the_finished() -> None:
    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = _started(ProbedAdapter, store)
        host = run.mgr.manager.host_pool
        free = host.free_slots
        engine = run.mgr.manager.fx.copy_engine
        submit = engine.submit_d2h
        for _ in range(8):  # every request has a whole stride due after this many decodes
            for spec in SC.requests:
                run.decode(spec)
        last = SC.requests[-1]
        run.finish(last)
        assert all(run.mgr.offload_kv_cache(run.reqs[s.rid]) for s in SC.requests)
        assert host.free_slots == free - 8 * len(SC.requests)  # taken at the calls, as upstream's

        def refuse(*args: Any) -> Any:
            raise RuntimeError("copy engine refused the batch")

        engine.submit_d2h = refuse
        with pytest.raises(RuntimeError, match="refused the batch"):
            run.mgr.check_offload_progress()
        engine.submit_d2h = submit
        assert host.free_slots == free and not run.mgr.has_inflight_device_transfer()
        assert run.reqs[last.rid].kv.req_pool_idx is None  # the finished request was released anyway
        assert all(run.mgr.offload_kv_cache(run.reqs[s.rid]) for s in SC.requests[:-1])  # due again
        run.mgr.check_offload_progress()
        assert run.mgr.manager.metrics.chunks == len(SC.requests) - 1
        for spec in SC.requests[:-1]:
            run.mgr.finalize_release_on_finish(run.reqs[spec.rid])
        run.probe.close(run.mgr)


def test_quiet_entries_go_with_their_requests() -> None:
    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = _started(ProbedAdapter, store)
        for spec in SC.requests:
            run.decode(spec)
            run.mgr.offload_kv_cache(run.reqs[spec.rid])
        quiet = run.mgr._views.quiet
        assert len(quiet) == len(SC.requests)
        run.mgr.drain_before_retraction()  # SGLang may now release anything itself: every Req takes the full path
        assert not quiet
        for spec in SC.requests:
            run.mgr.offload_kv_cache(run.reqs[spec.rid])
        assert len(quiet) == len(SC.requests)
        for spec in SC.requests:
            run.finish(spec)
            run.mgr.finalize_release_on_finish(run.reqs[spec.rid])
        assert not quiet
        run.probe.close(run.mgr)


def test_a_finished_req_that_sglang_dropped_is_still_released() -> None:
    """SGLang forgets a finished Req once `offload_kv_cache` took it (True): kvfsm releases it at the ack,
    after its last outside reference is gone."""
    with tempfile.TemporaryDirectory() as store, harness.published(SC, 0, store):
        run = _started(ProbedAdapter, store)
        for _ in range(8):
            for spec in SC.requests:
                run.decode(spec)
        spec = SC.requests[0]
        run.finish(spec)
        req = run.reqs.pop(spec.rid)
        row = req.kv.req_pool_idx
        assert run.mgr.offload_kv_cache(req) is True
        del req
        gc.collect()
        run.mgr.check_offload_progress()  # submits the batch, acks the CPU copy, releases the request
        run.settle()
        run.mgr.check_offload_progress()
        assert row in run.r2t.free_slots
        for other in SC.requests[1:]:
            run.mgr.finalize_release_on_finish(run.reqs[other.rid])
        run.probe.close(run.mgr)


# more chunks acknowledged at one progress check than kvfsm's default backup queue (64) holds
WIDE = Scenario(
    name="wide",
    page_size=4,
    stride=4,
    device_tokens=4096,
    requests=tuple(ReqSpec(f"w{i}", tuple(range(100 * i + 1, 100 * i + 9)), decode=12) for i in range(80)),
)


def test_every_acknowledged_copy_has_its_backup_queued_while_the_host_pool_has_room() -> None:
    """As upstream's progress check queues each acknowledged copy's backup at once (`write_storage`), no chunk
    waits parked while the host pool could hold it: the queue holds as many chunks as the pool. 80 chunks
    acknowledged at one check all go to the store, and their pages are stored."""
    with tempfile.TemporaryDirectory() as store, harness.published(WIDE, 0, store):
        run = _started(ProbedAdapter, store, WIDE)
        manager = run.mgr.manager
        settings = run.mgr.settings
        assert manager.fx.worker.capacity == settings.host_slots // settings.stride >= len(WIDE.requests)
        for _ in range(WIDE.stride):  # a stride of new tokens for every request: each has one chunk due
            run.mgr.check_offload_progress()
            for spec in WIDE.requests:
                run.decode(spec)
                run.mgr.offload_kv_cache(run.reqs[spec.rid])
            run.settle()
        run.mgr.check_offload_progress()  # submits the iteration's chunks
        run.settle()
        run.mgr.check_offload_progress()  # acknowledges their copies: every backup queued at once
        assert manager.metrics.chunks >= len(WIDE.requests) and manager.metrics.parked_chunks == 0
        run.settle()
        run.mgr.check_offload_progress()
        assert manager.metrics.stored_pages >= len(WIDE.requests)
        for spec in WIDE.requests:
            run.finish(spec)
            run.mgr.finalize_release_on_finish(run.reqs[spec.rid])
        run.probe.close(run.mgr)
