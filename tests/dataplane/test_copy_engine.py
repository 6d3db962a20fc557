"""Copy engines: bit-exact round trips into scattered slots, deferred completion, validation; GPU paths."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from timing import wait_for

from kvfsm.dataplane import (
    HAVE_TRITON,
    CopyEngine,
    CopyError,
    CpuCopyEngine,
    DeferredCpuCopyEngine,
    DeviceKVPool,
    DuplicateIndex,
    HostKVPool,
    KVCacheConfig,
    NotAllocated,
    OutOfRange,
    ThreadCpuCopyEngine,
    TokenSlotAllocator,
)
from kvfsm.dataplane.copy.coalescing import CoalescingCopyEngine
from kvfsm.dataplane.pools.allocator import PageSlots

from .helpers import bits, check_orders_after_compute_and_never_blocks, fill_random, make_device_pool, make_host_pool

CPU_ENGINES = {
    "cpu": CpuCopyEngine,
    "thread": ThreadCpuCopyEngine,
    "deferred": DeferredCpuCopyEngine,
    "coalescing": lambda: CoalescingCopyEngine(CpuCopyEngine()),
}
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def scattered_host_slots(host: HostKVPool, n: int, seed: int = 0) -> torch.Tensor:
    """n host slots made of whole pages taken in a shuffled order from a larger allocation."""
    x = host.alloc(2 * n)
    assert x is not None
    pages = x.view(-1, host.page_size)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(pages.shape[0], generator=g)[: n // host.page_size]
    return pages[order].reshape(-1)


def scattered_device_slots(pool: DeviceKVPool, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(pool.size - 1, generator=g)[:n] + 1).to(pool.device)


def round_trip(engine: CopyEngine, config: KVCacheConfig, layout: str, page_size: int, device: str = "cpu") -> None:
    n = 4 * page_size if page_size > 1 else 12
    slots = max(64, 4 * n)
    dev = make_device_pool(config, slots, device, seed=3)
    host = make_host_pool(config, max(48, 2 * n), page_size, layout)
    di = scattered_device_slots(dev, n, 1)
    hi = scattered_host_slots(host, n, 2)
    h = engine.submit_d2h(dev, di, host, hi)
    if isinstance(engine, DeferredCpuCopyEngine):
        assert not h.done()
    h.wait()
    assert h.done() and h.direction == "d2h" and h.num_tokens == n and h.nbytes == n * config.bytes_per_token
    assert torch.equal(bits(host.token_view()[:, :, hi]), bits(dev.storage[:, :, di].cpu()))

    back = DeviceKVPool.create(config, slots, device)
    dj = scattered_device_slots(back, n, 4)
    engine.submit_h2d(host, hi, back, dj).wait()
    assert torch.equal(bits(back.storage[:, :, dj]), bits(dev.storage[:, :, di]))
    untouched = torch.ones(slots, dtype=torch.bool, device=back.device)
    untouched[dj] = False
    assert not bool(back.storage[:, :, untouched].view(torch.uint8).any())  # nothing written elsewhere


@pytest.mark.parametrize("engine_name", sorted(CPU_ENGINES))
@pytest.mark.parametrize("page_size", [1, 4])
def test_cpu_engines_round_trip(engine_name: str, config: KVCacheConfig, layout: str, page_size: int) -> None:
    engine = CPU_ENGINES[engine_name]()
    round_trip(engine, config, layout, page_size)
    if isinstance(engine, ThreadCpuCopyEngine):
        engine.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_round_trip(dtype: torch.dtype, layout: str) -> None:
    round_trip(CpuCopyEngine(), KVCacheConfig.tiny("mha", dtype), layout, 4)
    round_trip(CpuCopyEngine(), KVCacheConfig.tiny("mla", dtype), layout, 4)


def test_deferred_copy_reads_the_source_at_completion_b2() -> None:
    """Freeing and reusing a device slot before the copy completes corrupts the offloaded data."""
    cfg = KVCacheConfig.tiny()
    for premature in (True, False):
        alloc = TokenSlotAllocator(12, page_size=4)  # two usable pages, so a freed page is reused at once
        dev = make_device_pool(cfg, 12, seed=5)
        host = make_host_pool(cfg, 8, 4)
        eng = DeferredCpuCopyEngine()
        slots = alloc.alloc(8)
        hi = host.alloc(8)
        assert slots is not None and hi is not None
        expected = dev.storage[:, :, slots].clone()
        handle = eng.submit_d2h(dev, slots, host, hi)
        if not premature:
            eng.complete(handle)
        alloc.free(slots)
        reused = alloc.alloc(8)
        assert reused is not None and sorted(reused.tolist()) == sorted(slots.tolist())
        fill_random(dev.storage, seed=6)  # the new owner writes its KV into the reused slots
        eng.complete(handle)
        same = torch.equal(bits(host.token_view()[:, :, hi]), bits(expected))
        assert same is not premature


def test_deferred_completion_in_any_order() -> None:
    cfg = KVCacheConfig.tiny()
    dev = make_device_pool(cfg, 64)
    host = make_host_pool(cfg, 48, 4)
    eng = DeferredCpuCopyEngine()
    handles, expect = [], []
    for i in range(3):
        di = torch.arange(4 * i + 4, 4 * i + 8)
        hi = host.alloc(4)
        assert hi is not None
        handles.append(eng.submit_d2h(dev, di, host, hi))
        expect.append((hi, di))
    assert [h.seq for h in eng.pending] == [h.seq for h in handles]
    assert eng.complete(handles[2]) is True
    assert eng.complete(handles[2]) is False  # already done: no second copy
    assert [h.done() for h in handles] == [False, False, True]
    assert eng.complete_next() is handles[0]
    assert eng.complete_all() == 1 and eng.complete_next() is None
    for hi, di in expect:
        assert torch.equal(bits(host.token_view()[:, :, hi]), bits(dev.storage[:, :, di]))
    other = DeferredCpuCopyEngine()
    with pytest.raises(CopyError):
        other.complete(eng.submit_d2h(dev, torch.arange(4, 8), host, expect[0][0]))


def test_coalesced_offloads_land_together_at_the_first_done() -> None:
    """Queued offloads are one inner copy, made at the first done() of any (reading the source then); a
    load-back flushes the queue first; each handle reports its own size."""
    cfg = KVCacheConfig.tiny()
    dev = make_device_pool(cfg, 64, seed=5)
    host = make_host_pool(cfg, 32, 4)
    inner = DeferredCpuCopyEngine()
    eng = CoalescingCopyEngine(inner)
    parts = [(torch.arange(8 + 8 * k, 12 + 8 * k), host.alloc(4)) for k in range(3)]
    handles = [eng.submit_d2h(dev, d, host, h) for d, h in parts]
    assert eng.queued == 3 and inner.pending == [] and [h.num_tokens for h in handles] == [4, 4, 4]
    dev.storage[:, :, 8:12] += 1  # written after submit, before the flush: what lands
    assert not handles[2].done()  # the flush: one inner copy, still pending there
    assert eng.queued == 0 and len(inner.pending) == 1 and inner.pending[0].num_tokens == 12
    inner.complete_all()
    assert all(h.done() for h in handles)
    for d, h in parts:
        assert torch.equal(bits(host.token_view()[:, :, h]), bits(dev.storage[:, :, d]))
    late = eng.submit_d2h(dev, torch.arange(40, 44), host, host.alloc(4))
    eng.submit_h2d(host, parts[0][1], dev, torch.arange(50, 54))
    assert eng.queued == 0 and [p.num_tokens for p in inner.pending] == [4, 4]  # the offload went first
    inner.complete_all()
    assert late.done()


def test_a_failed_coalesced_submit_keeps_the_copies_queued() -> None:
    """The inner engine refusing the merged copy loses nothing: every handle raises at done(), and once the
    engine works again the same copies land."""
    cfg = KVCacheConfig.tiny()
    dev = make_device_pool(cfg, 64, seed=6)
    host = make_host_pool(cfg, 32, 4)

    class Flaky(CpuCopyEngine):
        broken = True

        def submit_d2h(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if self.broken:
                raise CopyError("the copy engine is down")
            return super().submit_d2h(*args, **kwargs)

    inner = Flaky()
    eng = CoalescingCopyEngine(inner)
    parts = [(torch.arange(8 + 8 * k, 12 + 8 * k), host.alloc(4)) for k in range(2)]
    handles = [eng.submit_d2h(dev, d, host, h) for d, h in parts]
    for h in handles:
        with pytest.raises(CopyError, match="down"):
            h.done()
    assert eng.queued == 2
    inner.broken = False
    assert all(h.done() for h in handles) and eng.queued == 0
    for d, h in parts:
        assert torch.equal(bits(host.token_view()[:, :, h]), bits(dev.storage[:, :, d]))


def test_a_flush_refused_after_its_first_group_submits_each_copy_exactly_once() -> None:
    """Offloads from two device pools are two inner copies. The engine takes the first and refuses the
    second: the first group is submitted once and never again, the second stays queued and lands at the
    next flush, once."""
    cfg = KVCacheConfig.tiny()
    devs = [make_device_pool(cfg, 64, seed=7), make_device_pool(cfg, 64, seed=8)]
    host = make_host_pool(cfg, 32, 4)

    class RefusesSecond(CpuCopyEngine):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[int] = []
            self.refuse = {1}

        def submit_d2h(self, device_pool, *args, **kwargs):  # type: ignore[no-untyped-def]
            n = len(self.calls)
            self.calls.append(id(device_pool))
            if n in self.refuse:
                raise CopyError("refused the second copy")
            return super().submit_d2h(device_pool, *args, **kwargs)

    inner = RefusesSecond()
    eng = CoalescingCopyEngine(inner)
    parts = [(dev, torch.arange(8 + 8 * k, 12 + 8 * k), host.alloc(4)) for dev in devs for k in range(2)]
    handles = [eng.submit_d2h(dev, d, host, h) for dev, d, h in parts]
    with pytest.raises(CopyError, match="second"):
        eng.flush()
    assert inner.calls == [id(devs[0]), id(devs[1])] and eng.queued == 2  # the first group left the queue
    assert all(h.done() for h in handles[:2])
    eng.flush()  # the second group once more, the first not again
    assert inner.calls == [id(devs[0]), id(devs[1]), id(devs[1])] and eng.queued == 0
    assert all(h.done() for h in handles)
    eng.flush()
    assert len(inner.calls) == 3  # nothing is submitted twice
    for dev, d, h in parts:
        assert torch.equal(bits(host.token_view()[:, :, h]), bits(dev.storage[:, :, d]))


def test_thread_engine_polls_without_blocking() -> None:
    cfg = KVCacheConfig.tiny()
    dev = make_device_pool(cfg, 64)
    host = make_host_pool(cfg, 16, 4)
    hi = host.alloc(8)
    with ThreadCpuCopyEngine() as eng:
        h = eng.submit_d2h(dev, torch.arange(8, 16), host, hi)
        wait_for(h.done, "the copy thread's handle to report done (polled, never waited on)", 10, poll_s=0.001)
        h.wait()
    assert torch.equal(bits(host.token_view()[:, :, hi]), bits(dev.storage[:, :, 8:16]))


@pytest.mark.parametrize("engine_name", sorted(CPU_ENGINES))
def test_submit_validation(engine_name: str) -> None:
    eng = CPU_ENGINES[engine_name]()
    cfg = KVCacheConfig.tiny()
    dev = make_device_pool(cfg, 64)
    host = make_host_pool(cfg, 16, 4)
    hi = host.alloc(4)
    assert hi is not None
    host_before = host.kv_buffer.clone()
    with pytest.raises(CopyError):
        eng.submit_d2h(dev, torch.arange(8, 11), host, hi)  # 3 vs 4
    with pytest.raises(CopyError):
        eng.submit_d2h(make_device_pool(KVCacheConfig.tiny("mla"), 64), torch.arange(8, 12), host, hi)
    with pytest.raises(NotAllocated):
        eng.submit_d2h(dev, torch.arange(8, 12), host, torch.arange(8, 12))
    with pytest.raises(DuplicateIndex):
        eng.submit_d2h(dev, torch.arange(8, 12), host, torch.tensor([hi[0], hi[0], hi[1], hi[2]]))
    with pytest.raises(OutOfRange):
        eng.submit_d2h(dev, torch.tensor([8, 9, 10, 64]), host, hi)
    with pytest.raises(OutOfRange):
        eng.submit_h2d(host, torch.tensor([0, 1, 2, 99]), dev, torch.arange(8, 12))
    assert torch.equal(bits(host.kv_buffer), bits(host_before))
    if isinstance(eng, DeferredCpuCopyEngine):
        assert eng.pending == []
    twin = make_device_pool(KVCacheConfig.tiny(), 64)  # an equal config in another object: compared, accepted
    assert twin.config is not host.config and twin.config == host.config
    eng.submit_d2h(twin, torch.arange(8, 12), host, hi).wait()
    if isinstance(eng, ThreadCpuCopyEngine):
        eng.close()


@pytest.mark.parametrize("engine_name", sorted(CPU_ENGINES))
def test_page_slots_are_checked_as_page_lists(engine_name: str) -> None:
    """PageSlots (slots built from page ids) take the page-list check; whatever fails it gets the exact
    slot checks, so the errors are the ones plain tensors get, and nothing is copied."""
    eng = CPU_ENGINES[engine_name]()
    cfg = KVCacheConfig.tiny()
    dev = make_device_pool(cfg, 64)
    dev_alloc = TokenSlotAllocator(64, 4)
    host = make_host_pool(cfg, 32, 4)
    pages = host.alloc_pages(2)
    dev_pages = dev_alloc.alloc_pages(2)
    assert pages is not None and dev_pages is not None
    hp, dp = host.page_slots(pages), dev_alloc.page_slots(dev_pages)
    assert len(hp) == 8 and hp.slots.tolist() == [p * 4 + i for p in pages for i in range(4)]
    host_before = host.kv_buffer.clone()
    handle = eng.submit_d2h(dev, dp, host, hp)
    handle.wait()
    assert torch.equal(bits(host.kv_buffer[:, :, hp.slots]), bits(dev.storage[:, :, dp.slots]))
    host.kv_buffer.copy_(host_before)
    twice = host.allocator.page_slots([pages[0], pages[0]])
    with pytest.raises(DuplicateIndex):
        eng.submit_d2h(dev, dp, host, twice)
    host.free_pages([pages[1]])
    with pytest.raises(NotAllocated):
        eng.submit_d2h(dev, dp, host, hp)  # a page freed since its slots were built
    dev_alloc.free_pages(dev_pages)  # device pages not (or no longer) handed out: the range check decides
    fresh = host.page_slots([pages[0]] + (host.alloc_pages(1) or []))
    eng.submit_d2h(dev, dp, host, fresh).wait()
    with pytest.raises(OutOfRange):
        eng.submit_d2h(dev, TokenSlotAllocator(128, 4).page_slots([30, 31]), host, fresh)
    if isinstance(eng, ThreadCpuCopyEngine):
        eng.close()


@pytest.mark.parametrize("engine_name", sorted(CPU_ENGINES))
def test_a_block_table_list_and_host_pages_are_planned_as_lists(engine_name: str) -> None:
    """A list of ints (an engine's block table) and host PageSlots stay lists in the plan: no index tensor and
    no slot tensor is built unless a backend asks (dma_rows never does). The plan keeps its own copy of the
    list, the range check is the tensor path's, anything but a list of ints takes the tensor path, and the
    copies move the same bytes."""
    from kvfsm.dataplane.copy.base import plan_copy

    cfg = KVCacheConfig.tiny()
    dev = make_device_pool(cfg, 64)
    host = make_host_pool(cfg, 32, 1)
    pages = host.alloc_pages(4)
    assert pages is not None
    hp = host.page_slots(pages)
    assert hp._slots is None  # built on first use only
    table = [9, 3, 40, 17]
    plan = plan_copy("d2h", dev, table, host, hp)
    assert plan.device_ids == table and plan.device_ids is not table and plan.host_pages == pages
    assert plan._device_idx is None and plan._host_idx is None and hp._slots is None and plan.device_on_cpu
    assert plan.num_tokens == 4 and plan.nbytes == 4 * cfg.bytes_per_token
    table[0] = 63  # the caller's table changes after planning: the plan does not
    assert plan.device_idx.tolist() == [9, 3, 40, 17] and plan.device_idx.dtype == torch.int64
    assert plan.host_idx.tolist() == pages and hp._slots is not None
    table[0] = 9
    for bad in ([-1, 3, 40, 17], [9, 3, 64, 17]):
        with pytest.raises(OutOfRange):
            plan_copy("d2h", dev, bad, host, hp)
    assert plan_copy("d2h", dev, [0, 3, 40, 63], host, hp).device_ids == [0, 3, 40, 63]  # the range's two ends
    square = plan_copy("d2h", dev, torch.tensor([[9, 3], [40, 17]]), host, hp)  # any shape, counted flat
    assert square.device_ids is None and square.device_idx.tolist() == [9, 3, 40, 17]
    for not_ints in ([True, False, True, True], [1 + 2j, 3, 40, 17]):
        with pytest.raises(OutOfRange, match="integers"):
            plan_copy("d2h", dev, not_ints, host, hp)  # type: ignore[arg-type]
    with pytest.raises(CopyError):
        plan_copy("d2h", dev, table[:3], host, hp)
    for other in ([np.int64(b) for b in table], tuple(table), torch.tensor(table)):
        p = plan_copy("h2d", dev, other, host, hp)  # type: ignore[arg-type]
        assert p.device_ids is None and p.device_idx.tolist() == table
    with pytest.raises(OutOfRange):
        plan_copy("d2h", dev, [9.0, 3, 40, 17], host, hp)  # type: ignore[list-item]
    eng = CPU_ENGINES[engine_name]()
    eng.submit_d2h(dev, table, host, hp).wait()
    assert torch.equal(bits(host.kv_buffer[:, :, pages]), bits(dev.storage[:, :, table]))
    dev.storage.index_fill_(2, torch.tensor([1, 2, 50, 51]), 0)
    eng.submit_h2d(host, hp, dev, [1, 2, 50, 51]).wait()
    assert torch.equal(bits(dev.storage[:, :, [1, 2, 50, 51]]), bits(dev.storage[:, :, table]))
    if isinstance(eng, ThreadCpuCopyEngine):
        eng.close()


def test_page_slots_build_their_slots_once_on_first_use() -> None:
    a = TokenSlotAllocator(32, 4)
    pages = a.alloc_pages(3)
    assert pages is not None
    ps = a.page_slots(pages)
    pages.append(7)  # page_slots keeps its own list
    assert ps.pages == pages[:3] and ps._slots is None and len(ps) == 12
    slots = ps.slots
    assert slots.tolist() == [p * 4 + i for p in pages[:3] for i in range(4)] and ps.slots is slots
    given = torch.tensor([4, 5, 6, 7])
    assert a.page_slots([1]).slots.tolist() == [4, 5, 6, 7] and PageSlots(a, [1], given).slots is given


def test_owns_page_list() -> None:
    a = TokenSlotAllocator(32, 4)
    pages = a.alloc_pages(3)
    assert pages is not None and a.owns_page_list(pages) and a.owns_page_list([])
    assert not a.owns_page_list(pages + pages[:1])  # a page twice
    assert not a.owns_page_list([0])  # the padding page
    assert not a.owns_page_list([8])  # out of range
    a.free_pages(pages[:1])
    assert not a.owns_page_list(pages)
    with pytest.raises(OutOfRange):
        a.owns_page_list([1.5])  # type: ignore[list-item]


# ---- Triton kernel (GPU, or the Triton interpreter on CPU when TRITON_INTERPRET=1) -------------------

_interp = os.environ.get("TRITON_INTERPRET") == "1"
_KERNEL_CASES = [
    (d, a, h) for d in (torch.bfloat16, torch.float16, torch.float32) for a in ("mha", "mla") for h in (8, 3)
]
KERNEL_CASES = pytest.mark.parametrize("dtype,attention,head_dim", _KERNEL_CASES)
# Interpreted on the CPU, a case costs about 0.6 s of CPU at ROWS = 10 (the file's interpreted cases: 12.6 s, 18.3 s
# at 20 rows). float16 moves the same two bytes an element as bfloat16, which the kernel's addressing is all that
# tells apart, so CI interprets bfloat16 and float32 and KVFSM_FUZZ=deep all three (the GPU runs all three).
INTERPRETED_CASES = pytest.mark.parametrize(
    "dtype,attention,head_dim",
    [c for c in _KERNEL_CASES if c[0] != torch.float16 or os.environ.get("KVFSM_FUZZ") == "deep"],
)


ROWS = 10


def triton_vs_torch(device: str, dtype: torch.dtype, attention: str, head_dim: int, layout: str) -> None:
    from kvfsm.dataplane.copy.base import torch_copy_rows
    from kvfsm.dataplane.copy.triton_kernels import KernelConfig, kv_rows_copy

    mla = attention == "mla"
    cfg = KVCacheConfig(
        num_layers=3,
        kv_heads=1 if mla else 2,
        head_dim=head_dim * 8 if mla else head_dim,
        attention=attention,
        dtype=dtype,
    )  # type: ignore[arg-type]
    for kcfg in (KernelConfig(), KernelConfig(tokens=1, num_warps=8, layer_fastest=True)):
        dev = make_device_pool(cfg, 128, device, seed=7)
        host_a, host_b = make_host_pool(cfg, 64, 4, layout), make_host_pool(cfg, 64, 4, layout)
        fill_random(host_a.kv_buffer, 8)
        host_b.kv_buffer.copy_(host_a.kv_buffer)
        # 10 rows: two whole blocks of the default config's 4 tokens a program and a partial one, whose mask
        # the kernel must honour (20, a multiple of 4, cost twice the interpreter's time and tested no mask)
        di = scattered_device_slots(dev, ROWS, 9)
        hi = torch.randperm(64)[:ROWS]
        kv_rows_copy(dev.token_view(), di, host_a.token_view(), hi.to(device), kcfg)
        if device == "cuda":
            torch.cuda.synchronize()
        torch_copy_rows(dev.token_view(), di, host_b.token_view(), hi)
        assert torch.equal(bits(host_a.kv_buffer), bits(host_b.kv_buffer))  # same rows, nothing else touched
        back = DeviceKVPool.create(cfg, 128, device)
        dj = scattered_device_slots(back, ROWS, 10)
        kv_rows_copy(host_a.token_view(), hi.to(device), back.token_view(), dj, kcfg)
        assert torch.equal(bits(back.storage[:, :, dj]), bits(dev.storage[:, :, di]))


@gpu
@needs_cuda
@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
@KERNEL_CASES
def test_triton_kernel_matches_torch_path(dtype: torch.dtype, attention: str, head_dim: int, layout: str) -> None:
    triton_vs_torch("cuda", dtype, attention, head_dim, layout)


@pytest.mark.skipif(not (HAVE_TRITON and _interp), reason="needs triton and TRITON_INTERPRET=1")
@INTERPRETED_CASES
def test_triton_kernel_interpreted_matches_torch_path(
    dtype: torch.dtype, attention: str, head_dim: int, layout: str
) -> None:
    triton_vs_torch("cpu", dtype, attention, head_dim, layout)


# ---- CUDA engine ----------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "torch", "dma", "hybrid", "auto"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_engine_round_trip(backend: str, config: KVCacheConfig, layout: str, page_size: int) -> None:
    from kvfsm.dataplane import CudaCopyEngine

    if backend in ("triton", "hybrid") and not HAVE_TRITON:
        pytest.skip("triton not installed")
    round_trip(CudaCopyEngine(backend=backend), config, layout, page_size, "cuda")  # type: ignore[arg-type]


@gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "torch", "dma", "hybrid"])
def test_cuda_engine_orders_after_compute_and_never_blocks(backend: str) -> None:
    from kvfsm.dataplane import CudaCopyEngine

    if backend in ("triton", "hybrid") and not HAVE_TRITON:
        pytest.skip("triton not installed")
    cfg = KVCacheConfig.llama3_8b()
    dev = DeviceKVPool.create(cfg, 2048, "cuda")
    host = HostKVPool(cfg, 1024, 16, "page_first")
    eng = CudaCopyEngine(backend=backend)  # type: ignore[arg-type]
    di = scattered_device_slots(dev, 512, 11)
    hi = host.alloc(512)
    assert hi is not None
    check_orders_after_compute_and_never_blocks(eng, dev, host, di, hi)


def _block_rows_case(cfg: KVCacheConfig, eng: CopyEngine) -> tuple[Any, ...]:
    """A 64-slot CUDA pool, a 32-slot host pool, six scattered blocks (and six others to load back into),
    their host pages, the blocks as CUDA index tensors, fresh KV for them, and one warm-up offload."""
    dev = make_device_pool(cfg, 64, "cuda", seed=3)
    host = HostKVPool(cfg, 32, 1)
    blocks, back = [9, 3, 40, 41, 17, 60], [1, 2, 50, 51, 52, 7]
    pages = host.alloc_pages(len(blocks))
    assert pages is not None
    hs = host.page_slots(pages)
    idx, bidx = torch.tensor(blocks, device="cuda"), torch.tensor(back, device="cuda")
    fresh = fill_random(torch.empty_like(dev.storage[:, :, idx]), 12)
    eng.submit_d2h(dev, blocks, host, hs).wait()  # warm-up
    return dev, host, blocks, back, hs, idx, bidx, fresh


@gpu
@needs_cuda
def test_dma_rows_moves_whole_block_rows_after_compute_without_a_host_wait() -> None:
    """Rows of a whole 512 KiB block (the transformers pool's geometry) take "dma_rows" under "auto": one
    driver call, ordered after the compute stream's writes, and neither submit nor done() waits for the GPU."""
    from kvfsm.dataplane import CudaCopyEngine

    cfg = KVCacheConfig(num_layers=1, kv_heads=1, head_dim=256 * 1024, attention="mla")  # bf16: 512 KiB rows
    eng = CudaCopyEngine()
    dev, host, blocks, back, hs, idx, bidx, fresh = _block_rows_case(cfg, eng)
    g = eng._row_geometry(host)  # kept per pool while its buffer is the same tensor
    assert eng._row_geometry(host) is g and g.bases == (host.kv_buffer.data_ptr(),)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of busy compute stream
    dev.storage.index_copy_(2, idx, fresh)  # what the offload must see, written after the sleep
    torch.cuda.set_sync_debug_mode("error")
    try:
        h = eng.submit_d2h(dev, blocks, host, hs)
        assert h.backend == "dma_rows" and h.info["copies"] == len(blocks) and not h.done()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    h.wait()
    assert torch.equal(bits(host.token_view()[:, :, hs.slots]), bits(fresh.cpu()))
    dev.storage.index_fill_(2, bidx, 0)  # on the compute stream: the load-back must land after this
    torch.cuda.set_sync_debug_mode("error")
    try:
        h2 = eng.submit_h2d(host, hs, dev, back)
        h2.wait_stream()
        out = dev.storage[:, :, bidx].clone()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert h2.backend == "dma_rows" and torch.equal(bits(out), bits(fresh))
    untouched = torch.ones(64, dtype=torch.bool, device="cuda")
    untouched[idx] = False
    untouched[bidx] = False
    before = dev.storage[:, :, untouched].clone()
    eng.submit_h2d(host, hs, dev, back).wait()
    assert torch.equal(bits(dev.storage[:, :, untouched]), bits(before))  # nothing written elsewhere


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "backend,on_compute", [("auto", False), ("auto", True), ("triton", False), ("triton", True), ("torch", True)]
)
def test_a_bound_compute_stream_orders_copies_with_no_stream_context(backend: str, on_compute: bool) -> None:
    """An engine bound to a compute stream (compute_stream=) orders its copies after that stream's writes
    while another stream is current at submit. With on_compute_stream the copy runs on that stream (the
    handle names it, and its wait on the copy is free). Neither submit nor done() waits for the GPU."""
    from kvfsm.dataplane import CudaCopyEngine

    if backend == "triton" and not HAVE_TRITON:
        pytest.skip("triton not installed")
    rows = backend == "auto"  # whole-block rows: "auto" takes dma_rows
    cfg = (
        KVCacheConfig(num_layers=1, kv_heads=1, head_dim=256 * 1024, attention="mla") if rows else KVCacheConfig.tiny()
    )
    compute = torch.cuda.Stream()
    eng = CudaCopyEngine(backend=backend, compute_stream=compute, on_compute_stream=on_compute)  # type: ignore[arg-type]
    dev, host, blocks, back, hs, idx, bidx, fresh = _block_rows_case(cfg, eng)
    torch.cuda.synchronize()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of busy compute stream
        dev.storage.index_copy_(2, idx, fresh)  # what the offload must see, written after the sleep
    torch.cuda.set_sync_debug_mode("error")
    try:
        h = eng.submit_d2h(dev, blocks, host, hs)  # the default stream is current, not `compute`
        assert not h.done()
        assert (h.stream == compute) if on_compute else h.stream is None
    finally:
        torch.cuda.set_sync_debug_mode(0)
    h.wait()
    assert torch.equal(bits(host.token_view()[:, :, hs.slots]), bits(fresh.cpu()))
    with torch.cuda.stream(compute):
        torch.cuda._sleep(100_000_000)
        dev.storage.index_fill_(2, bidx, 0)  # the load-back must land after this
    torch.cuda.set_sync_debug_mode("error")
    try:
        h2 = eng.submit_h2d(host, hs, dev, back)
        h2.wait_stream(compute)
        with torch.cuda.stream(compute):
            out = dev.storage[:, :, bidx].clone()
        assert not h2.done()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(fresh))
    if rows:
        assert h.backend == h2.backend == "dma_rows"


@gpu
@needs_cuda
def test_cuda_handle_keeps_indices_until_done() -> None:
    from kvfsm.dataplane import CudaCopyEngine

    cfg = KVCacheConfig.tiny()
    dev = make_device_pool(cfg, 64, "cuda")
    host = make_host_pool(cfg, 16, 4)
    eng = CudaCopyEngine()
    hi = host.alloc(8)
    torch.cuda._sleep(50_000_000)
    h = eng.submit_d2h(dev, torch.arange(8, 16, device="cuda"), host, hi)
    assert h._keepalive is not None
    h.wait()
    assert h._keepalive is None and h.done()


@gpu
def test_a_cpu_pool_takes_slot_indices_from_a_cuda_tensor() -> None:
    """The CPU engines copy between CPU pools; slot indices that an engine keeps on its GPU (a request table on
    the device) are planned on the CPU, not refused as a device mismatch (only two different devices, a CUDA
    pool with indices on another device, are a mismatch)."""
    from kvfsm.dataplane.copy.base import plan_copy

    cfg = KVCacheConfig.tiny()
    dev = make_device_pool(cfg, 64)
    host = make_host_pool(cfg, 32, 1)
    slots = torch.tensor([9, 3, 40, 17], device="cuda")
    host_slots = host.alloc(4)
    assert host_slots is not None
    plan = plan_copy("d2h", dev, slots, host, host_slots)
    assert plan.device_idx.device.type == "cpu" and plan.device_idx.tolist() == [9, 3, 40, 17]
    handle = ThreadCpuCopyEngine().submit_d2h(dev, slots, host, host_slots)
    handle.wait()
    assert torch.equal(bits(host.token_view()[:, :, host_slots]), bits(dev.token_view()[:, :, slots.cpu()]))
