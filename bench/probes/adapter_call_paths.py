"""What one SGLang adapter call costs on each of its paths, in bench/sglang_adapter_gpu.py's loop.

`offload_kv_cache(req)` takes one of three paths: the early exit (no chunk due, the request's view in the
adapter's quiet set), a due call from the quiet set (a chunk's host pages reserved), or the full path (a
request the adapter has no quiet view of: its first call, its admission). Each call of the loop is timed
alone and counted under its path, read from the adapter's state just before the call; so are
`finalize_release_on_finish` calls. The medians say which path a change would have to shorten.

    python3 bench/probes/adapter_call_paths.py [--live 4096] [--page 16] [--iterations 60] [--out FILE]
Writes bench/results/quick/adapter_call_paths-<machine>.json (or --out).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

import sglang_adapter_gpu as bench  # noqa: E402
from common import write_result  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--live", type=int, default=4096)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    ns: dict[str, list[int]] = {"quiet": [], "due": [], "full": [], "finalize": []}
    timed = [False]  # only the timed iterations count (not warm-up, set-up or teardown)
    store = tempfile.mkdtemp(prefix="kvfsm-call-paths-")
    try:
        loop = bench.probe_loop("adapter", args.live, args.page, args.device, store)
        adapter = loop.adapter
        quiet = adapter._views.quiet
        offload, finalize = adapter.offload_kv_cache, adapter.finalize_release_on_finish

        def path(req: Any) -> str:
            view = quiet.get(req)
            if view is None:
                return "full"
            return "quiet" if req.kv.kv_committed_len < view.due else "due"

        adapter.offload_kv_cache = _timed(offload, ns, timed, path)  # type: ignore[method-assign]
        adapter.finalize_release_on_finish = _timed(finalize, ns, timed, lambda req: "finalize")  # type: ignore[method-assign]
        bench.run_marked(loop, args.warmup, args.iterations, timed)
        loop.close()
    finally:
        shutil.rmtree(store, ignore_errors=True)
    paths = {}
    for name, times in ns.items():
        paths[name] = {
            "calls_per_iteration": round(len(times) / args.iterations, 1),
            "median_us": round(statistics.median(times) / 1e3, 3) if times else None,
            "mean_us": round(statistics.fmean(times) / 1e3, 3) if times else None,
        }
        print(f"{name:9s} {paths[name]}")
    print("wrote", write_result("adapter_call_paths", {"settings": vars(args), "paths": paths}, args.out, quick=True))
    return 0


def _timed(
    call: Callable[[Any], Any], into: dict[str, list[int]], timed: list[bool], path: Callable[[Any], str]
) -> Callable[[Any], Any]:
    """`call(req)`, timed alone and counted under the path it is about to take, while `timed` holds."""

    def wrapper(req: Any) -> Any:
        if not timed[0]:
            return call(req)
        name = path(req)
        t0 = time.perf_counter_ns()
        try:
            return call(req)
        finally:
            into[name].append(time.perf_counter_ns() - t0)

    return wrapper


if __name__ == "__main__":
    raise SystemExit(main())
