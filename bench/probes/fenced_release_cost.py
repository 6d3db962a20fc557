"""What a fenced release costs the scheduler's thread as the copy FIFO grows.

A request that finishes while its last chunk's copy is in flight (the usual case at a page's stride: most
finishing requests offloaded a chunk that iteration) is released at once, fenced by the copies that still read
its slots. Those are found in the manager's copy FIFO, which holds the iteration's chunks: 215 at 4096 live,
16/16, in bench/sglang_adapter_gpu.py. The real manager over the CPU twin of that case (`SimEngine`: the
deferred copy engine keeps every copy in flight until completed): `--fifo` requests each offload one chunk in
one `offload_batch`, then `--finishes` of them finish one `finalize` at a time, each timed alone, with the
FIFO unchanged in between, as between an iteration's offload calls and its progress check.

    python bench/probes/fenced_release_cost.py [--fifo 64 256 1024] [--finishes 16] [--repeats 5] [--out FILE]
Writes bench/results/quick/fenced_release_cost-<machine>.json (or --out): a CPU probe, never a verdict. Its one
target holds a fenced release to a cost that does not grow with the FIFO: the later finalizes' median at the
largest FIFO over the same at the smallest, at most 1.5.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import target, write_result  # noqa: E402

from kvfsm.verify.engine import SimEngine  # noqa: E402

PAGE = 16


def finalize_us(fifo: int, finishes: int) -> list[float]:
    """Each of `finishes` finalize calls timed alone, with `fifo` chunks in flight."""
    e = SimEngine(
        page_size=PAGE,
        stride=PAGE,
        device_slots=(fifo + 1) * 3 * PAGE,
        host_slots=(fifo + 1) * PAGE,
        rows=fifo + 1,
        max_context=4 * PAGE,
        backup_queue=fifo + 1,
        fenced=True,
        checked=False,
        num_layers=1,
        kv_heads=1,
        head_dim=1,
    )
    reqs = [e.admit(f"r{i}", PAGE) for i in range(fifo)]
    for req in reqs:
        assert req is not None
        for _ in range(PAGE + 1):  # a whole stride of decoded KV past the prompt's page
            assert e.decode(req)
    assert e.manager.offload_batch(reqs) == fifo and len(e.manager.fx.copy_fifo) == fifo
    out = []
    for req in reqs[:finishes]:
        t0 = time.perf_counter_ns()
        e.manager.finalize(req)
        out.append((time.perf_counter_ns() - t0) / 1e3)
        req.done = True
        e.live.remove(req)
    for req in list(e.live):
        e.end(req)
    e.settle()
    return out


def targets(rows: list[dict]) -> list[dict]:
    """A release's cost at the largest FIFO over the smallest's: flat when the FIFO is not walked per release."""
    small, large = min(rows, key=lambda r: r["fifo"]), max(rows, key=lambda r: r["fifo"])
    ratio = large["later_finalize_us_median"] / small["later_finalize_us_median"]
    return [target(f"later finalize, FIFO {large['fifo']} / FIFO {small['fifo']}", ratio, 1.5)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fifo", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--finishes", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for fifo in args.fifo:
        runs = [finalize_us(fifo, args.finishes) for _ in range(args.repeats)]
        first = [r[0] for r in runs]
        rest = [us for r in runs for us in r[1:]]
        row = {
            "fifo": fifo,
            "finishes": args.finishes,
            "repeats": args.repeats,
            "first_finalize_us_median": statistics.median(first),
            "later_finalize_us_median": statistics.median(rest),
        }
        rows.append(row)
        print(
            f"fifo {fifo:5d}: first finalize {row['first_finalize_us_median']:8.1f} us, "
            f"later ones {row['later_finalize_us_median']:8.1f} us (medians)"
        )
    path = write_result(
        "fenced_release_cost", {"settings": vars(args), "rows": rows, "targets": targets(rows)}, args.out, quick=True
    )
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
