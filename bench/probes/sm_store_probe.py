"""How fast can the GPU's SMs write pinned host memory? (A development probe for page-size-1 offload.)

The copy engine's scattered offload is either SM stores through unified addressing (the Triton kernel) or
DMA copies, one per contiguous host run (`bench/probes/dma_batch_probe.py`). Page-size-1 offload has host runs
of 64 KiB (page_first) or 2 KiB (layer_first), too short for the DMA engines, so it rests on SM stores.
This probe measures, in one run and against that run's contiguous DMA ceiling (`copy_` of 1 GiB):

  sm_contiguous   SM stores of 1 GiB into one contiguous pinned buffer: the SM-store ceiling itself,
                  for several block sizes and warp counts;
  sm_runs_<n>     the same bytes with the destination cut into runs of n bytes at shuffled places;
  tma_contiguous  Hopper's bulk tensor copy (TMA) storing shared-memory tiles into pinned memory, where
                  Triton and the driver allow it (the error is recorded otherwise).

Each result is verified bit-exact. Run on the device machine; JSON lands in bench/results/.

Decision it informed: page-size-1 offload rests on SM stores, which cap at ~0.95 of the DMA ceiling on
the H200, so no kernel-driven path reaches a 0.97 target there (recorded as the limit, not chased).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common
from common import write_result  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the probe needs a GPU with Triton
    triton = None


if triton is not None:

    @triton.jit
    def _runs_copy(src, dst, dst_run_start, RUN: tl.constexpr, BLOCK: tl.constexpr):
        """Program p copies BLOCK words of source run p // (RUN // BLOCK) to its destination run."""
        pid = tl.program_id(0).to(tl.int64)
        per_run = RUN // BLOCK
        run = pid // per_run
        off = (pid % per_run) * BLOCK + tl.arange(0, BLOCK)
        d0 = tl.load(dst_run_start + run)
        x = tl.load(src + run * RUN + off)
        tl.store(dst + tl.multiple_of(d0, 16) + off, x)

    @triton.jit
    def _tma_copy(src, dst, rows, COLS: tl.constexpr, BR: tl.constexpr):
        pid = tl.program_id(0)
        s = tl.make_tensor_descriptor(src, shape=[rows, COLS], strides=[COLS, 1], block_shape=[BR, COLS])
        d = tl.make_tensor_descriptor(dst, shape=[rows, COLS], strides=[COLS, 1], block_shape=[BR, COLS])
        d.store([pid * BR, 0], s.load([pid * BR, 0]))


def _time(fn, reps: int) -> float:
    """Median ms of `fn` between CUDA events (after one warm-up call)."""
    fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return sorted(out)[len(out) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or triton is None:
        raise SystemExit("needs CUDA and Triton")
    words = int(args.gib * (1 << 30)) // 4
    src = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, device="cuda")
    dst = torch.empty(words, dtype=torch.int32, pin_memory=True)
    nbytes = words * 4
    rows = []

    def record(name: str, ms: float, ok: bool, **extra: object) -> None:
        gbps = nbytes / ms / 1e6
        rows.append({"case": name, "median_ms": ms, "GBps": gbps, "verified": ok, **extra})
        print(f"{name:28s} {gbps:6.1f} GB/s  ratio {gbps / ceiling:.3f}  ok={ok} {extra or ''}", flush=True)

    ceiling_ms = _time(lambda: dst.copy_(src, non_blocking=True), args.reps)
    ceiling = nbytes / ceiling_ms / 1e6
    print(f"DMA ceiling {ceiling:.1f} GB/s", flush=True)
    for run_bytes in (nbytes, 1 << 21, 1 << 16, 1 << 11):
        run = run_bytes // 4
        n_runs = words // run
        order = (
            torch.randperm(n_runs, device="cuda")
            if run_bytes < nbytes
            else torch.zeros(1, dtype=torch.int64, device="cuda")
        )
        starts = (order * run).to(torch.int64)
        for block, warps in ((512, 4), (1024, 4), (2048, 8), (4096, 8)):
            if run % block:
                continue
            grid = (words // block,)
            dst.zero_()
            ms = _time(lambda: _runs_copy[grid](src, dst, starts, RUN=run, BLOCK=block, num_warps=warps), args.reps)
            torch.cuda.synchronize()
            ok = bool(torch.equal(dst.view(n_runs, run)[order.cpu()], src.view(n_runs, run).cpu()))
            name = "sm_contiguous" if run_bytes == nbytes else f"sm_runs_{run_bytes}"
            record(name, ms, ok, block_words=block, num_warps=warps)
    try:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        cols = 256  # 1 KiB rows
        rows_n = words // cols
        for br in (64, 128):
            dst.zero_()
            grid = (rows_n // br,)
            ms = _time(lambda: _tma_copy[grid](src, dst, rows_n, COLS=cols, BR=br), args.reps)
            torch.cuda.synchronize()
            record("tma_contiguous", ms, bool(torch.equal(dst, src.cpu())), block_rows=br)
    except Exception as exc:  # the probe's answer is then "not available here"
        rows.append(
            {
                "case": "tma_contiguous",
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "trace": traceback.format_exc()[-2000:],
            }
        )
        print("tma_contiguous failed:", type(exc).__name__, str(exc)[:300], flush=True)
    path = write_result(
        "sm_store_probe",
        {
            "bytes": nbytes,
            "reps": args.reps,
            "dma_ceiling_GBps": ceiling,
            "rows": [{**r, "ratio": r["GBps"] / ceiling} if "GBps" in r else r for r in rows],
        },
        args.out,
    )
    print(f"-> {path}")


if __name__ == "__main__":
    main()
