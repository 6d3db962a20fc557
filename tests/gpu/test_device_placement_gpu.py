"""GPU: where the data plane's small host-made tensors land, and that writing them never waits for the GPU.

Each test here pins down a difference that only a CUDA host shows, found by the GPU mutation pass
(docs/mutation.md, "GPU pass"): a pointer table left on the host (a kernel reads it over the bus and still gets
the right rows), a page write given GPU bytes, and a request-table write through a blocking copy (it waits for the
stream, and that is no synchronisation that `set_sync_debug_mode` reports) or from pageable memory (which the
driver may wait on: the test checks the upload's source). Their CPU twins: tests/dataplane/test_layer_pool.py,
test_host_pool.py and test_req_to_token.py.
"""

from __future__ import annotations

import pytest
import torch
from copy_spy import Copy, CopySpy

from test_serving_path_gpu import spin  # noqa: F401  (tests/gpu is on sys.path; spin is a fixture)

from kvfsm.dataplane import HostKVPool, KVCacheConfig, ReqToTokenPool
from kvfsm.dataplane.pools.layer_pool import LayerBufferKVPool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_layer_pointer_table_is_on_the_buffers_device() -> None:
    bufs = [[torch.zeros(8, 2, 4, device="cuda") for _ in range(3)] for _ in range(2)]
    ptrs = LayerBufferKVPool(bufs).layer_pointers()
    torch.cuda.synchronize()
    assert ptrs.device == bufs[0][0].device
    assert ptrs.cpu().tolist() == [b.data_ptr() for plane in bufs for b in plane]


def test_page_bytes_given_on_the_gpu_are_written_to_the_host_pool() -> None:
    host = HostKVPool(KVCacheConfig.tiny("mha"), 64, 4, layout="page_first", pin_memory=True)
    slots = host.page_slots(host.alloc_pages(2))
    data = torch.randint(0, 256, (2, host.page_nbytes), dtype=torch.uint8, device="cuda")
    host.set_pages_bytes(slots, data)
    assert torch.equal(host.get_pages_bytes(slots), data.cpu())


def test_a_table_write_is_queued_behind_the_busy_stream_not_waited_for(spin) -> None:  # noqa: F811
    """The write's upload goes without blocking: after it returns, the stream is still busy with the work
    queued before it. The busy period is half a second of GPU time against microseconds of host work; a write
    that waited for the stream would return only after it. (The stream's state, not a clock, decides.)"""
    table = ReqToTokenPool(4, 64, "cuda")
    row = table.alloc()
    assert row is not None
    slots = torch.arange(100, 116, dtype=torch.int64)
    table.write(row, 0, slots[:4])  # pins and uploads once: the driver's first calls may wait
    torch.cuda.synchronize()
    spin(500)
    busy = torch.cuda.Event()
    busy.record()
    table.write(row, 4, slots[4:])
    assert not busy.query(), "the table write waited for the stream's earlier work"
    torch.cuda.synchronize()
    assert torch.equal(table.req_to_token[row, :16].cpu(), slots)
    assert torch.equal(table.read_host(row, 0, 16), slots)


@pytest.mark.parametrize("given", ["tensor", "list"])
def test_a_table_write_uploads_from_pinned_memory(given: str) -> None:
    """The upload's source is page-locked and the copy non-blocking, whatever the caller passed: the driver may
    wait for the stream before a copy from pageable memory (tests/copy_spy.py), which no clock or sync check sees
    reliably. The host mirror's own write stays on the host."""
    table = ReqToTokenPool(4, 64, "cuda")
    row = table.alloc()
    assert row is not None
    slots = torch.arange(100, 116, dtype=torch.int64)
    with CopySpy() as spy:
        table.write(row, 0, slots if given == "tensor" else slots.tolist())
    assert [c for c in spy.copies if c.dst == "cuda"] == [Copy("cpu", True, "cuda", True)], spy.copies
    torch.cuda.synchronize()
    assert torch.equal(table.req_to_token[row, :16].cpu(), slots)
