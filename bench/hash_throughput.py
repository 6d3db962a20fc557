#!/usr/bin/env python3
"""Page-hash throughput on one CPU core (target: >= 20 M tokens/s at page size 64).

Writes JSON to bench/results/hash_throughput-<machine>.json (or --out; --quick: bench/results/quick/) with
platform and CPU info.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

from common import result_path  # noqa: E402

from kvfsm.dataplane.hashing import page_hashes  # noqa: E402

TARGET_TOKENS_PER_S = 20e6


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_slug() -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", f"{platform.machine()}-{cpu_model()}".lower()).strip("-")
    return slug or "unknown"


def naive(tokens: list[int], page_size: int) -> list[str]:
    out, last = [], None
    for i in range(0, len(tokens), page_size):
        h = hashlib.sha256()
        if last:
            h.update(bytes.fromhex(last))
        for t in tokens[i : i + page_size]:
            h.update(t.to_bytes(4, "little", signed=False))
        last = h.hexdigest()
        out.append(last)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=8 * 2**20, help="tokens per run (default 8 Mi)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--core", type=int, default=None, help="pin to this CPU core (default: the first allowed)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run (checks the script, not the numbers): results under bench/results/quick/",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    pinned_core = None
    if hasattr(os, "sched_setaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        pinned_core = args.core if args.core is not None else allowed[0]
        os.sched_setaffinity(0, {pinned_core})

    n = args.tokens // args.page_size * args.page_size
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128256, size=n, dtype=np.int64)  # ids as an engine holds them (int64)
    sample = [int(t) for t in tokens[: args.page_size * 64]]
    correct = page_hashes(tokens[: len(sample)], args.page_size) == naive(sample, args.page_size)

    page_hashes(tokens[: args.page_size * 1024], args.page_size)  # warm-up
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        page_hashes(tokens, args.page_size)
        times.append(time.perf_counter() - t0)
    best, median = min(times), statistics.median(times)
    result = {
        "benchmark": "hash_throughput",
        "quick": bool(args.quick),
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "machine": {
            "hostname": platform.node(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_model": cpu_model(),
            "cpu_count": os.cpu_count(),
            "pinned_core": pinned_core,
            "loadavg_1m_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "openssl": __import__("ssl").OPENSSL_VERSION,
            "numpy": np.__version__,
        },
        "page_size": args.page_size,
        "tokens": n,
        "pages": n // args.page_size,
        "reps": args.reps,
        "seconds": times,
        "tokens_per_s_best": n / best,
        "tokens_per_s_median": n / median,
        "target_tokens_per_s": TARGET_TOKENS_PER_S,
        "meets_target": n / median >= TARGET_TOKENS_PER_S,
        "matches_naive_sha256": correct,
    }
    out = result_path("hash_throughput", machine_slug(), quick=args.quick, out=args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"page_hashes: {n / median / 1e6:.1f} M tokens/s median, {n / best / 1e6:.1f} best "
        f"(page {args.page_size}, 1 core, target {TARGET_TOKENS_PER_S / 1e6:.0f}); "
        f"correct={correct} -> {out}"
    )
    return 0 if correct else 1


if __name__ == "__main__":
    raise SystemExit(main())
