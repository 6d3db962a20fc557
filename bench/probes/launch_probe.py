"""Host time of one direct-kernel launch: `JITFunction.run` against the compiled handle `_Launcher` keeps.

The copy that the engine's "triton" backend launches for an offload of `--tokens` tokens of Llama-3-8B KV at
`--layers` layers (page_first pinned host pool), with the indices already on the GPU, so only the launch is
timed. Each way launches `--repeats` times behind a busy compute stream; the figure is the median host time
of the call. Every launch's copy is checked against the reference gather, so a launch through a handle
compiled for other arguments would fail the probe rather than be timed.

    python3 bench/probes/launch_probe.py [--tokens 2048] [--layers 32] [--repeats 200] [--quick]
Writes bench/results/launch_probe-<machine>.json (quick runs: bench/results/quick/). Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import write_result  # noqa: E402

from kvfsm.dataplane import HostKVPool, KVCacheConfig  # noqa: E402
from kvfsm.dataplane.copy import triton_kernels as tk  # noqa: E402
from kvfsm.dataplane.pools.device_pool import DeviceKVPool  # noqa: E402


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and tk.HAVE_TRITON):
        print("needs CUDA and Triton")
        return 2
    if args.quick:
        args.tokens, args.layers, args.repeats = 256, 4, 20
    kv = KVCacheConfig(num_layers=args.layers, kv_heads=8, head_dim=128, attention="mha", dtype=torch.bfloat16)
    pool = DeviceKVPool.create(kv, 4 * args.tokens, "cuda")
    host = HostKVPool(kv, 2 * args.tokens, 16, layout="page_first", pin_memory=True)
    dview, hview = pool.token_view(), host.token_view()
    dview.copy_(torch.randn(dview.shape, device="cuda", dtype=dview.dtype))
    cfg = tk.default_config("page_first")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    results: dict[str, dict[str, float]] = {}
    tk._launch.enabled = True  # the launcher's compiled path, off in the engine until measured here
    for way in ("jit", "compiled"):
        times = []
        for k in range(args.repeats + 3):
            src = torch.randperm(dview.shape[2], device="cuda")[: args.tokens]
            dst = torch.randperm(hview.shape[2], device="cuda")[: args.tokens]
            if way == "jit":
                tk._launch._compiled.clear()  # every launch is a first one: kernel[grid] (compiled in-process)
            for _ in range(20):
                torch.mm(a, a, out=c)
            torch.cuda.set_sync_debug_mode("error")
            t0 = time.perf_counter()
            tk.kv_rows_copy(dview, src, hview, dst, cfg)
            dt = time.perf_counter() - t0
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
            if not torch.equal(hview[:, :, dst.cpu()], dview[:, :, src].cpu()):
                raise SystemExit(f"{way} launch {k}: the copy differs from the reference gather")
            if k >= 3:
                times.append(dt * 1e3)
        results[way] = {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}
        print(f"{way:9s} launch: median {results[way]['median_ms']:.4f} ms, min {results[way]['min_ms']:.4f} ms")
    if not tk._launch.enabled:
        raise SystemExit("this Triton's compiled handle refused the arguments: every launch went through kernel[grid]")
    saved = results["jit"]["median_ms"] - results["compiled"]["median_ms"]
    path = write_result(
        "launch_probe", {"settings": vars(args), "launch": results, "saved_ms": saved}, args.out, quick=args.quick
    )
    print(f"saved {saved:.4f} ms per launch -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
