"""kvfsm's SGLang adapter on a GPU server's layout: scheduler-thread time per iteration, offloads coalesced into
one copy per iteration against one copy per request, in one run.

SGLang 0.5.23's own `ReqToTokenPool`, `MHATokenToKVPool` and paged allocator live on the H200 (the
differential harness builds them, `harness.on_device("cuda")`); kvfsm's adapter drives them as SGLang's
scheduler does: a progress check at the start of each iteration, then `offload_kv_cache(req)` for every
request of the decode batch. A decode step's matmuls are queued on the compute stream first, so every copy
is submitted behind a busy GPU, as in serving. The timed calls run under
`torch.cuda.set_sync_debug_mode("error")`: any wait for the GPU fails the run. The baseline is the same
adapter with its `CoalescingCopyEngine` bypassed (each offload call submits its own copy through
`CudaCopyEngine`). The decode here advances lengths and allocates pages with SGLang's allocator, but writes
no KV: copies move whatever the buffers hold.

    tests/upstream/run_on_device.sh is the set-up; then: python3 bench/sglang_adapter_gpu.py [--quick] [--out F]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests" / "upstream"))

import harness  # noqa: E402  (the CUDA-only stand-ins first)
import torch  # noqa: E402
from common import write_result  # noqa: E402
from scenarios import ReqSpec, Scenario  # noqa: E402
from test_differential import _KvfsmProbe  # noqa: E402

from kvfsm.integrations.sglang import DecodeKVCacheOffloadManager  # noqa: E402


class Coalesced(DecodeKVCacheOffloadManager):
    @staticmethod
    def harness_probe() -> harness.Probe:
        return _KvfsmProbe()


class PerRequest(Coalesced):
    """The baseline: every offload call submits its own copy (the coalescing engine bypassed)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.manager.fx.copy_engine = self.manager.fx.copy_engine.inner


def _scenario(requests: int, steps: int, page: int, layers: int) -> Scenario:
    reqs = tuple(ReqSpec(f"r{i}", tuple(range(1000 * i + 1, 1000 * i + 1 + 4 * page + 3)), decode=steps)
                 for i in range(requests))
    per_req = 4 * page + steps + 4 * page
    return Scenario(name="gpu-bench", page_size=page, stride=page, requests=reqs, layers=layers, heads=8,
                    head_dim=128, device_tokens=requests * per_req + 16 * page, host_ratio=1.0, drain_steps=2)


def _decode(run: Any, spec: ReqSpec) -> None:
    """One decode position for the request: a new page from SGLang's allocator when it crosses one."""
    req = run.reqs[spec.rid]
    pos = len(req.origin_input_ids) + len(req.output_ids) - 1
    if pos >= req.kv.kv_allocated_len:
        slots = run.allocator.alloc(run.sc.page_size)
        start = req.kv.kv_allocated_len
        run.r2t.write((req.kv.req_pool_idx, slice(start, start + slots.numel())), slots.to(torch.int32))
        req.kv.kv_allocated_len = start + slots.numel()
    req.kv.kv_committed_len = pos + 1
    req.output_ids.append(spec.outputs()[len(req.output_ids)])


def _run(sc: Scenario, cls: type, decode_ms: float) -> dict[str, Any]:
    store = tempfile.mkdtemp(prefix="kvfsm-gpu-bench-")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    iters = []
    with harness.on_device("cuda"), harness.published(sc, 0, store):
        run = harness._Run(sc, cls, 0, harness._tp_group_world1(), store)
        for spec in sc.requests:
            run.admit(spec)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
        matmuls = max(1, int(decode_ms / ((time.perf_counter() - t0) * 1e3 / 20)))
        for t in range(1, sc.steps):
            run.settle()
            for _ in range(matmuls):  # the decode step the GPU is busy with while the scheduler offloads
                a @ a
            torch.cuda.set_sync_debug_mode("error")
            t0 = time.perf_counter()
            run.mgr.check_offload_progress()
            t1 = time.perf_counter()
            torch.cuda.set_sync_debug_mode(0)
            live = [spec for spec in sc.requests if spec.start < t <= spec.start + spec.decode]
            for spec in live:
                _decode(run, spec)
            torch.cuda.set_sync_debug_mode("error")
            t2 = time.perf_counter()
            for spec in live:
                run.mgr.offload_kv_cache(run.reqs[spec.rid])
            t3 = time.perf_counter()
            torch.cuda.set_sync_debug_mode(0)
            iters.append({"progress_us": (t1 - t0) * 1e6, "offload_us": (t3 - t2) * 1e6})
        torch.cuda.synchronize()
        run.settle()
        run.mgr.check_offload_progress()
        chunks = run.mgr.manager.metrics.chunks
        run.probe.close(run.mgr)
    total = sorted(i["progress_us"] + i["offload_us"] for i in iters)
    return {"manager": cls.__name__, "chunks": chunks, "decode_matmuls": matmuls,
            "per_iteration_us": {"mean": statistics.fmean(total), "p50": total[len(total) // 2], "max": total[-1]},
            "offload_calls_us_mean": statistics.fmean(i["offload_us"] for i in iters),
            "progress_check_us_mean": statistics.fmean(i["progress_us"] for i in iters)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--decode-ms", type=float, default=5.0, help="GPU time of the stand-in decode step")
    ap.add_argument("--quick", action="store_true", help="8 requests, 20 steps: checks the script, not the numbers")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.steps = [8], 20
    _run(_scenario(4, 2 * args.page, args.page, args.layers), Coalesced, args.decode_ms)  # warm-up: JIT, streams
    rows, ratios = [], {}
    for n in args.requests:
        sc = _scenario(n, args.steps, args.page, args.layers)
        pair = [_run(sc, PerRequest, args.decode_ms) | {"requests": n}, _run(sc, Coalesced, args.decode_ms) | {"requests": n}]
        assert pair[0]["chunks"] == pair[1]["chunks"] > 0
        ratios[str(n)] = pair[1]["per_iteration_us"]["mean"] / pair[0]["per_iteration_us"]["mean"]
        for row in pair:
            it = row["per_iteration_us"]
            print(f"{n:5d} live  {row['manager']:<10} per iteration {it['mean']:9.1f} us (p50 {it['p50']:8.1f}, max "
                  f"{it['max']:9.1f})  offload calls {row['offload_calls_us_mean']:8.1f} us  progress check "
                  f"{row['progress_check_us_mean']:8.1f} us  chunks {row['chunks']}")
        print(f"{n:5d} live  coalesced / per-request scheduler-thread time per iteration: {ratios[str(n)]:.2f}")
        rows += pair
    payload = {"config": vars(args) | {"heads": 8, "head_dim": 128, "dtype": str(harness.DTYPE)}, "rows": rows,
               "coalesced_over_per_request": ratios}
    print("wrote", write_result("sglang_adapter_gpu", payload, args.out, quick=args.quick))


if __name__ == "__main__":
    main()
