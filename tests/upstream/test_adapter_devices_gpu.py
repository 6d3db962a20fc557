"""kvfsm's SGLang adapter on a CUDA host: what it builds for the pools' device, and the slots it hands back to
SGLang's CUDA allocator. Each test pins down a difference that only a CUDA host shows (docs/mutation.md, "GPU
pass"): on a CPU-only host every pool, slot and engine is on the CPU. Their CPU twins are the adapter's runs on
CPU pools in tests/upstream/test_differential.py.

Needs CUDA and sglang: on the device machine, `tests/upstream/run_on_device.sh`; skipped elsewhere.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import harness
from test_adapter_gpu import GPU_SCENARIOS, HotPathAdapter, _run

from kvfsm.integrations.sglang import DecodeKVCacheOffloadManager

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class Kept(HotPathAdapter):
    """The adapter, kept for a look once the scenario has run."""

    made: list[DecodeKVCacheOffloadManager] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        Kept.made.append(self)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_host_pool_is_pinned_and_the_engine_bound_for_the_pools_device(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CUDA host: over CUDA pools, a pinned host pool and a CUDA engine told the pools' device (not the
    current one, which on a server of several GPUs may be another); over CPU pools, an unpinned host pool
    (page-locked memory is the scarce kind, and the CPU engine has no use for it) and the CPU engine."""
    from kvfsm.dataplane.pools.device_pool import resolve_device
    from kvfsm.integrations.sglang import manager as adapter_module

    engines: list[Any] = []

    def engine(device_arg: Any = None, *args: Any, **kwargs: Any) -> Any:
        engines.append(device_arg)
        return real(device_arg, *args, **kwargs)

    real = adapter_module.CudaCopyEngine
    monkeypatch.setattr(adapter_module, "CudaCopyEngine", engine)
    Kept.made = []
    _run(GPU_SCENARIOS[0], Kept, device, False)
    (adapter,) = Kept.made
    assert adapter.decode_host_mem_pool.pinned is (device == "cuda")
    pool_device = resolve_device(adapter.kv_cache.device)  # SGLang's pools name "cuda", without an index
    assert pool_device.type == device
    if device == "cuda":
        assert engines and all(d is not None and torch.device(d) == pool_device for d in engines), engines
    else:
        assert engines == [] and type(adapter.manager.fx.copy_engine).__name__ == "CpuCopyEngine"


def test_slots_freed_from_the_cpu_go_back_to_sglangs_cuda_allocator() -> None:
    """kvfsm reads a request's slots from the table's host mirror, so `AllocatorView.free` hands SGLang's CUDA
    allocator CPU slots (an int64 array from a CPU table's mirror, or a CPU tensor): they must arrive as its own
    device's pages, usable by the next allocation."""
    from kvfsm.integrations.sglang.objects import AllocatorView

    sc = GPU_SCENARIOS[0]
    with harness.on_device("cuda"):
        _, kv, allocator = harness.build_pools(sc)
    ps = int(allocator.page_size)
    before = allocator.available_size()
    view = AllocatorView(allocator, int(kv.size))
    for host_form in (lambda t: t.cpu().numpy(), lambda t: t.cpu()):
        slots = allocator.alloc(4 * ps)
        assert slots is not None
        view.free(host_form(slots))
        assert allocator.available_size() == before
    free = allocator.free_pages if len(allocator.release_pages) == 0 else allocator.release_pages
    assert free.device == slots.device
    again = allocator.alloc(allocator.available_size())  # every page, the freed ones merged back in
    assert again is not None and again.device == slots.device
    assert set(again.cpu().tolist()) >= set(slots.cpu().tolist())
