"""MooncakeStorage against a real mooncake_master on loopback (see conftest.py).

Through the manager: offload -> backup into Mooncake -> host pages freed -> pages loaded back from Mooncake,
bit-exact; the stored-prefix query; per-page failure with a full store and with the master killed mid-run
(never a page reported stored that is not, never a host slot leaked); a second process reading what this
one wrote and the other way round; and the data path itself (batched calls, zero-copy puts from a
registered host pool, recycled read buffers, the staged path for transports that need registration).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mooncake_helpers import StoreEngine, free_port
from mooncake_peer import seeded_page
from timing import Watch, scaled, wait_for

from kvfsm.dataplane import HostKVPool, KVCacheConfig
from kvfsm.dataplane.storage import StorageBackend
from kvfsm.dataplane.storage.mooncake import NO_AVAILABLE_HANDLE, MooncakeUnavailable, error_name
from kvfsm.verify.engine import kv_value

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NO_EVICTION = ("--eviction_high_watermark_ratio=1.0", "--eviction_ratio=0.0")  # full means full: puts fail


def random_pages(n: int, nbytes: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) for _ in range(n)]


def check_stored_exact(e: StoreEngine, storage) -> int:
    """Every page the manager reports stored is in the store and equals its writer's KV; returns the count."""
    stored = e.stored_pages()
    keys = list(stored)
    pages = storage.batch_get(keys)
    for h, page in zip(keys, pages):
        serial, pos = stored[h]
        assert page is not None, f"page {h[:12]} at {pos} reported stored but not in Mooncake"
        assert torch.equal(page, e.expected_page(serial, pos)), f"page {h[:12]} at {pos} differs"
    return len(keys)


# ---- protocol -------------------------------------------------------------------------------------------
def test_batch_round_trip_and_keys(shared_storage, make_storage) -> None:
    s = shared_storage  # model "shared/model", TP rank 1 of 2
    assert isinstance(s, StorageBackend)
    pages = random_pages(12, 4096)
    keys = [f"rt{i:062x}" for i in range(12)]
    assert s.batch_set(keys, pages) == [True] * 12
    assert s.batch_exists(keys) == 12
    assert s.batch_exists(keys[:5] + ["f" * 64] + keys[5:]) == 5
    got = s.batch_get(keys + ["e" * 64])
    assert got[-1] is None
    assert all(torch.equal(a, b) for a, b in zip(got, pages))
    # SGLang 0.5.23's Mooncake keys: model prefix ("/" -> "-"), TP rank, one object per K and V half.
    assert s.key_of(keys[0]) == [f"shared-model_{keys[0]}_1_k", f"shared-model_{keys[0]}_1_v"]
    assert (
        s.client.is_exist(f"shared-model_{keys[0]}_1_k") == 1 and s.client.is_exist(f"shared-model_{keys[0]}_1_v") == 1
    )
    assert s.client.get_size(f"shared-model_{keys[0]}_1_k") == 2048  # half the page each
    assert s.batch_set(keys[:3], pages[:3]) == [True] * 3  # content-addressed: storing again is a success
    other_rank = make_storage(model_name="shared/model", tp_rank=0, tp_size=2, global_segment_size=0)
    assert other_rank.batch_exists(keys) == 0 and other_rank.batch_get(keys[:1]) == [None]
    assert s.batch_set([], []) == [] and s.batch_get([]) == [] and s.batch_exists([]) == 0


def test_read_buffers_are_recycled_not_overwritten(shared_storage) -> None:
    s = shared_storage  # read pool 16 MiB: 8 buffers of 2 MiB pages
    nbytes = 2 << 20
    pages = random_pages(8, nbytes, seed=1)
    keys = [f"recycle-{i}" for i in range(8)]
    assert all(s.batch_set(keys, pages))
    first = s.batch_get(keys[:4])
    ptrs = {p.data_ptr() for p in first}
    view = first[0].view(2, -1)[1]  # a view keeps its buffer (and the batch it came with) reserved
    again = s.batch_get(keys[4:])
    ptrs2 = {p.data_ptr() for p in again}
    assert not ptrs & ptrs2  # held buffers are not handed out twice
    assert all(torch.equal(a, b) for a, b in zip(first + again, pages))
    more = s.batch_get(keys)  # pool exhausted: the rest lands in fresh memory, still exact
    assert all(torch.equal(a, b) for a, b in zip(more, pages))
    del first, again, more
    gc.collect()
    reused = s.batch_get(keys[:4])
    assert {p.data_ptr() for p in reused} == ptrs2  # free again once nothing references them...
    assert torch.equal(view, pages[0].view(2, -1)[1])  # ...but not while a view is alive
    assert all(torch.equal(a, b) for a, b in zip(reused, pages))
    del view, reused
    assert {p.data_ptr() for p in s.batch_get(keys[4:])} & ptrs
    s.remove(keys)


def test_staged_path_for_registration_transports(shared_storage) -> None:
    """direct_unregistered=False (what RDMA needs): unregistered pages go through registered buffers."""
    s = shared_storage
    s.direct_unregistered = False
    try:
        pages = random_pages(6, 8192, seed=2)
        keys = [f"staged-{i}" for i in range(6)]
        assert s.batch_set(keys, pages) == [True] * 6
        assert all(torch.equal(a, b) for a, b in zip(s.batch_get(keys), pages))
        reg = torch.stack(random_pages(2, 8192, seed=3))
        s.register_buffer(reg)  # pages inside a registered region go in place
        assert s.batch_set(["staged-6", "staged-7"], list(reg.unbind(0))) == [True, True]
        assert torch.equal(torch.stack(s.batch_get(["staged-6", "staged-7"])), reg)
        s.unregister_buffer(reg)
    finally:
        s.direct_unregistered = True


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_zero_copy_put_from_registered_host_pool(shared_storage, layout: str) -> None:
    kv = KVCacheConfig(num_layers=3, kv_heads=2, head_dim=8, attention="mha", dtype=torch.float16)
    pool = HostKVPool(kv, 64, page_size=4, layout=layout)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, dtype=torch.float32).to(torch.float16))
    idx = pool.alloc(16)
    s = shared_storage
    s.register_host_pool(pool)
    keys = [f"{layout}-{i}" for i in range(4)]
    assert s.batch_set_from_host(keys, pool, idx) == [True] * 4
    want = pool.get_pages_bytes(idx)  # the canonical page bytes the protocol path would have stored
    got = s.batch_get(keys)
    assert all(g is not None and torch.equal(g, w) for g, w in zip(got, want.unbind(0)))
    dst = pool.alloc(16)
    pool.set_pages_bytes(dst, torch.stack(got))  # and they load back into the pool
    assert torch.equal(pool.get_pages_bytes(dst), want)
    pool.free(idx)
    pool.free(dst)
    s.unregister_host_pool(pool)


@pytest.mark.parametrize("store_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("pool_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_objects_are_sglangs(make_storage, store_layout: str, pool_layout: str, attention: str) -> None:
    """Each object holds what SGLang 0.5.23's MooncakeStore puts under its key (`get_page_buffer_meta`):
    a page_first host pool (SGLang's `(2, size, L, H, D)`, MLA `(size, L, 1, D)`) sends, per K / V plane
    (MLA: the latent), the page's one contiguous range; page_first_direct / MLA layer_first send (L, T, ...).
    Checked against the raw pool buffer, whichever layout kvfsm's own pool has."""
    kv = KVCacheConfig(
        num_layers=3, kv_heads=2 if attention == "mha" else 1, head_dim=8, attention=attention, dtype=torch.float16
    )
    T = 4
    pool = HostKVPool(kv, 32, page_size=T, layout=pool_layout)
    pool.kv_buffer.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, pool.kv_buffer.shape, dtype=torch.int16))
    idx = pool.alloc(8)
    planes = kv.num_planes
    s = make_storage(
        tp_rank=1, tp_size=2, is_mla=attention == "mla", layout=store_layout, page_dims=(planes, kv.num_layers, T)
    )
    keys = [f"obj-{attention}-{pool_layout}-{store_layout}-{i}" for i in range(2)]
    assert s.batch_set_from_host(keys, pool, idx) == [True, True]
    sg = HostKVPool(kv, 32, page_size=T, layout=store_layout)  # SGLang's pool of the store's layout
    sg.alloc(8)
    sg.set_pages_bytes(sg.slots_of([0, 1]), pool.get_pages_bytes(idx))
    tv = sg.kv_buffer  # MHA (2, S, L, H, D) or (2, L, S, H, D); MLA (S, L, 1, D) or (L, S, 1, D)
    for j, key in enumerate(keys):
        names = s.key_of(key)
        prefix = s.model_name.replace("/", "-")
        assert names == (
            [f"{prefix}_{key}__k"] if attention == "mla" else [f"{prefix}_{key}_1_k", f"{prefix}_{key}_1_v"]
        )
        for p, name in enumerate(names):
            plane = tv if attention == "mla" else tv[p]
            if store_layout == "page_first":  # one contiguous range: tokens, then layers
                want = plane[j * T : (j + 1) * T]
            else:  # page_first_direct's (L, T, ...) order: per layer, the page's tokens
                want = plane[:, j * T : (j + 1) * T]
            got = s.client.get(name)
            assert bytes(got) == want.contiguous().view(torch.uint8).numpy().tobytes(), (name, p)
    back = s.batch_get(keys)
    assert all(b is not None and torch.equal(b, w) for b, w in zip(back, pool.get_pages_bytes(idx).unbind(0)))


# ---- through the manager --------------------------------------------------------------------------------
def test_manager_round_trip_through_mooncake(shared_storage) -> None:
    """offload -> backup into Mooncake -> host pages evicted -> loaded back from Mooncake, bit-exact."""
    storage = shared_storage
    e = StoreEngine(
        backend=storage,
        page_size=4,
        device_slots=256,
        host_slots=64,
        rows=4,
        max_context=64,
        backup_queue=4,
        num_layers=2,
        kv_heads=2,
        head_dim=16,
    )
    reqs = e.admit_all(3, prompt_len=9)
    # The prefill side stores the prompt pages (so the whole chain can be queried).
    for r in reqs:
        hs = e.chain(r)[: len(r.origin_input_ids) // e.page_size]
        assert all(storage.batch_set(hs, [e.expected_page(r.serial, i * e.page_size) for i in range(len(hs))]))
    for _ in range(24):
        e.step(reqs)
    assert e.host_pool.free_slots == e.host_pool.capacity  # every backed-up chunk left host memory
    n = check_stored_exact(e, storage)
    assert n == e.manager.metrics.stored_pages == 3 * 6 and e.manager.metrics.backup_failures == 0
    # Stored-prefix query over each request's whole chain (prompt pages + decode pages).
    for r in reqs:
        chain = e.chain(r)
        assert storage.batch_exists(chain) == len(chain) == 8
    chains = {r.rid: e.chain(r) for r in reqs}
    e.finish(reqs)
    e.check_teardown()
    # Load back from Mooncake into host memory and compare with what the requests wrote.
    for r in reqs:
        chain = chains[r.rid]
        pages = storage.batch_get(chain)
        host = e.load_back(chain, pages)
        got = e.host_pool.token_view()[:, :, host]
        want = torch.tensor([kv_value(r.serial, p) for p in range(len(chain) * e.page_size)])
        assert torch.equal(got, want.view(1, 1, -1, 1, 1).expand_as(got))
        e.host_pool.free(host)
    # A hole in the chain shortens the usable prefix.
    r0 = chains["r0"]
    storage.remove([r0[5]])
    assert storage.batch_exists(r0) == 5
    e.check_teardown()


def test_full_store_fails_per_page(master_factory, make_storage) -> None:
    """No eviction, a 16 MiB store: pages beyond it fail one by one; none reported stored is missing."""
    master = master_factory(*NO_EVICTION)
    storage = make_storage(master, global_segment_size=16 << 20)
    # 2 planes x 4 layers x 4 heads x 64 x fp32 = 8 KiB per token, 16 tokens = 128 KiB per page: 128 pages fit.
    e = StoreEngine(
        backend=storage,
        page_size=16,
        device_slots=3200,
        host_slots=768,
        rows=6,
        max_context=512,
        backup_queue=8,
        num_layers=4,
        kv_heads=4,
        head_dim=64,
    )
    reqs = e.admit_all(6, prompt_len=16)
    for _ in range(16 * 28):
        e.step(reqs)
    m = e.manager.metrics
    assert m.backup_failures > 0 and m.stored_pages > 0
    assert storage.stats.errors[error_name(NO_AVAILABLE_HANDLE)] > 0
    assert check_stored_exact(e, storage) == m.stored_pages
    e.finish(reqs)
    e.check_teardown()  # host slots of failed backups were freed too
    # One batch straddling the boundary: per-page answers, and exactly the True ones are readable.
    assert storage.remove(list(e.manager.fx.stored)[:3]) == [0, 0, 0]
    pages = random_pages(8, 128 << 10, seed=4)
    keys = [f"full-{i}" for i in range(8)]
    ok = storage.batch_set(keys, pages)
    assert 0 < sum(ok) < 8, ok
    for k, p, good in zip(keys, pages, ok):
        got = storage.batch_get([k])[0]
        assert (got is not None and torch.equal(got, p)) if good else got is None


def test_master_killed_mid_run(master_factory, make_storage) -> None:
    """Backups after the master dies fail per page within the timeout and nothing is claimed stored; host
    slots come back; once a master is up again on the same address, backups succeed again."""
    master = master_factory()
    storage = make_storage(master, op_timeout_s=2.0)
    e = StoreEngine(
        backend=storage,
        page_size=4,
        device_slots=256,
        host_slots=64,
        rows=4,
        max_context=128,
        backup_queue=4,
        num_layers=2,
        kv_heads=1,
        head_dim=8,
    )
    reqs = e.admit_all(2, prompt_len=8)
    for _ in range(12):
        e.step(reqs)
    before = dict(e.manager.fx.stored)
    assert len(before) == 6 and check_stored_exact(e, storage) == 6
    master.kill()
    t0 = time.monotonic()
    for _ in range(8):
        e.step(reqs)  # 4 chunks' backups, each bounded by op_timeout_s (then fail-fast while the client is stuck)
    assert time.monotonic() - t0 < 4 * storage.op_timeout_s + scaled(2)  # the slack in this machine's seconds now
    assert e.manager.fx.stored == before  # no page written after the kill is reported stored
    assert e.manager.metrics.backup_failures == 4
    assert e.host_pool.free_slots == e.host_pool.capacity  # failed chunks' host slots were freed
    t0 = time.monotonic()
    assert storage.batch_exists(list(before)) == 0  # the index died with the master
    assert time.monotonic() - t0 < storage.op_timeout_s + scaled(1)
    master.restart()  # same address, empty index
    # the client reconnects and remounts (its retries run on their own clock: a scaled limit, no progress probe)
    wait_for(
        lambda: storage.batch_set(["probe"], random_pages(1, 64)) == [True],
        "the client to reconnect to the restarted master (a probe page stored)",
        20,
        poll_s=0.2,
    )
    for _ in range(8):
        e.step(reqs)
    after = {h: v for h, v in e.stored_pages().items() if h not in before}
    assert len(after) == 4 and e.manager.metrics.backup_failures == 4
    pages = storage.batch_get(list(after))
    assert all(p is not None and torch.equal(p, e.expected_page(*after[h])) for h, p in zip(after, pages))
    e.finish(reqs)
    e.check_teardown()


def test_unreachable_master_is_a_clear_error(mooncake_available) -> None:
    from kvfsm.dataplane.storage.mooncake import MooncakeStorage

    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(MooncakeUnavailable, match=f"master at 127.0.0.1:{port} is unreachable"):
        MooncakeStorage(f"127.0.0.1:{port}", f"http://127.0.0.1:{free_port()}/metadata", connect_timeout_s=1.0)
    assert time.monotonic() - t0 < 1.0 + scaled(2)  # the connect timeout, and slack in this machine's seconds now


# ---- sharing between engine processes ---------------------------------------------------------------------
def _peer(master, model: str, request: dict) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(
        [sys.executable, str(HERE / "mooncake_peer.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    p.stdin.write(json.dumps({"master": master.addr, "metadata": master.metadata, "model": model, **request}) + "\n")
    p.stdin.flush()
    return p


def _reply(p: subprocess.Popen, within_s: float = 30.0) -> dict:
    """The peer's next answer: waited for while the peer makes progress (its CPU time), `within_s` (scaled)
    without any is a hang."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    watch = Watch(f"an answer from the peer process (pid {p.pid})", within_s, p.pid)
    try:
        while not sel.select(watch.remaining()):
            watch.check()
    except BaseException:
        os.kill(p.pid, signal.SIGKILL)
        raise
    line = p.stdout.readline()
    assert line, f"peer exited with {p.wait(10)}"
    return json.loads(line)


def _finish(p: subprocess.Popen) -> None:
    p.stdin.close()
    try:
        p.wait(15)
    except subprocess.TimeoutExpired:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(5)


def test_second_process_shares_pages(mooncake_master, shared_storage) -> None:
    """Another engine process (same model, same TP rank) reads what this one wrote, and the reverse."""
    storage = shared_storage
    nbytes = 64 << 10
    mine = {f"mine-{i}": 100 + i for i in range(6)}
    assert all(storage.batch_set(list(mine), [seeded_page(v, nbytes) for v in mine.values()]))
    theirs = {f"theirs-{i}": 200 + i for i in range(4)}
    p = _peer(
        mooncake_master,
        "shared/model",
        {"tp_rank": 1, "tp_size": 2, "read": list(mine) + ["absent"], "write": theirs, "page_nbytes": nbytes},
    )
    try:
        rep = _reply(p)
        want = [hashlib.sha256(seeded_page(v, nbytes).numpy().tobytes()).hexdigest() for v in mine.values()]
        assert rep["sha256"] == want + [None]  # the other engine reads exactly what this one wrote
        assert rep["exists"] == len(mine)
        assert rep["written"] == [True] * len(theirs)
        got = storage.batch_get(list(theirs))  # and this one reads what it wrote
        assert all(g is not None and torch.equal(g, seeded_page(v, nbytes)) for g, v in zip(got, theirs.values()))
    finally:
        _finish(p)


def test_traffic_stays_on_loopback(mooncake_master, shared_storage) -> None:
    s = shared_storage
    assert all(s.batch_set(["lo-0"], random_pages(1, 4096)))
    assert s.batch_get(["lo-0"])[0] is not None
    pids = {os.getpid(), mooncake_master.pid}
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    seen = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[9] not in inodes or f[3] != "01":  # established connections only
                continue
            seen += 1
            for addr in (f[1], f[2]):
                host = addr.split(":")[0]
                assert host in ("0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"), (
                    line
                )
    assert seen >= 2  # at least the client's connections to the master
