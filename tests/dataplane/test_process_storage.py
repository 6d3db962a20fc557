"""ProcessStorage: the store in a child process stores what the in-process store would, byte for byte, and
every way the child can fail (its store raises, it dies, it hangs, it cannot build its store, its parent
dies) fails the call or the construction with a typed error, never reports a page stored that is not, and
leaves no process or staging file behind."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from timing import run_watched, wait_for

from kvfsm.dataplane import FileStorage, page_hashes
from kvfsm.dataplane.pools.config import KVCacheConfig
from kvfsm.dataplane.pools.host_pool import HostKVPool
from kvfsm.dataplane.storage import FaultyStorage, ProcessStorage, RemoteStoreError, fork_server

gpu = pytest.mark.gpu


def pool_with_pages(n: int, layout: str = "layer_first", seed: int = 0, shared: bool = False) -> tuple[HostKVPool, Any]:
    pool = HostKVPool(
        KVCacheConfig(num_layers=3, head_dim=8, kv_heads=2),
        64 * 8,
        page_size=8,
        layout=layout,  # type: ignore[arg-type]
        shared=shared,
    )
    slots = pool.page_slots(pool.allocator.alloc_pages(n))
    g = torch.Generator().manual_seed(seed)
    pool.set_pages_bytes(slots, torch.randint(0, 256, (n, pool.page_nbytes), dtype=torch.uint8, generator=g))
    return pool, slots


def raising_store(directory: str, bad_key: str) -> FaultyStorage:
    """A file store whose write of `bad_key` raises a client library's own error (built in the child)."""
    return FaultyStorage(
        FileStorage(directory, model_name="m"), raise_writes={bad_key: RuntimeError("client gave up")}.get
    )


class SleepingStore(FileStorage):
    """A store whose writes hang."""

    def batch_set_from_host(self, keys: Any, host_pool: Any, host_indices: Any) -> list[bool]:
        time.sleep(600)
        return []


def failing_factory() -> FileStorage:
    raise PermissionError("no such mount")


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pages_stored_by_the_child_read_back_byte_exact_in_process(tmp_path: Path, layout: str) -> None:
    """Rounds through a staging buffer smaller than the batch, then a page larger than the staging buffer
    (it grows): every page is what the pool holds, and an in-process FileStorage of the same directory reads
    it back with its sidecar checked (same format: layout, page geometry, dtype)."""
    pool, slots = pool_with_pages(7, layout)
    dims = (2, 3, 8)
    make = functools.partial(
        FileStorage, str(tmp_path), model_name="m", layout=layout, page_dims=dims if layout == "page_first" else None
    )
    store = ProcessStorage(make, staging_bytes=pool.page_nbytes * 3)  # 7 pages: three rounds
    try:
        keys = page_hashes(list(range(7 * 8)), 8)
        assert store.batch_set_from_host(keys, pool, slots) == [True] * 7
        assert store.batch_exists(keys) == 7
        want = pool.get_pages_bytes(slots)
        assert all(torch.equal(g, w) for g, w in zip(store.batch_get(keys), want))  # type: ignore[arg-type]
        local = FileStorage(str(tmp_path), model_name="m", layout=layout, page_dims=dims)
        got = local.batch_get(keys)
        assert all(g is not None and torch.equal(g, w) for g, w in zip(got, want))
        assert local.stats.reads_unverified == 0 and store.stats.writes_ok == 7
        # a staging buffer smaller than one page grows to hold it; the slot-index form of the pages works too
        small = ProcessStorage(make, staging_bytes=pool.page_nbytes // 2)
        try:
            more = page_hashes(list(range(100, 100 + 2 * 8)), 8)
            assert small.batch_set_from_host(more, pool, slots.slots[: 2 * 8]) == [True, True]
            assert all(torch.equal(g, w) for g, w in zip(local.batch_get(more), want[:2]))  # type: ignore[arg-type]
        finally:
            small.close()
        staging = Path(store._staging.path)  # type: ignore[union-attr]
        assert not staging.exists()  # mapped by both processes, its name removed: a crash leaves no file
    finally:
        store.close()
    assert store.pid is None
    with pytest.raises(RemoteStoreError, match="closed"):  # a closed store is not started again
        store.batch_exists(keys)


def test_bad_calls_are_refused_before_anything_is_sent(tmp_path: Path) -> None:
    pool, slots = pool_with_pages(2)
    store = ProcessStorage(functools.partial(FileStorage, str(tmp_path), model_name="m"))
    try:
        with pytest.raises(ValueError, match="3 keys for 2 pages"):
            store.batch_set_from_host(["a", "b", "c"], pool, slots)
        with pytest.raises(Exception, match="whole pages"):
            store.batch_set_from_host(["a"], pool, slots.slots[:5])
        assert store.stats.writes_ok == 0 and store.batch_set_from_host([], pool, pool.page_slots([])) == []
    finally:
        store.close()
    with pytest.raises(TypeError, match="pickles"):
        ProcessStorage(lambda: FileStorage(str(tmp_path)))  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="staging_bytes"):
        ProcessStorage(functools.partial(FileStorage, str(tmp_path)), staging_bytes=0)


def test_a_store_that_cannot_be_built_fails_the_construction_naming_why(tmp_path: Path) -> None:
    with pytest.raises(RemoteStoreError, match="PermissionError: no such mount"):
        ProcessStorage(failing_factory)


def test_a_store_error_fails_the_call_and_the_child_lives_on(tmp_path: Path) -> None:
    pool, slots = pool_with_pages(2)
    keys = page_hashes(list(range(16)), 8)
    store = ProcessStorage(functools.partial(raising_store, str(tmp_path), keys[1]))
    try:
        pid = store.pid
        with pytest.raises(RemoteStoreError, match="RuntimeError: client gave up"):
            store.batch_set_from_host(keys, pool, slots)
        assert store.pid == pid and store.restarts == 0
        assert store.batch_set_from_host(keys[:1], pool, pool.page_slots(slots.pages[:1])) == [True]
        assert store.batch_exists(keys) == 1
    finally:
        store.close()


def test_a_dead_child_fails_the_call_and_is_started_again(tmp_path: Path) -> None:
    pool, slots = pool_with_pages(2)
    keys = page_hashes(list(range(16)), 8)
    store = ProcessStorage(functools.partial(FileStorage, str(tmp_path), model_name="m"), restart_interval_s=3600)
    try:
        first = store.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        with pytest.raises(RemoteStoreError, match="ended during set|is gone"):
            store.batch_set_from_host(keys, pool, slots)
        assert store.pid is None
        with pytest.raises(RemoteStoreError, match="down"):  # within the restart interval: no restart loop
            store.batch_exists(keys)
        store.restart_interval_s = 0
        assert store.batch_set_from_host(keys, pool, slots) == [True, True]
        assert store.restarts == 1 and store.pid not in (None, first)
    finally:
        store.close()


def test_a_dead_child_is_seen_in_a_process_with_many_open_files(tmp_path: Path) -> None:
    """An engine may hold more than select()'s 1024 file descriptors: a store process's end is still seen (the
    fork server's pidfds are waited on with poll()), the call fails as it should and the next one restarts it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open only {hard} files")
    if soft != resource.RLIM_INFINITY and soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    pool, slots = pool_with_pages(2)
    keys = page_hashes(list(range(16)), 8)
    try:
        store = ProcessStorage(functools.partial(FileStorage, str(tmp_path), model_name="m"), restart_interval_s=0)
        try:
            assert store.pid is not None
            os.kill(store.pid, signal.SIGKILL)
            with pytest.raises(RemoteStoreError, match="ended during set|is gone"):
                store.batch_set_from_host(keys, pool, slots)
            assert store.batch_set_from_host(keys, pool, slots) == [True, True] and store.restarts == 1
        finally:
            store.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_hung_child_is_stopped_and_the_call_fails(tmp_path: Path) -> None:
    pool, slots = pool_with_pages(1)
    store = ProcessStorage(functools.partial(SleepingStore, str(tmp_path)))
    try:
        pid = store.pid
        store.call_timeout_s = 0.5  # the store sleeps 600 s: any machine is past this
        with pytest.raises(RemoteStoreError, match="no answer to set within 0.5 s"):
            store.batch_set_from_host(["k"], pool, slots)
        assert store.pid is None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # type: ignore[arg-type]
    finally:
        store.close()


def test_the_child_ends_with_its_parent(tmp_path: Path) -> None:
    """A parent that exits without closing (killed, say) leaves no store process: the child reads end-of-file."""
    script = textwrap.dedent(f"""
        import functools, os, sys
        from kvfsm.dataplane import FileStorage
        from kvfsm.dataplane.storage import ProcessStorage
        from kvfsm.dataplane.storage import fork_server
        store = ProcessStorage(functools.partial(FileStorage, {str(tmp_path)!r}))
        print(store.pid, fork_server._server.proc.pid if fork_server._server else "", flush=True)
        os._exit(0)
    """)
    proc = run_watched([sys.executable, "-c", script], "a parent that starts a store process and exits")
    assert proc.returncode == 0, proc.stderr
    children = [int(pid) for pid in proc.stdout.splitlines()[-1].split()]  # the store process, its fork server
    assert len(children) == (2 if fork_server.SUPPORTED else 1)

    def gone(child: int) -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        return subprocess.run(
            ["ps", "-o", "stat=", "-p", str(child)], capture_output=True, text=True
        ).stdout.startswith("Z")

    for child in children:
        wait_for(lambda: gone(child), f"process {child} to end after its parent", 10.0)


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.skipif(not fork_server.SUPPORTED, reason="the fork server needs Linux pidfds")
def test_store_processes_are_forked_by_one_server_and_a_dead_server_is_replaced(tmp_path: Path) -> None:
    """Every store process of this process comes from its fork server (whose imports are paid once), which
    neither a SIGINT nor a request without a descriptor ends; a server that died is started again at the next
    store process, and with the server off a store process is its own interpreter, started by this process."""
    pool, slots = pool_with_pages(2)
    keys = page_hashes(list(range(16)), 8)
    make = functools.partial(FileStorage, str(tmp_path), model_name="m")
    a, b = ProcessStorage(make), ProcessStorage(make)
    try:
        server = fork_server._server
        assert server is not None and a.pid is not None and b.pid is not None
        assert _parent_of(a.pid) == _parent_of(b.pid) == server.proc.pid != os.getpid()
        assert a.batch_set_from_host(keys, pool, slots) == [True, True] and b.batch_exists(keys) == 2
    finally:
        a.close(), b.close()
    os.kill(server.proc.pid, signal.SIGINT)  # a Ctrl-C at the terminal: the server ends with its parent, not here
    server.sock.send(b"F")  # a request without a descriptor is skipped, not taken for the parent's end
    e = ProcessStorage(make)
    try:
        assert fork_server._server is server and e.batch_exists(keys) == 2
    finally:
        e.close()
    server.proc.kill()
    server.proc.wait()
    c = ProcessStorage(make)
    try:
        assert fork_server._server is not None and fork_server._server is not server
        assert c.pid is not None and _parent_of(c.pid) == fork_server._server.proc.pid
        assert c.batch_exists(keys) == 2
    finally:
        c.close()
    fork_server.AVAILABLE = False
    try:
        d = ProcessStorage(make)
        try:
            assert d.pid is not None and _parent_of(d.pid) == os.getpid() and d.batch_exists(keys) == 2
        finally:
            d.close()
    finally:
        fork_server.AVAILABLE = fork_server.SUPPORTED


def test_a_manager_with_storage_process_stores_through_the_child(tmp_path: Path) -> None:
    """`storage_process=True`: the manager's store is a ProcessStorage of its FileStorage; close() ends it."""
    from kvfsm.dataplane import DeviceKVPool
    from kvfsm.runtime import OffloadConfig
    from kvfsm.runtime.build import storage_factory

    config = OffloadConfig(page_size=8, storage_dir=tmp_path, storage_process=True, storage_extra={"writers": 2})
    device_pool = DeviceKVPool(KVCacheConfig(num_layers=3, head_dim=8, kv_heads=2), 64, torch.device("cpu"))  # type: ignore[arg-type]
    make = storage_factory(config, device_pool, tp_rank=0, tp_size=1)
    assert make is not None
    store = make()
    try:
        assert isinstance(store, ProcessStorage)
        pool, slots = pool_with_pages(2)
        keys = page_hashes(list(range(16)), 8)
        assert store.batch_set_from_host(keys, pool, slots) == [True, True]
        assert len(list(tmp_path.glob("*_model_0_1.bin"))) == 2
    finally:
        store.close()


# --- a shared host pool: the child reads the pages in place -------------------------------------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_the_child_stores_a_shared_pools_pages_in_place(tmp_path: Path, layout: str) -> None:
    """Page ids go over the socket, the bytes do not: the child maps the pool once (again after a restart,
    and for another pool), and what it stores is what the pool holds, read back in process with its sidecar."""
    pool, slots = pool_with_pages(6, layout, shared=True)
    store = ProcessStorage(functools.partial(FileStorage, str(tmp_path), model_name="m"), restart_interval_s=0)
    try:
        keys = page_hashes(list(range(6 * 8)), 8)
        assert store.batch_set_from_host(keys[:4], pool, pool.page_slots(slots.pages[:4])) == [True] * 4
        assert store.batch_set_from_host(keys[4:], pool, slots.slots[4 * 8 :]) == [True, True]  # slot-index form
        assert store._staging is None  # nothing went through the staging buffer
        want = pool.get_pages_bytes(slots)
        local = FileStorage(str(tmp_path), model_name="m")
        assert all(g is not None and torch.equal(g, w) for g, w in zip(local.batch_get(keys), want))
        with pytest.raises(Exception, match="not allocated"):  # checked here, before anything is sent
            store.batch_set_from_host(["x"], pool, pool.page_slots([slots.pages[-1] + 1]))
        os.kill(store.pid, signal.SIGKILL)  # type: ignore[arg-type]
        with pytest.raises(RemoteStoreError):
            store.batch_exists(keys)
        other, other_slots = pool_with_pages(2, layout, seed=1, shared=True)
        more = page_hashes(list(range(500, 516)), 8)
        assert store.batch_set_from_host(more, other, other_slots) == [True, True]  # a fresh child maps this pool
        assert torch.equal(local.batch_get(more[:1])[0], other.get_pages_bytes(other_slots)[0])  # type: ignore[arg-type]
        again = page_hashes(list(range(900, 916)), 8)
        assert store.batch_set_from_host(again, pool, pool.page_slots(slots.pages[:2])) == [
            True,
            True,
        ]  # back to the first
        assert all(torch.equal(g, w) for g, w in zip(local.batch_get(again), want[:2]))  # type: ignore[arg-type]
    finally:
        store.close()


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "dma", "auto"])
def test_a_shared_pinned_pool_takes_cuda_copies_and_the_child_stores_them(tmp_path: Path, backend: str) -> None:
    """On a GPU the shared pool is pinned (cudaHostRegister): the engine's offload lands in it without the host
    waiting, and the child stores exactly the device rows."""
    from kvfsm.dataplane import HAVE_TRITON, CudaCopyEngine, DeviceKVPool

    if backend == "triton" and not HAVE_TRITON:
        pytest.skip("triton not installed")
    cfg = KVCacheConfig.llama3_8b()
    host = HostKVPool(cfg, 64 * 16, 16, "page_first", shared=True)
    assert host.pinned and host.kv_buffer.is_pinned()
    pages = host.alloc_pages(8)
    assert pages is not None
    dev = DeviceKVPool.create(cfg, 1024, "cuda")
    dev.storage.view(torch.int16).random_()
    di = torch.randperm(1024, device="cuda")[: 8 * 16]
    engine = CudaCopyEngine(backend=backend)  # type: ignore[arg-type]
    torch.cuda.set_sync_debug_mode("error")
    try:
        handle = engine.submit_d2h(dev, di, host, host.page_slots(pages))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    handle.wait()
    rows = dev.storage[:, :, di].cpu()  # (planes, L, tokens, H, D)
    assert torch.equal(host.token_view()[:, :, host.page_slots(pages).slots].view(torch.int16), rows.view(torch.int16))
    store = ProcessStorage(functools.partial(FileStorage, str(tmp_path), model_name="m"))
    try:
        keys = page_hashes(list(range(8 * 16)), 16)
        assert store.batch_set_from_host(keys, host, host.page_slots(pages)) == [True] * 8
        want = host.get_pages_bytes(host.page_slots(pages))
        assert all(g is not None and torch.equal(g, w) for g, w in zip(store.batch_get(keys), want))
    finally:
        store.close()
