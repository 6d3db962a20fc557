"""Retraction with kvfsm's SGLang adapter, against upstream, on SGLang's own objects.

SGLang's scheduler calls `drain_before_retraction()` and then releases the retracted requests itself
(`batch.retract_decode()` -> `release_kv_cache`, emulated by `_engine_release`), never telling the manager.
Upstream's manager keeps the request's offload state and ignores it; kvfsm's lifecycle of it would still
hold its table row, so the adapter ends it (muted: nothing freed twice) before the row is handed to another
request. The script below
retracts a request mid-decode, admits a new one (which SGLang gives the retracted row) and runs both to the
end on upstream's manager and on the adapter, comparing every step as the differential test does.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from typing import Any

import pytest
import torch

import harness
from scenarios import ReqSpec, Scenario
from test_differential import ProbedAdapter

from kvfsm.dataplane import DeferredCpuCopyEngine
from kvfsm.errors import RetractionRefused

SC = Scenario(
    name="retract-then-reuse-row",
    page_size=4,
    stride=8,
    requests=(
        ReqSpec("a", tuple(range(1, 9)), decode=12),
        ReqSpec("b", tuple(range(100, 110)), decode=12),
        ReqSpec("c", tuple(range(300, 306)), decode=9, start=6),  # admitted after a's retraction, on a's row
    ),
)
RETRACT_AT = 6


def _engine_release(run: harness._Run, req) -> None:
    """What `retract_decode` -> `release_kv_cache` does to a request's KV (its checks for speculative
    over-allocation aside: the harness allocates whole pages): the row's own range freed, the tree's lock
    dropped, the row given back, the KV marked released."""
    run.tree.free_kv_row(req.kv, [(req.kv.cache_protected_len, req.kv.kv_allocated_len)])
    run.tree.unlock(req.lock)
    req.lock = None
    run.r2t.free(req)
    req.kv.mark_kv_released()


def _readmit(run: harness._Run, spec: ReqSpec) -> None:
    """The retracted request comes back (same Req object, its outputs kept): a new row, fresh slots for every
    position, the KV of every committed position written again, as a re-prefill would."""
    req = run.reqs[spec.rid]
    run.r2t.alloc([req])
    row = req.kv.req_pool_idx
    committed = len(req.origin_input_ids) + len(req.output_ids) - 1
    slots = run._alloc(committed + 1)
    run.r2t.write((row, slice(0, slots.numel())), slots.to(torch.int32))
    run.owned[spec.rid] += slots.tolist()
    run._own(spec.rid, slots, 0)
    run._write_kv(spec, slots[:committed], torch.arange(committed))
    req.kv.cache_protected_len = 0
    req.kv.kv_allocated_len = slots.numel()
    req.kv.kv_committed_len = committed


SC_READMIT = Scenario(
    name="retract-and-readmit",
    page_size=4,
    stride=8,
    requests=(
        ReqSpec("a", tuple(range(1, 9)), decode=18),  # offloads [8, 16) at step 8; retracted at 10, back at 12
        ReqSpec("b", tuple(range(100, 110)), decode=12),
        ReqSpec("c", tuple(range(300, 306)), decode=9, start=10),
    ),
)


def _script(
    manager_cls: type, sc: Scenario = SC, retract_at: int = RETRACT_AT, readmit_at: int | None = None
) -> tuple[list[harness.Step], dict, Counter]:
    store = tempfile.mkdtemp(prefix="kvfsm-retract-")
    with harness.published(sc, 0, store):
        run = harness._Run(sc, manager_cls, 0, harness._tp_group_world1(), store)
        steps, live = [], {}
        for t in range(sc.steps):
            run.cur = harness.Step(t)
            run.settle()
            if hasattr(run.mgr, "hold"):  # FencedAdapter: this step's progress check leaves the copies in flight
                run.mgr.hold = t == retract_at
            run.mgr.check_offload_progress()
            if t == retract_at:
                run.mgr.drain_before_retraction()
                run.cur.retract = "ok"
                a = run.reqs["a"]
                a_row = a.kv.req_pool_idx
                _engine_release(run, a)
                live["a"] = False
                run.cur.released.append("a")
            if t == readmit_at:
                _readmit(run, sc.requests[0])
                live["a"] = True
            for spec in sc.requests:
                if spec.start == t:
                    run.admit(spec)
                    live[spec.rid] = True
                    if spec.rid == "c":
                        assert run.reqs["c"].kv.req_pool_idx == a_row  # the retracted request's row
            for spec in sc.requests:
                if live.get(spec.rid) and spec.start < t <= spec.start + spec.decode:
                    run.decode_and_offload(spec, t)
            run.end_step(live, steps)
        stored = run.stored()
        freed = Counter(s for st in steps for s in st.device_freed)
        owned = Counter(s for slots in run.owned.values() for s in slots)
        assert freed == owned, f"freed - owned {freed - owned}, owned - freed {owned - freed}"
        assert run.tree.protected_size() == 0
        if hasattr(run.mgr, "manager"):  # kvfsm: the retracted lifecycle ended with the spec's released_by_engine
            assert run.mgr.manager.metrics.engine_releases == 1
        if hasattr(run.mgr, "hold"):
            assert run.mgr.held_at_drain > 0, "no copy was in flight at the retraction"
            assert harness_states(run.mgr) == {"released"}
            from kvfsm.generated.decode_offload import TRANSITIONS

            taken = {TRANSITIONS[t][:2] for t in run.mgr.manager.coverage}
            assert ("offloading", "released_by_engine_fenced") in taken and ("fenced", "copy_done") in taken
        run.probe.close(run.mgr)
    return steps, stored, freed


def test_retraction_then_row_reuse_matches_upstream() -> None:
    up_steps, up_stored, up_freed = _script(harness.UpstreamManager)
    kv_steps, kv_stored, kv_freed = _script(ProbedAdapter)
    for a, b in zip(up_steps, kv_steps):
        assert (a.step, a.offloads, a.released, a.host_alloc, a.host_freed, a.keys, a.retract, sorted(a.freed_at)) == (
            b.step,
            b.offloads,
            b.released,
            b.host_alloc,
            b.host_freed,
            b.keys,
            b.retract,
            sorted(b.freed_at),
        )
    # slot ids are not compared (the free lists' orders differ); owners and row positions are, above
    assert up_stored == kv_stored and sum(up_freed.values()) == sum(kv_freed.values())


class FencedAdapter(ProbedAdapter):
    """The adapter with `retraction="fenced"` over the CPU twin of in-flight copies: its batched copies run
    on a deferred engine, completed at each progress check except while `hold` is set, so the retraction
    meets a copy of the retracted request still in flight (on a GPU server the drain meets such copies at
    once; here CPU copies would have landed)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs, retraction="fenced")
        self.deferred = DeferredCpuCopyEngine()
        self.manager.fx.copy_engine = self.deferred
        self.hold = False
        self.held_at_drain = 0

    def check_offload_progress(self) -> None:
        if not self.hold:
            self.deferred.complete_all()
        super().check_offload_progress()

    def drain_before_retraction(self) -> None:
        self.held_at_drain = len(self.deferred.pending)
        super().drain_before_retraction()  # never refuses: the stream waits on the copies (here: they run)

    def release_host_resources(self) -> None:
        self.deferred.complete_all()
        super().release_host_resources()


def harness_states(mgr: FencedAdapter) -> set[str]:
    from kvfsm.generated.decode_offload import STATES

    return {STATES[r.machine.state] for r in mgr.manager._records.values()}


SC_FENCED = Scenario(
    name="fenced-retract",
    page_size=4,
    stride=8,
    requests=(
        ReqSpec("a", tuple(range(1, 9)), decode=12),  # offloads [8, 16) at step 8, retracted at 9 with it in flight
        ReqSpec("b", tuple(range(100, 110)), decode=12),
        ReqSpec("c", tuple(range(300, 306)), decode=9, start=10),  # on a's row
    ),
)


def test_fenced_retraction_with_a_copy_in_flight_is_never_refused_and_stores_what_upstream_stores() -> None:
    """`retraction="fenced"`: the drain meets a copy of the request SGLang then releases itself; instead of
    refusing (upstream's rule) it makes the stream wait on it, SGLang frees the slots at once and hands
    the row to the next request, and kvfsm records the release fenced (released_by_engine_fenced, freeing
    nothing). Every slot is freed exactly once, and the store ends up with upstream's pages, bytes and keys
    (upstream met no copy in flight: its CPU copies land at the progress check)."""
    up_steps, up_stored, up_freed = _script(harness.UpstreamManager, SC_FENCED, retract_at=9)
    kv_steps, kv_stored, kv_freed = _script(FencedAdapter, SC_FENCED, retract_at=9)
    assert up_stored == kv_stored
    assert sum(up_freed.values()) == sum(kv_freed.values())
    for a, b in zip(up_steps, kv_steps):
        assert (a.released, a.retract) == (b.released, b.retract), a.step


def test_a_readmitted_request_offloads_its_decode_again() -> None:
    """Intended difference: after a retraction SGLang re-admits the same Req; upstream's manager continues
    after its last offloaded chunk (its offload state survives), kvfsm starts a new lifecycle and copies the
    decoded chunks again from the first. Their keys already exist, so the store writes nothing new: the
    same files appear at the same steps, with the same bytes; only host slots taken (and given back) differ."""
    up_steps, up_stored, _ = _script(harness.UpstreamManager, SC_READMIT, retract_at=10, readmit_at=12)
    kv_steps, kv_stored, _ = _script(ProbedAdapter, SC_READMIT, retract_at=10, readmit_at=12)
    assert up_stored == kv_stored
    for a, b in zip(up_steps, kv_steps):
        assert (a.released, a.keys, sorted(a.freed_at)) == (b.released, b.keys, sorted(b.freed_at)), a.step
    up_host, kv_host = sum(st.host_alloc for st in up_steps), sum(st.host_alloc for st in kv_steps)
    assert kv_host > up_host  # the re-copied chunks
    assert kv_host == sum(st.host_freed for st in kv_steps) and up_host == sum(st.host_freed for st in up_steps)


def test_refusal_is_upstreams_runtime_error_and_kvfsms_typed_error() -> None:
    from kvfsm.integrations.sglang import RetractionRefusedError

    err = RetractionRefusedError("local: 1 copies unacknowledged")
    assert isinstance(err, RuntimeError) and isinstance(err, RetractionRefused)
    assert str(err).startswith("Decode KV offload copies are still pending on some rank; refusing to retract")
    import pickle

    assert str(pickle.loads(pickle.dumps(err))) == str(err)  # crosses TP worker processes intact


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
