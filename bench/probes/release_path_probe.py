"""What freeing a request's device slots costs the scheduler's thread: the free given a torch tensor against the
same free given a numpy array, interleaved in one run, alone and beside a thread that runs Python.

The manager reads a request's slots from the request table's host mirror as a numpy array. `tensor` is the
free as a release made it before, through `torch.from_numpy` (as_index_tensor then reshapes and converts it,
two more torch calls, and the tensors are objects the garbage collector tracks); `array` hands the array over
(`as_index_array`: no torch call). The contender thread plays the backup worker: it hashes 128-byte token
pages, each chained on the last (sha256, as kvfsm's page hashes are), so any call that let go of the
interpreter lock would wait for it behind that thread.

  python bench/probes/release_path_probe.py [--page 16] [--pages 32] [--iters 3000] [--quick] [--out FILE]
Writes bench/results/release_path_probe-<machine>.json (quick runs: bench/results/quick/).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import target, write_result  # noqa: E402

from kvfsm.dataplane import TokenSlotAllocator  # noqa: E402


def _contend(stop: threading.Event, hashed: list[int]) -> None:
    """The backup worker's kind of work: chained sha256 over 128-byte pages, in pure Python calls."""
    last, page = bytes(32), bytes(128)
    while not stop.is_set():
        for _ in range(64):
            last = hashlib.sha256(last + page).digest()
        hashed[0] += 64


def _stats(us: list[float]) -> dict[str, float]:
    s = sorted(us)
    return {
        "median": statistics.median(s),
        "p99": s[int(0.99 * (len(s) - 1))],
        "max": s[-1],
        "mean": statistics.fmean(s),
    }


def run(page: int, pages: int, iters: int, contender: bool) -> dict[str, Any]:
    alloc = TokenSlotAllocator(num_slots=page * (pages * 4 + 1), page_size=page)
    times: dict[str, list[float]] = {"tensor": [], "array": []}
    stop, hashed = threading.Event(), [0]
    worker = threading.Thread(target=_contend, args=(stop, hashed), daemon=True) if contender else None
    if worker is not None:
        worker.start()
    t_start = time.perf_counter()
    try:
        for i in range(iters):
            got = alloc.alloc(page * pages)
            assert got is not None
            slots = got.numpy()
            path = "tensor" if i % 2 == 0 else "array"
            t0 = time.perf_counter()
            alloc.free(torch.from_numpy(slots) if path == "tensor" else slots)
            times[path].append((time.perf_counter() - t0) * 1e6)
    finally:
        stop.set()
        if worker is not None:
            worker.join()
    wall = time.perf_counter() - t_start
    return {
        "contender": "python" if contender else "none",
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
        "frees_per_path": iters // 2,
        "pages_hashed_per_s": hashed[0] / wall,
        **{f"{path}_us": _stats(us) for path, us in times.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page", type=int, default=16, help="slots a page")
    ap.add_argument("--pages", type=int, default=32, help="pages a request frees (32 of 16: 512 tokens)")
    ap.add_argument("--iters", type=int, default=3000, help="frees a run, alternating the two paths")
    ap.add_argument("--quick", action="store_true", help="a smoke run: results under bench/results/quick/")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    iters = min(args.iters, 200) if args.quick else args.iters
    torch.set_num_threads(1)
    rows = [run(args.page, args.pages, iters, contender) for contender in (False, True)]
    for r in rows:
        print(
            f"contender {r['contender']:6s}: tensor mean {r['tensor_us']['mean']:8.1f} us p99 "
            f"{r['tensor_us']['p99']:8.1f}; array mean {r['array_us']['mean']:8.1f} us p99 {r['array_us']['p99']:8.1f}"
        )
    busy = rows[1]
    targets = [
        target(
            "free given an array / given a tensor, mean, beside a thread running Python",
            busy["array_us"]["mean"] / busy["tensor_us"]["mean"],
            1.0,
        )
    ]
    path = write_result(
        "release_path_probe",
        {"settings": vars(args) | {"iters": iters}, "rows": rows, "targets": targets},
        args.out,
        quick=args.quick,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
