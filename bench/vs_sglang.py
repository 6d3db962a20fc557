"""Scheduler-side cost of SGLang 0.5.23's decode offload manager and of kvfsm's drop-in, on the CPU.

Runs in `.venv-sglang` (`make upstream-venv`), over SGLang's own objects built by the differential harness
(tests/upstream/harness.py: its CUDA-only stand-ins, `ReqToTokenPool`, `MHATokenToKVPool`, paged allocator,
`RadixCache`, `HiCacheFile` in a temp dir). Each iteration is one decode step for every live request (the
KV write and token append are the harness's and not timed), then the calls SGLang's scheduler makes, timed:
`offload_kv_cache(req)` per request (`finalize_release_on_finish` at the end), inside the allocator's free group
as SGLang's result processing makes them, and one `check_offload_progress()`. Both managers' backups run on their own threads; before each progress check the
run waits for them to settle (untimed), so every iteration's check has the same work on both sides.

What it measures is Python bookkeeping plus the CPU copy into host memory, on both sides alike (upstream's
`direct` io backend is the harness's per-layer index copy on a CPU; kvfsm's is `CpuCopyEngine` over the same
per-layer buffers). It says nothing about a GPU: neither side's CUDA path runs here.

The figure is the ratio kvfsm / upstream of the scheduler-thread time per iteration (offload calls plus
the progress check), per live-request count, all counts in one run.

    .venv-sglang/bin/python bench/vs_sglang.py [--requests 1024 4096 --steps 64 --page 16 --stride 16] [--quick]
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

import harness  # noqa: E402  (installs the CUDA-only stand-ins before sglang is imported)
from common import write_result  # noqa: E402
from scenarios import ReqSpec, Scenario  # noqa: E402

from kvfsm.integrations.sglang import DecodeKVCacheOffloadManager  # noqa: E402


def _scenario(requests: int, steps: int, page: int, stride: int) -> Scenario:
    reqs = tuple(
        ReqSpec(f"r{i}", tuple(range(1000 * i + 1, 1000 * i + 1 + 4 * page + 3)), decode=steps) for i in range(requests)
    )
    per_req = 4 * page + steps + 4 * page
    return Scenario(
        name="bench",
        page_size=page,
        stride=stride,
        requests=reqs,
        layers=4,
        heads=2,
        head_dim=32,
        device_tokens=requests * per_req + 16 * page,
        host_ratio=1.0,
        drain_steps=2,
    )


def _run(sc: Scenario, cls: type) -> dict[str, Any]:
    store = tempfile.mkdtemp(prefix="kvfsm-vs-sglang-")
    offload_us: list[float] = []
    progress_us: list[float] = []
    with harness.published(sc, 0, store):
        run = harness._Run(sc, cls, 0, harness._tp_group_world1(), store)
        for spec in sc.requests:
            run.admit(spec)
        offloads = 0
        for t in range(1, sc.steps):
            run.settle()
            t0 = time.perf_counter()
            run.mgr.check_offload_progress()
            progress_us.append((time.perf_counter() - t0) * 1e6)
            live = [spec for spec in sc.requests if spec.start < t <= spec.start + spec.decode]
            for spec in live:
                run.decode(spec)
                if t == spec.start + spec.decode:
                    run.finish(spec)
            spent = 0.0
            with harness.free_group(run.allocator):  # as SGLang's process_batch_result_decode makes these calls
                for spec in live:
                    req = run.reqs[spec.rid]
                    t0 = time.perf_counter()
                    ok = run.mgr.offload_kv_cache(req)
                    if not ok and req.finished():
                        run.mgr.finalize_release_on_finish(req)
                    spent += time.perf_counter() - t0
                    offloads += bool(ok)
            if live:
                offload_us.append(spent * 1e6)
        run.settle()
        run.mgr.check_offload_progress()
        released = sum(r.kv.req_pool_idx is None for r in run.reqs.values())
        run.probe.close(run.mgr)
    return {
        "manager": f"{cls.__module__}.{cls.__qualname__}",
        "chunks": offloads,
        "released": released,
        "offload_calls_us_per_step": _stats(offload_us),
        "progress_check_us": _stats(progress_us),
    }


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "mean": statistics.fmean(xs),
        "p50": xs[len(xs) // 2],
        "p99": xs[min(len(xs) - 1, int(len(xs) * 0.99))],
        "n": len(xs),
    }


class _Adapter(DecodeKVCacheOffloadManager):
    @staticmethod
    def harness_probe() -> harness.Probe:
        from test_differential import _KvfsmProbe  # the differential test's probe: settle, close

        return _KvfsmProbe()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, nargs="+", default=[1024, 4096], help="live-request counts")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--stride", type=int, default=16)
    ap.add_argument(
        "--quick", action="store_true", help="4 and 8 requests, 32 steps: checks the script, not the numbers"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.steps = [4, 8], 32
    harness.warm()
    warm = _scenario(2, 2 * args.stride, args.page, args.stride)  # first-call costs (imports, native hash) out
    _run(warm, harness.UpstreamManager), _run(warm, _Adapter)
    rows, ratios = [], {}
    for n in args.requests:
        sc = _scenario(n, args.steps, args.page, args.stride)
        pair = [_run(sc, harness.UpstreamManager) | {"requests": n}, _run(sc, _Adapter) | {"requests": n}]
        assert pair[0]["chunks"] == pair[1]["chunks"] and pair[0]["released"] == pair[1]["released"] == n
        per_iter = [r["offload_calls_us_per_step"]["mean"] + r["progress_check_us"]["mean"] for r in pair]
        ratios[str(n)] = per_iter[1] / per_iter[0]
        for row in pair:
            o, p = row["offload_calls_us_per_step"], row["progress_check_us"]
            print(
                f"{n:5d} live  {row['manager']:<80} offload calls/step {o['mean']:9.1f} us (p99 {o['p99']:9.1f})  "
                f"progress check {p['mean']:8.1f} us (p99 {p['p99']:8.1f})  chunks {row['chunks']}"
            )
        print(f"{n:5d} live  kvfsm / upstream scheduler-thread time per iteration: {ratios[str(n)]:.2f}")
        rows += pair
    payload = {
        "config": vars(args)
        | {"layers": sc.layers, "heads": sc.heads, "head_dim": sc.head_dim, "dtype": str(harness.DTYPE)},
        "rows": rows,
        "kvfsm_over_upstream_per_iteration": ratios,
    }
    print("wrote", write_result("vs_sglang", payload, args.out, quick=args.quick))


if __name__ == "__main__":
    main()
