"""GPU: the data plane's public calls given tensors on the other device, and the host memory they pin.

On a CPU-only host every tensor is on the CPU, so a call that forgets to move its input (or moves it nowhere:
`.to(None)` keeps a tensor where it is) gives the same result there; each test here hands the call a tensor on
the device it does not expect, or asks for the pinning that only a CUDA host does, and checks the result. They
pin down differences that only a CUDA host shows, found by the GPU mutation pass (docs/mutation.md, "GPU pass").
Their CPU twins are the same calls' tests with every tensor on the CPU (tests/dataplane/, tests/runtime/).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfsm.dataplane import DeviceKVPool, FileStorage, HostKVPool, KVCacheConfig, MemoryStorage
from kvfsm.dataplane.copy.base import plan_copy, run_plan, torch_copy_rows
from kvfsm.dataplane.hashing import page_hashes
from kvfsm.dataplane.pools.allocator import as_index_tensor
from kvfsm.dataplane.pools.layer_pool import LayerBufferKVPool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def test_page_slots_asked_for_on_the_gpu_are_moved_there() -> None:
    host = HostKVPool(KVCacheConfig.tiny("mha"), 64, 4, layout="page_first", pin_memory=False)
    slots = host.page_slots(host.alloc_pages(2))
    on_gpu = as_index_tensor(slots, CUDA)
    assert on_gpu.device == CUDA and torch.equal(on_gpu.cpu(), slots.slots)
    assert as_index_tensor(slots, torch.device("cpu")) is slots.slots  # the CPU asks for no copy


@pytest.mark.parametrize("pin", [False, True])
def test_a_host_pool_sized_from_a_device_pool_pins_as_asked(pin: bool) -> None:
    """`pin_memory=None` pins on any CUDA host; an explicit choice is kept (page-locked memory is the host's
    scarce kind: a CPU pool's host tier has no use for it)."""
    device_pool = DeviceKVPool.create(KVCacheConfig.tiny("mha"), 64, "cpu")
    host = HostKVPool.for_device_pool(device_pool, page_size=4, ratio=1.0, pin_memory=pin)
    assert host.pinned is pin and host.kv_buffer.is_pinned() is pin
    assert HostKVPool.for_device_pool(device_pool, page_size=4, ratio=1.0).pinned  # None: CUDA is here


def test_rows_copied_between_devices_with_indices_on_either() -> None:
    """`torch_copy_rows` moves each index to its tensor's device and the rows to the destination's."""
    g = torch.Generator().manual_seed(3)
    src = torch.randn(2, 3, 16, 4, generator=g).to(CUDA)
    dst = torch.zeros(2, 3, 16, 4)
    src_idx, dst_idx = torch.tensor([5, 1, 9]), torch.tensor([0, 7, 15], device=CUDA)
    torch_copy_rows(src, src_idx, dst, dst_idx)
    assert torch.equal(dst[:, :, [0, 7, 15]], src[:, :, [5, 1, 9]].cpu())
    back = torch.zeros(2, 3, 16, 4, device=CUDA)
    torch_copy_rows(dst, dst_idx, back, src_idx)  # CPU source, GPU destination, the indices swapped
    torch.cuda.synchronize()
    assert torch.equal(back[:, :, [5, 1, 9]].cpu(), dst[:, :, [0, 7, 15]])


def test_the_reference_copy_of_a_layer_buffer_pool_on_the_gpu_takes_cpu_indices() -> None:
    """`run_plan` over a CUDA pool of per-layer buffers (no token view), with the device indices on the CPU as
    the manager passes them: both directions land the right rows."""
    g = torch.Generator().manual_seed(4)
    bufs = [[torch.randn(32, 2, 8, generator=g).to(CUDA) for _ in range(3)] for _ in range(2)]
    pool = LayerBufferKVPool(bufs)
    host = HostKVPool(pool.config, 16, 4, "page_first", pin_memory=True)
    src, dst = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23]), torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    slots = host.alloc(8)
    run_plan(plan_copy("d2h", pool, src, host, slots))
    want = torch.stack([torch.stack([b[src.to(CUDA)].cpu() for b in plane]) for plane in bufs])
    assert torch.equal(host.token_view()[:, :, slots], want)
    run_plan(plan_copy("h2d", pool, dst, host, slots))
    torch.cuda.synchronize()
    assert torch.equal(torch.stack([torch.stack([b[dst.to(CUDA)].cpu() for b in plane]) for plane in bufs]), want)


def test_host_indices_given_on_the_gpu_are_planned_on_the_cpu() -> None:
    device_pool = DeviceKVPool.create(KVCacheConfig.tiny("mha"), 64, "cpu")
    host = HostKVPool(device_pool.config, 16, 4, "page_first", pin_memory=False)
    slots = host.alloc(4)
    plan = plan_copy("d2h", device_pool, torch.tensor([0, 1, 2, 3]), host, torch.as_tensor(slots).to(CUDA))
    assert plan.host_idx is not None and plan.host_idx.device.type == "cpu"
    run_plan(plan)
    assert torch.equal(host.token_view()[:, :, slots], device_pool.token_view()[:, :, :4])


def test_token_ids_on_the_gpu_hash_as_on_the_cpu() -> None:
    ids = list(range(1000, 1036))
    assert page_hashes(torch.tensor(ids, device=CUDA), 4) == page_hashes(ids, 4) != []


def test_stores_keep_pages_given_on_the_gpu_on_the_host(tmp_path: Path) -> None:
    """A page handed over on the GPU is read back from the store as host bytes: the memory store keeps a host
    copy (never a hold on device memory), and the file store writes it."""
    pages = [torch.randint(0, 256, (64,), dtype=torch.uint8, device=CUDA) for _ in range(2)]
    memory = MemoryStorage()
    assert memory.batch_set(["a", "b"], pages) == [True, True]
    files = FileStorage(tmp_path)
    try:
        assert files.batch_set(["a", "b"], pages) == [True, True]
        for store in (memory, files):
            got = store.batch_get(["a", "b"])
            assert all(p is not None and p.device.type == "cpu" for p in got), store
            assert [p.tolist() for p in got] == [p.cpu().tolist() for p in pages], store  # type: ignore[union-attr]
    finally:
        files.close()
