"""Host time of one engine submit at full model size: the scheduler thread's cost of a chunk's copy.

One `CudaCopyEngine.submit_d2h` of `--tokens` tokens (default 2048) of Llama-3-8B KV at all 32 layers (8 KV
heads of 128, bf16: 256 MiB at 2048 tokens), from random whole device pages of a `DeviceKVPool` into random
pages of a pinned page_first `HostKVPool`, the way the manager submits (device slots as the allocator's
`PageSlots` on the CPU, or as a tensor on the GPU: the request table read on the device). Before each
submit the compute stream is given `--busy-ms` of matmuls, so the copy is queued behind a busy GPU as in
serving; the submit runs under `torch.cuda.set_sync_debug_mode("error")`. Each configuration is submitted
`--repeats` times after warm-up; the median host time is the figure, with the engine's own phase times
(`handle.info`) and, with `--profile`, the heaviest functions of one submit.

    python3 bench/submit_cost.py [--tokens 2048] [--layers 32] [--pages 16 64] [--backends auto triton dma]
                                 [--launcher off on]   # the direct kernel through Triton's JIT, its compiled handle
Writes bench/results/submit_cost-<machine>.json with a `targets` list. Needs CUDA (`--quick` checks the script).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

from kvfsm.dataplane import CudaCopyEngine, HostKVPool, KVCacheConfig, TokenSlotAllocator  # noqa: E402
from kvfsm.dataplane.pools.device_pool import DeviceKVPool  # noqa: E402

LIMIT_MS = 0.5


def use_launcher(on: bool) -> None:
    """The direct kernel's launches through its compiled handle (on) or `kernel[grid]` (off, the default)."""
    from kvfsm.dataplane.copy import triton_kernels as tk

    if tk.HAVE_TRITON:
        tk._launch.enabled = on
        tk._launch._compiled.clear()


def busy(a: torch.Tensor, c: torch.Tensor, n: int) -> None:
    for _ in range(n):
        torch.mm(a, a, out=c)


def measure(
    engine: CudaCopyEngine,
    pool: DeviceKVPool,
    host: HostKVPool,
    dev_alloc: TokenSlotAllocator,
    tokens: int,
    page: int,
    index_on: str,
    repeats: int,
    mm: tuple[torch.Tensor, torch.Tensor, int],
    profile: bool,
) -> dict[str, Any]:
    times: list[float] = []
    infos: list[dict[str, Any]] = []
    prof_text: Optional[str] = None
    profs: list[cProfile.Profile] = []
    rng = random.Random(0)
    for k in range(repeats + 3):
        pages = rng.sample(range(1, dev_alloc.num_pages), tokens // page)  # random whole device pages
        slots = np.add.outer(np.asarray(pages, dtype=np.int64) * page, np.arange(page)).reshape(-1)
        if index_on == "cuda":
            device: Any = torch.from_numpy(slots).cuda()
        else:
            device = torch.from_numpy(slots)
        host_pages = host.alloc_pages(tokens // page)
        assert host_pages is not None
        host_slots = host.page_slots(host_pages)
        torch.cuda.synchronize()
        busy(*mm)  # the decode step the copy queues behind
        prof = cProfile.Profile() if profile and k >= 3 else None
        torch.cuda.set_sync_debug_mode("error")
        try:
            if prof is not None:
                prof.enable()
            t0 = time.perf_counter()
            handle = engine.submit_d2h(pool, device, host, host_slots)
            dt = time.perf_counter() - t0
            if prof is not None:
                prof.disable()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        handle.wait()
        host.free_pages(host_pages)
        if k >= 3:  # the first submits build kernels, staging and driver state
            times.append(dt * 1e3)
            infos.append({k: v for k, v in getattr(handle, "info", {}).items() if isinstance(v, (int, float))})
        if prof is not None:
            profs.append(prof)
    if profs:  # every timed submit's profile together (their host times above include the profiler's cost)
        out = io.StringIO()
        pstats.Stats(*profs, stream=out).sort_stats("tottime").print_stats(30)
        prof_text = out.getvalue()
    keys = sorted({k for i in infos for k in i})
    return {
        "tokens": tokens,
        "page": page,
        "index_on": index_on,
        "backend": getattr(handle, "backend", None),
        "host_ms": {"median": statistics.median(times), "min": min(times), "max": max(times)},
        "info_median": {k: statistics.median(i[k] for i in infos if k in i) for k in keys},
        **({"profile": prof_text} if prof_text else {}),
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--backends", nargs="+", default=["auto", "triton", "dma"])
    ap.add_argument("--index-on", nargs="+", default=["cpu", "cuda"], choices=["cpu", "cuda"])
    ap.add_argument(
        "--launcher",
        nargs="+",
        default=["off"],
        choices=["off", "on"],
        help="the direct kernel launched through Triton's JIT (off) or its compiled handle (on)",
    )
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--busy-ms", type=float, default=20.0)
    ap.add_argument("--profile", action="store_true", help="then a profiled pass of each configuration")
    ap.add_argument("--quick", action="store_true", help="4 layers, 256 tokens, 5 repeats: checks the script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    if args.quick:
        args.layers, args.tokens, args.repeats = 4, 256, 5
    kv = KVCacheConfig(num_layers=args.layers, kv_heads=8, head_dim=128, attention="mha", dtype=torch.bfloat16)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    busy(a, c, 10)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    busy(a, c, 50)
    end.record()
    end.synchronize()
    n_mm = max(1, round(args.busy_ms / (start.elapsed_time(end) / 50)))
    rows = []
    for page in args.pages:
        dev_slots = (16 * args.tokens // page + 1) * page
        pool = DeviceKVPool.create(kv, dev_slots, "cuda")
        dev_alloc = TokenSlotAllocator(dev_slots, page)
        host = HostKVPool(kv, 4 * args.tokens, page, layout="page_first", pin_memory=True)
        for backend, launcher in itertools.product(args.backends, args.launcher):
            if launcher == "on" and backend == "dma":
                continue  # the DMA pipeline launches no kernel
            use_launcher(launcher == "on")
            engine = CudaCopyEngine("cuda", backend=backend)
            for index_on in args.index_on:
                row = measure(
                    engine, pool, host, dev_alloc, args.tokens, page, index_on, args.repeats, (a, c, n_mm), False
                ) | {"asked_backend": backend, "layers": args.layers, "launcher": launcher}
                if args.profile:
                    row["profile"] = measure(
                        engine, pool, host, dev_alloc, args.tokens, page, index_on, args.repeats, (a, c, n_mm), True
                    )["profile"]
                rows.append(row)
                print(
                    f"page {page:3d} {backend:7s} ({row['backend']}, launcher {launcher}) indices on {index_on:4s}: "
                    f"host {row['host_ms']['median']:.3f} ms (min {row['host_ms']['min']:.3f}, max "
                    f"{row['host_ms']['max']:.3f})  {row['info_median']}",
                    flush=True,
                )
        use_launcher(False)
        del pool, host
        torch.cuda.empty_cache()
    targets = [
        {
            "name": f"submit host ms, {r['tokens']} tokens x {r['layers']} layers, page {r['page']}, "
            f"indices on {r['index_on']} (auto: {r['backend']}, launcher {r['launcher']})",
            "value": r["host_ms"]["median"],
            "limit": LIMIT_MS,
            "met": r["host_ms"]["median"] <= LIMIT_MS,
        }
        for r in rows
        if r["asked_backend"] == "auto"
    ]
    for t in targets:
        print(t)
    print(
        "wrote",
        write_result(
            "submit_cost",
            {
                "settings": {k: v for k, v in vars(args).items() if k != "out"},
                "busy_matmuls": n_mm,
                "rows": rows,
                "targets": targets,
            },
            args.out,
            quick=args.quick,
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
