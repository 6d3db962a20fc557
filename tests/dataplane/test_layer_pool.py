"""`LayerBufferKVPool` (an engine's separate per-layer KV buffers) under every copy path: the CPU engine's
reference copy, the Triton pointer-table kernel (interpreted on CPU, compiled on the GPU) and the CUDA
engine, whose offload must not wait for the GPU."""

from __future__ import annotations

import os

import pytest
import torch

from kvfsm.dataplane import CpuCopyEngine, HostKVPool
from kvfsm.dataplane.copy.triton_kernels import HAVE_TRITON
from kvfsm.dataplane.errors import OutOfRange
from kvfsm.dataplane.pools.layer_pool import LayerBufferKVPool, NoTokenView

LAYERS, SLOTS, PS = 3, 40, 4


def _pool(attention: str, dtype: torch.dtype, device: str = "cpu", heads: int = 2, dim: int = 8) -> LayerBufferKVPool:
    g = torch.Generator().manual_seed(1)
    planes = 1 if attention == "mla" else 2
    bufs = [
        [torch.randn(SLOTS, heads, dim, generator=g).to(dtype).to(device) for _ in range(LAYERS)] for _ in range(planes)
    ]
    return LayerBufferKVPool(bufs, attention=attention)


def _want(pool: LayerBufferKVPool, idx: torch.Tensor) -> torch.Tensor:
    """The rows at `idx` read buffer by buffer, independently of gather_rows."""
    return torch.stack([torch.stack([b[idx.to(b.device)].cpu() for b in plane]) for plane in pool.planes])


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_cpu_round_trip_and_refusals(attention: str) -> None:
    pool = _pool(attention, torch.float32, heads=1 if attention == "mla" else 2)
    host = HostKVPool(pool.config, 16, PS, "page_first", pin_memory=False)
    src = torch.tensor([8, 9, 10, 11, 36, 37, 38, 39])
    slots = host.alloc(8)
    rows = _want(pool, src)  # read before the copy: a d2h must leave the device's rows as they were
    assert CpuCopyEngine().submit_d2h(pool, src, host, slots).done()
    assert torch.equal(host.token_view()[:, :, slots], rows) and torch.equal(_want(pool, src), rows)
    dst = torch.tensor([0, 1, 2, 3, 20, 21, 22, 23])
    CpuCopyEngine().submit_h2d(host, slots, pool, dst)
    assert torch.equal(_want(pool, dst), _want(pool, src))
    with pytest.raises(OutOfRange):
        CpuCopyEngine().submit_d2h(pool, torch.tensor([0, 1, 2, SLOTS]), host, host.alloc(4))
    with pytest.raises(NoTokenView):
        pool.token_view()


def test_buffers_that_differ_are_refused() -> None:
    a = torch.zeros(8, 2, 4)
    with pytest.raises(ValueError, match="one \\[slots, heads, dim\\] shape"):
        LayerBufferKVPool([[a, torch.zeros(8, 2, 5)], [a, a]])
    with pytest.raises(ValueError, match="fp8|bfloat16"):
        LayerBufferKVPool([[a.to(torch.uint8)], [a.to(torch.uint8)]])
    with pytest.raises(ValueError, match="contiguous"):
        LayerBufferKVPool([[torch.zeros(2, 8, 4).transpose(0, 1)], [torch.zeros(2, 8, 4).transpose(0, 1)]])
    with pytest.raises(ValueError, match="plane"):
        LayerBufferKVPool([[a]], attention="mha")


def _kernel_round_trip(device: str, attention: str, dtype: torch.dtype, dim: int) -> None:
    from kvfsm.dataplane.copy.triton_kernels import KernelConfig, kv_layer_rows_copy

    pool = _pool(attention, dtype, device, heads=1 if attention == "mla" else 2, dim=dim)
    host = HostKVPool(pool.config, 32, PS, "layer_first", pin_memory=device != "cpu")
    hv = host.token_view()
    hv.zero_()
    di = torch.tensor([5, 17, 3, 39, 0, 22, 8], device=device)
    hi = torch.tensor([1, 30, 2, 9, 4, 12, 7], device=device)
    kv_layer_rows_copy(pool.layer_pointers(), pool.token_stride, di, hv, hi, True, KernelConfig())
    if device != "cpu":
        torch.cuda.synchronize()
    assert torch.equal(hv[:, :, hi.cpu()], _want(pool, di))
    di2 = torch.tensor([1, 2, 4, 6, 9, 10, 11], device=device)
    kv_layer_rows_copy(pool.layer_pointers(), pool.token_stride, di2, hv, hi, False, KernelConfig(layer_fastest=True))
    if device != "cpu":
        torch.cuda.synchronize()
    assert torch.equal(_want(pool, di2), hv[:, :, hi.cpu()])


CASES = [("mha", torch.bfloat16, 8), ("mla", torch.float32, 12), ("mha", torch.float16, 3)]


@pytest.mark.skipif(
    not (HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and TRITON_INTERPRET=1 (make test-upstream runs it)",
)
@pytest.mark.parametrize("attention, dtype, dim", CASES)
def test_pointer_table_kernel_interpreted(attention: str, dtype: torch.dtype, dim: int) -> None:
    _kernel_round_trip("cpu", attention, dtype, dim)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA and triton")
@pytest.mark.parametrize("attention, dtype, dim", CASES)
def test_pointer_table_kernel_on_gpu(attention: str, dtype: torch.dtype, dim: int) -> None:
    _kernel_round_trip("cuda", attention, dtype, dim)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; test_cpu_round_trip_and_refusals is its twin")
@pytest.mark.parametrize("backend", ["auto", "torch", "dma"])
def test_cuda_engine_copies_layer_buffers_without_waiting(backend: str) -> None:
    from kvfsm.dataplane import CudaCopyEngine

    pool = _pool("mha", torch.bfloat16, "cuda", dim=64)
    host = HostKVPool(pool.config, 32, PS, "page_first", pin_memory=True)
    engine = CudaCopyEngine("cuda", backend=backend)  # type: ignore[arg-type]
    pool.layer_pointers()  # the pointer table's one upload, made before the hot path
    src = torch.arange(8, 24, device="cuda")  # device slots on the GPU, as a GPU request table gives them
    slots = host.alloc(16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        handle = engine.submit_d2h(pool, src, host, slots)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    handle.wait()
    assert handle.backend == ("torch" if backend == "torch" else "triton")  # no staged pipeline without a view
    assert torch.equal(host.token_view()[:, :, slots], _want(pool, src))
    dst = torch.arange(24, 40, device="cuda")
    engine.submit_h2d(host, slots, pool, dst).wait()
    assert torch.equal(_want(pool, dst), _want(pool, src))
