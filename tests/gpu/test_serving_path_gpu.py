"""GPU: no manager entry point and no copy-engine submit waits for the GPU.

Every call below is made while the compute stream is busy (a spin kernel), under
`torch.cuda.set_sync_debug_mode("error")`, which raises on any synchronizing CUDA call torch makes. A
copy submitted then must still be pending when the call returns (it is ordered after the busy stream,
and the host did not wait for it), and must land bit-exact once the GPU gets to it. CPU twins:
tests/runtime/test_serving_path.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvfsm.dataplane import CudaCopyEngine, HostKVPool, KVCacheConfig, ReqToTokenPool, TokenSlotAllocator
from kvfsm.dataplane.pools.device_pool import DeviceKVPool
from kvfsm.dataplane.storage import FileStorage
from kvfsm.engine.scheduler import EngineRequest
from kvfsm.runtime import DecodeOffloadManager, OffloadConfig, SimplePrefixCache

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def spin():
    """spin(ms): keep the current stream busy for about `ms` (calibrated torch.cuda._sleep)."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    per_ms = 10_000_000 / start.elapsed_time(end)
    return lambda ms: torch.cuda._sleep(int(ms * per_ms))


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _pools(attention: str, page: int = 16) -> tuple[DeviceKVPool, TokenSlotAllocator, HostKVPool]:
    kv = KVCacheConfig.tiny(attention)
    pool = DeviceKVPool.create(kv, 2048, "cuda")
    pool.token_view().copy_(torch.randn(pool.token_view().shape, device="cuda").to(kv.dtype))
    return pool, TokenSlotAllocator(2048, page), HostKVPool(kv, 1024, page, layout="page_first", pin_memory=True)


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("backend", ["auto", "triton", "dma", "torch"])
@pytest.mark.parametrize("where", ["cpu", "gpu", "page_slots"])
def test_copy_engine_submits_never_wait(spin, attention: str, backend: str, where: str) -> None:
    pool, allocator, host = _pools(attention)
    engine = CudaCopyEngine(backend=backend)
    dev_pages = allocator.alloc_pages(12)
    slots = allocator.page_slots(dev_pages)
    dev_arg = {"cpu": slots.slots, "gpu": slots.slots.cuda(), "page_slots": slots}[where]
    host_slots = host.page_slots(host.allocator.alloc_pages(12))
    engine.submit_d2h(pool, dev_arg, host, host_slots).wait()  # compile kernels, load the driver
    engine.submit_h2d(host, host_slots, pool, dev_arg).wait()  # both directions: a first h2d compiles its
    # kernel for longer than the busy stream below runs, and would then find its copy done (order-dependent)
    want = pool.token_view()[:, :, slots.slots.cuda()].cpu()
    torch.cuda.synchronize()

    spin(200)
    with no_sync():
        handle = engine.submit_d2h(pool, dev_arg, host, host_slots)
        assert not handle.done()  # ordered after the busy stream, and the host did not wait
    handle.wait()
    assert torch.equal(host.token_view()[:, :, host_slots.slots], want)

    back = allocator.page_slots(allocator.alloc_pages(12))
    back_arg = {"cpu": back.slots, "gpu": back.slots.cuda(), "page_slots": back}[where]
    torch.cuda.synchronize()
    spin(200)
    with no_sync():
        handle = engine.submit_h2d(host, host_slots, pool, back_arg)
        assert not handle.done()
    handle.wait()
    torch.cuda.synchronize()
    assert torch.equal(pool.token_view()[:, :, back.slots.cuda()].cpu(), want)


class Engine:
    """A decode loop's own work around the manager: rows, pages, table writes, KV writes (known values)."""

    def __init__(self, pool: DeviceKVPool, allocator: TokenSlotAllocator, table: ReqToTokenPool) -> None:
        self.pool, self.allocator, self.table = pool, allocator, table
        self.kv: dict[str, torch.Tensor] = {}  # rid -> every KV row it wrote, (P, L, n, H, D) on the CPU
        self.page = allocator.page_size

    def admit(self, rid: str, prompt_len: int) -> EngineRequest:
        req = EngineRequest(rid, list(range(100, 100 + prompt_len)))
        req.req_pool_idx = self.table.alloc()
        c = self.pool.config
        self.kv[rid] = torch.randn((c.num_planes, c.num_layers, 512, *c.token_shape)).to(c.dtype)
        self.grow(req, prompt_len + 1)
        self.write_kv(req, 0, prompt_len)
        req.kv_committed_len = prompt_len
        req.output_ids.append(1)
        return req

    def grow(self, req: EngineRequest, length: int) -> None:
        have = req.kv_allocated_len
        if length > have:
            pages = self.allocator.alloc_pages(-(-(length - have) // self.page))
            self.table.write(req.req_pool_idx, have, torch.from_numpy(self.allocator.slots_of(pages)))
            req.kv_allocated_len = have + len(pages) * self.page

    def write_kv(self, req: EngineRequest, start: int, end: int) -> None:
        slots = self.table.read_host(req.req_pool_idx, start, end).cuda(non_blocking=False)
        self.pool.token_view()[:, :, slots] = self.kv[req.rid][:, :, start:end].cuda()

    def decode(self, req: EngineRequest) -> None:
        pos = req.kv_committed_len
        self.grow(req, pos + 1)
        self.write_kv(req, pos, pos + 1)
        req.kv_committed_len = pos + 1
        req.output_ids.append(len(req.output_ids) + 1)


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("table_device", ["cuda", "cpu"])
@pytest.mark.parametrize("checked", [False, True])
def test_manager_entry_points_never_wait(
    spin, tmp_path: Path, attention: str, table_device: str, checked: bool
) -> None:
    """offload, offload_batch, check_progress, finalize, abort and retract (request table on the GPU or
    the CPU; checked mode too) with the compute stream busy; then every stored page holds what the
    engine wrote, and every slot comes back."""
    pool, allocator, _ = _pools(attention)
    table = ReqToTokenPool(rows=16, max_context=512, device=table_device)
    storage = FileStorage(tmp_path / "store")
    config = OffloadConfig(
        page_size=16, offload_stride=16, host_layout="page_first", storage_dir=tmp_path, checked=checked
    )
    manager = DecodeOffloadManager(
        config,
        device_pool=pool,
        allocator=allocator,
        req_to_token=table,
        prefix_cache=SimplePrefixCache(),
        copy_engine=CudaCopyEngine(),
        storage=storage,
    )
    engine = Engine(pool, allocator, table)
    reqs = [engine.admit(f"r{i}", 20 + 7 * i) for i in range(8)]
    ended: dict[str, str] = {}
    torch.cuda.synchronize()
    for step in range(64):
        for req in reqs:
            engine.decode(req)  # the engine's own KV writes (it may wait; they are not under test)
        spin(5)  # the decode step: the GPU is busy while the scheduler calls the manager
        with no_sync():
            if step % 2:
                manager.offload_batch(reqs, [r.req_pool_idx for r in reqs], [r.kv_committed_len for r in reqs])
            else:
                for req in reqs:
                    manager.offload(req)
            for how, at in (("finish", 20), ("abort", 30), ("retract", 40), ("finish", 50)):
                if step == at:
                    victim = reqs.pop(0)
                    ended[victim.rid] = how
                    victim.done = True
                    {"finish": manager.finalize, "abort": manager.abort, "retract": manager.retract}[how](victim)
            manager.check_progress()
    assert manager.metrics.chunks > 16 and manager.metrics.copies_in_flight > 0  # copies were pending
    with no_sync():
        for req in reqs:
            manager.finalize(req)
    manager.drain()
    torch.cuda.synchronize()
    # every stored page holds the rows the engine wrote there
    scratch = HostKVPool(pool.config, 16, 16, layout="page_first", pin_memory=False)
    page_slots = scratch.page_slots(scratch.allocator.alloc_pages(1))
    assert len(manager.fx.stored) == manager.metrics.stored_pages > 16
    for h, (key, pos) in manager.fx.stored.items():
        (page,) = storage.batch_get([h])
        assert page is not None
        scratch.set_page_bytes(page_slots, page)
        rid = key.split("#")[0]
        assert torch.equal(scratch.token_view()[:, :, page_slots.slots], engine.kv[rid][:, :, pos : pos + 16]), (
            key,
            pos,
        )
    assert allocator.free_slots == allocator.capacity and table.free_rows == table.rows
    assert manager.fx.host_pool.free_slots == manager.fx.host_pool.capacity
    manager.close()


def test_offload_batch_host_time_is_a_small_fraction_of_the_step(spin, tmp_path: Path) -> None:
    """A 200 ms GPU step is running; offload_batch of 256 due chunks (one copy) takes a small fraction of
    it on the host (the step's own time is measured with events in the same run)."""
    kv = KVCacheConfig(num_layers=4, kv_heads=8, head_dim=128, attention="mha", dtype=torch.bfloat16)
    page = 16
    pool = DeviceKVPool.create(kv, 256 * 64 + page, "cuda")
    allocator = TokenSlotAllocator(pool.size, page)
    table = ReqToTokenPool(rows=256, max_context=64, device="cuda")
    manager = DecodeOffloadManager(
        OffloadConfig(
            page_size=page, offload_stride=page, host_layout="page_first", storage_dir=tmp_path, host_pool_bytes=1 << 30
        ),
        device_pool=pool,
        allocator=allocator,
        req_to_token=table,
        prefix_cache=SimplePrefixCache(),
        copy_engine=CudaCopyEngine(),
    )
    reqs = []
    for i in range(256):
        req = EngineRequest(f"r{i}", list(range(16)))
        req.req_pool_idx = table.alloc()
        table.write(req.req_pool_idx, 0, allocator.alloc(64))
        req.kv_allocated_len, req.output_ids = 64, [1]
        reqs.append(req)

    def due(step: int) -> None:
        for req in reqs:
            req.output_ids += [1] * 16
            req.kv_committed_len = 16 + 16 * step

    due(1)
    manager.offload_batch(reqs, [r.req_pool_idx for r in reqs], [r.kv_committed_len for r in reqs])  # warm
    manager.drain()
    torch.cuda.synchronize()
    due(2)
    rows = [r.req_pool_idx for r in reqs]
    committed = [r.kv_committed_len for r in reqs]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    spin(200)
    end.record()
    with no_sync():
        t0 = time.perf_counter()
        submitted = manager.offload_batch(reqs, rows, committed)
        host_ms = (time.perf_counter() - t0) * 1e3
        manager.check_progress()
    end.synchronize()
    step_ms = start.elapsed_time(end)
    assert submitted == 256
    assert host_ms / step_ms < 0.05, (host_ms, step_ms)
    manager.drain()
    manager.close()
