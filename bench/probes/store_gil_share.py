"""What a store's page writes take from the scheduler thread: FileStorage in the scheduler's process against
the same store in a child process (ProcessStorage), and against no store at all.

A backup thread writes one decode iteration's pages per batch, as the backup worker does, as fast as the
store takes them. Meanwhile the main thread plays the scheduler: each iteration a busy phase of pure-Python
work (dict and list operations, what a manager call is made of; `--busy-ms` alone), timed, then a wait for
the decode step (`--idle-ms`). The busy phase holds the interpreter lock throughout, so what stretches it is
the lock going to the store's threads (or, where cores are short, the CPU going to the store's process).
Per mode: the busy phase's median, p99 and max against the same phase with no store running, in one run; the pages per second each store wrote meanwhile; and the CPU seconds per page spent in
the scheduler's process outside the main thread (the share of the interpreter a store can take). Modes:
`MODES` below. `--hashed-keys` makes the backup thread hash each batch's token ids into its keys, as the
backup worker does, so that what a store keeps up with includes the hashing's share of the interpreter.

    python3 bench/probes/store_gil_share.py [--layers 2] [--page 64] [--batch 64] [--writers 4] [--seconds 8]
Writes bench/results/quick/store_gil_share-quick-<machine>.json on a CPU host, bench/results/store_gil_share-
<machine>.json on a GPU host (or --out).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
sys.path.insert(1, str(BENCH.parent))

from common import target, write_result  # noqa: E402

from kvfsm.dataplane import FileStorage, HostKVPool, KVCacheConfig  # noqa: E402
from kvfsm.dataplane.hashing import page_hashes  # noqa: E402
from kvfsm.dataplane.storage import ProcessStorage, ShardedStorage  # noqa: E402

MODES = {
    "none": "no store: the scheduler alone",
    "file": "FileStorage in this process (the default store)",
    "process": "ProcessStorage over a shared host pool: the child reads the pages in place",
    "process-staged": "ProcessStorage over an ordinary pool: pages gathered here into the staging buffer",
    "sharded": "ShardedStorage of --processes ProcessStorage children over the shared pool, the keys sharded",
}


def unit(n: int) -> int:
    """One slice of scheduler-like Python: dict lookups and writes, list appends, attribute-free arithmetic."""
    d: dict[int, int] = {}
    acc: list[int] = []
    for i in range(n):
        d[i & 255] = d.get(i & 255, 0) + i
        acc.append(i ^ 7)
    return len(acc) + len(d)


def _timed(fn: Any, *a: Any) -> float:
    t = time.perf_counter()
    fn(*a)
    return (time.perf_counter() - t) * 1e3


def other_threads_cpu_s() -> float:
    """CPU seconds of every thread of this process but the main one (from /proc; 0 where there is none)."""
    main = threading.main_thread().native_id
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tasks:
        if int(tid) == main:
            continue
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def run_mode(
    mode: str, pools: dict[bool, HostKVPool], args: argparse.Namespace, root: Path, work: int
) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = args.pin and len(cores) > 1
    if pin:  # what starts now (store threads, the child) inherits the other cores; the main thread keeps one
        os.sched_setaffinity(0, cores[1:])
    store: Any = None
    if mode == "file":
        store = FileStorage(root / mode, model_name="probe", writers=args.writers)
    elif mode.startswith("process"):
        store = ProcessStorage(functools.partial(FileStorage, root / mode, model_name="probe", writers=args.writers))
    elif mode == "sharded":
        store = ShardedStorage.of(
            functools.partial(
                ProcessStorage, functools.partial(FileStorage, root / mode, model_name="probe", writers=args.writers)
            ),
            args.processes,
        )
    pool = pools[mode in ("process", "sharded")]  # the shared pool only where the children read it in place
    stop = threading.Event()
    written = [0]
    backup_cpu = [0.0]

    def backups() -> None:
        c0 = time.thread_time()
        slots = pool.page_slots(list(range(args.batch)))
        rng = random.Random(0)
        tokens = [rng.randrange(1 << 17) for _ in range(args.batch * args.page)]
        while not stop.is_set():
            if args.hashed_keys:  # as the backup worker does: the pages' chained hashes of their token ids (a
                # fresh prior each batch: new keys, so every page is a real write)
                keys = page_hashes(tokens, args.page, secrets.token_hex(32))
            else:
                keys = [secrets.token_hex(32) for _ in range(args.batch)]  # new keys: every page is a real write
            ok = store.batch_set_from_host(keys, pool, slots)
            written[0] += sum(ok)
        backup_cpu[0] = time.thread_time() - c0

    cpu0 = other_threads_cpu_s()
    thread = threading.Thread(target=backups, name="backup") if store is not None else None
    if thread is not None:
        thread.start()
        time.sleep(0.5)  # past the store's start-up (its writer threads, the child's first batch)
    if pin:
        os.sched_setaffinity(0, cores[:1])
    w0, t0 = written[0], time.perf_counter()
    times = []
    while time.perf_counter() - t0 < args.seconds:
        a = time.perf_counter()
        unit(work)  # one scheduler iteration's Python: args.busy_ms alone
        times.append((time.perf_counter() - a) * 1e3)
        if args.idle_ms:
            time.sleep(args.idle_ms / 1e3)  # the scheduler waits for the decode step
    elapsed = time.perf_counter() - t0
    pages_written = written[0] - w0
    stop.set()
    if thread is not None:
        thread.join()
    cpu = other_threads_cpu_s() - cpu0 + backup_cpu[0]  # the backup thread has ended: its own count
    if store is not None:
        store.close()
    if pin:
        os.sched_setaffinity(0, cores)
    shutil.rmtree(root / mode, ignore_errors=True)
    times.sort()
    return {
        "mode": mode,
        "iterations": len(times),
        "busy_ms": {
            "median": statistics.median(times),
            "p99": times[int(0.99 * (len(times) - 1))],
            "max": times[-1],
            "mean": statistics.fmean(times),
        },
        "pages_per_s": pages_written / elapsed,
        "mb_per_s": pages_written * pool.page_nbytes / elapsed / 1e6,
        "other_threads_cpu_ms_per_page": cpu * 1e3 / pages_written if pages_written else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2, help="Llama-3-8B rows (8 KV heads of 128, bf16), this many layers")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64, help="pages per store call (one iteration's chunks)")
    ap.add_argument("--writers", type=int, default=4, help="FileStorage writer threads, in either process")
    ap.add_argument("--seconds", type=float, default=8.0, help="timed seconds per mode")
    ap.add_argument(
        "--busy-ms",
        type=float,
        default=4.0,
        help="the scheduler's Python per iteration, alone (what kvfsm's batch door costs at 4096 live)",
    )
    ap.add_argument(
        "--idle-ms",
        type=float,
        default=16.0,
        help="then it waits this long for the decode step (0: the thread never waits)",
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="the main thread on a core of its own, the store's threads "
        "and process on the others: what is left is the interpreter lock, not a shortage of cores",
    )
    ap.add_argument("--store-root", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--processes", type=int, default=4, help="children of the sharded mode")
    ap.add_argument(
        "--hashed-keys",
        action="store_true",
        help="the backup thread hashes each batch's token ids "
        "into its keys (page_hashes), as the backup worker does, instead of drawing random keys",
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    kv = KVCacheConfig(num_layers=args.layers, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    pools = {}
    for shared in (False, True):  # pinned where there is CUDA, as the manager's pool is
        pool = HostKVPool(kv, args.batch * args.page, args.page, layout="page_first", shared=shared)
        assert pool.allocator.alloc_pages(args.batch) == list(range(args.batch))
        pool.kv_buffer.view(torch.int16).random_()
        pools[shared] = pool
    work = 1000
    while True:  # the busy phase's size: args.busy_ms alone (median of 5)
        took = statistics.median(_timed(unit, work) for _ in range(5))
        if took >= args.busy_ms / 2:
            work = max(1, int(work * args.busy_ms / took))
            break
        work *= 2
    root = Path(tempfile.mkdtemp(prefix="kvfsm-store-gil-", dir=args.store_root))
    try:
        rows = [run_mode(mode, pools, args, root, work) for mode in args.modes]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = next((r for r in rows if r["mode"] == "none"), None)
    targets = []
    for r in rows:
        if base is not None and r is not base:
            r["median_vs_none"] = r["busy_ms"]["median"] / base["busy_ms"]["median"]
            r["p99_vs_none"] = r["busy_ms"]["p99"] / base["busy_ms"]["p99"]
        print(
            f"{r['mode']:14s} busy phase median {r['busy_ms']['median']:.3f} ms p99 {r['busy_ms']['p99']:.3f} "
            f"max {r['busy_ms']['max']:.3f}; {r['pages_per_s']:.0f} pages/s ({r['mb_per_s']:.0f} MB/s); "
            f"other threads' CPU {r['other_threads_cpu_ms_per_page'] or 0:.3f} ms/page",
            flush=True,
        )
    print(f"(modes: {MODES})")
    process = next((r for r in rows if r["mode"] == "process"), None)
    if process is not None and base is not None:
        # what the store in a child process may cost the scheduler's busy phase, next to running none
        targets.append(
            target(
                "busy-phase median with the store in a child process / with no store", process["median_vs_none"], 1.1
            )
        )
    quick = args.quick or not torch.cuda.is_available()
    path = write_result(
        "store_gil_share",
        {"settings": {**vars(args), "unit_work": work}, "rows": rows, "targets": targets},
        args.out,
        quick=quick,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
