"""transformers' continuous batching with kvfsm as its offloading manager, on a tiny random Llama.

The cache is made small enough that the engine must preempt and restore requests many times; every
swap goes through spec/cb_swap.yaml in checked mode (invariants, block ledger, every landed copy compared
with its source: B15), and the outputs must equal per-request `generate` token for token, with the
victims' device blocks released fenced at the swap-out (the default over kvfsm's engines) and deferred to
its acknowledgement (`fenced=False`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cb_helpers import cb_config, generation_config, prompts, reference_outputs, require_transformers, tiny_llama
from timing import measure, scaled

require_transformers()

import kvfsm.integrations.transformers as kt  # noqa: E402
from kvfsm.dataplane import CopyEngine, CopyHandle, CpuCopyEngine, DeferredCpuCopyEngine  # noqa: E402
from kvfsm.dataplane.copy.base import plan_copy  # noqa: E402
from kvfsm.dataplane.copy.cpu import DeferredHandle  # noqa: E402
from kvfsm.dataplane.fences import SlotFence  # noqa: E402
from kvfsm.generated import cb_swap as gen  # noqa: E402
from kvfsm.runtime.ledger import CheckedModeError  # noqa: E402

NEW_TOKENS = 24
N_REQUESTS = 16
NUM_BLOCKS = 16  # 64 token slots for 16 requests of up to 30 + 24 tokens


def tid(src: str, event: str, guard: str | None = None) -> int:
    """The id of the spec's transition from `src` on `event` (the coverage sets hold these)."""
    return next(i for i, t in enumerate(gen.TRANSITIONS) if t[:3] == (src, event, guard))


SWAP_OUT = {False: tid("resident", "preempt", "deferred_release"), True: tid("resident", "preempt", "fenced_release")}
SWAP_OUT_DONE = {False: tid("swapping_out", "swap_out_done"), True: tid("swapping_out_fenced", "swap_out_done")}
ROUND_TRIP = {tid("swapped", "restore"), tid("swapping_in", "swap_in_done"), tid("resident", "finish")}


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama()


@pytest.fixture(scope="module")
def workload(model: Any) -> tuple[list[list[int]], list[list[int]]]:
    inputs = prompts(N_REQUESTS)
    return inputs, reference_outputs(model, inputs, NEW_TOKENS)


def run_batch(model: Any, inputs: list[list[int]], config: Any, cb: Any) -> tuple[list[list[int]], Any]:
    with kt.installed(model, config) as inst:
        results = model.generate_batch(
            inputs, generation_config=generation_config(NEW_TOKENS), continuous_batching_config=cb, progress_bar=False
        )
    outs = [r.generated_tokens for r in results.values()]
    assert all(r.error is None for r in results.values())
    return outs, inst


# ---- the engine, end to end -----------------------------------------------------------------------


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "deferred"])
@pytest.mark.parametrize("sharing", [False, True], ids=["no-prefix-sharing", "prefix-sharing"])
def test_generate_batch_swaps_many_times_and_matches_generate(
    model: Any, workload: Any, sharing: bool, fenced: bool
) -> None:
    inputs, expected = workload
    config = (
        kt.SwapConfig(host_blocks=64, checked=True)
        if fenced
        else kt.SwapConfig(host_blocks=64, checked=True, fenced=False)
    )  # fenced is the default over kvfsm's engines
    outs, inst = run_batch(model, inputs, config, cb_config(NUM_BLOCKS, sharing=sharing))
    m = inst.metrics
    print(f"\n{'sharing' if sharing else 'no sharing'}, {'fenced' if fenced else 'deferred'}: {m.as_dict()}")
    assert outs == expected
    assert m.preempts >= 10 and m.soft_resets == 0
    assert m.swap_outs_done == m.preempts and m.restores == m.preempts and m.swap_ins_done == m.restores
    assert m.verified_copies == m.swap_outs_done + m.swap_ins_done  # every copy compared with its source (B15)
    assert m.bytes_d2h == m.bytes_h2d > 0
    assert m.fenced_releases == (m.preempts if fenced else 0)
    assert {SWAP_OUT[fenced], SWAP_OUT_DONE[fenced]} | ROUND_TRIP <= inst.coverage
    assert not {SWAP_OUT[not fenced], SWAP_OUT_DONE[not fenced]} & inst.coverage
    assert inst.leaks() == []
    (kv,) = inst.managers
    assert kv.fenced is fenced
    assert kv.live == {} and kv.host_pool.free_slots == kv.host_pool.capacity


def test_small_host_pool_soft_resets_and_still_matches(model: Any, workload: Any) -> None:
    inputs, expected = workload
    outs, inst = run_batch(model, inputs, kt.SwapConfig(host_blocks=6, checked=True), cb_config(NUM_BLOCKS))
    m = inst.metrics
    assert outs == expected
    assert m.soft_resets >= 1 and m.preempts >= 1
    assert tid("resident", "soft_reset") in inst.coverage
    assert m.host_blocks_peak <= 6 and inst.leaks() == []


def test_cancel_swapped_resident_and_running_requests(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancel, mid-run, a swapped request (host blocks freed), a restored one (device blocks through its
    machine) and a running request that never swapped; the others still match `generate`.

    The picks are made at every batch boundary, in the generation thread, right where the engine reads its
    cancellations (kvfsm's clear_cancelled_requests hook), so which requests are cancelled and in which state
    depend only on the engine's own schedule, never on how often another thread got the CPU. The running
    request is picked only once a swap happened, so the memory pressure that makes the swaps is not relieved
    before it."""
    inputs = prompts(12, seed=3)
    expected = reference_outputs(model, inputs, NEW_TOKENS)
    cancelled: dict[str, str] = {}
    clears = kt.KvfsmOffloadingManager._engine_clears_cancelled

    def pick_then_clear(kv: kt.KvfsmOffloadingManager) -> list[Any]:
        by_state: dict[int, list[str]] = {}
        for rid, rec in kv.live.items():
            by_state.setdefault(rec.machine.state, []).append(rid)
        picks = {"swapped": by_state.get(gen.SWAPPED, []), "resident": by_state.get(gen.RESIDENT, [])}
        if "swapped" in cancelled.values():
            picks["running"] = [rid for rid in kv.scheduler.active_requests if rid not in kv.live]
        for kind, rids in picks.items():
            rid = next((r for r in rids if r not in cancelled), None)
            if kind not in cancelled.values() and rid is not None:
                cancelled[rid] = kind
                kv.scheduler.set_request_cancellation(rid)  # what manager.cancel_request(rid) leads to
        return clears(kv)

    monkeypatch.setattr(kt.KvfsmOffloadingManager, "_engine_clears_cancelled", pick_then_clear)
    manager = model.init_continuous_batching(
        generation_config=generation_config(NEW_TOKENS), continuous_batching_config=cb_config(14)
    )
    inst = kt.install(manager, kt.SwapConfig(host_blocks=64, checked=True))
    manager.start()
    results = {}
    try:
        ids = manager.add_requests(inputs, max_new_tokens=NEW_TOKENS)
        while len(results) + len(cancelled) < len(ids):
            wait = scaled(30)  # a hang guard: half a minute of the reference machine, in this machine's seconds
            r = manager.get_result(timeout=wait)
            assert r is not None, (
                f"timed out after {wait:.0f} s waiting for a result: the engine stalled with "
                f"{len(results)} results, cancelled {cancelled}; {measure(0)}"
            )
            if r.request_id not in cancelled:
                results[r.request_id] = r
    finally:
        wait = scaled(30)
        manager.stop(block=True, timeout=wait)
        # destroy() would join the generation thread without a timeout: only once it stopped
        assert not manager.is_running(), f"the generation thread did not stop within {wait:.0f} s; {measure(0)}"
        manager.destroy()
    assert sorted(cancelled.values()) == ["resident", "running", "swapped"], (
        f"the run ended before a swapped, a resident and a running request were there to cancel: {cancelled}"
    )
    (kv,) = inst.managers
    for i, rid in enumerate(ids):
        if rid not in cancelled:
            assert results[rid].generated_tokens == expected[i], rid
    m = inst.metrics
    assert m.cancels >= 2  # the swapped and the restored request ended through their machines
    assert {tid("resident", "cancel"), tid("swapped", "cancel")} <= inst.coverage
    assert inst.leaks() == [] and kv.live == {}
    assert kv.host_pool.free_slots == kv.host_pool.capacity


# ---- white box: one request driven through the manager ----------------------------------------------


class _Engine:
    """A batch processor built by the engine (no generation thread) with kvfsm installed."""

    def __init__(self, model: Any, config: Any, num_blocks: int = 16) -> None:
        self.manager = model.init_continuous_batching(
            generation_config=generation_config(4), continuous_batching_config=cb_config(num_blocks)
        )
        self.inst = kt.install(self.manager, config)
        self.processor = self.manager._create_batch_processor()
        self.kv: kt.KvfsmOffloadingManager = self.processor.offloading_manager
        self.cache, self.scheduler = self.processor.cache, self.processor.scheduler
        self.allocator = self.kv.allocator

    def admit(self, rid: str, tokens: int, fill: bool = True) -> Any:
        """A decoding request of `tokens` tokens; `fill`: random KV written into its blocks."""
        from transformers.generation.continuous_batching.requests import RequestState, RequestStatus

        state = RequestState(request_id=rid, initial_tokens=list(range(1, tokens + 1)), max_new_tokens=4)
        assert self.cache.can_store_request_tokens(state, tokens)
        state.position_offset = tokens
        state._status = RequestStatus.DECODING
        self.scheduler.active_requests[rid] = state
        if not fill:
            return state
        blocks = self.allocator.block_table[rid]
        pool = self.kv.device_pool
        p, layers, _, rows, dim = pool.kv.shape
        kv = torch.randn(p, layers, len(blocks), rows, dim, dtype=pool.config.dtype)
        pool.kv.index_copy_(2, torch.tensor(blocks), kv)
        return state

    def free_blocks(self) -> int:
        return self.cache.pool.count_free_blocks(self.allocator.index) + (
            self.cache.pool.num_free_sectors * self.allocator.blocks_per_sector
        )

    def restore(self, state: Any) -> Any:
        from transformers.generation.continuous_batching.requests import FutureRequestState

        assert self.cache.can_store_request_tokens(state, 1)
        future = FutureRequestState(state, True, {}, 1)
        self.kv.restore_scheduled_requests([future])
        return future


def test_paged_cache_pool_is_the_engines_layout(model: Any) -> None:
    e = _Engine(model, kt.SwapConfig(host_blocks=8))
    pool, alloc = e.kv.device_pool, e.allocator
    assert pool.storage.data_ptr() == alloc.cache_tensor.data_ptr()  # a view, not a copy
    state = e.admit("a", 9)
    ps, heads, dim = alloc.tokens_per_page, alloc.num_key_value_heads, alloc.head_dim
    for layer_pos, layer_idx in enumerate(alloc.layer_indices):
        k_view, v_view = alloc._kv_token_views[layer_idx]
        for b in alloc.block_table["a"]:
            rows = slice(b * alloc.block_physical_stride, b * alloc.block_physical_stride + ps)
            assert torch.equal(pool.kv[0, layer_pos, b].view(ps, heads, dim), k_view[rows])
            assert torch.equal(pool.kv[1, layer_pos, b].view(ps, heads, dim), v_view[rows])
            assert pool.token_view()[0, 0, b, 0].data_ptr() == pool.kv[0, 0, b].data_ptr()  # one row per block
    before = alloc.cache_tensor.clone()
    e.kv.warm_up()  # what a CUDA cache runs at install: trash blocks out and back, unchanged
    assert torch.equal(alloc.cache_tensor, before) and e.kv.host_pool.free_slots == e.kv.host_pool.capacity
    del state


def test_swap_out_and_in_restore_the_exact_kv(model: Any) -> None:
    e = _Engine(model, kt.SwapConfig(host_blocks=8, checked=True))
    state = e.admit("a", 10)
    pool = e.kv.device_pool
    before = pool.blocks(e.allocator.block_table["a"]).clone()
    free0 = e.free_blocks()
    assert e.kv._swap_out(state)
    rec = e.kv.live["a"]
    assert rec.machine.state == gen.SWAPPED and "a" not in e.allocator.block_table
    assert e.free_blocks() == free0 + before.shape[2]  # the device blocks went back to the engine
    # the engine reuses them: scribble over every free block
    pool.storage.zero_()
    state.is_cpu_offloaded = True
    e.restore(state)
    assert rec.machine.state == gen.RESIDENT  # CPU copies land at submit; the poll acknowledged it
    after = pool.blocks(e.allocator.block_table["a"][: before.shape[2]])
    assert torch.equal(after, before)
    assert e.kv.host_pool.free_slots == e.kv.host_pool.capacity
    e.cache.free_blocks("a")  # the engine finishes it: through its machine
    assert "a" not in e.kv.live and e.inst.leaks() == []
    assert tid("resident", "finish") in e.inst.coverage


def test_awaiting_restore_is_swapped_and_what_swap_out_done_takes_there() -> None:
    """The manager's _AWAITING_RESTORE, read off spec/cb_swap.yaml: `swapped` (where `restore` is accepted)
    and every state that `swap_out_done` takes to it."""
    from kvfsm.integrations.transformers.manager import _AWAITING_RESTORE
    from kvfsm.spec.checks import load_spec

    spec = load_spec(Path(__file__).resolve().parents[2] / "spec" / "cb_swap.yaml")
    restorable = {t.src for t in spec.transitions if t.event == "restore"}
    waiting = restorable | {t.src for t in spec.transitions if t.event == "swap_out_done" and t.dst in restorable}
    assert {gen.STATES[s] for s in _AWAITING_RESTORE} == waiting == {"swapping_out", "swapping_out_fenced", "swapped"}


class _Untouchable(list):
    """A batch that fails the test if it is scanned."""

    def __iter__(self) -> Any:
        raise AssertionError("the batch was scanned")


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "deferred"])
def test_a_restore_call_skips_its_scan_only_while_no_machine_awaits_a_restore(model: Any, fenced: bool) -> None:
    e = _Engine(model, kt.SwapConfig(host_blocks=8, copy_engine=DeferredCpuCopyEngine(), fenced=fenced))
    state = e.admit("a", 10)
    e.kv.restore_scheduled_requests(_Untouchable())  # nothing swapped: not scanned
    assert e.kv._swap_out(state)  # fenced: swapping_out_fenced; deferred: waited and acknowledged, swapped
    assert e.kv.awaiting_restore == 1
    with pytest.raises(AssertionError, match="scanned"):  # a swapped request may be in any batch now
        e.kv.restore_scheduled_requests(_Untouchable())
    state.is_cpu_offloaded = True
    e.restore(state)
    assert e.kv.awaiting_restore == 0 and e.kv.live["a"].machine.state == gen.SWAPPING_IN
    e.kv.restore_scheduled_requests(_Untouchable())
    e.kv.poll(wait=True)
    e.cache.free_blocks("a")
    assert e.inst.leaks() == [] and e.kv.awaiting_restore == 0 and e.kv.metrics.restore_calls == 4


def test_a_fenced_swap_out_enqueues_the_compute_streams_wait_before_the_blocks_go_back(model: Any) -> None:
    """The victim's blocks go back to the engine only after a wait on the copy was enqueued on the compute
    stream (recorded by the CPU twin), not merely a fence marked waited; the host does not wait."""
    engine = DeferredCpuCopyEngine(stream_ordered=True)
    e = _Engine(model, kt.SwapConfig(host_blocks=8, copy_engine=engine, fenced=True))
    state = e.admit("a", 10)
    assert e.kv._swap_out(state)
    (copy,) = engine.pending
    assert engine.waits == [(e.kv.compute_stream, copy)] and not copy.done()
    assert e.kv.metrics.fenced_releases == 1
    engine.complete_all()
    state.is_cpu_offloaded = True
    e.restore(state)
    e.kv.poll(wait=True)
    e.cache.free_blocks("a")
    assert e.inst.leaks() == []


def test_checked_mode_scans_every_call_and_catches_a_wrong_awaiting_count(model: Any) -> None:
    e = _Engine(model, kt.SwapConfig(host_blocks=8, checked=True))
    state = e.admit("a", 10)
    with pytest.raises(AssertionError, match="scanned"):  # checked mode always scans
        e.kv.restore_scheduled_requests(_Untouchable())
    assert e.kv._swap_out(state)
    e.kv.awaiting_restore = 0  # as if a transition into `swapped` had not been counted
    state.is_cpu_offloaded = True
    with pytest.raises(CheckedModeError, match="awaiting_restore is 0, but 1 machines await"):
        e.restore(state)
    assert e.kv.live["a"].machine.state == gen.SWAPPED and state.is_cpu_offloaded  # refused before any change


def test_cancel_during_swap_in_defers_the_release_to_the_ack(model: Any) -> None:
    """Without fences the device blocks a swap-in still writes stay out of the engine's pool until its ack."""
    engine = DeferredCpuCopyEngine()
    e = _Engine(model, kt.SwapConfig(host_blocks=8, checked=True, copy_engine=engine, fenced=False))
    state = e.admit("a", 10)
    assert e.kv._swap_out(state)  # deferred: waited for and acknowledged at once
    state.is_cpu_offloaded = True
    e.restore(state)
    rec = e.kv.live["a"]
    assert rec.machine.state == gen.SWAPPING_IN and len(engine.pending) == 1
    restored = list(e.allocator.block_table["a"])
    # the B2 hazard: freeing blocks a copy still writes is refused by the ledger
    with pytest.raises(CheckedModeError, match="B2"):
        e.kv.ledger.release_device(rec.key, "test", restored)
    free_before = e.free_blocks()
    e.scheduler.set_request_cancellation("a")
    e.scheduler.clear_cancelled_requests()  # the engine frees the request now ...
    assert rec.machine.state == gen.ENDING
    assert "a" not in e.allocator.block_table and e.free_blocks() == free_before  # ... kvfsm defers it
    assert e.inst.leaks()  # still held while the copy is in flight
    engine.complete_all()
    e.kv.poll()
    assert rec.machine.state == gen.RELEASED and "a" not in e.kv.live
    assert e.free_blocks() == free_before + len(restored)
    assert e.inst.leaks() == []
    ends = {tid("swapping_in", "cancel", "deferred_release"), tid("ending", "swap_in_done", "swap_in_in_flight")}
    assert ends <= e.inst.coverage


class _Logged(list):  # type: ignore[type-arg]
    """DeferredCpuCopyEngine.waits that also logs each wait, in order, into `log`."""

    def __init__(self, items: Any, log: list[Any]) -> None:
        super().__init__(items)
        self.log = log

    def append(self, item: Any) -> None:
        self.log.append(("wait", item))
        super().append(item)


@pytest.mark.parametrize("end", ["finish", "cancel"])
@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_an_end_under_the_swap_in_releases_the_blocks_fenced_against_the_swap_in(
    model: Any, checked: bool, end: str
) -> None:
    """With fences, a request ended while its swap-in (host -> device) is in flight gives its device blocks back
    at once, after the compute stream was made to wait on that swap-in, which still writes them: the next
    writer of a reused block writes after the swap-in's last write, not under it. The host blocks the swap-in
    reads stay held until its ack. A fence against swap-outs only (no wait here) fails: the swap-in lands
    over the next writer's KV, and in checked mode the ledger refuses the release."""
    engine = DeferredCpuCopyEngine(stream_ordered=True)  # the GPU's case: a stream wait orders, lands nothing
    e = _Engine(model, kt.SwapConfig(host_blocks=8, checked=checked, copy_engine=engine, fenced=True))
    pool = e.kv.device_pool
    state = e.admit("a", 10)
    assert e.kv._swap_out(state)
    engine.complete_all()
    e.kv.poll()
    state.is_cpu_offloaded = True
    e.restore(state)
    rec = e.kv.live["a"]
    (load,) = engine.pending
    assert load.direction == "h2d" and rec.machine.state == gen.SWAPPING_IN
    restored, held = list(e.allocator.block_table["a"]), e.kv.host_pool.free_slots
    log: list[Any] = []
    engine.waits = _Logged(engine.waits, log)
    free = e.kv._orig_free_blocks
    e.kv._orig_free_blocks = lambda rid, no_cache=False: (log.append(("free", rid)), free(rid, no_cache))[1]
    free0 = e.free_blocks()
    if end == "finish":
        e.cache.free_blocks("a")
    else:
        e.scheduler.set_request_cancellation("a")
        e.scheduler.clear_cancelled_requests()
    assert rec.machine.state == gen.ENDING_FENCED
    assert log == [("wait", (e.kv.compute_stream, load)), ("free", "a")]  # the wait, on the compute stream, first
    assert not load.done() and e.free_blocks() == free0 + len(restored)  # back at once; the host did not wait
    assert e.kv.host_pool.free_slots == held and e.inst.leaks()  # the swap-in still reads the host blocks
    assert e.kv.metrics.fenced_ends == 1 and e.kv.metrics.deferred_releases == 1
    tokens = e.free_blocks() * pool.tokens_per_block
    e.admit("b", tokens)  # every free block, the released ones among them, written with b's KV
    mine = list(e.allocator.block_table["b"])
    assert set(restored) <= set(mine)
    written = pool.blocks(mine).clone()
    engine.complete_all()  # the swap-in lands now: it wrote before b's KV (ordered by the wait), not over it
    assert torch.equal(pool.blocks(mine), written)
    e.kv.poll()
    assert rec.machine.state == gen.RELEASED and "a" not in e.kv.live
    assert e.kv.host_pool.free_slots == e.kv.host_pool.capacity
    e.cache.free_blocks("b")
    assert e.inst.leaks() == []
    ends = {tid("swapping_in", end, "fenced_release"), tid("ending_fenced", "swap_in_done", "swap_in_in_flight")}
    assert ends <= e.inst.coverage


def test_events_the_spec_declares_errors_are_rejected(model: Any) -> None:
    from kvfsm.errors import EventRejected

    e = _Engine(model, kt.SwapConfig(host_blocks=8, checked=True))
    state = e.admit("a", 10)
    assert e.kv._swap_out(state)
    m = e.kv.live["a"].machine
    with pytest.raises(EventRejected):
        m.finish()  # a swapped request is not running
    with pytest.raises(EventRejected):
        m.preempt()  # nor can it be swapped out twice
    e.kv.reset()
    assert e.inst.leaks() == [] and e.kv.live == {}


class _B15Engine(CopyEngine):
    """The bug of transformers' first CPU offloading (PR #45184): `dst[idx].copy_(src[idx])` writes into
    the temporary that advanced indexing returns, so nothing reaches the destination."""

    def submit_d2h(self, device_pool, device_indices, host_pool, host_indices):  # type: ignore[no-untyped-def]
        plan = plan_copy("d2h", device_pool, device_indices, host_pool, host_indices)
        src, si, dst, di = plan.views()
        dst[:, :, di].copy_(src[:, :, si])
        return CpuCopyEngine().submit_d2h(device_pool, [], host_pool, [])  # a done handle

    def submit_h2d(self, host_pool, host_indices, device_pool, device_indices):  # type: ignore[no-untyped-def]
        plan = plan_copy("h2d", device_pool, device_indices, host_pool, host_indices)
        src, si, dst, di = plan.views()
        dst[:, :, di].copy_(src[:, :, si])
        return CpuCopyEngine().submit_h2d(host_pool, [], device_pool, [])  # a done handle


class _B15RestoreEngine(_B15Engine):
    """Swap-out correct, swap-in broken."""

    def submit_d2h(self, device_pool, device_indices, host_pool, host_indices):  # type: ignore[no-untyped-def]
        return CpuCopyEngine().submit_d2h(device_pool, device_indices, host_pool, host_indices)


@pytest.mark.parametrize("broken", ["swap-out", "swap-in"])
def test_checked_mode_catches_a_copy_that_moves_nothing(model: Any, broken: str) -> None:
    engine = _B15Engine() if broken == "swap-out" else _B15RestoreEngine()
    e = _Engine(model, kt.SwapConfig(host_blocks=8, checked=True, copy_engine=engine))
    state = e.admit("a", 10)
    if broken == "swap-out":
        with pytest.raises(CheckedModeError, match="B15"):
            e.kv._swap_out(state)
        return
    assert e.kv._swap_out(state)
    e.kv.device_pool.storage.zero_()  # the engine reused the freed blocks
    state.is_cpu_offloaded = True
    with pytest.raises(CheckedModeError, match="B15"):
        e.restore(state)


# ---- fenced swap-out: the victim's blocks go back at once, the compute stream waits on the copy ----------


class _StreamHandle(DeferredHandle):
    """A deferred CPU copy whose `wait_stream` only records the stream, as a CUDA handle's `wait_event` orders
    the stream without running anything; the test, playing that stream, completes the copy before it writes
    a reused block. Host waits are counted."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.host_waits = 0
        self.streams: list[Any] = []

    def wait(self) -> None:
        self.host_waits += 1
        super().wait()

    def wait_stream(self, stream: object | None = None) -> None:
        self.streams.append(stream)


class _StreamOrderedEngine(DeferredCpuCopyEngine):
    def _submit(self, plan: Any) -> DeferredHandle:
        plan.device_idx, plan.host_idx = plan.device_idx.clone(), plan.host_idx.clone()
        with self._lock:
            handle = _StreamHandle(self, plan, next(self._seq))
            self._pending[handle.seq] = handle
        return handle


class _LateAckHandle(CopyHandle):
    """A copy that ran at submit, whose completion the host sees only after `lag` queries (a CUDA event is
    seen landed some iterations later); counts host waits and stream waits."""

    def __init__(self, inner: CopyHandle, lag: int) -> None:
        self.direction, self.num_tokens, self.nbytes = inner.direction, inner.num_tokens, inner.nbytes
        self.lag, self.host_waits, self.stream_waits = lag, 0, 0

    def done(self) -> bool:
        if self.lag > 0:
            self.lag -= 1
            return False
        return True

    def wait(self) -> None:
        self.host_waits += 1
        self.lag = 0

    def wait_stream(self, stream: object | None = None) -> None:
        self.stream_waits += 1


class _LateAckEngine(CopyEngine):
    """CpuCopyEngine whose swap-outs are seen landed late (swap-ins at once)."""

    fences = True

    def __init__(self, lag: int) -> None:
        self.lag, self.inner, self.handles = lag, CpuCopyEngine(), []

    def submit_d2h(self, device_pool, device_indices, host_pool, host_indices):  # type: ignore[no-untyped-def]
        h = _LateAckHandle(self.inner.submit_d2h(device_pool, device_indices, host_pool, host_indices), self.lag)
        self.handles.append(h)
        return h

    def submit_h2d(self, host_pool, host_indices, device_pool, device_indices):  # type: ignore[no-untyped-def]
        return self.inner.submit_h2d(host_pool, host_indices, device_pool, device_indices)


@pytest.mark.parametrize("sharing", [False, True], ids=["no-prefix-sharing", "prefix-sharing"])
@pytest.mark.parametrize("lag", [1, 10**9], ids=["seen-at-next-poll", "seen-only-by-a-wait"])
def test_fenced_swap_outs_never_wait_on_the_host_and_still_match_generate(
    model: Any, workload: Any, lag: int, sharing: bool
) -> None:
    """Swap-outs acknowledged at a later poll: the blocks went back at the preempt with one stream wait
    each and no host wait; a restore that comes before the ack waits for that copy, and only there."""
    inputs, expected = workload
    engine = _LateAckEngine(lag)
    outs, inst = run_batch(
        model,
        inputs,
        kt.SwapConfig(host_blocks=64, checked=True, copy_engine=engine, fenced=True),
        cb_config(NUM_BLOCKS, sharing=sharing),
    )
    m = inst.metrics
    assert outs == expected
    assert m.preempts >= 10 and m.fenced_releases == m.preempts == len(engine.handles)
    assert all(h.stream_waits == 1 for h in engine.handles)  # the compute stream waited on every swap-out
    if lag == 1:  # every ack came from a poll; no copy was ever waited for
        assert m.restore_waits == 0 and sum(h.host_waits for h in engine.handles) == 0
    else:  # never seen landed by a query: each restore waited for its own swap-out, nothing else did
        assert m.restore_waits == m.restores == sum(h.host_waits for h in engine.handles)
    assert m.swap_outs_done == m.preempts and m.verified_copies == m.swap_outs_done + m.swap_ins_done
    assert SWAP_OUT[True] in inst.coverage and inst.leaks() == []


def test_fenced_is_the_default_over_a_fencing_engine_and_refused_over_one_that_does_not(model: Any) -> None:
    assert _Engine(model, kt.SwapConfig(host_blocks=8)).kv.fenced
    assert not _Engine(model, kt.SwapConfig(host_blocks=8, copy_engine=_B15Engine())).kv.fenced  # fences nothing
    with pytest.raises(ValueError, match="does not fence"):
        _Engine(model, kt.SwapConfig(host_blocks=8, copy_engine=_B15Engine(), fenced=True))


def test_fenced_swap_out_returns_the_blocks_at_once_and_is_acknowledged_later(model: Any) -> None:
    engine = _StreamOrderedEngine()
    e = _Engine(model, kt.SwapConfig(host_blocks=8, checked=True, copy_engine=engine))
    state = e.admit("a", 10)
    pool = e.kv.device_pool
    blocks = list(e.allocator.block_table["a"])
    before = pool.blocks(blocks).clone()
    free0 = e.free_blocks()
    assert e.kv._swap_out(state)
    rec = e.kv.live["a"]
    (h,) = engine.pending
    assert rec.machine.state == gen.SWAPPING_OUT_FENCED and rec.copy.fence is not None
    assert "a" not in e.allocator.block_table and e.free_blocks() == free0 + len(blocks)  # back at once ...
    assert h.streams == [None] and h.host_waits == 0  # ... after the compute stream's wait (CPU: None), no host wait
    assert sorted(e.kv.ledger.fenced) == sorted(blocks) and e.inst.leaks()
    e.kv.poll()
    assert rec.machine.state == gen.SWAPPING_OUT_FENCED  # not landed: not acknowledged
    engine.complete_all()  # the copy reads the blocks: the stream's wait orders it before any write of them
    pool.storage.zero_()  # then the engine rewrites the reused blocks
    e.kv.poll()
    assert rec.machine.state == gen.SWAPPED and e.kv.ledger.fenced == {}  # verified against the snapshot (B15)
    state.is_cpu_offloaded = True
    e.restore(state)
    engine.complete_all()
    e.kv.poll()
    assert rec.machine.state == gen.RESIDENT
    assert torch.equal(pool.blocks(e.allocator.block_table["a"][: len(blocks)]), before)
    assert h.host_waits == 0 and e.kv.metrics.restore_waits == 0 and e.kv.metrics.verified_copies == 2
    e.cache.free_blocks("a")
    assert e.inst.leaks() == [] and {SWAP_OUT[True], SWAP_OUT_DONE[True]} <= e.inst.coverage


def test_cancel_during_a_fenced_swap_out_frees_the_host_blocks_at_the_ack(model: Any) -> None:
    engine = _StreamOrderedEngine()
    e = _Engine(model, kt.SwapConfig(host_blocks=8, checked=True, copy_engine=engine))
    state = e.admit("a", 10)
    assert e.kv._swap_out(state)
    rec = e.kv.live["a"]
    used = e.kv.host_pool.capacity - e.kv.host_pool.free_slots
    e.scheduler.set_request_cancellation("a")
    for cancelled in e.scheduler.clear_cancelled_requests():  # the engine frees it: its machine's cancel ...
        e.kv.free_request_cpu_cache(cancelled)  # ... and then, as the batch processor does, a declared no-op
    assert rec.machine.state == gen.ENDING_FENCED and e.kv.metrics.ignored_ends == 1
    assert e.kv.host_pool.capacity - e.kv.host_pool.free_slots == used > 0  # the copy still writes them
    assert e.inst.leaks()
    engine.complete_all()
    e.kv.poll()
    assert rec.machine.state == gen.RELEASED and "a" not in e.kv.live
    assert e.inst.leaks() == [] and e.kv.host_pool.free_slots == e.kv.host_pool.capacity
    ends = {tid("swapping_out_fenced", "cancel"), tid("ending_fenced", "swap_out_done", "swap_out_in_flight")}
    assert ends <= e.inst.coverage


def test_a_restore_before_the_fenced_swap_out_landed_waits_for_it(model: Any) -> None:
    engine = _StreamOrderedEngine()
    e = _Engine(model, kt.SwapConfig(host_blocks=8, checked=True, copy_engine=engine))
    state = e.admit("a", 10)
    pool = e.kv.device_pool
    before = pool.blocks(e.allocator.block_table["a"]).clone()
    assert e.kv._swap_out(state)
    (h,) = engine.pending
    state.is_cpu_offloaded = True
    e.restore(state)  # the swap-in reads the host blocks the swap-out writes: it waits for it, on the host
    rec = e.kv.live["a"]
    assert h.host_waits == 1 and e.kv.metrics.restore_waits == 1 and rec.machine.state == gen.SWAPPING_IN
    engine.complete_all()
    e.kv.poll()
    assert rec.machine.state == gen.RESIDENT
    assert torch.equal(pool.blocks(e.allocator.block_table["a"][: before.shape[2]]), before)


# ---- a victim whose swap-in is not seen landed yet --------------------------------------------------------
# transformers' async batching chooses the victims of batch N+1 while batch N, which may read a request just
# restored, still runs on the GPU: a victim's swap-in can still be in flight at its preemption (how often
# depends only on the GPU's pace, seen in GPU tests run ten at a time). The spec preempts only `resident`:
# the swap-out waits for that swap-in first. These tests decide when each copy is seen landed.


def test_preempting_a_request_whose_swap_in_is_in_flight_waits_for_it(model: Any) -> None:
    engine = DeferredCpuCopyEngine()
    e = _Engine(model, kt.SwapConfig(host_blocks=8, checked=True, copy_engine=engine))
    state = e.admit("a", 10)
    pool = e.kv.device_pool
    before = pool.blocks(e.allocator.block_table["a"]).clone()
    assert e.kv._swap_out(state)  # fenced: the fence's wait completes a deferred CPU copy, acknowledged at once
    state.is_cpu_offloaded = True
    e.restore(state)
    rec = e.kv.live["a"]
    (swap_in,) = engine.pending
    assert rec.machine.state == gen.SWAPPING_IN and not swap_in.done()
    assert e.kv._swap_out(state)  # chosen again before its swap-in was seen landed: waits for it, then swaps out
    assert swap_in.done() and e.kv.metrics.preempt_waits == 1 and e.kv.metrics.swap_ins_done == 1
    assert rec.machine.state == gen.SWAPPED and e.kv.metrics.preempts == 2
    pool.storage.zero_()  # the engine reuses the blocks
    state.is_cpu_offloaded = True
    e.restore(state)
    engine.complete_all()
    e.kv.poll()
    assert rec.machine.state == gen.RESIDENT and e.kv.metrics.verified_copies == 4  # B15: every copy compared
    assert torch.equal(pool.blocks(e.allocator.block_table["a"][: before.shape[2]]), before)
    e.cache.free_blocks("a")
    assert e.inst.leaks() == [] and e.kv.metrics.preempt_waits == 1
    assert {tid("swapping_in", "swap_in_done"), SWAP_OUT[True]} <= e.inst.coverage


class _LateSwapInHandle(CopyHandle):
    """A swap-in that ran at submit, seen landed only by a host wait or by the poll of an engine free (by
    then the forward that read it has completed: on the GPU its event has passed). Counts host waits."""

    def __init__(self, inner: CopyHandle, engine: _LateSwapInEngine) -> None:
        self.direction, self.num_tokens, self.nbytes = inner.direction, inner.num_tokens, inner.nbytes
        self.engine, self.seen, self.host_waits = engine, False, 0

    def done(self) -> bool:
        self.seen = self.seen or self.engine.freeing > 0
        return self.seen

    def wait(self) -> None:
        self.host_waits += 1
        self.seen = True

    def wait_stream(self, stream: object | None = None) -> None:
        pass


class _LateSwapInEngine(CopyEngine):
    """CpuCopyEngine whose swap-ins the host sees landed as late as a GPU can show them: not at the polls of
    the restore and of the next offload (the GPU may still be running the batch before), only by a wait or
    at an engine free. `freeing` is set by the test around the manager's handling of engine frees."""

    fences = True

    def __init__(self) -> None:
        self.inner, self.swap_ins, self.freeing = CpuCopyEngine(), [], 0

    def submit_d2h(self, device_pool, device_indices, host_pool, host_indices):  # type: ignore[no-untyped-def]
        return self.inner.submit_d2h(device_pool, device_indices, host_pool, host_indices)

    def submit_h2d(self, host_pool, host_indices, device_pool, device_indices):  # type: ignore[no-untyped-def]
        h = _LateSwapInHandle(self.inner.submit_h2d(host_pool, host_indices, device_pool, device_indices), self)
        self.swap_ins.append(h)
        return h


@pytest.mark.parametrize("sharing", [False, True], ids=["no-prefix-sharing", "prefix-sharing"])
def test_victims_whose_swap_in_is_not_seen_landed_wait_for_it_and_still_match_generate(
    model: Any, workload: Any, sharing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every swap-in is still in flight, as far as the host can tell, when the next victims are chosen: a
    request restored and chosen again (what async batching on a busy GPU does) waits for its own swap-in,
    and only there. Before, its `preempt` in `swapping_in` was rejected and the engine failed every request."""
    inputs, expected = workload
    engine = _LateSwapInEngine()
    frees = kt.KvfsmOffloadingManager._engine_frees

    def engine_frees(self: kt.KvfsmOffloadingManager, request_id: str, no_cache: bool = False) -> None:
        engine.freeing += 1
        try:
            frees(self, request_id, no_cache)
        finally:
            engine.freeing -= 1

    monkeypatch.setattr(kt.KvfsmOffloadingManager, "_engine_frees", engine_frees)
    outs, inst = run_batch(
        model,
        inputs,
        kt.SwapConfig(host_blocks=64, checked=True, copy_engine=engine),
        cb_config(NUM_BLOCKS, sharing=sharing),
    )
    m = inst.metrics
    assert outs == expected
    assert m.preempts >= 10 and m.restores == m.preempts == m.swap_outs_done == m.swap_ins_done
    assert m.preempt_waits >= 1 and m.preempt_waits == sum(h.host_waits for h in engine.swap_ins)
    assert m.restore_waits == 0 and m.verified_copies == m.swap_outs_done + m.swap_ins_done
    assert inst.leaks() == []


def test_checked_mode_flags_a_fenced_release_no_stream_waited_on(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fault "the release skips the compute stream's wait": the engine could rewrite a block before the
    copy has read it. The ledger refuses the release."""
    monkeypatch.setattr(SlotFence, "wait", lambda self, stream=None: None)
    e = _Engine(model, kt.SwapConfig(host_blocks=8, checked=True, copy_engine=_StreamOrderedEngine()))
    state = e.admit("a", 10)
    with pytest.raises(CheckedModeError, match="no stream has waited on"):
        e.kv._swap_out(state)


def test_without_the_wait_the_reused_block_is_rewritten_under_the_copy(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same fault with the ledger off: the deferred CPU engine's copy reads the blocks only when it runs,
    so the rewrite really lands in the host blocks, and checked mode's snapshot comparison catches it."""
    monkeypatch.setattr(SlotFence, "wait", lambda self, stream=None: None)
    engine = DeferredCpuCopyEngine()
    e = _Engine(model, kt.SwapConfig(host_blocks=8, checked=True, copy_engine=engine))
    e.kv.ledger = None  # it would refuse the release first
    state = e.admit("a", 10)
    assert e.kv._swap_out(state) and e.kv.live["a"].machine.state == gen.SWAPPING_OUT_FENCED
    e.kv.device_pool.storage.zero_()  # the engine rewrites the reused blocks before the copy has read them
    engine.complete_all()
    with pytest.raises(CheckedModeError, match="B15"):
        e.kv.poll()


def test_the_ledger_sees_the_engines_writes_into_fenced_blocks(model: Any) -> None:
    """Checked mode wraps the calls naming the blocks the next kernels write; a write into a block the
    swap-out still reads passes only while its fence was waited on or has passed."""
    from kvfsm.integrations.transformers.compat import FULL_ATTENTION

    engine = _StreamOrderedEngine()
    e = _Engine(model, kt.SwapConfig(host_blocks=8, checked=True, copy_engine=engine))
    state = e.admit("a", 10)
    blocks = list(e.allocator.block_table["a"])
    assert e.kv._swap_out(state)
    tokens = e.free_blocks() * e.kv.device_pool.tokens_per_block
    e.admit("b", tokens, fill=False)  # every free block, the victim's among them
    mine = e.allocator.block_table["b"]
    assert set(blocks) <= set(mine)

    def prefill() -> None:
        e.cache.extend_read_and_write_indices("b", 0, tokens, None, [[]])

    prefill()  # ordered after the copy: the compute stream waited on its fence at the release
    (fence,) = {id(f): f for readers in e.kv.ledger.fenced.values() for f in readers.values()}.values()
    fence.waited = False  # as if no stream had waited on it
    with pytest.raises(CheckedModeError, match="neither passed nor been waited on"):
        prefill()
    with pytest.raises(CheckedModeError, match="neither passed nor been waited on"):
        e.cache.perform_cache_copy({FULL_ATTENTION: ([mine[-1]], [blocks[0]])})  # a block fork into it
    engine.complete_all()
    e.kv.poll()  # landed and acknowledged: nothing fences the blocks any more
    prefill()
    assert e.kv.ledger.fenced == {}


class _Pending(CopyHandle):
    """A copy not landed until `landed` is set; records the streams made to wait on it."""

    def __init__(self) -> None:
        self.landed = False
        self.streams: list[Any] = []

    def done(self) -> bool:
        return self.landed

    def wait(self) -> None:
        self.landed = True

    def wait_stream(self, stream: object | None = None) -> None:
        self.streams.append(stream)


def test_swap_ledger_takes_a_fenced_release_only_covered_and_waited_on() -> None:
    led = kt.SwapLedger()
    h = _Pending()
    led.copy_started("a#1", "preempt", "d2h", [5, 6], [0, 1])
    led.copy_submitted("a#1", h)
    with pytest.raises(CheckedModeError, match="still reads"):
        led.device_write("b#2", [6])
    with pytest.raises(CheckedModeError, match="B2"):
        led.release_device("a#1", "preempt", [5, 6])  # plain, under the copy
    with pytest.raises(CheckedModeError, match="misses"):
        led.release_device("a#1", "preempt", [5, 6], SlotFence([_Pending()]))
    fence = SlotFence([h])
    with pytest.raises(CheckedModeError, match="no stream has waited on"):
        led.release_device("a#1", "preempt", [5, 6], fence)
    fence.wait("compute")
    assert h.streams == ["compute"]
    led.release_device("a#1", "preempt", [5, 6], fence)
    assert led.in_flight == {} and set(led.fenced) == {5, 6}
    led.device_write("b#2", [6])
    fence.waited = False
    with pytest.raises(CheckedModeError, match="neither passed nor been waited on"):
        led.device_write("b#2", [6])
    h.landed = True
    led.device_write("b#2", [6])  # passed: a query says so
    led.copy_done("a#1", [5, 6])
    led.free_host("a#1", "swap_out_done", [0, 1])
    assert led.fenced == {} and led.handles == {} and led.host_owner == {}


def test_swap_ledger_takes_a_release_under_a_swap_in_only_fenced_against_that_swap_in() -> None:
    """The swap-in writes the device blocks: a release under it is fenced against it (not against some swap-out),
    and only by the request whose swap-in it is; its host blocks stay held until the ack."""
    led = kt.SwapLedger()
    out, load = _Pending(), _Pending()
    led.copy_started("a#1", "preempt", "d2h", [5, 6], [0, 1])
    led.copy_submitted("a#1", out)
    out.landed = True
    led.copy_done("a#1", [5, 6])
    led.copy_started("a#1", "restore", "h2d", [8, 9], [0, 1])
    led.copy_submitted("a#1", load)
    with pytest.raises(CheckedModeError, match="in-flight h2d copy of a#1 still uses"):
        led.release_device("a#1", "end", [8, 9])  # plain, under the swap-in
    with pytest.raises(CheckedModeError, match="misses the h2d copy that still writes"):
        led.release_device("a#1", "end", [8, 9], SlotFence([out]))  # fenced against the (landed) swap-out only
    fence = SlotFence([load])
    with pytest.raises(CheckedModeError, match="only a request's own copy"):
        led.release_device("b#2", "end", [8, 9], fence)
    with pytest.raises(CheckedModeError, match="no stream has waited on"):
        led.release_device("a#1", "end", [8, 9], fence)
    fence.wait("compute")
    led.release_device("a#1", "end", [8, 9], fence)
    assert led.in_flight == {} and set(led.fenced) == {8, 9} and led.host_owner == {0: "a#1", 1: "a#1"}
    led.device_write("b#2", [9])
    fence.waited = False
    with pytest.raises(CheckedModeError, match="neither passed nor been waited on"):
        led.device_write("b#2", [9])
    load.landed = True
    led.copy_done("a#1", [8, 9])
    led.free_host("a#1", "swap_in_done", [0, 1])
    assert led.fenced == {} and led.handles == {} and led.host_owner == {}


# ---- the same on the H200: CUDA cache, CUDA copy engine ----------------------------------------------
# `acks`: "as-they-land" sees each copy landed when its event has passed (how often a restore or a preemption
# comes before that depends on the GPU's pace: async batching on a GPU shared by ten test processes, say);
# "seen-late" sees every swap-out landed only by a host wait and every swap-in only by a wait or at an engine
# free, so both of those waits happen in every run.

ACKS = ["as-they-land", "seen-late"]


def _cuda_copies_seen_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaCopyHandle.done() is the event's query only once the copy was waited for on the host, or, for a
    swap-in, inside the manager's handling of an engine free (the forward that read it has completed, so
    its event has passed: what a GPU running as far behind as it can would show)."""
    from kvfsm.dataplane.copy.cuda import CudaCopyHandle

    done, wait, frees = CudaCopyHandle.done, CudaCopyHandle.wait, kt.KvfsmOffloadingManager._engine_frees
    freeing = [0]

    def late_done(self: CudaCopyHandle) -> bool:
        if not getattr(self, "seen_by_test", False) and not (self.direction == "h2d" and freeing[0]):
            return False
        return done(self)

    def seen_wait(self: CudaCopyHandle) -> None:
        self.seen_by_test = True  # type: ignore[attr-defined]
        wait(self)

    def engine_frees(self: kt.KvfsmOffloadingManager, request_id: str, no_cache: bool = False) -> None:
        freeing[0] += 1
        try:
            frees(self, request_id, no_cache)
        finally:
            freeing[0] -= 1

    monkeypatch.setattr(CudaCopyHandle, "done", late_done)
    monkeypatch.setattr(CudaCopyHandle, "wait", seen_wait)
    monkeypatch.setattr(kt.KvfsmOffloadingManager, "_engine_frees", engine_frees)


@pytest.mark.gpu
@pytest.mark.parametrize("acks", ACKS)
@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "deferred"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_generate_batch_swaps_on_cuda(
    asynchronous: bool, fenced: bool, acks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_llama("cuda")
    inputs = prompts(N_REQUESTS)
    expected = reference_outputs(model, inputs, NEW_TOKENS)
    if acks == "seen-late":
        _cuda_copies_seen_late(monkeypatch)
    cb = cb_config(NUM_BLOCKS, use_async_batching=asynchronous, use_cuda_graph=asynchronous)
    outs, inst = run_batch(model, inputs, kt.SwapConfig(host_blocks=64, checked=True, fenced=fenced), cb)
    (kv,) = inst.managers
    m = inst.metrics
    print(
        f"\ncuda {'async' if asynchronous else 'sync'} {'fenced' if fenced else 'deferred'} {acks} "
        f"({type(kv.engine).__name__}): {m.as_dict()}"
    )
    assert type(kv.engine).__name__ == "CudaCopyEngine" and kv.host_pool.pinned
    assert outs == expected
    assert m.preempts >= 10 and m.swap_ins_done == m.restores == m.preempts
    assert m.fenced_releases == (m.preempts if fenced else 0)
    assert m.verified_copies == m.swap_outs_done + m.swap_ins_done  # B15, also for copies acknowledged by a wait
    if acks == "seen-late":
        assert m.preempt_waits >= 1 and m.restore_waits == (m.restores if fenced else 0)
    assert inst.leaks() == []


@pytest.mark.gpu
@pytest.mark.parametrize("acks", ACKS)
@pytest.mark.parametrize("on_compute", [True, False], ids=["compute-stream", "copy-stream"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_fenced_swap_out_on_cuda_never_synchronizes(
    asynchronous: bool, on_compute: bool, acks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every swap-out and every restore call runs under torch.cuda.set_sync_debug_mode("error"): a host-device
    synchronisation in it (a blocking transfer, a stream or device synchronize) raises. The one host wait the
    spec allows there is for the request's own copy when the host has not yet seen it landed: a restore
    before its fenced swap-out (`restore_waits`), a preemption before its swap-in (`preempt_waits`). The debug
    mode does not see an event wait, so each CudaCopyHandle.wait inside these calls is counted, by direction,
    and must be exactly the waits those metrics declare (none at all in sync batching, which synchronises the
    compute stream after every step). Checked mode is off: its snapshots synchronise. Both places a swap's copy
    can run: the engine's compute stream, or a copy stream."""
    from kvfsm.dataplane.copy.cuda import CudaCopyHandle

    model = tiny_llama("cuda")
    inputs = prompts(N_REQUESTS)
    expected = reference_outputs(model, inputs, NEW_TOKENS)
    if acks == "seen-late":
        _cuda_copies_seen_late(monkeypatch)
    strict_calls: dict[str, list[Any]] = {"_swap_out": [], "restore_scheduled_requests": []}
    inside: list[str] = []
    waits: list[str] = []  # the direction of each copy waited for inside a strict call

    def strict(name: str) -> Any:
        real = getattr(kt.KvfsmOffloadingManager, name)

        def call(self: kt.KvfsmOffloadingManager, *args: Any) -> Any:
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            inside.append(name)
            try:
                out = real(self, *args)
            finally:
                inside.pop()
                torch.cuda.set_sync_debug_mode(previous)
            strict_calls[name].append(out)
            return out

        return call

    wait = CudaCopyHandle.wait

    def counted_wait(self: CudaCopyHandle) -> None:
        if inside:
            waits.append(self.direction)
        wait(self)

    for name in strict_calls:
        monkeypatch.setattr(kt.KvfsmOffloadingManager, name, strict(name))
    monkeypatch.setattr(CudaCopyHandle, "wait", counted_wait)
    cb = cb_config(NUM_BLOCKS, use_async_batching=asynchronous, use_cuda_graph=asynchronous)
    outs, inst = run_batch(
        model, inputs, kt.SwapConfig(host_blocks=64, fenced=True, copy_on_compute_stream=on_compute), cb
    )
    (kv,) = inst.managers
    m = inst.metrics
    print(f"\ncuda {'async' if asynchronous else 'sync'} fenced {acks}, sync debug: {m.as_dict()}")
    assert type(kv.engine).__name__ == "CudaCopyEngine" and kv.fenced and kv._stream_bound
    assert kv.engine.on_compute_stream is on_compute and kv.engine.compute_stream is kv.compute_stream
    assert outs == expected
    assert m.preempts >= 10 and len(strict_calls["_swap_out"]) == m.preempts + m.soft_resets
    assert len(strict_calls["restore_scheduled_requests"]) == m.restore_calls and m.restores == m.preempts
    assert m.fenced_releases == m.preempts == m.swap_outs_done
    assert waits.count("d2h") == m.restore_waits and waits.count("h2d") == m.preempt_waits
    assert len(waits) == m.restore_waits + m.preempt_waits
    if acks == "seen-late":
        assert m.restore_waits == m.restores and m.preempt_waits >= 1
    elif not asynchronous:
        assert waits == []
    assert inst.leaks() == []


@pytest.mark.gpu
def test_warm_up_copies_what_the_engine_wrote_before_it_on_another_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up swaps blocks 0 and 1 (block 0 is the read trash, zeroed by the engine on the stream it built
    its cache on) out and back. Copies on the compute stream are not ordered after that stream: here the
    engine's write lands between the swap-out and the swap-in (held back 200 ms, then waited for just before the
    swap-in), which wrote the stale bytes back over it before the warm-up synchronised first. The race that
    explains request 0's wrong first tokens in async batching with CUDA graphs (whose padding tokens read the
    read trash) when ten test processes shared the GPU."""
    model = tiny_llama("cuda")
    manager = model.init_continuous_batching(
        generation_config=generation_config(4), continuous_batching_config=cb_config(NUM_BLOCKS)
    )
    kt.install(manager, kt.SwapConfig(host_blocks=8))
    kv = manager._create_batch_processor().offloading_manager
    pool, engine = kv.device_pool, kv.engine
    before = pool.blocks([0, 1])
    written = torch.full_like(before, 7.0)
    real_h2d = engine.submit_h2d

    def submit_h2d(*args: Any) -> Any:
        torch.cuda.default_stream(pool.device).synchronize()  # the engine's write lands now, after the swap-out
        return real_h2d(*args)

    monkeypatch.setattr(engine, "submit_h2d", submit_h2d)
    with torch.cuda.stream(torch.cuda.default_stream(pool.device)):
        torch.cuda._sleep(400_000_000)  # ~200 ms of other work ahead of the engine's write on its stream
        pool.kv[:, :, :2] = written
    kv.warm_up()
    torch.cuda.synchronize()
    assert torch.equal(pool.blocks([0, 1]), written)
    assert kv.host_pool.free_slots == kv.host_pool.capacity


@pytest.mark.gpu
@pytest.mark.parametrize("end", ["finish", "cancel"])
def test_an_end_under_a_swap_in_on_cuda_is_fenced_and_never_synchronizes(
    end: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA twin of test_an_end_under_the_swap_in_releases_the_blocks_fenced_against_the_swap_in: a request
    ended while its swap-in is in flight (the host sees it landed only once the test says so) gives its device
    blocks back under torch.cuda.set_sync_debug_mode("error"), fenced against the swap-in; the engine's next
    write of them on the compute stream lands after the swap-in's, and the host blocks go back only at its ack.
    The compute stream also waited on the swap-in at its submit, so a fence of the wrong direction is told
    apart by the CPU twin, not here."""
    from kvfsm.dataplane.copy.cuda import CudaCopyHandle

    done, landed = CudaCopyHandle.done, [False]
    monkeypatch.setattr(CudaCopyHandle, "done", lambda self: (self.direction != "h2d" or landed[0]) and done(self))
    e = _Engine(tiny_llama("cuda"), kt.SwapConfig(host_blocks=8, fenced=True))
    kv, pool = e.kv, e.kv.device_pool
    assert type(kv.engine).__name__ == "CudaCopyEngine" and kv.fenced
    state = e.admit("a", 10, fill=False)
    blocks = list(e.allocator.block_table["a"])
    pool.kv.index_copy_(2, torch.tensor(blocks, device=pool.device), torch.randn_like(pool.kv[:, :, blocks]))
    assert kv._swap_out(state)
    torch.cuda.synchronize()
    kv.poll()
    state.is_cpu_offloaded = True
    with kv.stream_ctx():
        torch.cuda._sleep(200_000_000)  # work ahead of the swap-in on the stream it is ordered after
    e.restore(state)
    rec = kv.live["a"]
    assert rec.machine.state == gen.SWAPPING_IN
    restored, held, free0 = list(e.allocator.block_table["a"]), kv.host_pool.free_slots, e.free_blocks()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        if end == "finish":
            e.cache.free_blocks("a")
        else:
            e.scheduler.set_request_cancellation("a")
            e.scheduler.clear_cancelled_requests()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert rec.machine.state == gen.ENDING_FENCED and kv.metrics.fenced_ends == 1
    assert e.free_blocks() == free0 + len(restored) and kv.host_pool.free_slots == held
    reused = torch.tensor(restored, device=pool.device)
    with kv.stream_ctx():
        pool.kv.index_fill_(2, reused, 7.0)  # the engine's next write of the reused blocks, on its compute stream
    torch.cuda.synchronize()
    assert bool((pool.kv.index_select(2, reused) == 7.0).all())  # written after the swap-in, not under it
    landed[0] = True
    kv.poll()
    assert rec.machine.state == gen.RELEASED and kv.host_pool.free_slots == kv.host_pool.capacity
    assert e.inst.leaks() == []
