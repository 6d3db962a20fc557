"""Tests written to kill survivors of the mutation run (docs/mutation.md): each pins down a behaviour of the
runtime, the data plane or the generated machine that the rest of the fast subset left open. They are part
of the mutation subset (tests/mutation/mutate.py TESTS) and of the ordinary suite."""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import pytest
import torch

from timing import scaled

import kvfsm.generated.decode_offload as gen
from kvfsm.codegen.generator import batch_action_order
from kvfsm.dataplane.storage.file import FileStorage
from kvfsm.errors import EventRejected
from kvfsm.generated.decode_offload import DecodeOffloadEffectsEach, DecodeOffloadMachine
from kvfsm.runtime.backup import BackupJob, SteppedBackupWorker
from kvfsm.spec import load_spec
from kvfsm.spec.locations import packaged_spec

# --- the generated batch events, over every pair of states ----------------------------------------------


class Recorder(DecodeOffloadEffectsEach):
    """Every action logs (action, machine tag, arg); `fail` names an action that raises."""

    def __init__(self, fail: str | None = None) -> None:
        self.log: list[tuple[str, Any, Any]] = []
        self.fail = fail

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name.endswith("_each") or name not in gen.DecodeOffloadEffects.__dict__:
            raise AttributeError(name)

        def action(m: DecodeOffloadMachine, arg: Any) -> None:
            if name == self.fail:
                raise RuntimeError(f"{name} failed")
            self.log.append((name, m.ctx, arg))

        return action


# single events that bring a new machine to each state, with every mix of counters a transition tells apart
SCRIPTS = {
    "allocated": [],
    "offloading": ["offload"],
    "offloading2": ["offload", "offload"],
    "offloading_backup": ["offload", "offload", "copy_done"],
    "offloading_parked": ["offload", "offload", "copy_parked"],
    "inflight": ["offload", "copy_done"],
    "inflight_parked": ["offload", "copy_parked"],
    "inflight2": ["offload", "offload", "copy_done", "copy_done"],
    "inflight_mixed": ["offload", "offload", "copy_done", "copy_parked"],
    "finished": ["offload", "finish"],
    "finished2": ["offload", "offload", "finish"],
    "finished_backup": ["offload", "offload", "copy_done", "finish"],
    "finished_parked": ["offload", "offload", "copy_parked", "abort"],
    "draining": ["offload", "copy_done", "finish"],
    "draining2": ["offload", "offload", "copy_done", "copy_parked", "abort"],
    "draining_backups2": ["offload", "offload", "copy_done", "copy_done", "retract"],
    "released": ["retract"],
    # three copies, and two of a counter beside another: a decrement or increment that sets the counter to a
    # constant instead shows only from there
    "offloading3": ["offload"] * 3,
    "offloading2_backup": ["offload"] * 3 + ["copy_done"],
    "offloading2_parked": ["offload"] * 3 + ["copy_parked"],
    "finished3": ["offload"] * 3 + ["finish"],
    "finished2_backup": ["offload"] * 3 + ["copy_done", "finish"],
    "finished2_parked": ["offload"] * 3 + ["copy_parked", "abort"],
    "inflight_b2p1": ["offload"] * 3 + ["copy_done", "copy_done", "copy_parked"],
    "inflight_b1p2": ["offload"] * 3 + ["copy_done", "copy_parked", "copy_parked"],
    "draining_b2p1": ["offload"] * 3 + ["copy_done", "copy_done", "copy_parked", "retract"],
    "offloading_b1p1": ["offload"] * 3 + ["copy_done", "copy_parked"],
    "finished_b1p1": ["offload"] * 3 + ["copy_done", "copy_parked", "finish"],
    "draining_parked": ["offload", "copy_parked", "finish"],
}


def _machines(fx: Recorder, names: tuple[str, ...], observer: Any = None) -> list[DecodeOffloadMachine]:
    ms = []
    for i, name in enumerate(names):
        m = DecodeOffloadMachine(fx, ctx=i)
        for event in SCRIPTS[name]:
            getattr(m, event)(None)
        m.observer = observer
        ms.append(m)
    fx.log.clear()
    return ms


_SPEC = load_spec(packaged_spec())  # once: every worker imports this module at collection
ORDERS = {e: batch_action_order(_SPEC, e) for e in gen.EVENTS}


@pytest.mark.parametrize("event", gen.EVENTS)
def test_every_batch_event_equals_its_loop_over_every_pair_of_states(event: str) -> None:
    """`<event>_each` over one machine, or two in any two states (each arg its own): the machines end as a loop of
    single events leaves them, each action gets the same items in the event's action order, and a rejected
    item leaves both machines untouched; with an observer, the same, item by item."""
    for pair in [(name,) for name in SCRIPTS] + list(itertools.product(SCRIPTS, repeat=2)):
        args = [f"{name}-arg{i}" for i, name in enumerate(pair)]
        fx_loop, fx_batch, fx_obs = Recorder(), Recorder(), Recorder()
        loop, batch = _machines(fx_loop, pair), _machines(fx_batch, pair)
        seen: list[tuple] = []
        observed = _machines(fx_obs, pair, observer=lambda m, e, s, d, t: seen.append((m, e, s, d, t)))
        before = [m.snapshot() for m in batch]
        try:
            for m, arg in zip(loop, args):
                getattr(m, event)(arg)
        except EventRejected:
            with pytest.raises(EventRejected):
                getattr(DecodeOffloadMachine, f"{event}_each")(batch, args)
            assert [m.snapshot() for m in batch] == before and fx_batch.log == [], pair
            continue
        getattr(DecodeOffloadMachine, f"{event}_each")(batch, args)
        getattr(DecodeOffloadMachine, f"{event}_each")(observed, args)
        assert [m.snapshot() for m in batch] == [m.snapshot() for m in loop], pair
        assert [m.snapshot() for m in observed] == [m.snapshot() for m in loop], pair
        assert fx_obs.log == fx_loop.log, pair  # item by item: the loop's own order
        # one observer call per item: the machine, the event, its source and target state, and the id of a
        # transition of the spec that goes from that source to that target on that event
        assert [x[0] for x in seen] == observed and [x[1] for x in seen] == [event] * len(pair), (pair, seen)
        assert [(x[2], x[3]) for x in seen] == [(b[0], m.state) for b, m in zip(before, loop)], (pair, seen)
        for _, e, src, dst, tid in seen:
            row = gen.TRANSITIONS[tid] if tid != gen.IGNORED_TRANSITION else None
            if row is None:
                assert src == dst and src in gen.IGNORED[e], (pair, seen)
            else:
                assert row[:2] == (gen.STATES[src], e) and row[3] == gen.STATES[dst], (pair, tid, row)
        order = ORDERS[event]
        assert fx_batch.log == [entry for a in order for entry in fx_loop.log if entry[0] == a], pair


@pytest.mark.parametrize("event", gen.EVENTS)
def test_a_raising_batch_puts_every_machine_back(event: str) -> None:
    """Whatever the two machines' states, a batch whose first action raises leaves both as it found them."""
    each = getattr(DecodeOffloadMachine, f"{event}_each")
    for pair in itertools.product(SCRIPTS, repeat=2):
        probe_fx = Recorder()
        try:
            each(_machines(probe_fx, pair), [None, None])
        except EventRejected:
            continue
        if not probe_fx.log:
            continue  # declared no-ops only: nothing to raise
        fx = Recorder()
        ms = _machines(fx, pair)
        before = [m.snapshot() for m in ms]
        fx.fail = probe_fx.log[0][0]
        with pytest.raises(RuntimeError):
            each(ms, [None, None])
        assert [m.snapshot() for m in ms] == before, (event, pair)


def test_batch_events_check_their_arguments() -> None:
    fx = Recorder()
    ms = _machines(fx, ("allocated", "allocated"))
    for event in gen.EVENTS:
        with pytest.raises(ValueError):
            getattr(DecodeOffloadMachine, f"{event}_each")(ms, [None])
        getattr(DecodeOffloadMachine, f"{event}_each")([], [])  # an empty batch is a no-op
    assert fx.log == []


def test_machines_of_two_effects_objects_run_item_by_item() -> None:
    a, b = Recorder(), Recorder()
    ms = _machines(a, ("allocated",)) + _machines(b, ("allocated",))
    DecodeOffloadMachine.offload_each(ms, ["x", "y"])
    assert a.log == [("start_copy", 0, "x")] and b.log == [("start_copy", 0, "y")]
    assert [m.snapshot() for m in ms] == [(gen.OFFLOADING, 1, 0, 0)] * 2


# --- the backup worker's accounting ---------------------------------------------------------------------


def test_collect_returns_one_slot_of_room_per_job() -> None:
    w = SteppedBackupWorker(capacity=3)
    jobs = [BackupJob(i, lambda p: [True]) for i in range(3)]
    w.submit_many(jobs)
    assert (w.outstanding(), w.room()) == (3, 0)
    w.run_all()
    assert w.collect() is jobs[0]
    assert (w.outstanding(), w.room(), w.completed()) == (2, 1, 2)
    assert w.collect_many(2) == jobs[1:]
    assert (w.outstanding(), w.room(), w.completed()) == (0, 3, 0)


# --- FileStorage: parallel writers, stale temp files, corrupt pages -------------------------------------


def _pages(n: int, size: int = 16) -> list[torch.Tensor]:
    return [torch.arange(size, dtype=torch.uint8) + i for i in range(n)]


def test_parallel_writers_store_every_page_and_count_each_outcome(tmp_path) -> None:
    store = FileStorage(tmp_path, writers=2)
    keys = [f"k{i}" for i in range(5)]
    assert store.batch_set(keys[:3], _pages(3)) == [True] * 3
    assert store.batch_set(keys, _pages(5)) == [True] * 5  # three already there: skipped, still stored
    assert (store.stats.writes_ok, store.stats.writes_skipped, store.stats.writes_failed) == (5, 3, 0)
    got = store.batch_get(keys)
    for i, page in enumerate(got):
        assert page is not None and torch.equal(page, _pages(5)[i]), i
    assert store.batch_exists(keys) == 5 and store.batch_exists(keys + ["missing"]) == 5
    os.chmod(tmp_path, 0o500)  # a read-only directory: every write fails, none is reported stored
    try:
        if not os.access(tmp_path, os.W_OK):  # (root writes anyway: then this part proves nothing)
            assert store.batch_set(["n0", "n1"], _pages(2)) == [False, False]
            assert store.stats.writes_failed == 2 and store.stats.writes_ok == 5
    finally:
        os.chmod(tmp_path, 0o700)


def test_sweep_removes_only_old_temp_files_of_dead_writers(tmp_path) -> None:
    import subprocess

    alive = subprocess.Popen(["sleep", "60"])  # a live writer of ours (never signal a process we did not start)
    dead = 2**22 + 12345  # above any pid_max here: no such process
    while True:
        try:
            os.kill(dead, 0)
            dead += 1
        except ProcessLookupError:
            break
        except OSError:
            dead += 1
    old = time.time() - 3600
    names = {
        "dead_old": f".k0.bin.{dead}.0123456789ab.0.tmp",
        "dead_old2": f".k1.bin.{dead}.0123456789ab.1.tmp",
        "dead_new": f".k2.bin.{dead}.0123456789ab.2.tmp",
        "mine_old": f".k3.bin.{os.getpid()}.0123456789ab.3.tmp",
        "alive_old": f".k4.bin.{alive.pid}.0123456789ab.4.tmp",
        "pid0_old": ".k7.bin.0.0123456789ab.7.tmp",
        "other_tmp": ".notours.tmp",
        "page": "k5.bin",
        "hidden": f".k6.bin.{dead}.0123456789ab.6.txt",
    }
    for tag, name in names.items():
        path = tmp_path / name
        path.write_bytes(b"x")
        if tag != "dead_new":
            os.utime(path, (old, old))
    store = FileStorage(tmp_path, stale_temp_age_s=600)
    assert store.swept_temps == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        n for t, n in names.items() if not t.startswith("dead_old")
    )
    assert store.sweep_stale_temps(600) == 0
    assert FileStorage(tmp_path, stale_temp_age_s=None).swept_temps == 0
    assert FileStorage(tmp_path, tp_rank=1, stale_temp_age_s=0).swept_temps == 0  # only rank 0 sweeps
    os.utime(tmp_path / names["dead_new"], (old, old))
    assert FileStorage(tmp_path, stale_temp_age_s=600).swept_temps == 1
    try:
        assert alive.poll() is None, "the sweep signalled a live writer"
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.parametrize("damage", ["truncate_header", "magic", "torn", "other_key", "checksum", "empty"])
def test_a_damaged_page_is_counted_moved_aside_and_never_returned(tmp_path, damage: str) -> None:
    store = FileStorage(tmp_path)
    assert store.batch_set(["good", "bad", "other"], _pages(3)) == [True] * 3
    path = store.path_of("bad")
    raw = bytearray(open(path, "rb").read())
    if damage == "truncate_header":
        raw = raw[:10]
    elif damage == "magic":
        raw[0] ^= 0xFF
    elif damage == "torn":
        raw = raw[:-1]
    elif damage == "other_key":
        raw = bytearray(open(store.path_of("other"), "rb").read())
    elif damage == "checksum":
        raw[-1] ^= 0xFF
    elif damage == "empty":
        raw = bytearray()
    open(path, "wb").write(raw)
    got = store.batch_get(["good", "bad", "missing"])
    assert got[0] is not None and torch.equal(got[0], _pages(3)[0])
    assert got[1] is None and got[2] is None
    assert (store.stats.reads_ok, store.stats.reads_corrupt, store.stats.reads_missing) == (1, 1, 1)
    assert os.path.exists(path + ".corrupt") and not os.path.exists(path)


def test_an_empty_payload_round_trips(tmp_path) -> None:
    store = FileStorage(tmp_path)
    assert store.batch_set(["e"], [torch.empty(0, dtype=torch.uint8)]) == [True]
    (page,) = store.batch_get(["e"])
    assert page is not None and page.numel() == 0 and page.dtype == torch.uint8  # bytes, as every page read


# --- the manager's slot gather for a batch of chunks ----------------------------------------------------


def test_device_slot_gather_of_a_batch_equals_each_chunk_read_alone() -> None:
    """The batch gather (equal strides, or chunks of different lengths, longer than any cached offsets)
    returns, in order, exactly the slots each chunk's own table read returns."""
    from types import SimpleNamespace

    from kvfsm.verify.engine import SimEngine

    e = SimEngine(page_size=2, stride=4, device_slots=96, host_slots=16, rows=4, max_context=48, backup_queue=2)
    mgr = e.manager
    table = mgr.req_to_token.host_table
    table.copy_(torch.arange(table.numel(), dtype=torch.int64).reshape(table.shape) * 7 + 3)
    alone = lambda rec, n: mgr._device_slots([(rec, None, n)])  # noqa: E731
    recs = [
        SimpleNamespace(row=r, prefill_len=p, inc_len=i) for r, p, i in ((2, 4, 8), (0, 0, 0), (3, 2, 6), (1, 6, 4))
    ]
    for lengths in ((4, 4, 4, 4), (4, 2, 6, 4), (8, 12, 2, 30), (1, 1, 1, 1), (20, 20, 20, 20), (36, 3, 5, 9)):
        due = [(rec, None, n) for rec, n in zip(recs, lengths)]
        want = torch.cat([alone(rec, n) for rec, n in zip(recs, lengths)])
        assert torch.equal(mgr._device_slots(due), want), lengths
        assert torch.equal(mgr._device_slots(due[:2]), want[: lengths[0] + lengths[1]]), lengths
    assert mgr._aranges(5).tolist() == [0, 1, 2, 3, 4] and mgr._aranges(100).tolist() == list(range(100))


# --- the stored-page index against an OrderedDict ------------------------------------------------------


@pytest.mark.parametrize("limit", [0, 1, 3, 1500])
def test_stored_page_index_is_a_bounded_insertion_ordered_map(limit: int) -> None:
    import collections
    import random

    from kvfsm.runtime.stored_index import StoredPageIndex

    rng = random.Random(limit)
    index, model = StoredPageIndex(limit), collections.OrderedDict()
    for step in range(4000):
        h = f"h{rng.randrange(limit * 2 + 3)}"
        value = (f"r{step % 7}", step)
        index.put(h, *value)
        if limit:
            if h in model:
                model[h] = value  # stored again: new value, same age
            else:
                model[h] = value
                if len(model) > limit:
                    model.popitem(last=False)
        if step % 97 == 0 or step > 3990:
            assert len(index) == len(model) and list(index) == list(model), step
            assert all(index[k] == v and k in index for k, v in model.items())
            assert f"h{limit * 2 + 5}" not in index
    with pytest.raises(KeyError):
        index["never"]
    with pytest.raises(ValueError):
        StoredPageIndex(-1)


# --- backups: grouped writes, the worker thread, failure counting --------------------------------------


def test_run_jobs_writes_runs_of_one_write_many_together_and_falls_back_job_by_job() -> None:
    from kvfsm.runtime.backup import run_jobs

    calls: list[tuple[str, list]] = []

    def many_a(payloads):
        calls.append(("a", list(payloads)))
        return [[True] * p for p in payloads]

    def many_bad(payloads):  # answers one result too few: run again job by job
        calls.append(("bad", list(payloads)))
        return [[True]]

    def many_raises(payloads):
        calls.append(("raises", list(payloads)))
        raise OSError("store down")

    def one(p):
        calls.append(("one", [p]))
        return [True] * p

    jobs = (
        [BackupJob(1, one, many_a), BackupJob(2, one, many_a)]
        + [BackupJob(3, one)]
        + [BackupJob(p, one, many_a) for p in (4, 5, 6)]
        + [BackupJob(7, one, many_bad), BackupJob(8, one, many_bad)]
        + [BackupJob(9, one, many_raises), BackupJob(10, one, many_raises)]
        + [BackupJob(11, one, many_a)]
    )
    run_jobs(jobs)
    assert calls == [
        ("a", [1, 2]),
        ("one", [3]),
        ("a", [4, 5, 6]),
        ("bad", [7, 8]),
        ("one", [7]),
        ("one", [8]),
        ("raises", [9, 10]),
        ("one", [9]),
        ("one", [10]),
        ("one", [11]),
    ]
    assert [len(j.results) for j in jobs] == [j.payload for j in jobs] and all(j.ok for j in jobs)


def test_thread_worker_batches_at_most_its_limit_and_wait_idle_times_out() -> None:
    import threading

    from kvfsm.runtime.backup import ThreadBackupWorker

    sizes: list[int] = []
    gate = threading.Event()

    def many(payloads):
        gate.wait(10)
        sizes.append(len(payloads))
        return [[True] for _ in payloads]

    w = ThreadBackupWorker(capacity=8, batch_limit=2)
    try:
        w.submit_many([BackupJob(i, lambda p: (gate.wait(10), sizes.append(1), [True])[2], many) for i in range(5)])
        assert w.wait_idle(timeout=0.05) is False  # the store has not answered yet
        gate.set()
        assert w.wait_idle(timeout=scaled(10)) is True
        assert max(sizes) <= 2 and sum(sizes) == 5
        assert [j.payload for j in w.collect_many(5)] == list(range(5)) and w.room() == 8
    finally:
        gate.set()
        w.close()


def test_failed_backups_are_counted_per_chunk_and_logged_at_most_once_per_interval(monkeypatch, caplog) -> None:
    import logging
    from types import SimpleNamespace

    import kvfsm.runtime.effects as effects
    from kvfsm.verify.engine import SimEngine

    fx = SimEngine(
        page_size=2, stride=4, device_slots=96, host_slots=16, rows=4, max_context=48, backup_queue=2
    ).manager.fx
    clock = [1000.0]
    monkeypatch.setattr(effects.time, "monotonic", lambda: clock[0])
    fx._failures_logged_at = -effects.FAILURE_LOG_INTERVAL_S
    a, b = (SimpleNamespace(record=SimpleNamespace(failed_backups=0), error=None, results=()) for _ in range(2))
    before = fx.metrics.backup_failures
    with caplog.at_level(logging.WARNING, logger="kvfsm"):
        fx.count_backup_failure_each([(None, a), (None, b), (None, a)])
        assert (a.record.failed_backups, b.record.failed_backups) == (2, 1)
        assert fx.metrics.backup_failures == before + 3
        first = [r.getMessage() for r in caplog.records]
        assert len(first) == 1 and first[0].startswith("3 backup(s) failed") and "reported no result" in first[0]
        clock[0] += effects.FAILURE_LOG_INTERVAL_S / 2
        fx.count_backup_failure_each([(None, b)])
        assert len(caplog.records) == 1  # within the interval: counted, not logged
        clock[0] += effects.FAILURE_LOG_INTERVAL_S
        b.error, b.results = None, (True, False, False)
        fx.count_backup_failure_each([(None, b)])
        last = caplog.records[-1].getMessage()
        assert len(caplog.records) == 2 and last.startswith("2 backup(s) failed") and "refused 2 of 3" in last
        clock[0] += effects.FAILURE_LOG_INTERVAL_S
        b.error, b.results = OSError("disk"), ()
        fx.count_backup_failure_each([(None, b)])
        assert "raised OSError('disk')" in caplog.records[-1].getMessage()
    assert b.record.failed_backups == 4


# --- model presets, and what build.py makes of a config ------------------------------------------------


def test_kv_presets_have_their_models_shapes_and_take_a_dtype() -> None:
    from kvfsm.dataplane.pools.config import KVCacheConfig

    llama = KVCacheConfig.llama3_8b("float16")
    assert (llama.num_layers, llama.kv_heads, llama.head_dim, llama.attention, llama.dtype) == (
        32,
        8,
        128,
        "mha",
        torch.float16,
    )
    assert llama.bytes_per_token == 2 * 32 * 8 * 128 * 2
    mla = KVCacheConfig.deepseek_mla(torch.float32)
    assert (mla.num_layers, mla.kv_heads, mla.head_dim, mla.attention, mla.dtype) == (61, 1, 576, "mla", torch.float32)
    assert mla.bytes_per_token == 61 * 576 * 4 and mla.is_mla and not llama.is_mla
    assert KVCacheConfig.deepseek_mla().dtype == torch.bfloat16
    tiny_mla, tiny = KVCacheConfig.tiny("mla", torch.float32), KVCacheConfig.tiny(dtype="float16")
    assert (tiny_mla.num_layers, tiny_mla.kv_heads, tiny_mla.head_dim, tiny_mla.attention, tiny_mla.dtype) == (
        3,
        1,
        24,
        "mla",
        torch.float32,
    )
    assert (tiny.num_layers, tiny.kv_heads, tiny.head_dim, tiny.attention, tiny.dtype) == (
        3,
        2,
        8,
        "mha",
        torch.float16,
    )


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_the_file_store_a_config_builds_carries_the_deployment_suffix(tmp_path, attention: str) -> None:
    from kvfsm.dataplane.pools.config import KVCacheConfig
    from kvfsm.dataplane.pools.device_pool import DeviceKVPool
    from kvfsm.runtime.build import storage_factory
    from kvfsm.runtime.config import OffloadConfig

    pool = DeviceKVPool.create(KVCacheConfig.tiny(attention), 64)
    config = OffloadConfig(page_size=4, storage_backend="file", storage_dir=tmp_path / "pages", model_name="org/m")
    store = storage_factory(config, pool, tp_rank=1, tp_size=2)()
    assert isinstance(store, FileStorage) and store.directory == str(tmp_path / "pages")
    assert store.suffix == ("_org-m" if attention == "mla" else "_org-m_1_2")


def test_close_storage_closes_what_has_a_close_and_ignores_the_rest() -> None:
    from kvfsm.runtime.build import close_storage

    closed = []

    class Closable:
        def close(self) -> None:
            closed.append(self)

    store = Closable()
    close_storage(store)
    close_storage(object())
    close_storage(None)
    assert closed == [store]


def test_planned_host_slots_round_down_to_pages_and_refuse_less_than_one(monkeypatch) -> None:
    import kvfsm.runtime.build as build
    from kvfsm.dataplane.pools.config import KVCacheConfig
    from kvfsm.dataplane.pools.device_pool import DeviceKVPool
    from kvfsm.errors import ConfigError
    from kvfsm.runtime.config import OffloadConfig

    pool = DeviceKVPool.create(KVCacheConfig.tiny(), 100)
    bpt = pool.config.bytes_per_token
    monkeypatch.setattr(build, "available_host_memory", lambda: None)
    assert build.planned_host_slots(OffloadConfig(page_size=4, host_pool_bytes=bpt * 10 + 3), pool) == 8
    assert build.planned_host_slots(OffloadConfig(page_size=4, host_pool_ratio=0.5), pool) == 48
    assert build.planned_host_slots(OffloadConfig(page_size=4, host_pool_bytes=bpt * 4), pool) == 4  # exactly a page
    with pytest.raises(ConfigError) as exc:
        build.planned_host_slots(OffloadConfig(page_size=4, host_pool_bytes=bpt * 3), pool)
    assert exc.value.field == "host_pool_bytes"
    with pytest.raises(ConfigError) as exc:
        build.planned_host_slots(OffloadConfig(page_size=8, host_pool_ratio=0.05), pool)
    assert exc.value.field == "host_pool_ratio"
    monkeypatch.setattr(build, "available_host_memory", lambda: bpt * 8)
    assert build.planned_host_slots(OffloadConfig(page_size=4, host_pool_bytes=bpt * 8), pool) == 8  # all of it fits
    with pytest.raises(ConfigError) as exc:
        build.planned_host_slots(OffloadConfig(page_size=4, host_pool_bytes=bpt * 12), pool)
    assert exc.value.field == "host_pool_bytes"


# --- storage_extra, checked against the backends' constructors -----------------------------------------


def test_storage_options_come_from_each_backends_constructor() -> None:
    from kvfsm.runtime import storage_options as so

    so.backend_options.cache_clear()  # built once per process: build it here, from the constructors
    file_opts, moon_opts = so.backend_options("file"), so.backend_options("mooncake")
    assert {"fsync", "writers", "stale_temp_age_s"} <= set(file_opts) and "directory" not in file_opts
    assert file_opts["writers"] == (int, False) and not any(req for _, req in file_opts.values())
    assert moon_opts["master_server_addr"] == (str, True) and "protocol" in moon_opts and "writers" not in moon_opts
    assert so.backend_options("none") == {}


@pytest.mark.parametrize(
    "hint,value,ok",
    [
        (int, 3, True),
        (int, True, False),
        (int, 2.5, False),
        (float, 3, True),
        (float, 2.5, True),
        (float, False, False),
        (bool, True, True),
        (bool, 1, False),
        (str, "x", True),
        (str, 1, False),
        (type(None), None, True),
        (type(None), 0, False),
        (Any, object(), True),
        (int | None, None, True),
        (int | None, 4, True),
        (int | None, "4", False),
        (list[int], "not checked here", True),
    ],
)
def test_accepts_plain_types_optionals_and_unions(hint: Any, value: Any, ok: bool) -> None:
    from typing import Optional

    from kvfsm.runtime.storage_options import _accepts

    assert _accepts(hint, value) is ok
    if hint is not Any and hint is not type(None) and not isinstance(hint, type(int | None)):
        assert _accepts(Optional[hint], value) is (ok or value is None)


@pytest.mark.parametrize(
    "addr,ok",
    [
        ("127.0.0.1:50051", True),
        ("host", True),
        ("h:1", True),
        ("h:65535", True),
        ("h:0", False),
        ("h:65536", False),
        ("h:port", False),
        ("::1:50051", True),
        ("tcp://host", True),
        (" ", False),
    ],
)
def test_master_address_needs_a_port_number_when_it_names_one(addr: str, ok: bool) -> None:
    from kvfsm.errors import ConfigError
    from kvfsm.runtime.storage_options import check_storage_extra

    if ok:
        check_storage_extra("mooncake", {"master_server_addr": addr})
    else:
        with pytest.raises(ConfigError) as exc:
            check_storage_extra("mooncake", {"master_server_addr": addr})
        assert exc.value.field == "storage_extra.master_server_addr"


# --- pools, keys and hashes: edges the subset left open -------------------------------------------------


def test_allocator_index_checks_take_page_slots_and_refuse_every_slot_out_of_range() -> None:
    from kvfsm.dataplane.errors import OutOfRange
    from kvfsm.dataplane.pools.allocator import TokenSlotAllocator

    a = TokenSlotAllocator(16, page_size=4, reserve_padding_page=False)
    pages = a.alloc_pages(2)
    slots = a.page_slots(pages)
    assert a.is_allocated(slots).tolist() == [True] * 8
    assert a.is_allocated(torch.tensor([15, 0])).tolist() == [False, pages[0] == 0]
    for bad in ([16], [-1], [3, 16], [-1, 4]):
        with pytest.raises(OutOfRange):
            a.is_allocated(torch.tensor(bad))
    a.undo_alloc(a.page_slots(pages))
    assert a.free_page_count == 4 and list(a._free_pages)[:2] == pages
    a.alloc_pages(4)
    free, allocated = a.snapshot()
    assert free.dtype == torch.int64 and free.numel() == 0 and bool(allocated.all())


def test_host_pool_sizing_defaults_and_page_writes_through_page_slots() -> None:
    from kvfsm.dataplane.pools.config import KVCacheConfig
    from kvfsm.dataplane.pools.device_pool import DeviceKVPool
    from kvfsm.dataplane.pools.host_pool import HostKVPool

    dev = DeviceKVPool.create(KVCacheConfig.tiny(), 10)
    pool = HostKVPool.for_device_pool(dev)
    assert (pool.capacity, pool.page_size) == (20, 1)  # twice the device pool, token pages
    sized = HostKVPool.for_device_pool(dev, page_size=2, size_bytes=dev.config.bytes_per_token * 9 + 1)
    assert sized.capacity == 8 and isinstance(sized.capacity, int)
    with pytest.raises(ValueError):
        HostKVPool.for_device_pool(dev, ratio=0)
    pages = sized.alloc_pages(1)
    data = torch.arange(sized.get_pages_bytes(sized.page_slots(pages)).numel(), dtype=torch.int64).to(torch.uint8)
    sized.set_page_bytes(sized.page_slots(pages), data)
    assert torch.equal(sized.get_page_bytes(sized.page_slots(pages)).reshape(-1), data)


def test_storage_key_suffix_defaults_and_model_names() -> None:
    from kvfsm.dataplane.storage.base import storage_key_suffix

    assert storage_key_suffix() == "__0_1"
    assert storage_key_suffix("", 2, 4) == "__2_4" and storage_key_suffix(is_mla=True) == "_"
    assert storage_key_suffix("org/model/v2", 1, 2) == "_org-model-v2_1_2"


def test_page_hash_chains_on_the_prior_hash() -> None:
    from kvfsm.dataplane.hashing import page_hash, page_hashes

    first = page_hash([1, 2, 3, 4])
    assert page_hash([5, 6, 7, 8], first) == page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1]
    assert page_hash([5, 6, 7, 8], first) != page_hash([5, 6, 7, 8])


def test_faulty_storage_corrupts_a_read_whatever_its_first_byte() -> None:
    from kvfsm.dataplane.storage.faulty import FaultyStorage
    from kvfsm.dataplane.storage.memory import MemoryStorage

    store = FaultyStorage(MemoryStorage(), corrupt_reads={"k"})
    page = torch.full((8,), 0xFF, dtype=torch.uint8)
    assert store.batch_set(["k"], [page]) == [True]
    (got,) = store.batch_get(["k"])
    assert got is not None and not torch.equal(got, page)


def test_the_backup_thread_is_a_named_daemon() -> None:
    """A daemon, so a worker nobody closed cannot keep the serving process from exiting; named, for py-spy."""
    from kvfsm.runtime.backup import ThreadBackupWorker

    w = ThreadBackupWorker(2)
    try:
        assert w._thread.daemon is True and w._thread.name == "kvfsm-backup" and w.batch_limit == 1024
    finally:
        w.close()
    assert not w._thread.is_alive()


# --- the manager over a random serving workload, checked at the end -------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_returns_everything_and_stores_only_what_succeeded(seed: int) -> None:
    """Random admits, decodes, single and batch offloads, copy and backup completions in any order, failing
    writes and every way to end; then a drain: every pool is full again, every page the index reports stored
    is in the store (B13), and the per-request failure counts stay within the metric."""
    import random

    import numpy as np

    from kvfsm.verify.engine import SimEngine

    rng = random.Random(seed)
    e = SimEngine(
        page_size=2,
        stride=4,
        device_slots=96,
        host_slots=12,
        rows=4,
        max_context=48,
        backup_queue=2,
        checked=seed % 2 == 0,
    )
    mgr, ended, records = e.manager, [], []
    for step in range(160):
        r = rng.random()
        if r < 0.12 and len(e.live) < 4:
            e.admit(f"r{step}", rng.randrange(1, 9), rng.randrange(0, 3))
        elif r < 0.5 and e.live:
            for req in list(e.live):
                if rng.random() < 0.7 and not e.decode(req, rng.choice((0, 0, 1, 3))):
                    e.end(req, "abort")
                    ended.append(req)
            if rng.random() < 0.5:
                for req in list(e.live):
                    mgr.offload(req)
            else:
                rows = [q.req_pool_idx for q in e.live]
                lens = [q.kv_committed_len for q in e.live]
                form = rng.choice((np.int64, np.int32, list, torch.tensor, None))  # the engine's batch arrays, any form
                if form is None:
                    mgr.offload_batch(list(e.live))
                elif form in (np.int64, np.int32):
                    mgr.offload_batch(list(e.live), np.array(rows, dtype=form), np.array(lens, dtype=form))
                else:
                    mgr.offload_batch(list(e.live), form(rows), form(lens))
        elif r < 0.7:
            pending = [h for h in e.copies.pending if rng.random() < 0.6]
            rng.shuffle(pending)
            for h in pending:
                e.copies.complete(h)
            while e.worker.pending and rng.random() < 0.6:
                job = e.worker.pending[rng.randrange(len(e.worker.pending))]
                if rng.random() < 0.3:
                    e.fail_writes.update(job.payload.hashes)
                e.worker.run(e.worker.pending.index(job))
            mgr.check_progress()
        elif r < 0.8 and e.live:
            req = rng.choice(e.live)
            how = rng.choice(("finish", "abort", "retract"))
            if mgr.machine_of(req) is not None:
                records.append(mgr.machine_of(req).ctx)
            e.end(req, how)
            ended.append(req)
            if rng.random() < 0.3:  # a second end of the same request is a declared no-op
                {"finish": mgr.finalize, "abort": mgr.abort, "retract": mgr.retract}[how](req)
    for req in list(e.live):
        if mgr.machine_of(req) is not None:
            records.append(mgr.machine_of(req).ctx)
        e.end(req, "finish")
    for _ in range(1000):
        if mgr.idle():
            break
        for h in list(e.copies.pending):
            e.copies.complete(h)
        e.worker.run_all()
        mgr.check_progress()
    e.check_teardown()
    stored = mgr.fx.stored
    assert all(h in e.store.pages for h in stored), "a page reported stored is not in the store"
    recs, m = set(records), mgr.metrics
    assert m.stored_pages >= len(stored) and m.releases >= len(recs)  # (and those never offloaded)
    assert sum(rec.failed_backups for rec in recs) == m.backup_failures
    assert sum(rec.stored_pages for rec in recs) == m.stored_pages
    assert sum(rec.inc_len for rec in recs) == m.offloaded_tokens
    assert m.offloaded_bytes == m.offloaded_tokens * e.kv.bytes_per_token
    assert 0 < m.chunks <= m.offloaded_tokens or m.chunks == m.offloaded_tokens == 0


def test_violated_invariants_names_exactly_what_the_spec_says_is_broken() -> None:
    """For every state and every counter valuation in [-1, 2]^3 (most of them unreachable): the generated
    check names the state's invariant and each spec invariant that fails there, in the spec's order."""
    from kvfsm.spec import expr as ex

    spec = _SPEC
    for state in spec.states:
        for copies, parked, backups in itertools.product(range(-1, 3), repeat=3):
            m = DecodeOffloadMachine(Recorder(), ctx=None)
            m.state, m.copies, m.parked, m.backups = spec.states.index(state), copies, parked, backups
            env = {"copies": copies, "parked": parked, "backups": backups}
            want = []
            inv = spec.state_invariants.get(state)
            if inv is not None and not ex.evaluate(inv, env):
                want.append(f"state {state}")
            want += [
                name
                for name, (node, where) in spec.invariants.items()
                if (not where or state in where) and not ex.evaluate(node, env)
            ]
            assert gen.violated_invariants(m) == want, (state, env)


def test_the_default_batch_actions_call_the_single_action_per_item_in_order() -> None:
    """DecodeOffloadEffectsEach's `<action>_each` defaults (an effects class may override them): each item's
    machine and arg, in order, to the single action; the creation action's too."""
    actions = [a for a in gen.DecodeOffloadEffects.__dict__ if not a.startswith("_") and not a.endswith("_each")]
    assert "seed_hash_chain" in actions and "release_request" in actions
    for action in actions:
        fx = Recorder()
        ms = _machines(fx, ("allocated", "offloading"))
        getattr(DecodeOffloadEffectsEach, f"{action}_each")(fx, [(ms[0], "a"), (ms[1], "b"), (ms[0], "c")])
        assert fx.log == [(action, 0, "a"), (action, 1, "b"), (action, 0, "c")], action


# --- copy planning: every host-index defect is refused before any copy -----------------------------------


def test_plan_copy_refuses_host_slots_out_of_range_twice_or_unallocated_and_counts_page_slots() -> None:
    from kvfsm.dataplane.copy.base import plan_copy
    from kvfsm.dataplane.errors import CopyError, DuplicateIndex, NotAllocated, OutOfRange
    from kvfsm.dataplane.pools.allocator import TokenSlotAllocator
    from kvfsm.dataplane.pools.config import KVCacheConfig
    from kvfsm.dataplane.pools.device_pool import DeviceKVPool
    from kvfsm.dataplane.pools.host_pool import HostKVPool

    kv = KVCacheConfig.tiny(dtype="float32")
    dev = DeviceKVPool.create(kv, 32)
    host = HostKVPool(kv, 16, page_size=2)
    pages = host.alloc_pages(3)  # 6 host slots, whole pages
    slots = host.page_slots(pages)
    own = slots.slots.clone()
    d6 = torch.arange(6)
    assert plan_copy("d2h", dev, d6, host, slots).num_tokens == 6
    assert plan_copy("d2h", dev, d6, host, slots).host_pages == pages
    assert plan_copy("d2h", dev, d6, host, own).host_pages is None  # a tensor: no page list
    dev_alloc = TokenSlotAllocator(32, page_size=2, reserve_padding_page=False)
    dpages = dev_alloc.alloc_pages(3)
    assert plan_copy("h2d", dev, dev_alloc.page_slots(dpages), host, slots).num_tokens == 6
    swapped = own[[1, 0, 2, 3, 4, 5]]  # not in slot order: checked slot by slot, and fine
    assert plan_copy("d2h", dev, d6, host, swapped).num_tokens == 6
    first_free = next(s for s in range(16) if not bool(host.allocator.is_allocated(torch.tensor([s]))[0]))
    for bad, err in (
        (torch.tensor([own[0], own[1], own[2], own[3], own[4], 16]), OutOfRange),
        (torch.tensor([-1, own[1], own[2], own[3], own[4], own[5]]), OutOfRange),
        (torch.tensor([own[5], own[1], own[2], own[3], own[4], 17]), OutOfRange),
        (torch.tensor([own[0], own[0], own[2], own[3], own[4], own[5]]), DuplicateIndex),
        (torch.tensor([own[0], own[1], own[2], own[3], own[5], own[5]]), DuplicateIndex),
        (torch.tensor([own[0], own[1], own[2], own[3], own[4], first_free]), NotAllocated),
    ):
        with pytest.raises(err):
            plan_copy("d2h", dev, d6, host, bad)
    with pytest.raises(DuplicateIndex):  # two slots, the same one twice
        plan_copy("d2h", dev, torch.arange(2), host, torch.tensor([own[1], own[1]]))
    with pytest.raises(OutOfRange):
        plan_copy("d2h", dev, torch.tensor([0, 1, 2, 3, 4, 32]), host, slots)
    with pytest.raises(OutOfRange):
        plan_copy("d2h", dev, torch.tensor([0, 1, 2, 3, 4, -1]), host, slots)
    with pytest.raises(CopyError):
        plan_copy("d2h", dev, torch.arange(4), host, slots)
    other = HostKVPool(kv, 16, page_size=2)  # PageSlots of another pool: checked slot by slot
    with pytest.raises(NotAllocated):
        plan_copy("d2h", dev, d6, other, slots)


# --- the TP consensus, over a stand-in process group -----------------------------------------------------


class _FakeGroup:
    """What torch.distributed would do for a group of this rank and one other whose counts are `other`."""

    def __init__(self, other: tuple[int, ...], backend: str = "gloo") -> None:
        self.other, self.backend, self.calls = other, backend, []
        self.queue: list[tuple[int, ...]] = []  # the other rank's tensors, one per all_reduce, when given


def _fake_dist(monkeypatch) -> None:
    import torch.distributed as dist

    def all_reduce(t, op=None, group=None):
        assert op == dist.ReduceOp.MIN and isinstance(group, _FakeGroup) and t.device.type == "cpu"
        other = group.queue.pop(0) if group.queue else group.other
        t.copy_(torch.minimum(t, torch.tensor(other, dtype=t.dtype)))
        group.calls.append(t.tolist())

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2 if isinstance(group, _FakeGroup) else 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: group.backend if isinstance(group, _FakeGroup) else "x")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)


def test_progress_consensus_takes_the_min_over_its_group(monkeypatch) -> None:
    from kvfsm.runtime.tp import ProgressConsensus

    solo = ProgressConsensus(None)
    assert (solo.world, solo.device, solo.agree(3, 1)) == (1, torch.device("cpu"), (3, 1)) and solo.check_same(4, 5)
    group = _FakeGroup(other=(2, 7))
    _fake_dist(monkeypatch)
    tp = ProgressConsensus(group)
    assert tp.group is group and tp.world == 2 and tp.device == torch.device("cpu")
    assert tp.agree(3, 5) == (2, 5) and group.calls == [[2, 5]]
    for mine, theirs, same in (((4, 9), (4, 9), True), ((4, 9), (4, 8), False), ((4, 9), (5, 9), False)):
        group.queue = [theirs, tuple(-v for v in theirs)]  # the other rank's two calls, as check_same makes them
        assert tp.check_same(*mine) is same, (mine, theirs)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    nccl = ProgressConsensus(_FakeGroup(other=(), backend="nccl"))
    assert nccl.device == torch.device("cuda", 3)


# --- OffloadConfig's sources and error reports -----------------------------------------------------------


def test_config_errors_name_their_source_and_every_problem(monkeypatch, tmp_path) -> None:
    from kvfsm.errors import ConfigError
    from kvfsm.runtime.config import OffloadConfig

    with pytest.raises(ConfigError) as exc:
        OffloadConfig.load(page_size="eight")
    assert exc.value.source == "<code>" and exc.value.field == "page_size"
    with pytest.raises(ConfigError) as exc:
        OffloadConfig.load("my.yaml", page_size="eight")
    assert exc.value.source == "my.yaml"
    from types import SimpleNamespace

    with pytest.raises(ConfigError) as exc:
        OffloadConfig.model_validate({"page_size": "eight"})
    assert exc.value.source == "OffloadConfig" and exc.value.field == "page_size"
    # pydantic's own options reach it: from an object's attributes, which a plain call refuses
    assert OffloadConfig.model_validate(SimpleNamespace(page_size=8), from_attributes=True).page_size == 8
    with pytest.raises(ConfigError):
        OffloadConfig.model_validate(SimpleNamespace(page_size=8))
    with pytest.raises(ConfigError) as exc:
        OffloadConfig(qqqqzzzz=1)
    assert exc.value.problems == (("qqqqzzzz", "unknown field"),)
    with pytest.raises(ConfigError) as exc:
        OffloadConfig(page_sise=4)
    assert exc.value.reason == "unknown field; did you mean 'page_size'?"
    with pytest.raises(ConfigError) as exc:  # two problems: both reported, each with its field
        OffloadConfig(page_size="x", backup_queue_size="y", qqqqzzzz=1)
    assert {f for f, _ in exc.value.problems} == {"page_size", "backup_queue_size", "qqqqzzzz"}


def test_config_from_a_tab_indented_json_file_and_from_the_environment(monkeypatch, tmp_path) -> None:
    from kvfsm.runtime.config import OffloadConfig

    path = tmp_path / "offload.json"
    path.write_text('{\n\t"page_size": 8,\n\t"copy_backend": "cpu"\n}\n')  # JSON, not YAML: tabs are fine
    assert OffloadConfig.from_file(path).page_size == 8
    got = OffloadConfig.from_env({"KVFSM_COPY_BACKEND": "cpu", "KVFSM_PAGE_SIZE": "16", "OTHER": "1"})
    assert (got.copy_backend, got.page_size) == ("cpu", 16)
    monkeypatch.setenv("KVFSM_PAGE_SIZE", "32")
    assert OffloadConfig.from_env().page_size == 32


def test_trace_writer_makes_its_folders_writes_compact_lines_and_closes_once(tmp_path) -> None:
    import json as _json

    from kvfsm.runtime.trace import TraceWriter

    path = tmp_path / "a" / "b" / "trace.jsonl"
    w = TraceWriter(path, "abc")
    w.transition("r0", "offload", "allocated", "offloading", 0, {"copies": 1}, ("host_slots",), ())
    w.close()
    w.close()  # a second close is a no-op
    w.write({"kind": "late"})  # after close: dropped
    lines = path.read_text().splitlines()
    assert lines[0] == '{"kind":"header","spec_sha256":"abc"}' and len(lines) == 2
    rec = _json.loads(lines[1])
    assert (rec["req"], rec["from"], rec["to"], rec["transition"], rec["acquired"]) == (
        "r0",
        "allocated",
        "offloading",
        0,
        ["host_slots"],
    )
    assert ", " not in lines[1] and ": " not in lines[1]
    TraceWriter(path, "again").close()  # into an existing folder
    assert path.read_text() == '{"kind":"header","spec_sha256":"again"}\n'


def test_devices_dtypes_and_index_tensors_are_normalised(monkeypatch) -> None:
    import numpy as np

    from kvfsm.dataplane.errors import OutOfRange
    from kvfsm.dataplane.pools.allocator import as_index_tensor
    from kvfsm.dataplane.pools.config import parse_dtype
    from kvfsm.dataplane.pools.device_pool import resolve_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert resolve_device(2) == torch.device("cuda", 2) and resolve_device("cuda") == torch.device("cuda", 5)
    assert resolve_device("cuda:1") == torch.device("cuda", 1) and resolve_device("cpu") == torch.device("cpu")
    assert parse_dtype("torch.float16") is torch.float16 and parse_dtype("BF16") is torch.bfloat16
    assert parse_dtype(torch.float32) is torch.float32
    cpu = torch.device("cpu")
    for given in (
        torch.tensor([[3, 1], [2, 0]], dtype=torch.int32),
        np.array([[3, 1], [2, 0]], dtype=np.int32),
        [3, 1, 2, 0],
        (3, 1, 2, 0),
    ):
        got = as_index_tensor(given, cpu)
        assert got.dtype == torch.int64 and got.tolist() == [3, 1, 2, 0], type(given)
    for bad in (torch.tensor([True, False]), torch.tensor([1.0]), np.array([1.5])):
        with pytest.raises(OutOfRange):
            as_index_tensor(bad, cpu)
    assert as_index_tensor([], cpu).dtype == torch.int64


def test_page_hashes_of_every_token_container_and_every_bad_id() -> None:
    import numpy as np

    from kvfsm.dataplane.hashing import page_hashes

    ids = [0, 1, 2, 3, 70000, 5, 2**32 - 1, 7]
    want = page_hashes(ids, 4)
    for given in (
        tuple(ids),
        np.array(ids, dtype=np.int64),
        np.array(ids, dtype=np.uint32),
        np.array(ids, dtype=np.uint64),
        np.array(ids, dtype=np.int64).reshape(2, 4),
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor(ids, dtype=torch.int64).reshape(4, 2),
    ):
        assert page_hashes(given, 4) == want, type(given)
    assert page_hashes([0, 0], 2) == page_hashes(np.zeros(2, dtype=np.int32), 2)  # token 0 is an id like any
    for empty in ([], np.array([], dtype=np.int64), torch.empty(0, dtype=torch.int64)):
        assert page_hashes(empty, 1) == []
    for bad in (
        [-1, 2],
        np.array([-1, 2]),
        [2**63, 1],
        np.array([1.0, 2.0]),  # ids >= 2**32 are wide pages
        np.array([True, False]),
        torch.tensor([-3, 1]),
    ):
        with pytest.raises(ValueError):
            page_hashes(bad, 2)


def test_storage_extra_of_none_takes_anything_and_unknown_keys_list_the_options() -> None:
    from kvfsm.errors import ConfigError
    from kvfsm.runtime.storage_options import check_storage_extra

    check_storage_extra("none", {"anything": object()})
    with pytest.raises(ConfigError) as exc:
        check_storage_extra("file", {"qqqqzzzz": 1})
    assert exc.value.field == "storage_extra.qqqqzzzz" and "(options: dtype, fsync, layout, " in exc.value.reason
    with pytest.raises(ConfigError) as exc:
        check_storage_extra("file", {"writer": 2})
    assert "did you mean 'writers'?" in exc.value.reason


@pytest.mark.parametrize("seed", range(6))
def test_offload_batch_with_the_engines_arrays_offloads_what_a_loop_of_offload_does(seed: int) -> None:
    """The batch arrays only decide which requests are looked at: twin engines, one offloading with
    offload_batch(reqs, rows, committed), the other with offload(r) for each, submit the same chunks."""
    import random

    import numpy as np

    from kvfsm.verify.engine import SimEngine

    rng = random.Random(seed)
    twins = [
        SimEngine(page_size=2, stride=4, device_slots=128, host_slots=64, rows=6, max_context=64, backup_queue=8)
        for _ in range(2)
    ]
    for step in range(60):
        plan = []
        if rng.random() < 0.3:
            plan.append(("admit", f"r{step}", rng.randrange(1, 12), rng.randrange(0, 3)))
        plan += [("decode", k, rng.choice((0, 1, 3))) for k in range(6) if rng.random() < 0.8]
        if rng.random() < 0.1:
            plan.append(("end", rng.randrange(6)))
        for i, e in enumerate(twins):
            for act in plan:
                if act[0] == "admit":
                    e.admit(*act[1:])
                elif act[0] == "decode" and act[1] < len(e.live):
                    if not e.decode(e.live[act[1]], act[2]):
                        e.end(e.live[act[1]], "abort")
                elif act[0] == "end" and act[1] < len(e.live):
                    e.end(e.live[act[1]], "finish")
            if i == 0:
                live = list(e.live)
                e.manager.offload_batch(
                    live,
                    np.array([q.req_pool_idx for q in live], dtype=np.int64),
                    np.array([q.kv_committed_len for q in live], dtype=np.int64),
                )
            else:
                for q in list(e.live):
                    e.manager.offload(q)
            for h in list(e.copies.pending):
                e.copies.complete(h)
            e.worker.run_all()
            e.manager.check_progress()
        chunks = [(m.metrics.chunks, m.metrics.offloaded_tokens) for m in (e.manager for e in twins)]
        assert chunks[0] == chunks[1], (step, chunks)
        assert [q.kv_committed_len for q in twins[0].live] == [q.kv_committed_len for q in twins[1].live]
    assert chunks[0][0] > 5, chunks  # the workload did offload


def test_request_table_sizes_and_a_device_table_kept_beside_its_host_mirror() -> None:
    from kvfsm.dataplane.pools.req_to_token import ReqToTokenPool

    for rows, ctx in ((0, 8), (4, 0), (-1, 8), (4, -2)):
        with pytest.raises(ValueError):
            ReqToTokenPool(rows, ctx)
    assert ReqToTokenPool(1, 1).host_table.shape == (1, 1)
    cpu = ReqToTokenPool(2, 8)
    assert cpu.req_to_token is cpu.host_table  # on the CPU the mirror is the table
    pool = ReqToTokenPool(2, 8, device="meta")  # a table nobody can read: only its mirror holds values
    assert pool.req_to_token is not pool.host_table and pool.req_to_token.device.type == "meta"
    row = pool.alloc()
    pool.write(row, 2, [5, 6, 7])
    assert pool.read_host(row, 2, 5).tolist() == [5, 6, 7]
    assert pool.read(row, 2, 5).device.type == "meta" and pool.read(row, 2, 5).shape == (3,)


def test_build_picks_each_configured_engine_and_store_and_says_who_owns_the_store(monkeypatch, tmp_path) -> None:
    from types import SimpleNamespace

    import kvfsm.runtime.build as build
    from kvfsm.dataplane import CpuCopyEngine, DeferredCpuCopyEngine
    from kvfsm.dataplane.pools.config import KVCacheConfig
    from kvfsm.dataplane.pools.device_pool import DeviceKVPool
    from kvfsm.errors import ConfigError
    from kvfsm.runtime.config import OffloadConfig

    pool = DeviceKVPool.create(KVCacheConfig.tiny(), 64)
    assert build.copy_engine_factory(OffloadConfig(copy_backend="deferred"), pool) is DeferredCpuCopyEngine
    assert build.copy_engine_factory(OffloadConfig(copy_backend="cpu"), pool) is CpuCopyEngine
    made = []
    monkeypatch.setattr(build, "CudaCopyEngine", lambda device: made.append(device) or "cuda-engine")
    cuda_pool = SimpleNamespace(device=torch.device("cuda", 1), config=pool.config)
    assert build.copy_engine_factory(OffloadConfig(copy_backend="auto"), cuda_pool)() == "cuda-engine"
    assert made == [torch.device("cuda", 1)]
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError) as exc:
            build.copy_engine_factory(OffloadConfig(copy_backend="cuda"), pool)
        assert "but CUDA is not available;" in exc.value.reason
    config = OffloadConfig(
        page_size=4,
        storage_backend="file",
        storage_dir=tmp_path,
        model_name="m",
        host_pool_bytes=pool.config.bytes_per_token * 16,
        copy_backend="cpu",
    )
    built = build.build_components(config, device_pool=pool)
    assert built.owns_storage and built.storage.suffix == "_m_0_1" and built.host_pool.capacity == 16
    given = build.build_components(config, device_pool=pool, storage=built.storage, tp_rank=1, tp_size=2)
    assert not given.owns_storage and given.storage is built.storage
    ranked = build.build_components(config, device_pool=pool, tp_rank=1, tp_size=2)
    assert ranked.storage.suffix == "_m_1_2"


def test_a_mooncake_config_builds_its_client_with_the_deployment(monkeypatch) -> None:
    pytest.importorskip("mooncake.store")
    import kvfsm.runtime.build as build
    from kvfsm.dataplane.pools.config import KVCacheConfig
    from kvfsm.dataplane.pools.device_pool import DeviceKVPool
    from kvfsm.dataplane.storage.mooncake import MooncakeStorage
    from kvfsm.runtime.config import OffloadConfig

    calls = []
    monkeypatch.setattr(
        MooncakeStorage, "from_config", classmethod(lambda cls, config, **kw: calls.append((config, kw)) or "client")
    )
    config = OffloadConfig(storage_backend="mooncake", storage_extra={"master_server_addr": "127.0.0.1:1"})
    mla = DeviceKVPool.create(KVCacheConfig.tiny("mla"), 16)
    assert build.storage_factory(config, mla, tp_rank=1, tp_size=4)() == "client"
    assert calls == [(config, {"tp_rank": 1, "tp_size": 4, "is_mla": True})]


# --- the manager's lifecycle bookkeeping (second pass over the survivors) --------------------------------


def _engine(**kw: Any) -> Any:
    from kvfsm.verify.engine import SimEngine

    opts = dict(page_size=2, stride=4, device_slots=96, host_slots=16, rows=4, max_context=48, backup_queue=2)
    opts.update(kw)
    return SimEngine(**opts)


def _due(e: Any, rid: str, steps: int = 4) -> Any:
    """A request admitted with a 2-token prompt of its own (its page hashes are its own) and decoded `steps`
    times: one stride (4 tokens) due per 4 steps."""
    from kvfsm.verify.engine import SimRequest

    base = 1000 + 10 * sum(map(ord, rid))
    req = e.admit(rid, 2, req=SimRequest(rid, [base, base + 1]))
    for _ in range(steps):
        assert e.decode(req)
    return req


def _rebuild(e: Any, **kw: Any) -> Any:
    """The engine's manager again, over the same pools, with some constructor arguments replaced."""
    from kvfsm.runtime import DecodeOffloadManager

    old = e.manager
    args = dict(
        device_pool=e.device_pool,
        allocator=e.allocator,
        req_to_token=e.req_to_token,
        prefix_cache=old.fx.prefix_cache,
        host_pool=e.host_pool,
        copy_engine=e.copies,
        storage=e.storage,
        backup_worker=e.worker,
    )
    args.update(kw)
    old.close()
    e.manager = DecodeOffloadManager(e.config, **args)
    return e.manager


def _settle(e: Any) -> None:
    """Every copy acknowledged, every backup run and collected."""
    for h in list(e.copies.pending):
        e.copies.complete(h)
    e.manager.check_progress()
    e.worker.run_all()
    e.manager.check_progress()


def test_a_dropped_request_gives_up_its_record_and_machine_without_the_collector() -> None:
    """The weakref callback pops the record and, once the lifecycle ended, unlinks record and machine (the
    cycle only the collector would free); a re-admitted object has two callbacks, and the second finds
    nothing to pop and must not raise (an exception in a weakref callback is reported, not raised)."""
    import gc
    import sys

    e = _engine()
    mgr = e.manager
    req = _due(e, "a")
    assert mgr.offload(req)
    rec = mgr.machine_of(req).ctx
    e.end(req, "finish")  # a copy in flight: release deferred
    _settle(e)
    assert rec.machine is not None and rec.machine.state in gen.TERMINAL
    unraisable: list[Any] = []
    old_hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    gc.disable()
    try:
        del req
        assert id(rec) not in {id(r) for r in mgr._records.values()} and rec.machine is None
        # dropped while its backup is still in flight: the completion unlinks it
        req = _due(e, "b")
        assert mgr.offload(req)
        rec = mgr.machine_of(req).ctx
        for h in list(e.copies.pending):
            e.copies.complete(h)
        mgr.check_progress()  # the copy acknowledged, the backup queued
        e.end(req, "finish")
        del req
        assert rec.machine is not None  # not ended yet: its backup is outstanding
        e.worker.run_all()
        mgr.check_progress()
        assert rec.machine is None
        # retracted, re-admitted into a new lifecycle, dropped: both records' callbacks run
        req = _due(e, "c")
        assert mgr.offload(req)
        first = mgr.machine_of(req)
        e.end(req, "retract")
        assert e.admit("c", 0, req=req) is req and e.decode(req)
        assert mgr.offload(req) and mgr.machine_of(req) is not first
        assert mgr.machine_of(req).ctx.key != first.ctx.key  # a lifecycle's key names it alone
        e.end(req, "finish")
        _settle(e)
        del req
    finally:
        gc.enable()
        sys.unraisablehook = old_hook
    assert unraisable == [], [u.exc_value for u in unraisable]


def test_a_manager_built_from_its_config_namespaces_owns_and_closes_its_store(monkeypatch, tmp_path) -> None:
    """The store the manager builds carries its TP rank and size and is closed by close(); a store the
    caller passed in is the caller's to close."""
    from types import SimpleNamespace

    from kvfsm.dataplane import ReqToTokenPool, TokenSlotAllocator
    from kvfsm.dataplane.pools.config import KVCacheConfig
    from kvfsm.dataplane.pools.device_pool import DeviceKVPool
    from kvfsm.runtime import DecodeOffloadManager, OffloadConfig

    closed: list[Any] = []
    monkeypatch.setattr(FileStorage, "close", lambda self: closed.append(self), raising=False)
    pool = DeviceKVPool.create(KVCacheConfig.tiny(), 64)

    def manager(**kw: Any) -> DecodeOffloadManager:
        config = OffloadConfig(
            page_size=4,
            storage_backend="file",
            storage_dir=tmp_path,
            model_name="m",
            host_pool_bytes=pool.config.bytes_per_token * 16,
            copy_backend="cpu",
        )
        return DecodeOffloadManager(
            config,
            device_pool=pool,
            allocator=TokenSlotAllocator(64, 4),
            req_to_token=ReqToTokenPool(2, 16),
            prefix_cache=SimpleNamespace(),
            **kw,
        )

    built = manager(tp_rank=1, tp_size=2)
    store = built.fx.storage
    assert isinstance(store, FileStorage) and store.suffix == "_m_1_2"
    built.close()
    assert closed == [store]
    built.close()
    assert closed == [store]  # once
    given = manager(storage=store)
    given.close()
    assert given.fx.storage is store and closed == [store]


def test_progress_waits_for_the_slowest_rank_of_the_managers_tp_group(monkeypatch) -> None:
    """With a TP group, check_progress applies only the completions every rank has: the other rank
    reporting none, a finished copy stays in flight."""
    e = _engine()
    group = _FakeGroup(other=(0, 0))
    _fake_dist(monkeypatch)
    sizes = (2, 4, 16, 2)  # page size, stride, host slots, backup queue: the same on both ranks
    group.queue = [sizes, tuple(-v for v in sizes)]
    mgr = _rebuild(e, tp_group=group)
    req = _due(e, "a")
    assert mgr.offload(req)
    for h in list(e.copies.pending):
        e.copies.complete(h)
    mgr.check_progress()
    assert len(mgr.fx.copy_fifo) == 1 and mgr.machine_of(req).copies == 1 and group.calls[-1] == [0, 0]
    group.other = (1, 0)
    mgr.check_progress()
    assert not mgr.fx.copy_fifo and mgr.machine_of(req).backups == 1


def test_transitions_are_observed_only_in_checked_mode_or_when_traced(tmp_path, monkeypatch) -> None:
    """Checked mode records every transition id taken (T0 included) and checks the spec's invariants after
    each; a trace gets one line per transition even unchecked; unchecked and untraced, nothing listens."""
    import json

    from kvfsm.runtime.ledger import CheckedModeError

    def run(e: Any) -> Any:
        req = _due(e, "a")
        assert e.manager.offload(req)
        _settle(e)
        e.end(req, "finish")
        e.manager.finalize(req)  # a declared no-op
        return e.manager

    checked = run(_engine())
    assert 0 in checked.coverage and checked.coverage <= set(range(len(gen.TRANSITIONS)))
    assert gen.TRANSITIONS[0][:2] == ("allocated", "offload")
    assert run(_engine(checked=False)).coverage == set()
    trace = tmp_path / "t.jsonl"
    traced = run(_engine(checked=False, trace_path=str(trace)))
    traced.close()
    lines = [json.loads(l) for l in trace.read_text().splitlines()[1:]]
    assert [(l["event"], l["transition"]) for l in lines][0] == ("offload", 0) and len(lines) >= 5
    assert lines[-1]["event"] == "finish" and lines[-1]["transition"] == gen.IGNORED_TRANSITION
    import kvfsm.runtime.lifecycles as lifecycles_mod

    monkeypatch.setattr(lifecycles_mod.spec_gen, "violated_invariants", lambda m: ["an invariant"])
    with pytest.raises(CheckedModeError):
        run(_engine())
    run(_engine(checked=False))  # unchecked: not checked


def test_the_gauges_are_exact_after_every_manager_call() -> None:
    e = _engine(backup_queue=1)
    mgr = e.manager
    a, b = _due(e, "a"), _due(e, "b")
    assert mgr.offload_batch([a, b]) == 2
    assert mgr.metrics.copies_in_flight == 2 and mgr.metrics.backups_in_flight == 0
    for h in list(e.copies.pending):
        e.copies.complete(h)
    mgr.check_progress()  # one backup queued, one chunk parked: both in flight
    assert mgr.metrics.copies_in_flight == 0 and mgr.metrics.backups_in_flight == 2
    assert mgr.fx.worker.outstanding() == 1 and len(mgr.fx.parked) == 1


def test_backups_completing_together_keep_each_ones_outcome() -> None:
    """Three backups collected by one progress check, the last one failing: only it counts as failed."""
    e = _engine(backup_queue=3)
    mgr = e.manager
    reqs = [_due(e, r) for r in "abc"]
    assert mgr.offload_batch(reqs) == 3
    for h in list(e.copies.pending):
        e.copies.complete(h)
    mgr.check_progress()
    assert len(e.worker.pending) == 3
    e.fail_writes.update(e.worker.pending[2].payload.hashes)
    e.worker.run_all()
    mgr.check_progress()
    recs = [mgr.machine_of(r).ctx for r in reqs]
    assert [(r.stored_pages, r.failed_backups) for r in recs] == [(2, 0), (2, 0), (0, 1)]


def test_drain_waits_for_a_threaded_worker_and_gives_up_on_a_stepped_one() -> None:
    """drain() waits for the backup thread between progress checks (a slow store drains in three), and
    with a worker that has no wait_idle (stepped, nobody runs it) it runs out of iterations."""
    from kvfsm.dataplane.storage.memory import MemoryStorage
    from kvfsm.runtime.backup import ThreadBackupWorker

    class SlowStore(MemoryStorage):
        def batch_set(self, keys, pages):  # type: ignore[no-untyped-def]
            time.sleep(0.2)
            return super().batch_set(keys, pages)

    e = _engine()
    _rebuild(e, storage=SlowStore(), backup_worker=ThreadBackupWorker(2))
    try:
        req = _due(e, "a")
        assert e.manager.offload(req)
        e.manager.drain(max_iterations=3)
        assert e.manager.idle() and e.manager.machine_of(req).ctx.stored_pages == 2
    finally:
        e.manager.close()
    stepped = _engine()
    req = _due(stepped, "a")
    assert stepped.manager.offload(req)
    with pytest.raises(RuntimeError, match="did not drain"):
        stepped.manager.drain(max_iterations=3)


def test_offload_batch_skips_requests_without_a_row_or_output_and_takes_arrays_only_as_a_pair() -> None:
    e = _engine()
    mgr = e.manager
    waiting = _due(e, "w")
    waiting.req_pool_idx = -1  # the engine's "no row" (it has outputs: only the row says it is not running)
    fresh = e.admit("f", 2)
    fresh.output_ids.clear()  # sampled nothing yet
    due = _due(e, "d")
    assert mgr.offload(waiting) is False and mgr.machine_of(waiting) is None
    rows = [q.req_pool_idx for q in (waiting, fresh, due)]
    assert mgr.offload_batch([waiting, fresh, due], rows, None) == 1  # one array: ignored, as with none
    assert mgr.machine_of(waiting) is None and mgr.machine_of(fresh) is None
    more = _due(e, "m")
    assert mgr.offload_batch([waiting, more], None, [0, more.kv_committed_len]) == 1


def test_an_ended_request_refuses_offload_whether_its_row_reads_none_or_minus_one() -> None:
    e = _engine()
    mgr = e.manager
    req = _due(e, "a")
    e.end(req, "abort")
    assert req.req_pool_idx is None
    for row in (None, -1):
        req.req_pool_idx = row
        with pytest.raises(EventRejected):
            mgr.offload(req)
        with pytest.raises(EventRejected):
            mgr.offload_batch([req])
    # a second end after the engine reset the row to -1 is the declared no-op, not a new admission
    before = mgr.metrics.ignored_duplicate_releases
    mgr.abort(req)
    assert mgr.metrics.ignored_duplicate_releases == before + 1
    # the engine also resets the lengths of an ended request: the batch arrays still get it looked at
    req.kv_committed_len = 0
    with pytest.raises(EventRejected):
        mgr.offload_batch([req], [-1], [0])
    # finished with its copy in flight (release deferred, the row still its own), lengths reset: still refused
    late = _due(e, "b")
    assert mgr.offload(late)
    e.end(late, "finish")
    late.kv_committed_len = 0
    with pytest.raises(EventRejected):
        mgr.offload(late)
    _settle(e)
    e.check_teardown()


def test_a_request_without_a_protocol_field_is_reported_from_its_attribute_error() -> None:
    from kvfsm.errors import RequestFieldMissing

    class NoOutputs:
        rid, req_pool_idx, kv_committed_len, kv_allocated_len, prefix_len = "x", 0, 4, 4, 0
        origin_input_ids = [1, 2]

    class NoRow:
        rid = "y"

    mgr = _engine().manager
    for call, req in (
        (mgr.offload, NoOutputs()),
        (lambda r: mgr.offload_batch([r]), NoOutputs()),
        (mgr.finalize, NoRow()),
    ):
        with pytest.raises(RequestFieldMissing) as exc:
            call(req)
        assert isinstance(exc.value.__cause__, AttributeError), call


def test_a_retracted_request_readmitted_and_ended_before_any_offload_is_a_new_lifecycle() -> None:
    e = _engine()
    mgr = e.manager
    req = _due(e, "a")
    assert mgr.offload(req)
    first = mgr.machine_of(req)
    _settle(e)
    e.end(req, "retract")
    assert e.admit("a", 0, req=req) is req
    e.end(req, "finish")  # the engine's next call is the end: the manager admits the new lifecycle there
    assert mgr.machine_of(req) is not first and mgr.machine_of(req).state == gen.RELEASED
    assert first.state == gen.RELEASED
    e.check_teardown()


def test_admission_refuses_a_row_past_the_table_and_live_records_are_the_row_holders() -> None:
    from kvfsm.errors import InvalidRequest

    e = _engine()
    mgr = e.manager
    a, b = _due(e, "a"), _due(e, "b")
    assert mgr.offload(a) and mgr.offload(b)
    e.end(b, "abort")
    _settle(e)
    assert mgr.live_records() == [mgr.machine_of(a).ctx]
    c = _due(e, "c")
    c.req_pool_idx = e.rows
    with pytest.raises(InvalidRequest):
        mgr.offload(c)


def test_each_chunk_that_finds_no_host_room_counts_one_retry() -> None:
    e = _engine(host_slots=4)
    mgr = e.manager
    a, b = _due(e, "a"), _due(e, "b")
    assert mgr.offload(a)
    assert mgr.offload(b) is False and mgr.offload(b) is False
    assert mgr.metrics.host_full_retries == 2


# --- the effects, the ledger and the backup jobs (second pass) ------------------------------------------


def test_token_slice_is_the_list_slice_of_prompt_and_outputs_for_every_span() -> None:
    from types import SimpleNamespace

    import numpy as np

    from kvfsm.runtime.effects import token_slice

    for prompt in ([1, 2, 3], (1, 2, 3), np.array([1, 2, 3])):
        req = SimpleNamespace(origin_input_ids=prompt, output_ids=[4, 5])
        for start in range(6):
            for end in range(start, 6):
                got = token_slice(req, start, end)
                assert type(got) is list and got == [1, 2, 3, 4, 5][start:end], (type(prompt), start, end)


def test_a_chunk_has_no_hashes_until_its_copy_is_acknowledged() -> None:
    e = _engine()
    req = _due(e, "a")
    assert e.manager.offload(req)
    (chunk,) = e.manager.fx.copy_fifo
    assert chunk.hashes == []
    for h in list(e.copies.pending):
        e.copies.complete(h)
    e.manager.check_progress()
    assert len(chunk.hashes) == 2


def test_without_a_store_every_backup_fails_and_nothing_is_stored() -> None:
    from kvfsm.verify.engine import SimEngine

    class NoStore(SimEngine):
        def make_storage(self) -> Any:
            return None

    e = NoStore(page_size=2, stride=4, device_slots=96, host_slots=16, rows=4, max_context=48, backup_queue=2)
    req = _due(e, "a")
    assert e.manager.offload(req)
    _settle(e)
    rec = e.manager.machine_of(req).ctx
    assert (rec.stored_pages, rec.failed_backups) == (0, 1) and len(e.manager.fx.stored) == 0


def test_one_store_call_for_several_chunks_gives_each_chunk_its_own_pages_outcome() -> None:
    """The thread worker writes the three backups it finds queued in one store call; the store refuses the
    last chunk's two pages (the 5th and 6th page of the call): only that chunk failed."""
    from kvfsm.dataplane.storage import FaultyStorage
    from kvfsm.dataplane.storage.memory import MemoryStorage
    from kvfsm.runtime.backup import ThreadBackupWorker

    e = _engine(backup_queue=3)
    store = FaultyStorage(MemoryStorage(), fail_write_ordinals={4, 5})
    _rebuild(e, storage=store, backup_worker=ThreadBackupWorker(3))
    try:
        reqs = [_due(e, r) for r in "abc"]
        assert e.manager.offload_batch(reqs) == 3
        e.manager.drain()
        recs = [e.manager.machine_of(r).ctx for r in reqs]
        assert [(r.stored_pages, r.failed_backups) for r in recs] == [(2, 0), (2, 0), (0, 1)]
        assert store.pages_written == 6  # (one call: the ordinals are positions in it)
    finally:
        e.manager.close()


def test_the_first_backup_failure_is_logged_on_a_host_booted_seconds_ago(monkeypatch, caplog) -> None:
    import logging

    import kvfsm.runtime.effects as effects

    e = _engine()
    monkeypatch.setattr(effects.time, "monotonic", lambda: 5.0)  # a monotonic clock that started 5 s ago
    req = _due(e, "a")
    assert e.manager.offload(req)
    for h in list(e.copies.pending):
        e.copies.complete(h)
    e.manager.check_progress()
    e.fail_writes.update(e.worker.pending[0].payload.hashes)
    e.worker.run_all()
    with caplog.at_level(logging.WARNING, logger="kvfsm"):
        e.manager.check_progress()
    assert [r.getMessage()[:20] for r in caplog.records] == ["1 backup(s) failed s"]


def test_the_ledger_owns_pages_not_slots_and_keeps_every_reader() -> None:
    from kvfsm.runtime.ledger import CheckedModeError, SlotLedger

    led = SlotLedger(page_size=2)
    led.claim_device("A", "offload", [0])
    with pytest.raises(CheckedModeError):
        led.claim_device("B", "offload", [1])  # slot 1 is on A's page
    with pytest.raises(CheckedModeError):
        led.release_device("B", "release", [1])  # freeing a page A owns
    led.copy_started("A", 1, [0, 1], [4, 5])
    led.copy_started("A", 2, [0, 1], [6, 7])
    assert led.host_pages() == 2  # two host pages, four slots
    led.copy_completed(1, [0, 1])
    with pytest.raises(CheckedModeError):
        led.release_device("A", "release", [0, 1])  # chunk 2 still reads page 0 (B2)
    led.copy_completed(2, [0, 1])
    led.release_device("A", "release", [0, 1])
    with pytest.raises(CheckedModeError):
        led.release_device("A", "release", [1])  # double release (B9)


def test_stepped_worker_runs_the_oldest_job_by_default_and_run_all_counts() -> None:
    w = SteppedBackupWorker(4)
    w.submit_many([BackupJob(i, lambda p: [True]) for i in range(3)])
    assert w.run().payload == 0
    assert w.run_all() == 2 and w.completed() == 3

    def raises(p: Any) -> list[bool]:
        raise OSError("store down")

    job = BackupJob(0, raises)
    job.run()
    assert job.results == () and isinstance(job.error, OSError) and not job.ok


# --- the pools' argument checks and exact paths (second pass) -------------------------------------------


def test_slot_allocator_sizes_defaults_and_argument_checks() -> None:
    from kvfsm.dataplane import TokenSlotAllocator

    assert TokenSlotAllocator(3).page_size == 1  # the default page size: any slot count
    assert TokenSlotAllocator(1, 1, reserve_padding_page=False).capacity == 1
    for args, kw in (
        ((4, 0), {}),
        ((4, -2), {}),
        ((6, 4), {"reserve_padding_page": False}),
        ((0, 1), {}),
        ((-4, 2), {}),
        ((1, 1), {}),
        ((4, 4), {}),
    ):  # the last two: only the padding page
        with pytest.raises(ValueError):
            TokenSlotAllocator(*args, **kw)
    for a in (TokenSlotAllocator(8, 1), TokenSlotAllocator(8, 2)):
        for bad in (True, -2, 1.0):
            with pytest.raises(ValueError):
                a.alloc(bad)  # type: ignore[arg-type]
        assert a.free_slots == a.capacity


def test_a_free_batch_is_refused_exactly_slot_by_slot() -> None:
    from kvfsm.dataplane import TokenSlotAllocator
    from kvfsm.dataplane.errors import DuplicateIndex, OutOfRange, PartialPage

    one = TokenSlotAllocator(8, 1, reserve_padding_page=False)
    one.alloc(8)
    for bad, err in (([8], OutOfRange), ([5, 5], DuplicateIndex), ([1, 2, 2], DuplicateIndex)):
        with pytest.raises(err):
            one.free(bad)
    assert one.free_slots == 0
    one.free(one.page_slots([3, 1]))  # a PageSlots frees like its slots
    assert one.free_slots == 2
    two = TokenSlotAllocator(8, 2, reserve_padding_page=False)
    two.alloc(8)
    with pytest.raises(PartialPage):
        two.free([1, 2])  # two slots, one from each of two pages
    assert two.free_slots == 0


def test_conservation_checks_catch_a_free_list_that_names_a_reserved_or_missing_page() -> None:
    from collections import deque

    from kvfsm.dataplane import ReqToTokenPool, TokenSlotAllocator
    from kvfsm.dataplane.errors import ConservationError

    for free in ([0, 3], [4, 3]):  # page 0 is the padding page; page 4 is past the pool
        a = TokenSlotAllocator(8, 2)
        assert a.alloc_pages(1) == [1]
        a.check_conservation()
        a._free_pages = deque(free)
        with pytest.raises(ConservationError):
            a.check_conservation()
    t = ReqToTokenPool(2, 4)
    assert t.alloc() == 0
    t.check_conservation()
    t._free = deque([0])  # the allocated row listed free, the free one missing: the counts still add up
    with pytest.raises(ConservationError):
        t.check_conservation()


def test_kv_config_parses_its_dtype_and_refuses_zero_sizes() -> None:
    from kvfsm.dataplane.pools.config import KVCacheConfig

    assert KVCacheConfig(num_layers=1, head_dim=2, dtype="float16").dtype is torch.float16  # type: ignore[arg-type]
    for kw in ({"num_layers": 0}, {"head_dim": 0}, {"kv_heads": 0}, {"num_layers": 1.0}):
        with pytest.raises(ValueError):
            KVCacheConfig(**{"num_layers": 1, "head_dim": 2, **kw})


def test_device_pools_default_to_the_cpu_pick_their_attention_and_expose_their_planes() -> None:
    from kvfsm.dataplane.pools.config import KVCacheConfig
    from kvfsm.dataplane.pools.device_pool import DeviceKVPool, MHADeviceKVPool, MLADeviceKVPool

    mha, mla = KVCacheConfig.tiny(), KVCacheConfig.tiny("mla")
    assert MHADeviceKVPool(mha, 1).device == torch.device("cpu")
    for bad in (0, -1):
        with pytest.raises(ValueError):
            MHADeviceKVPool(mha, bad)
    assert type(DeviceKVPool.create(mha, 4)) is MHADeviceKVPool and type(DeviceKVPool.create(mla, 4)) is MLADeviceKVPool
    meta = DeviceKVPool.create(mha, 4, device="meta")
    assert meta.device.type == "meta" and meta.storage.device.type == "meta"  # (a pool that allocates nothing)
    p = DeviceKVPool.create(mha, 4)
    p.storage.copy_(torch.arange(p.storage.numel(), dtype=p.storage.dtype).view_as(p.storage))
    for layer in range(mha.num_layers):
        assert torch.equal(p.k_buffer(layer), p.storage[0, layer]) and torch.equal(
            p.v_buffer(layer), p.storage[1, layer]
        )
        assert [t.data_ptr() for t in p.layer_buffers(layer)] == [p.storage[i, layer].data_ptr() for i in range(2)]
    q = DeviceKVPool.create(mla, 4)
    q.storage.copy_(torch.arange(q.storage.numel(), dtype=q.storage.dtype).view_as(q.storage))
    assert torch.equal(q.kv_buffer(1), q.storage[0, 1]) and len(q.layer_buffers(1)) == 1


def test_host_memory_is_read_from_meminfo_and_the_pool_keeps_its_headroom(monkeypatch) -> None:
    import kvfsm.dataplane.pools.host_pool as hp
    from kvfsm.dataplane import HostKVPool
    from kvfsm.dataplane.errors import HostMemoryError
    from kvfsm.dataplane.pools.config import KVCacheConfig

    if os.path.exists("/proc/meminfo"):
        got = hp.available_host_memory()
        assert isinstance(got, int) and got > 0
    cfg = KVCacheConfig.tiny()
    need = 8 * cfg.bytes_per_token
    monkeypatch.setattr(hp, "available_host_memory", lambda: need + 100)
    assert HostKVPool(cfg, 8, headroom_bytes=100).size == 8  # exactly fits
    with pytest.raises(HostMemoryError):
        HostKVPool(cfg, 8, headroom_bytes=101)


def test_host_pool_sizes_and_page_checks_of_every_index_form() -> None:
    from kvfsm.dataplane import HostKVPool
    from kvfsm.dataplane.errors import NotAllocated, PartialPage
    from kvfsm.dataplane.pools.config import KVCacheConfig

    cfg = KVCacheConfig.tiny()
    assert HostKVPool(cfg, 2, page_size=2).size == 2  # one page is enough
    for bad in (0, -1):
        with pytest.raises(ValueError):
            HostKVPool(cfg, 8, page_size=bad)
    one = HostKVPool(cfg, 4)
    one.allocator.alloc(4)
    assert one.get_pages_bytes([0, 1]).shape[0] == 2 and one.get_pages_bytes(torch.tensor([2])).shape[0] == 1
    two = HostKVPool(cfg, 8, page_size=2)
    pages = two.allocator.alloc_pages(2)
    with pytest.raises(PartialPage):
        two.get_pages_bytes([])
    with pytest.raises(PartialPage):
        two.get_pages_bytes([pages[0] * 2, pages[0] * 2 + 3])  # aligned start, not one page
    slots = two.allocator.page_slots(pages)
    assert two.get_pages_bytes(slots).shape[0] == 2
    # a PageSlots of another allocator (page size 4) counts by its slots, never by its page ids
    from kvfsm.dataplane import TokenSlotAllocator

    four = TokenSlotAllocator(8, 4, reserve_padding_page=False)
    assert pages == [0, 1]  # this pool's pages 0 and 1: slots 0..3, which the other calls its page 0
    theirs = four.page_slots([1])  # slots 4..7: pages 2 and 3 here, not allocated
    with pytest.raises(NotAllocated):
        two.get_pages_bytes(theirs)
    assert two.get_pages_bytes(four.page_slots([0])).shape[0] == 2  # slots 0..3: this pool's two pages
    two.allocator.free_pages(pages)
    for stale in (slots, slots.slots):
        with pytest.raises(NotAllocated):
            two.get_pages_bytes(stale)  # pages given back: their bytes are no one's


def test_request_table_empty_spans_page_slots_and_plan_copy_of_a_page_list_past_the_pool() -> None:
    from kvfsm.dataplane import HostKVPool, ReqToTokenPool, TokenSlotAllocator
    from kvfsm.dataplane.copy.base import plan_copy
    from kvfsm.dataplane.errors import OutOfRange
    from kvfsm.dataplane.pools.allocator import PageSlots
    from kvfsm.dataplane.pools.config import KVCacheConfig
    from kvfsm.dataplane.pools.device_pool import DeviceKVPool

    t = ReqToTokenPool(2, 8)
    row = t.alloc()
    alloc = TokenSlotAllocator(16, 2)
    t.write(row, 0, alloc.page_slots(alloc.alloc_pages(2)))
    assert t.read_host(row, 0, 4).tolist() == alloc.slots_of([1, 2]).tolist()
    assert t.read_host(row, 2, 2).numel() == 0 and t.read(row, 4, 4).numel() == 0
    cfg = KVCacheConfig.tiny()
    dev = DeviceKVPool.create(cfg, 16)
    host = HostKVPool(cfg, 4, page_size=2)
    hslots = host.allocator.page_slots(host.allocator.alloc_pages(1))
    bogus = PageSlots(alloc, [8], torch.tensor([16, 17]))  # a page list naming a page past the pool
    with pytest.raises(OutOfRange):
        plan_copy("d2h", dev, bogus, host, hslots)


def test_build_passes_the_configs_host_layout_and_ratio_and_closes_a_store_it_built_when_a_later_step_fails(
    monkeypatch, tmp_path
) -> None:
    import kvfsm.runtime.build as build
    from kvfsm.dataplane import HostKVPool
    from kvfsm.dataplane.pools.config import KVCacheConfig
    from kvfsm.dataplane.pools.device_pool import DeviceKVPool
    from kvfsm.runtime.config import OffloadConfig

    pool = DeviceKVPool.create(KVCacheConfig.tiny(), 64)
    laid = build.build_components(
        OffloadConfig(page_size=4, host_layout="page_first", host_pool_ratio=0.5, copy_backend="cpu"), device_pool=pool
    )
    assert laid.host_pool.layout == "page_first" and laid.host_pool.capacity == 32
    exact = OffloadConfig(
        page_size=4, offload_stride=16, host_pool_bytes=pool.config.bytes_per_token * 16, copy_backend="cpu"
    )
    assert build.build_components(exact, device_pool=pool).host_pool.capacity == 16  # one stride fits exactly
    closed: list[Any] = []
    monkeypatch.setattr(FileStorage, "close", lambda self: closed.append(self), raising=False)

    def no_room(*a: Any, **kw: Any) -> Any:
        raise MemoryError("no host memory")

    monkeypatch.setattr(HostKVPool, "for_device_pool", no_room)
    with pytest.raises(MemoryError):
        build.build_components(
            OffloadConfig(page_size=4, storage_backend="file", storage_dir=tmp_path, copy_backend="cpu"),
            device_pool=pool,
        )
    assert len(closed) == 1 and isinstance(closed[0], FileStorage)


def test_storage_extra_numbers_positive_or_non_negative_as_each_option_says() -> None:
    from kvfsm.errors import ConfigError
    from kvfsm.runtime.storage_options import check_storage_extra

    check_storage_extra("file", {"writers": 1})
    check_storage_extra("mooncake", {"master_server_addr": "127.0.0.1:50051", "global_segment_size": 0})
    for backend, extra in (
        ("file", {"writers": 0}),
        ("mooncake", {"master_server_addr": "127.0.0.1:50051", "global_segment_size": -1}),
    ):
        with pytest.raises(ConfigError):
            check_storage_extra(backend, extra)


def test_a_config_error_inside_a_mapping_names_its_dotted_field() -> None:
    from kvfsm.errors import ConfigError
    from kvfsm.runtime.config import OffloadConfig

    with pytest.raises(ConfigError) as exc:
        OffloadConfig(storage_extra={1: 2})  # type: ignore[dict-item]
    assert exc.value.field is not None and exc.value.field.startswith("storage_extra.1."), exc.value.field


def test_release_host_resources_unregisters_the_pool_from_a_store_that_registered_it_once_and_first() -> None:
    """A store that registered the host pool with its transport (Mooncake) is told to unregister it, with the
    manager's pool and before the pool is released; once released, a second release unregisters nothing."""
    from kvfsm.dataplane.storage.memory import MemoryStorage
    from kvfsm.verify.engine import SimEngine

    calls: list[tuple[object, bool]] = []

    class Engine(SimEngine):
        def make_storage(self) -> Any:
            engine = self

            class RegisteringStore(MemoryStorage):
                def unregister_host_pool(self, pool: object) -> None:
                    calls.append((pool, engine.host_pool.released))

            return RegisteringStore()

    e = Engine(page_size=2, stride=2, device_slots=32, host_slots=16)
    r = e.admit("a", 4)
    assert e.decode(r) and e.decode(r) and e.manager.offload(r)
    e.end(r)
    e.settle()
    e.manager.drain()
    assert calls == []
    e.manager.release_host_resources()
    assert calls == [(e.host_pool, False)] and e.host_pool.released
    e.manager.release_host_resources()
    assert calls == [(e.host_pool, False)]


def test_an_explicit_pin_choice_of_the_host_pool_is_kept_where_cuda_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """`for_device_pool(pin_memory=False)` stays unpinned on a CUDA host: only `None` means "pin when CUDA is
    there". Here CUDA is made to look present, so a pool that dropped the caller's False would try to pin (which a
    CPU-only build refuses) or report itself pinned. (Found by the GPU mutation pass: only a CUDA host told the
    dropped argument apart.)"""
    from kvfsm.dataplane.pools.config import KVCacheConfig
    from kvfsm.dataplane.pools.device_pool import DeviceKVPool
    from kvfsm.dataplane.pools.host_pool import HostKVPool

    dev = DeviceKVPool.create(KVCacheConfig.tiny(), 16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pool = HostKVPool.for_device_pool(dev, page_size=4, pin_memory=False)
    assert pool.pinned is False and not pool.kv_buffer.is_pinned()


def test_page_slots_come_on_the_device_asked_for() -> None:
    """`as_index_tensor` moves an allocator's page slots (built on the CPU) to the device it is given; the meta
    device stands in for CUDA on a CPU host. (Found by the GPU mutation pass.)"""
    from kvfsm.dataplane.pools.allocator import TokenSlotAllocator, as_index_tensor

    a = TokenSlotAllocator(32, 4)
    slots = a.page_slots(a.alloc_pages(2))
    moved = as_index_tensor(slots, torch.device("meta"))
    assert moved.device.type == "meta" and moved.shape == (8,) and moved.dtype == torch.int64
    assert as_index_tensor(slots, torch.device("cpu")) is slots.slots
