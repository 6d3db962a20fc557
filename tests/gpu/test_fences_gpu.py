"""GPU: slots freed fenced under a CUDA copy are reused with a stream wait, and nothing waits on the host.

While the compute stream is busy and under `torch.cuda.set_sync_debug_mode("error")`: an offload reads a
request's slots, the slots are freed fenced, `alloc_fenced` hands them to the next request with the copy's
fence, the compute stream waits on it (`wait_fences`) and overwrites them. The copy must land the old
bytes; the fence must be reclaimed by a query once it passed. CPU twin: tests/dataplane/test_fences.py.
"""

from __future__ import annotations

import pytest
import torch

from test_serving_path_gpu import no_sync, spin  # noqa: F401  (tests/gpu is on sys.path; spin is a fixture)

from kvfsm.dataplane import CudaCopyEngine, HostKVPool, KVCacheConfig, SlotFence, TokenSlotAllocator, wait_fences
from kvfsm.dataplane.copy.coalescing import CoalescingCopyEngine
from kvfsm.dataplane.pools.device_pool import DeviceKVPool

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("coalesced", [False, True])
@pytest.mark.parametrize("backend", ["triton", "dma", "torch"])
def test_fenced_slots_are_rewritten_only_after_their_copy_on_the_gpu(spin, backend: str, coalesced: bool) -> None:  # noqa: F811
    kv = KVCacheConfig.tiny("mha")
    page = 16
    pool = DeviceKVPool.create(kv, 1024, "cuda")
    pool.token_view().copy_(torch.randn(pool.token_view().shape, device="cuda").to(kv.dtype))
    allocator = TokenSlotAllocator(1024, page)
    host = HostKVPool(kv, 512, page, layout="page_first", pin_memory=True)
    cuda = CudaCopyEngine(backend=backend)
    engine = CoalescingCopyEngine(cuda) if coalesced else cuda
    slots = allocator.alloc(8 * page)
    host_slots = host.alloc(8 * page)
    assert slots is not None and host_slots is not None
    engine.submit_d2h(pool, slots, host, host_slots).wait()  # compile, load the driver
    want = pool.token_view()[:, :, slots.cuda()].cpu()
    staged = torch.empty(8 * page, dtype=torch.int64, pin_memory=True)  # pinned before: pinning may sync
    torch.cuda.synchronize()

    spin(300)
    with no_sync():
        handle = engine.submit_d2h(pool, slots, host, host_slots)
        allocator.free(slots, SlotFence([handle]))
        assert allocator.fenced_page_count == 8  # the copy is behind the busy stream: not passed
        while allocator.alloc_pages(1) is not None:  # every plain page goes first
            pass
        got = allocator.alloc_fenced(8 * page)
        assert got is not None
        reused, fences = got
        assert sorted(reused.tolist()) == sorted(slots.tolist()) and len(fences) == 1
        wait_fences(fences, torch.cuda.current_stream())  # a wait_event: the host does not wait
        staged.copy_(reused)  # the next request's KV, on the compute stream after the wait
        pool.token_view().index_fill_(2, staged.cuda(non_blocking=True), 0)
        assert not handle.done()  # still behind the busy stream, and the write behind the copy
    torch.cuda.synchronize()
    assert torch.equal(host.token_view()[:, :, host_slots], want)
    assert pool.token_view()[:, :, slots.cuda()].abs().sum().item() == 0
    with no_sync():  # reclaim is an event query
        allocator.free(reused, SlotFence([handle]))
        assert allocator.fenced_page_count == 0  # passed: freed plainly
