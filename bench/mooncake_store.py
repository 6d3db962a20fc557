"""Batch put / get through kvfsm's MooncakeStorage against the raw Mooncake client, in the same run.

A mooncake_master is started on free loopback ports (traffic stays on 127.0.0.1: MC_TE_FILTERS=lo,
MC_TCP_BIND_ADDRESS) and one client mounts a segment. For each page size, repetitions alternate between:

  raw put     client.batch_put_from(keys, ptrs, sizes) from a registered buffer of pages
  kvfsm put   MooncakeStorage.batch_set(keys, pages)   (the pages are rows of such a buffer)
  raw get     client.batch_get_into(keys, ptrs, sizes) into a registered buffer
  kvfsm get   MooncakeStorage.batch_get(keys)          (returns one tensor per page; dropped after use)

plus, for reference, kvfsm's zero-copy put straight from a registered HostKVPool (batch_set_from_host), the
manager's own path (HostKVPool.get_pages_bytes, then batch_set; a few repetitions), and kvfsm's time per
batch against a stand-in client that answers at once (what kvfsm adds, with no transfer). Keys are removed between puts
(untimed) so every put writes. Overhead = median over repetitions of kvfsm time / raw time - 1 (the two run
back to back in each repetition, order alternating); the target is <= 10%.

  python bench/mooncake_store.py [--reps 41] [--segment-mib 1536] [--sizes 256K:64,1M:64,4M:32]

On a shared machine run it at a higher priority (nice -n -10) so other jobs disturb both sides less.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.update({"MC_TE_FILTERS": "lo", "MC_TCP_BIND_ADDRESS": "127.0.0.1"})

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

from kvfsm.dataplane import HostKVPool, KVCacheConfig  # noqa: E402
from kvfsm.dataplane.storage.mooncake import MooncakeStorage, master_binary, master_command  # noqa: E402

TARGET_OVERHEAD = 0.10
SLOW_REPS = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_master(log: Path) -> tuple[subprocess.Popen, str, str]:
    binary = master_binary()
    if binary is None:
        sys.exit("mooncake_master not found: pip install 'kvfsm[mooncake]'")
    rpc, http, metrics = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        master_command(binary, rpc, http, metrics),
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 20
    for port in (rpc, http):
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    sys.exit(f"mooncake_master did not start; see {log}")
                time.sleep(0.05)
    return proc, f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"


def kv_for(page_nbytes: int) -> tuple[KVCacheConfig, int]:
    """A bf16 MHA shape (8 layers, 8 KV heads, head_dim 128: 32 KiB per token) and the tokens per page."""
    kv = KVCacheConfig(num_layers=8, kv_heads=8, head_dim=128, attention="mha", dtype=torch.bfloat16)
    return kv, page_nbytes // kv.bytes_per_token


def bench_size(s: MooncakeStorage, page_nbytes: int, pages: int, reps: int) -> dict:
    client = s.client
    s.page_nbytes = page_nbytes  # one deployment, one page size (the constructor's page_nbytes)
    kv, page_size = kv_for(page_nbytes)
    assert page_size * kv.bytes_per_token == page_nbytes
    src = torch.randint(0, 256, (pages, page_nbytes), dtype=torch.uint8)
    dst = torch.empty((pages, page_nbytes), dtype=torch.uint8)
    dst.fill_(0)  # fault the destination in once, as a long-lived registered buffer would be
    s.register_buffer(src)
    s.register_buffer(dst)
    host = HostKVPool(kv, pages * page_size, page_size)
    host.kv_buffer.view(torch.uint8).view(-1)[:].copy_(src.view(-1)[: host.nbytes])
    host_idx = host.alloc(pages * page_size)
    s.register_host_pool(host)
    ptrs = [src.data_ptr() + i * page_nbytes for i in range(pages)]
    dptrs = [dst.data_ptr() + i * page_nbytes for i in range(pages)]
    sizes = [page_nbytes] * pages
    rows = list(src.unbind(0))
    tag = f"p{page_nbytes}"
    raw_keys = [f"raw-{tag}-{i}" for i in range(pages)]
    kv_keys = [f"kvfsm-{tag}-{i}" for i in range(pages)]
    host_keys = [f"host-{tag}-{i}" for i in range(pages)]
    mgr_keys = [f"mgr-{tag}-{i}" for i in range(pages)]
    mk = [o for k in kv_keys for o in s.key_of(k)]  # a page is a K and a V object

    def clear() -> None:
        client.batch_remove(raw_keys, True)
        client.batch_remove(mk, True)
        client.batch_remove([o for k in host_keys + mgr_keys for o in s.key_of(k)], True)

    t: dict[str, list[float]] = {
        k: []
        for k in (
            "raw_put",
            "kvfsm_put",
            "raw_get",
            "kvfsm_get",
            "kvfsm_put_from_host",
            "kvfsm_put_via_get_pages_bytes",
        )
    }
    for rep in range(reps + 2):  # two warm-up rounds, not recorded
        clear()
        order = ("raw", "kvfsm") if rep % 2 == 0 else ("kvfsm", "raw")
        for who in order:
            t0 = time.perf_counter()
            if who == "raw":
                rc = client.batch_put_from(raw_keys, ptrs, sizes)
                ok = all(r == 0 for r in rc)
            else:
                ok = all(s.batch_set(kv_keys, rows))
            dt = time.perf_counter() - t0
            assert ok, f"{who} put failed"
            if rep >= 2:
                t[f"{who}_put"].append(dt)
        for who in order:
            t0 = time.perf_counter()
            if who == "raw":
                rc = client.batch_get_into(raw_keys, dptrs, sizes)
                ok = all(r == page_nbytes for r in rc)
            else:
                got = s.batch_get(kv_keys)
                ok = all(g is not None for g in got)
                del got
            dt = time.perf_counter() - t0
            assert ok, f"{who} get failed"
            if rep >= 2:
                t[f"{who}_get"].append(dt)
        t0 = time.perf_counter()
        ok = all(s.batch_set_from_host(host_keys, host, host_idx))
        dt = time.perf_counter() - t0
        assert ok
        if rep >= 2:
            t["kvfsm_put_from_host"].append(dt)
        if rep < 2 + SLOW_REPS:  # the manager's serialising path is slow: a few repetitions suffice
            t0 = time.perf_counter()
            ok = all(s.batch_set(mgr_keys, list(host.get_pages_bytes(host_idx).unbind(0))))
            dt = time.perf_counter() - t0
            assert ok
            if rep >= 2:
                t["kvfsm_put_via_get_pages_bytes"].append(dt)
    # bit-exactness of what was measured
    assert all(torch.equal(g, r) for g, r in zip(s.batch_get(kv_keys), rows))
    assert all(torch.equal(g, r) for g, r in zip(s.batch_get(host_keys), host.get_pages_bytes(host_idx).unbind(0)))
    clear()
    s.unregister_buffer(src)
    s.unregister_buffer(dst)
    s.unregister_host_pool(host)
    nbytes = pages * page_nbytes
    out: dict = {"page_nbytes": page_nbytes, "pages_per_batch": pages, "batch_bytes": nbytes, "reps": reps}
    for k, v in t.items():
        if not v:
            continue
        med = statistics.median(v)
        out[k] = {
            "median_ms": med * 1e3,
            "min_ms": min(v) * 1e3,
            "pages_per_s": pages / med,
            "GB_per_s": nbytes / med / 1e9,
        }
    for op in ("put", "get"):
        # Paired: each repetition times raw and kvfsm back to back (order alternating), so the median of the
        # per-repetition ratios cancels the drift of a shared machine; medians and minima for reference.
        ratios = sorted(m / r for m, r in zip(t[f"kvfsm_{op}"], t[f"raw_{op}"]))
        out[f"{op}_overhead"] = statistics.median(ratios) - 1
        out[f"{op}_overhead_of_medians"] = out[f"kvfsm_{op}"]["median_ms"] / out[f"raw_{op}"]["median_ms"] - 1
        out[f"{op}_overhead_of_minima"] = out[f"kvfsm_{op}"]["min_ms"] / out[f"raw_{op}"]["min_ms"] - 1
    return out


class _NoIO:
    """Stand-in client answering at once: what kvfsm itself adds per batch, without the transfer."""

    def batch_put_from(self, keys, ptrs, sizes, cfg=None):  # type: ignore[no-untyped-def]
        return [0] * len(keys)

    def batch_get_into(self, keys, ptrs, sizes):  # type: ignore[no-untyped-def]
        return list(sizes)

    def close(self) -> int:
        return 0


def python_overhead(page_nbytes: int, pages: int, reps: int = 200) -> dict:
    s = MooncakeStorage("127.0.0.1:1", client=_NoIO(), model_name="bench/model", page_nbytes=page_nbytes)
    rows = list(torch.zeros((pages, page_nbytes), dtype=torch.uint8).unbind(0))
    keys = [f"{i:064x}" for i in range(pages)]
    out = {}
    for name, fn in (
        ("batch_set", lambda: s.batch_set(keys, rows)),
        ("batch_get", lambda: s.batch_get(keys)),
        ("bounded_call_only", lambda: s._call(lambda: None)),
    ):
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[f"{name}_us_median"] = statistics.median(ts) * 1e6
        out[f"{name}_us_min"] = min(ts) * 1e6
    s.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=41)
    ap.add_argument("--segment-mib", type=int, default=1536)
    ap.add_argument("--sizes", default="256K:64,1M:64,4M:32", help="page size:pages per batch, comma separated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cases = []
    for item in args.sizes.split(","):
        size, n = item.split(":")
        mult = {"K": 1 << 10, "M": 1 << 20}.get(size[-1], 1)
        cases.append((int(size.rstrip("KM")) * mult, int(n)))
    load_before = os.getloadavg()
    logdir = Path(tempfile.mkdtemp(prefix="kvfsm-mooncake-bench-"))
    proc, master, metadata = start_master(logdir / "master.log")
    try:
        s = MooncakeStorage(
            master,
            metadata,
            model_name="bench/model",
            global_segment_size=args.segment_mib << 20,
            local_buffer_size=64 << 20,
            read_pool_bytes=512 << 20,
            op_timeout_s=60,
        )
        try:
            runs = []
            for nbytes, pages in cases:
                r = bench_size(s, nbytes, pages, args.reps)
                r["kvfsm_without_io"] = python_overhead(nbytes, pages)
                runs.append(r)
                print(
                    f"page {nbytes >> 10} KiB x {pages}: "
                    + "  ".join(
                        f"{k} {r[k]['GB_per_s']:.2f} GB/s" for k in r if isinstance(r[k], dict) and "GB_per_s" in r[k]
                    )
                    + f"  overhead put {r['put_overhead']:+.1%} get {r['get_overhead']:+.1%}"
                )
        finally:
            s.close()
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
    worst = max(max(r["put_overhead"], r["get_overhead"]) for r in runs)
    payload = {
        "setup": {
            "transport": "tcp over loopback (127.0.0.1)",
            "master": "mooncake_master, HTTP metadata",
            "client": f"one MooncakeDistributedStore, segment {args.segment_mib:d} MiB",
            "mooncake": _mooncake_version(),
            "nice": os.nice(0),
            "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        },
        "runs": runs,
        "target": {"overhead_max": TARGET_OVERHEAD},
        "worst_overhead": worst,
        "meets_target": worst <= TARGET_OVERHEAD,
    }
    path = write_result("mooncake_store", payload, args.out)
    print(f"worst overhead {worst:+.1%} (target <= {TARGET_OVERHEAD:.0%}) -> {path}")


def _mooncake_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "unknown"


if __name__ == "__main__":
    main()
