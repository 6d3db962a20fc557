"""The serving path's CPU twins: what the GPU tests (tests/gpu/test_serving_path_gpu.py) prove under
`torch.cuda.set_sync_debug_mode("error")`, shown here without a GPU.

- The manager never reads the request table's device tensor: with the table on the `meta` device (a
  tensor whose values cannot be read at all) every entry point behaves exactly as with a CPU table.
- Copy planning never reads device slot indices that live off the CPU, and checks CPU ones against the
  allocator's host-side state before anything is copied.
- Index staging hands a region out again only once its copy's event says it has passed, and never
  waits for one.
- The hot path leaves no reference cycles for the garbage collector, and the stored-page index keeps
  nothing the collector tracks however large it grows.
- A request's release reads and frees its slots from the table's host mirror with no torch call, and the
  batch path's torch calls do not grow with its chunks: each torch call lets go of the interpreter lock
  (docs/performance.md, "The interpreter lock on the scheduler's thread").
"""

from __future__ import annotations

import gc
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.runtime.test_offload_batch import batch_arrays, run_workload

from kvfsm.dataplane import HostKVPool, KVCacheConfig, OutOfRange, ReqToTokenPool
from kvfsm.dataplane.copy.base import plan_copy
from kvfsm.dataplane.copy.staging import PinnedIndexStaging
from kvfsm.dataplane.pools.device_pool import DeviceKVPool
from kvfsm.dataplane.storage import FaultyStorage
from kvfsm.runtime.stored_index import StoredPageIndex
from kvfsm.verify.engine import SimEngine

# ---- the request table --------------------------------------------------------------------------------


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_a_table_nobody_can_read_changes_nothing(batched: bool, checked: bool, seed: int) -> None:
    """offload/offload_batch, check_progress, finish/abort/retract and drain over a `meta` request table
    (any read of it raises) make the same transitions, copies, frees and stores as over a CPU table."""
    kw: dict[str, Any] = dict(page_size=2, stride=4, host_slots=16, checked=checked)
    assert run_workload(batched, seed, **kw, table_device="meta") == run_workload(batched, seed, **kw)


def test_table_write_keeps_the_mirror_and_rejects_before_changing_it() -> None:
    table = ReqToTokenPool(rows=2, max_context=8, device="meta")
    row = table.alloc()
    table.write(row, 2, torch.tensor([10, 11, 12]))
    assert table.read_host(row, 0, 5).tolist() == [0, 0, 10, 11, 12]
    assert table.read(row, 0, 5).device.type == "meta"
    before = table.host_table.clone()
    with pytest.raises(OutOfRange):
        table.write(row, 6, torch.tensor([1, 2, 3]))  # past max_context
    with pytest.raises(OutOfRange):
        table.write(row, 0, torch.tensor([1.5]))  # not integers
    assert torch.equal(table.host_table, before)


# ---- copy planning ---------------------------------------------------------------------------------


def _pools(device: str) -> tuple[DeviceKVPool, HostKVPool]:
    kv = KVCacheConfig.tiny()
    return DeviceKVPool.create(kv, 64, device), HostKVPool(kv, 32, 4, pin_memory=False)


def test_plan_copy_counts_device_indices_off_the_cpu_without_reading_them() -> None:
    device_pool, host_pool = _pools("meta")
    pages = host_pool.allocator.alloc_pages(2)
    plan = plan_copy("d2h", device_pool, torch.arange(8, device="meta"), host_pool, host_pool.page_slots(pages))
    assert plan.device_idx.device.type == "meta" and plan.num_tokens == 8


def test_plan_copy_keeps_cpu_device_indices_on_the_cpu_and_checks_them() -> None:
    device_pool, host_pool = _pools("meta")
    slots = host_pool.page_slots(host_pool.allocator.alloc_pages(1))
    plan = plan_copy("d2h", device_pool, torch.tensor([4, 5, 6, 7]), host_pool, slots)
    assert plan.device_idx.device.type == "cpu"  # the engine uploads it, without blocking
    with pytest.raises(OutOfRange):
        plan_copy("d2h", device_pool, torch.tensor([4, 5, 6, 64]), host_pool, slots)


def test_manager_hands_the_copy_engine_cpu_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    e = SimEngine(page_size=2, stride=2, host_slots=16, table_device="meta")
    seen: list[str] = []
    submit = e.copies.submit_d2h

    def record(device_pool, device_indices, host_pool, host_indices):  # type: ignore[no-untyped-def]
        t = getattr(device_indices, "slots", device_indices)
        seen.append(t.device.type)
        return submit(device_pool, device_indices, host_pool, host_indices)

    monkeypatch.setattr(e.copies, "submit_d2h", record)
    reqs = [e.admit(f"r{i}", 5) for i in range(3)]
    for _ in range(4):
        for r in reqs:
            e.decode(r)
        e.manager.offload_batch(reqs, [r.req_pool_idx for r in reqs], [r.kv_committed_len for r in reqs])
        e.copies.complete_all()
        e.manager.check_progress()
    assert seen and set(seen) == {"cpu"}


def test_mean_copy_size_from_the_page_list_equals_the_slot_count() -> None:
    from kvfsm.dataplane.copy.cuda import mean_copy_bytes

    _, host_pool = _pools("meta")
    rng = random.Random(1)
    for _ in range(50):
        pages = rng.sample(range(1, 8), rng.randint(1, 7))
        pages.sort(key=lambda p: p + rng.random() * 3)  # runs of neighbours, broken at random
        slots = host_pool.allocator.slots_of(pages)
        assert mean_copy_bytes(host_pool, slots, pages) == pytest.approx(mean_copy_bytes(host_pool, slots))


# ---- pinned index staging ----------------------------------------------------------------------------


class FakeEvent:
    """An event the test passes by hand; staging may only query it (a synchronize would be a wait)."""

    def __init__(self) -> None:
        self.passed = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.passed


def test_staging_reuses_a_region_only_after_its_copy_passed() -> None:
    staging = PinnedIndexStaging(capacity=16, pin_memory=False)
    rng = random.Random(0)
    live: list[tuple[np.ndarray, np.ndarray, FakeEvent]] = []  # (region view, what was written, its event)
    for step in range(400):
        n = rng.randint(0, 12)
        _, view = staging.reserve(n)
        data = np.arange(step * 100, step * 100 + n, dtype=np.int64)
        view[:] = data
        event = FakeEvent()
        staging.mark(event)
        live.append((view, data, event))
        for item in live:  # the GPU finishes copies in order, at random times
            if not item[2].passed and rng.random() < 0.3:
                item[2].passed = True
                break
        for v, d, ev in live:
            if not ev.passed:  # a region still being read was never handed out again
                assert np.array_equal(v, d), step
        live = [item for item in live if not item[2].passed]
    assert staging.capacity >= 16


def test_staging_grows_instead_of_waiting() -> None:
    staging = PinnedIndexStaging(capacity=8, pin_memory=False)
    events = []
    for _ in range(5):
        _, view = staging.reserve(6)
        view[:] = 1
        events.append(FakeEvent())
        staging.mark(events[-1])  # none ever passes
    assert staging.capacity >= 30  # grew (each full buffer stays alive until its copies pass)
    for ev in events:
        ev.passed = True
    staging.reserve(1)
    assert not staging._retired and len(staging._busy) == 0  # reclaimed by queries alone


def test_staging_mark_without_reserve_is_an_error() -> None:
    with pytest.raises(RuntimeError):
        PinnedIndexStaging(pin_memory=False).mark(FakeEvent())


# ---- the garbage collector -----------------------------------------------------------------------------


class FlakyStoreEngine(SimEngine):
    """A store that fails every third page write (by key), so backups fail as well as succeed."""

    def make_storage(self) -> Any:
        return FaultyStorage(self.store, fail_writes=lambda key: int(key[:8], 16) % 3 == 0)


@pytest.mark.parametrize("checked", [False, True])
def test_the_hot_path_leaves_no_reference_cycles(checked: bool) -> None:
    """Every lifecycle ending (finish under in-flight copies and backups, abort, retract, failed backups),
    the request objects dropped by the engine as it goes: with the manager still alive, a collection
    finds nothing to free (a server's collector never has a manager's garbage to walk)."""
    e = FlakyStoreEngine(page_size=2, stride=2, host_slots=16, checked=checked)
    gc.collect()
    gc.disable()
    try:
        gc.set_debug(gc.DEBUG_SAVEALL)
        for seed in range(3):
            run_workload(True, seed, 80, engine=e)
        m = e.manager.metrics
        assert m.releases > 10 and m.stored_pages > 10 and m.backup_failures > 0
        gc.collect()
        # kvfsm's objects only: threads left by earlier tests may drop cycles of their own meanwhile
        ours = [o for o in gc.garbage if type(o).__module__.startswith(("kvfsm", "generated"))]
        assert not ours, sorted({type(o).__qualname__ for o in ours})[:12]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_stored_index_holds_nothing_the_collector_tracks() -> None:
    index = StoredPageIndex(limit=50_000)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(120_000):  # more than the limit: the oldest go first
        index.put(f"{i:064x}", f"req#{i % 7}", i * 4)
    gc.collect()
    assert len(gc.get_objects()) - before < 2_000  # not one tracked object per entry (120k); slack for other threads
    assert len(index) == 50_000 and f"{0:064x}" not in index
    assert index[f"{119_999:064x}"] == ("req#" + str(119_999 % 7), 119_999 * 4)
    assert next(iter(index)) == f"{70_000:064x}"


def test_stored_index_keeps_the_age_of_a_hash_stored_again() -> None:
    index = StoredPageIndex(limit=3)
    for h in "abc":
        index.put(h, "k1", ord(h))
    index.put("a", "k2", 0)  # updated, still the oldest
    index.put("d", "k3", 1)
    assert list(index) == ["b", "c", "d"] and "a" not in index
    assert dict(index) == {"b": ("k1", ord("b")), "c": ("k1", ord("c")), "d": ("k3", 1)}
    empty = StoredPageIndex(limit=0)
    empty.put("x", "k", 0)
    assert len(empty) == 0
    with pytest.raises(ValueError):
        StoredPageIndex(limit=-1)


class _TorchCalls(TorchFunctionMode):
    """Records every torch function and tensor method called inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.names.append(getattr(func, "__qualname__", repr(func)))
        return func(*args, **(kwargs or {}))


def test_a_release_from_the_host_mirror_makes_no_torch_call() -> None:
    """The slots come from the mirror as an int64 array and the allocator frees that array as it is
    (as_index_array); a tensor in between cost three torch calls (bench/probes/release_path_probe.py)."""
    e = SimEngine(page_size=2, stride=4, device_slots=64, host_slots=32)
    r = e.admit("a", 4)
    for _ in range(3):
        e.decode(r)
    e.settle()  # no copy in flight: finalize releases at once
    free_before, releases_before = e.allocator.free_slots, e.manager.metrics.releases
    with _TorchCalls() as calls:
        e.manager.finalize(r)
    assert e.manager.metrics.releases == releases_before + 1 and e.allocator.free_slots > free_before
    assert calls.names == []
    x = e.allocator.alloc(4)
    assert x is not None
    with _TorchCalls() as calls:  # the spy sees a free given a tensor
        e.allocator.free(x)
    assert "TensorBase.reshape" in calls.names


def test_the_batch_path_makes_a_fixed_number_of_torch_calls_whatever_its_chunks() -> None:
    """Unchecked (as served): offload_batch's torch calls are the copy engine's submit, as many for 4 chunks as
    for 16, and the progress check that lands and backs up those chunks makes none. (Checked mode's ledger
    reads each chunk's slots: that mode is for finding bugs, not for serving.)"""
    calls = {}
    for live in (4, 16):
        e = SimEngine(
            page_size=2, stride=2, device_slots=4096, host_slots=2048, rows=64, backup_queue=64, checked=False
        )
        for i in range(live):
            e.admit(f"r{i}", 4)
        offload, check, chunks = [], [], 0
        for _ in range(4):
            for r in list(e.live):
                e.decode(r)
            reqs, rows, committed = batch_arrays(e)
            with _TorchCalls() as c:
                chunks += e.manager.offload_batch(reqs, rows, committed)
            offload.append(len(c.names))
            e.copies.complete_all()
            while e.worker.pending:
                e.worker.run(0)
            with _TorchCalls() as c:
                e.manager.check_progress()
            check.append(len(c.names))
        m = e.manager.metrics  # two strides each, stored but for the last check's, whose backups were just queued
        assert chunks == 2 * live and m.stored_pages + m.backups_in_flight == chunks and m.stored_pages >= live
        calls[live] = (max(offload), check)
    assert calls[4] == calls[16] and calls[16][1] == [0, 0, 0, 0], calls
    assert 0 < calls[16][0] <= 2, calls  # the CPU copy engine's submit
