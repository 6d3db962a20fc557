"""`SGLangDeviceKVPool` + kvfsm's CPU copy engine over SGLang's real per-layer KV buffers: copies land in
kvfsm's host pool as they would from kvfsm's own pools (every plane, layer and slot), back again, in
both host layouts, and bad indices are refused with kvfsm's typed errors before anything moves."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

import harness  # noqa: F401  (installs the CUDA-only stand-ins before sglang's pools are used)

from kvfsm.dataplane import CpuCopyEngine, HostKVPool
from kvfsm.dataplane.errors import NotAllocated, OutOfRange
from kvfsm.dataplane.pools.layer_pool import NoTokenView
from kvfsm.integrations.sglang import SGLangDeviceKVPool


def _pool(kind: str):
    if kind == "mha":
        return MHATokenToKVPool(
            size=64,
            page_size=4,
            dtype=torch.float32,
            head_num=2,
            head_dim=3,
            layer_num=3,
            device="cpu",
            enable_memory_saver=False,
        )
    return MLATokenToKVPool(
        size=64,
        page_size=4,
        dtype=torch.float32,
        kv_lora_rank=4,
        qk_rope_head_dim=2,
        layer_num=3,
        device="cpu",
        enable_memory_saver=False,
    )


def _fill(dev: SGLangDeviceKVPool) -> None:
    for p, plane in enumerate(dev.planes):
        for layer, buf in enumerate(plane):
            buf.copy_(torch.arange(buf.numel(), dtype=buf.dtype).reshape(buf.shape) + 1000 * (10 * p + layer))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_round_trip_through_the_host_pool(kind: str, layout: str) -> None:
    dev = SGLangDeviceKVPool(_pool(kind))
    assert dev.size == 64 + 4 and dev.config.num_planes == (2 if kind == "mha" else 1)
    _fill(dev)
    host = HostKVPool(dev.config, 16, page_size=4, layout=layout, pin_memory=False)
    engine = CpuCopyEngine()
    src = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23])
    slots = host.alloc(8)
    assert engine.submit_d2h(dev, src, host, slots).done()
    view = host.token_view()
    for p, plane in enumerate(dev.planes):
        for layer, buf in enumerate(plane):
            assert torch.equal(view[p, layer, slots], buf[src])
    # the page bytes are kvfsm's canonical (planes, layers, tokens, heads, dim): what FileStorage writes
    page = host.get_pages_bytes(slots[:4]).view(torch.float32)
    want = torch.stack([torch.stack([buf[src[:4]] for buf in plane]) for plane in dev.planes]).reshape(-1)
    assert torch.equal(page[0], want)
    dst = torch.tensor([40, 41, 42, 43, 44, 45, 46, 47])
    assert engine.submit_h2d(host, slots, dev, dst).done()
    for plane in dev.planes:
        for buf in plane:
            assert torch.equal(buf[dst], buf[src])


def test_bad_indices_are_refused_before_anything_moves() -> None:
    dev = SGLangDeviceKVPool(_pool("mha"))
    _fill(dev)
    host = HostKVPool(dev.config, 16, page_size=4, pin_memory=False)
    host.kv_buffer.zero_()  # torch.empty: garbage (NaN != NaN) otherwise
    before = host.token_view().clone()
    engine = CpuCopyEngine()
    slots = host.alloc(4)
    with pytest.raises(OutOfRange):
        engine.submit_d2h(dev, torch.tensor([8, 9, 10, 68]), host, slots)  # past the buffers' rows
    with pytest.raises(NotAllocated):
        engine.submit_d2h(dev, torch.tensor([8, 9, 10, 11]), host, torch.tensor([4, 5, 6, 7]))  # host slots not taken
    assert torch.equal(host.token_view(), before)
    with pytest.raises(NoTokenView, match="separate allocations"):
        dev.token_view()
