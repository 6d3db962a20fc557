"""Where the host time of transformers' offloading goes, per call, without a profiler's inflation.

bench/transformers_offload.py's workload (smaller by default). Per mode, a warm run and a run without
timers (its host times as the benchmark measures them: "untimed"); then per mode one run with a
perf_counter wrapper around each entry point and each function under it that could cost host time
(kvfsm's manager, machine, effects, pools and copy engine; the engine's own offload and restore). A
wrapper costs about a microsecond, so the per-call figures are within that of the unwrapped calls.
Also reads each kvfsm copy handle's `info` (validate / pre-launch / launched / submit milliseconds).

  python bench/probes/transformers_host_time.py [--requests 32 --new-tokens 128] [--tag TAG] [--out FILE]

Writes bench/results/transformers_host_time-<machine>[-TAG].json (or --out).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import transformers_offload as tob  # noqa: E402
from common import write_result  # noqa: E402

TOTALS: dict[str, list[float]] = defaultdict(list)
INFO: dict[str, list[float]] = defaultdict(list)


def timed(owner: Any, attr: str, label: str) -> None:
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TOTALS[label].append(time.perf_counter() - t0)

    setattr(owner, attr, wrapper)


def instrument() -> None:
    from transformers.generation.continuous_batching import cache as tcache, offloading_manager as om

    import kvfsm.dataplane.copy.cuda as cuda_mod
    from kvfsm.dataplane import HostKVPool
    from kvfsm.dataplane.copy.staging import PinnedIndexStaging
    from kvfsm.dataplane.fences import SlotFence
    from kvfsm.generated.cb_swap import CbSwapMachine
    from kvfsm.integrations.transformers.effects import SwapEffects
    from kvfsm.integrations.transformers.manager import KvfsmOffloadingManager as K

    for name in ("_offload_to_cpu", "_reserve_cpu_blocks"):
        timed(om.OffloadingManager, name, f"engine.{name}")
    for name in ("evict_cached_blocks", "count_storable_requests", "free_blocks"):
        timed(tcache.PagedAttentionCache, name, f"cache.{name}")
    for name in (
        "poll",
        "_swap_out",
        "_record",
        "_ack",
        "_retire",
        "engine_free_blocks",
        "_engine_frees",
        "submit",
        "offload_requests",
        "restore_scheduled_requests",
    ):
        timed(K, name, f"manager.{name}")
    for name in ("preempt", "restore", "swap_out_done", "swap_in_done", "finish", "cancel"):
        timed(CbSwapMachine, name, f"machine.{name}")
    for name in (
        "start_swap_out",
        "release_device_blocks_fenced",
        "release_device_blocks",
        "start_swap_in",
        "free_host_blocks",
    ):
        timed(SwapEffects, name, f"effects.{name}")
    for name in ("alloc", "free"):
        timed(HostKVPool, name, f"host_pool.{name}")
    timed(SlotFence, "wait", "fence.wait")
    timed(PinnedIndexStaging, "upload_here", "staging.upload_here")
    for name in ("submit_d2h", "submit_h2d", "_launch", "_launch_rows", "choose_backend"):
        timed(cuda_mod.CudaCopyEngine, name, f"cuda.{name}")
    timed(cuda_mod.dma, "row_copies", "dma.row_copies")
    from kvfsm.dataplane.copy.cuda_driver import CudaDriver

    timed(CudaDriver, "run_batch_buffers", "driver.run_batch_buffers")
    for name in ("plan_copy", "kv_rows_copy"):
        timed(cuda_mod, name, f"cuda.{name}")

    launch = cuda_mod.CudaCopyEngine._launch

    def launch_info(self: Any, *a: Any, **k: Any) -> Any:
        h = launch(self, *a, **k)
        for key, v in (getattr(h, "info", None) or {}).items():
            if key.endswith("_ms"):  # times; the counts beside them (copies, driver_calls) are not
                INFO[f"{h.direction}.{key}"].append(float(v))
        return h

    cuda_mod.CudaCopyEngine._launch = launch_info


def table(d: dict[str, list[float]], scale: float) -> dict[str, dict[str, float]]:
    return {
        k: {
            "calls": len(v),
            "total_ms": round(sum(v) * scale, 3),
            "mean_us": round(statistics.mean(v) * scale * 1e3, 1),
            "median_us": round(statistics.median(v) * scale * 1e3, 1),
        }
        for k, v in sorted(d.items())
        if v
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["engine", "kvfsm_fenced", "kvfsm_fenced_own_stream"],
        help="engine, kvfsm, kvfsm_fenced; a kvfsm mode with the suffix _own_stream runs its copies on "
        "the CUDA engine's copy stream (SwapConfig(copy_on_compute_stream=False))",
    )
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    args = argparse.Namespace(
        quick=False,
        model="small",
        cuda_graphs=False,
        device="cuda",
        requests=a.requests,
        new_tokens=a.new_tokens,
        prompt_min=32,
        prompt_max=256,
        page_size=32,
        num_blocks=192,
        max_batch_tokens=1024,
        host_gib=4.0,
        repeats=1,
        soft_reset=False,
        sync_timing=False,
        checked=False,
        async_batching=None,
        out=None,
        kvfsm_backend="auto",
    )
    model = tob.build_model(args, "cuda")
    inputs = tob.workload(args, model.config.vocab_size)
    keys = (
        "offload_calls",
        "restore_calls",
        "time_in_offload_s",
        "time_offload_requests_s",
        "time_restore_s",
        "swapped_out",
        "restores",
        "throughput_tok_s",
    )
    out: dict[str, Any] = {"params": {"requests": a.requests, "new_tokens": a.new_tokens}, "modes": {}}

    def run(mode: str) -> dict[str, Any]:
        args.kvfsm_copy_stream = "own" if mode.endswith("_own_stream") else "compute"
        return tob.run(model, inputs, args, mode.removesuffix("_own_stream"), False)

    # First without timers (each mode after a warm run: kernels compiled, allocator caches filled): the
    # host times as the benchmark measures them; then each mode again with every timer in place.
    for mode in a.modes:
        run(mode)
        row = run(mode)
        out["modes"][mode] = {"untimed": {k: row[k] for k in keys}}
        print(mode, "untimed", json.dumps(out["modes"][mode]["untimed"]))
    instrument()
    for mode in a.modes:
        TOTALS.clear()
        INFO.clear()
        row = run(mode)
        res = out["modes"][mode]
        res.update({"row": {k: row[k] for k in keys}, "timers": table(TOTALS, 1e3), "submit_info_ms": table(INFO, 1.0)})
        print(mode, json.dumps(res["row"]))
        for k, v in res["timers"].items():
            print(
                f"  {k:40s} {v['calls']:6d} calls {v['total_ms']:9.3f} ms  mean {v['mean_us']:8.1f} us  "
                f"median {v['median_us']:8.1f} us"
            )
        for k, v in res["submit_info_ms"].items():
            print(
                f"  info {k:35s} {v['calls']:6d} mean {v['mean_us'] / 1e3:8.3f} ms median {v['median_us'] / 1e3:8.3f} ms"
            )
    print(f"wrote {write_result('transformers_host_time', out, a.out, tag=a.tag)}")


if __name__ == "__main__":
    main()
