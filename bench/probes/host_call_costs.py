"""What each host-side call of a swap costs on this machine: the floor under kvfsm's (and the engine's own)
host time in transformers' offloading (bench/transformers_offload.py).

Times, as the median of many calls with the GPU idle, the CUDA runtime calls a swap makes (event create and
record, stream wait, event query, a stream context), the engine's own swap ops (index upload, gather,
pinned copy), and kvfsm's steps (copy planning, dma_rows addressing, the batched driver call, a fence wait,
host page alloc/free) on pools shaped like the benchmark's (512 KiB blocks).

  python bench/probes/host_call_costs.py [--iters 2000] [--out FILE]
Writes bench/results/host_call_costs-<machine>.json (or --out). Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import write_result  # noqa: E402

from kvfsm.dataplane import CudaCopyEngine, DeviceKVPool, HostKVPool, KVCacheConfig  # noqa: E402
from kvfsm.dataplane.copy import dma  # noqa: E402
from kvfsm.dataplane.copy.base import plan_copy  # noqa: E402
from kvfsm.dataplane.fences import SlotFence  # noqa: E402


def median_us(fn: Callable[[], Any], iters: int, sync: Callable[[], None] | None = None) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if sync is not None:
            sync()
    return round(statistics.median(times) * 1e6, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=8, help="blocks per swap (the benchmark's mean is 8)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    cfg = KVCacheConfig(num_layers=1, kv_heads=1, head_dim=256 * 1024, attention="mla")  # 512 KiB bf16 rows
    dpool = DeviceKVPool.create(cfg, 192, dev)
    hpool = HostKVPool(cfg, 256, 1)
    eng = CudaCopyEngine(dev)
    compute = torch.cuda.Stream(dev)
    blocks = list(range(10, 10 + a.blocks))
    pages = hpool.alloc_pages(a.blocks)
    assert pages is not None
    slots = hpool.page_slots(pages)
    flat_view = dpool.storage.view(192, -1)
    pinned = torch.empty((256, flat_view.shape[1]), dtype=flat_view.dtype, pin_memory=True)
    n, sync = a.iters, torch.cuda.synchronize
    ev = torch.cuda.Event()
    ev.record(compute)
    handle = eng.submit_d2h(dpool, blocks, hpool, slots)
    handle.wait()
    fence = SlotFence([handle])
    plan = plan_copy("d2h", dpool, blocks, hpool, slots)
    res: dict[str, float] = {}

    def record() -> None:
        torch.cuda.Event().record(compute)

    res["event create + record"] = median_us(record, n)
    res["stream.wait_event"] = median_us(lambda: eng.stream.wait_event(ev), n)
    res["event.query (passed)"] = median_us(ev.query, n)
    res["current_stream()"] = median_us(lambda: torch.cuda.current_stream(dev), n)

    def ctx() -> None:
        with torch.cuda.stream(compute):
            pass

    res["torch.cuda.stream(s) enter + exit"] = median_us(ctx, n)
    res["torch.as_tensor(list of blocks)"] = median_us(lambda: torch.as_tensor(blocks, dtype=torch.long), n)
    res["engine: ids .to(cuda, non_blocking)"] = median_us(
        lambda: torch.as_tensor(blocks, dtype=torch.long).to(dev, non_blocking=True), n, sync
    )
    ids = torch.as_tensor(blocks, dtype=torch.long).to(dev)
    res["engine: index_select of the blocks"] = median_us(lambda: flat_view.index_select(0, ids), n, sync)
    gathered = flat_view.index_select(0, ids)
    res["engine: one pinned copy_(non_blocking)"] = median_us(
        lambda: pinned[: a.blocks].copy_(gathered, non_blocking=True), n, sync
    )
    res["kvfsm: plan_copy (list + PageSlots)"] = median_us(lambda: plan_copy("d2h", dpool, blocks, hpool, slots), n)
    res["kvfsm: token_view() of the host pool"] = median_us(hpool.token_view, n)
    dv, hv = dpool.token_view(), hpool.token_view()
    res["kvfsm: dma.row_copies"] = median_us(lambda: dma.row_copies(dv, blocks, hv, pages), n)
    rc = dma.row_copies(dv, blocks, hv, pages)
    drv = eng._ops.driver
    res["kvfsm: driver run_batch_buffers (8 x 512 KiB)"] = median_us(
        lambda: drv.run_batch_buffers(rc.dst, rc.src, rc.size, eng.stream.cuda_stream), n, sync
    )
    res["kvfsm: choose_backend"] = median_us(lambda: eng.choose_backend(plan), n)
    res["kvfsm: submit_d2h (whole)"] = median_us(lambda: eng.submit_d2h(dpool, blocks, hpool, slots), n, sync)
    res["kvfsm: SlotFence.wait(compute)"] = median_us(lambda: fence.wait(compute), n)

    def host_pages() -> None:
        p = hpool.alloc_pages(a.blocks)
        hpool.page_slots(p)
        hpool.free_pages(p)

    res["kvfsm: host alloc_pages + page_slots + free_pages"] = median_us(host_pages, n)
    for k, v in res.items():
        print(f"{k:50s} {v:8.2f} us")
    print(
        f"wrote {write_result('host_call_costs', {'params': {'iters': n, 'blocks': a.blocks}, 'median_us': res}, a.out)}"
    )


if __name__ == "__main__":
    main()
