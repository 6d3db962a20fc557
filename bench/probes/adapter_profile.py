"""Where the SGLang adapter's scheduler-thread time goes: bench/sglang_adapter_gpu.py's loop (one mode, one
configuration) with cProfile around the timed manager calls only, the heaviest functions by own time.

    python3 bench/probes/adapter_profile.py [--mode adapter] [--live 4096] [--page 64] [--out FILE]
Writes bench/results/adapter_profile-<machine>.json (or --out): the loop's figures and the profile as text.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

import sglang_adapter_gpu as bench  # noqa: E402
from common import PROFILED_THREADS, write_result  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="adapter", choices=bench.MODES)
    ap.add_argument("--live", type=int, default=4096)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    opts = argparse.Namespace(
        device="cuda" if bench.torch.cuda.is_available() else "cpu",
        layers=2,
        kv_heads=8,
        head_dim=128,
        host_gb=8.0,
        step_ms=20.0,
        seed=0,
        store_root="/dev/shm" if Path("/dev/shm").is_dir() else None,
    )
    if opts.device == "cpu":
        opts.kv_heads, opts.head_dim, opts.step_ms, opts.host_gb = 1, 8, 0.0, 1.0
    store = tempfile.mkdtemp(prefix="kvfsm-adapter-profile-", dir=opts.store_root)
    try:
        loop = bench.Loop(args.mode, args.live, args.page, args.page, opts, store)
        prof = cProfile.Profile()
        check, offload = loop.check, loop.offload

        def profiled_check() -> None:
            prof.enable()
            try:
                check()
            finally:
                prof.disable()

        def profiled_offload(ended, batch_args=None):  # type: ignore[no-untyped-def]
            prof.enable()
            try:
                return offload(ended, batch_args)
            finally:
                prof.disable()

        loop.check, loop.offload = profiled_check, profiled_offload  # type: ignore[method-assign]
        out = loop.run(args.warmup, args.iterations)
        loop.close()
    finally:
        shutil.rmtree(store, ignore_errors=True)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    print(f"profiled: {PROFILED_THREADS}")
    print(text.getvalue())
    print(
        "wrote",
        write_result(
            "adapter_profile",
            {"settings": vars(args), "figures": out, "profile": text.getvalue(), "profiled_threads": PROFILED_THREADS},
            args.out,
            quick=opts.device == "cpu",
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
