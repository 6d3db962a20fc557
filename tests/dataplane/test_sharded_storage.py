"""ShardedStorage: a store spread over several answers as one store would (per-key results in order, the stored
prefix, what reads back), each key always in the same shard, in every process; a failing shard fails the call
only after every other shard's part is done; a manager's store processes as shards write the shared pool's
pages."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

from kvfsm.dataplane import FileStorage, MemoryStorage, page_hashes
from kvfsm.dataplane.pools.config import KVCacheConfig
from kvfsm.dataplane.pools.host_pool import HostKVPool
from kvfsm.dataplane.storage import ProcessStorage, ShardedStorage
from kvfsm.dataplane.storage.sharded import shard_of
from kvfsm.errors import ConfigError


def pages(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, 256, (n, 32), dtype=torch.uint8, generator=g).unbind(0))


def shared_pool(n: int) -> tuple[HostKVPool, object]:
    pool = HostKVPool(KVCacheConfig(num_layers=2, head_dim=8, kv_heads=2), 32 * 8, page_size=8, shared=True)
    slots = pool.page_slots(pool.allocator.alloc_pages(n))
    g = torch.Generator().manual_seed(n)
    pool.set_pages_bytes(slots, torch.randint(0, 256, (n, pool.page_nbytes), dtype=torch.uint8, generator=g))
    return pool, slots


@given(st.lists(st.booleans(), min_size=0, max_size=24), st.integers(1, 5))
def test_the_stored_prefix_and_reads_are_what_one_store_answers(stored: list[bool], shards: int) -> None:
    """Any subset of the keys stored, any shard count: batch_exists, batch_get and batch_set answer, key by key and
    in the caller's order, what a single store holding the same pages answers."""
    keys = [f"k{i:03d}" for i in range(len(stored))]
    data = pages(len(keys))
    one, sharded = MemoryStorage(), ShardedStorage([MemoryStorage() for _ in range(shards)])
    picked = [i for i, s in enumerate(stored) if s]
    for store in (one, sharded):
        assert store.batch_set([keys[i] for i in picked], [data[i] for i in picked]) == [True] * len(picked)
    assert sharded.batch_exists(keys) == one.batch_exists(keys)
    for got, want in zip(sharded.batch_get(keys), one.batch_get(keys)):
        assert (got is None and want is None) or (got is not None and want is not None and torch.equal(got, want))
    sharded.close()


def test_each_key_is_stored_in_its_own_shard_only() -> None:
    """A key lives in `shards[shard_of(key, n)]` and in no other, so a read goes where the write went."""
    shards = [MemoryStorage() for _ in range(3)]
    store = ShardedStorage(shards)
    keys = page_hashes(list(range(40 * 4)), 4)
    assert store.batch_set(keys, pages(len(keys))) == [True] * len(keys)
    for key in keys:
        assert [s.batch_exists([key]) for s in shards] == [int(i == shard_of(key, 3)) for i in range(3)]
    assert all(s.batch_exists([k for k in keys if shard_of(k, 3) == i]) > 0 for i, s in enumerate(shards))
    store.close()


def test_a_keys_shard_is_the_same_in_every_process() -> None:
    """A page written by one server process is found by the next: the shard is a fixed function of the key's
    bytes (CRC-32), never Python's per-process salted hash. These values were computed once, in another process;
    the last key has a stored page's shape (a digest and the deployment suffix)."""
    keys = {
        "": 0,
        "abc": 5,
        "ключ": 1,
        "x" * 300: 3,
        "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0_m_0_1": 3,
    }
    assert {k: shard_of(k, 7) for k in keys} == keys
    assert shard_of("abc", 1) == 0


class RecordingStore(MemoryStorage):
    """A store whose writes wait for `release` (when given) and record that they finished."""

    def __init__(self, release: threading.Event | None = None) -> None:
        super().__init__()
        self.release, self.finished = release, 0

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        if self.release is not None:
            assert self.release.wait(60), "the test never released the write"
        out = super().batch_set(keys, pages)
        self.finished += 1
        return out


class RaisingStore(MemoryStorage):
    def __init__(self, started: threading.Event) -> None:
        super().__init__()
        self.started = started

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        self.started.set()
        raise RuntimeError("client gave up")


def test_a_failing_shard_fails_the_call_after_the_other_shards_finish() -> None:
    """One shard's own error (any type) is the call's error, raised only once every other shard's part has
    returned: no write runs on behind a call the backup worker has counted as failed."""
    release = threading.Event()
    good = RecordingStore(release)
    bad = RaisingStore(threading.Event())
    store = ShardedStorage([good, bad])
    keys = page_hashes(list(range(4 * 40)), 4)
    assert {shard_of(k, 2) for k in keys} == {0, 1}
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            store.batch_set(keys, pages(len(keys)))
        except BaseException as exc:  # noqa: B036  recorded for the main thread
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert bad.started.wait(60), "the failing shard was never called"
    caller.join(0.2)  # the bad shard has raised; the call still waits for the good one
    assert caller.is_alive() and good.finished == 0 and not outcome
    release.set()
    caller.join(60)
    assert not caller.is_alive()
    assert good.finished == 1 and len(outcome) == 1
    assert isinstance(outcome[0], RuntimeError) and "client gave up" in str(outcome[0])
    store.close()


def test_a_shard_that_cannot_be_built_closes_those_built_before_it(tmp_path: Path) -> None:
    """`ShardedStorage.of`: the factory's error reaches the caller, and the shards already built are closed."""
    built: list[RecordingStore] = []
    closed: list[RecordingStore] = []

    class Closing(RecordingStore):
        def close(self) -> None:
            closed.append(self)

    def make() -> RecordingStore:
        if len(built) == 2:
            raise PermissionError("no such mount")
        built.append(Closing())
        return built[-1]

    with pytest.raises(PermissionError, match="no such mount"):
        ShardedStorage.of(make, 3)
    assert closed == built
    with pytest.raises(ValueError, match="at least 1"):
        ShardedStorage.of(make, 0)
    with pytest.raises(ValueError, match="at least one shard"):
        ShardedStorage([])


def test_bad_calls_are_refused_before_any_shard_is_called() -> None:
    shards = [RecordingStore() for _ in range(2)]
    store = ShardedStorage(shards)
    with pytest.raises(ValueError, match="2 keys but 1 pages"):
        store.batch_set(["a", "b"], pages(1))
    pool, slots = shared_pool(2)
    with pytest.raises(ValueError, match="3 keys for 2 pages"):
        store.batch_set_from_host(["a", "b", "c"], pool, slots)
    assert [s.finished for s in shards] == [0, 0] and store.stats.writes_ok == 0
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.batch_get(["a"])


def test_host_pages_reach_each_shard_as_its_own_pages(tmp_path: Path) -> None:
    """batch_set_from_host: a shard that gathers pages itself (FileStorage) and one that takes bytes (a memory
    store) each store exactly their keys' pages; the stats add up."""
    pool, slots = shared_pool(12)
    want = pool.get_pages_bytes(slots)
    keys = page_hashes(list(range(12 * 8)), 8)
    for shards in (
        [FileStorage(str(tmp_path / "f0"), model_name="m"), FileStorage(str(tmp_path / "f1"), model_name="m")],
        [MemoryStorage(), MemoryStorage(), MemoryStorage()],
    ):
        store = ShardedStorage(shards)
        assert store.batch_set_from_host(keys, pool, slots) == [True] * 12
        got = store.batch_get(keys)
        assert all(g is not None and torch.equal(g, w) for g, w in zip(got, want))
        assert store.batch_exists(keys) == 12
        if isinstance(shards[0], FileStorage):
            assert store.stats.writes_ok == 12 and store.stats.reads_ok == 12
        store.close()


def test_a_manager_with_several_store_processes_shards_its_store_over_the_shared_pool(tmp_path: Path) -> None:
    """`storage_processes=2`: the store is a ShardedStorage of two ProcessStorage children, each mapping the
    shared host pool and storing its keys' pages in place; an in-process FileStorage of the directory reads every
    page back byte-exact; close ends both children. More than one without `storage_process` is a ConfigError
    naming the field."""
    from kvfsm.dataplane import DeviceKVPool
    from kvfsm.runtime import OffloadConfig
    from kvfsm.runtime.build import storage_factory

    with pytest.raises(ConfigError, match="storage_processes"):
        OffloadConfig(page_size=8, storage_dir=tmp_path, storage_processes=2)
    with pytest.raises(ConfigError, match="storage_processes"):
        OffloadConfig(page_size=8, storage_dir=tmp_path, storage_process=True, storage_processes=0)
    config = OffloadConfig(page_size=8, storage_dir=tmp_path, storage_process=True, storage_processes=2)
    device_pool = DeviceKVPool(KVCacheConfig(num_layers=2, head_dim=8, kv_heads=2), 64, torch.device("cpu"))  # type: ignore[arg-type]
    make = storage_factory(config, device_pool, tp_rank=0, tp_size=1)
    assert make is not None
    store = make()
    assert isinstance(store, ShardedStorage) and len(store.shards) == 2
    shards = store.shards
    try:
        assert all(isinstance(s, ProcessStorage) for s in shards)
        children = [s.pid for s in shards]  # type: ignore[attr-defined]
        assert None not in children and len(set(children)) == 2
        pool, slots = shared_pool(10)
        keys = page_hashes(list(range(10 * 8)), 8)
        assert {shard_of(k, 2) for k in keys} == {0, 1}
        assert store.batch_set_from_host(keys, pool, slots) == [True] * 10
        local = FileStorage(str(tmp_path), model_name="model")
        assert all(
            g is not None and torch.equal(g, w) for g, w in zip(local.batch_get(keys), pool.get_pages_bytes(slots))
        )
        assert store.batch_exists(keys) == 10 and len(list(tmp_path.glob("*_model_0_1.bin"))) == 10
    finally:
        store.close()
    assert [s.pid for s in shards] == [None, None]  # type: ignore[attr-defined]


def test_an_idle_call_returns_at_once() -> None:
    """No keys: no shard is called, nothing is waited for."""
    shards = [RecordingStore(threading.Event()) for _ in range(2)]  # a write would wait for a release never given
    store = ShardedStorage(shards)
    assert store.batch_set([], []) == [] and store.batch_exists([]) == 0 and store.batch_get([]) == []
    assert [s.finished for s in shards] == [0, 0]
    store.close()


class BarrierStore(MemoryStorage):
    """A store whose writes wait until every shard's write has started, and note the thread each ran on."""

    def __init__(self, barrier: threading.Barrier, threads: list[str]) -> None:
        super().__init__()
        self.barrier, self.threads = barrier, threads

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        self.threads.append(threading.current_thread().name)
        self.barrier.wait()  # raises BrokenBarrierError after its timeout if not every shard runs at once
        return super().batch_set(keys, pages)


def test_every_shards_part_runs_at_once_on_a_named_thread() -> None:
    """40 shards, more than a default thread pool gives on any machine: all 40 parts of one call run at the same
    time (each waits for the others), on threads named `kvfsm-shard...`, which an operator's thread dump shows."""
    n = 40
    threads: list[str] = []
    barrier = threading.Barrier(n, timeout=60)
    store = ShardedStorage([BarrierStore(barrier, threads) for _ in range(n)])
    keys = page_hashes(list(range(4 * 400)), 4)
    assert {shard_of(k, n) for k in keys} == set(range(n))
    assert store.batch_set(keys, pages(len(keys))) == [True] * len(keys)
    assert len(threads) == n and all(name.startswith("kvfsm-shard") for name in threads)
    store.close()


class HostRecordingStore(MemoryStorage):
    """A store that gathers host pages itself, noting the pages it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.given: list[list[int]] = []

    def batch_set_from_host(self, keys: Sequence[str], host_pool: HostKVPool, host_indices: object) -> list[bool]:
        pages_given = host_pool.pages_of(host_indices)  # type: ignore[arg-type]
        self.given.append(pages_given)
        return self.batch_set(keys, list(host_pool.get_pages_bytes(host_indices).unbind(0)))  # type: ignore[arg-type]


def test_a_shard_that_gathers_host_pages_itself_is_given_its_pages_not_their_bytes() -> None:
    """A store process over a shared pool reads pages in place: ShardedStorage hands each such shard the host
    pages of its own keys (no copy in the scheduler's process), and every page lands under its key."""
    pool, slots = shared_pool(12)
    shards = [HostRecordingStore(), HostRecordingStore()]
    store = ShardedStorage(shards)
    keys = page_hashes(list(range(12 * 8)), 8)
    assert store.batch_set_from_host(keys, pool, slots) == [True] * 12
    for i, shard in enumerate(shards):
        assert shard.given == [[p for k, p in zip(keys, slots.pages) if shard_of(k, 2) == i]]  # type: ignore[attr-defined]
    want = pool.get_pages_bytes(slots)
    assert all(g is not None and torch.equal(g, w) for g, w in zip(store.batch_get(keys), want))
    store.close()


def test_close_waits_for_a_call_in_progress_before_closing_the_shards() -> None:
    """close() from another thread while a write runs: the shards are closed only after that write returned."""
    events: list[str] = []
    release = threading.Event()
    both_started = threading.Barrier(3, timeout=60)  # the two shards' parts and the test

    class Slow(RecordingStore):
        def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
            both_started.wait()
            assert release.wait(60), "the test never released the write"
            events.append("write done")
            return MemoryStorage.batch_set(self, keys, pages)

        def close(self) -> None:
            events.append("closed")

    store = ShardedStorage([Slow(), Slow()])
    keys = page_hashes(list(range(4 * 40)), 4)
    writer = threading.Thread(target=store.batch_set, args=(keys, pages(len(keys))))
    writer.start()
    both_started.wait()  # the write is in progress in both shards
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive() and events == []  # close waits for the write in progress
    release.set()
    writer.join(60)
    closer.join(60)
    assert not closer.is_alive() and events == ["write done", "write done", "closed", "closed"]


def test_one_shard_is_a_sharded_store_too() -> None:
    """`ShardedStorage.of(make, 1)`: one shard holding every key (the count a config may give)."""
    store = ShardedStorage.of(MemoryStorage, 1)
    keys = page_hashes(list(range(16)), 4)
    assert len(store.shards) == 1 and store.batch_set(keys, pages(4)) == [True] * 4
    assert store.shards[0].batch_exists(keys) == 4
    store.close()
