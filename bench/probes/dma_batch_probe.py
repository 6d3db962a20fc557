#!/usr/bin/env python3
"""Exploratory probe: can gather-to-staging + ONE cuMemcpyBatchAsync per chunk beat the Triton
kernel's scattered-PCIe ceiling (offload 0.93-0.947 of contiguous D2H, load-back 0.90-0.925 of H2D)?

Llama-3-8B-like KV (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB per token), --gib per batch (1),
random scattered host pages in a page_first host pool (as HostKVPool), page sizes 1, 16, 64. Sections:
  diagnostics  driver API version, which cuMemcpyBatchAsync symbols libcuda exports, what cuGetProcAddress
               returns for CUDA 12.8 / 13.0, sizeof(CUmemcpyAttributes); then a self-test of each ABI
               ("v2" = cuMemcpyBatchAsync_v2, 8 arguments; "v1" = cuMemcpyBatchAsync, 9 with failIdx), each
               in its own subprocess so a wrong signature that crashes is recorded, not fatal. The first
               ABI that passes is used below (or --batch-abi forces one; "off" = per-copy loop).
  ceilings     contiguous pinned D2H / H2D (bench/offload_bandwidth.py's helper), best of >= 10.
  dma          pure DMA: N copies of S bytes (S in --sizes) between a contiguous device buffer and random
               S-byte slots of the pinned host pool; one batch call on 1 stream, split over 2 and 4
               streams, with flags=PREFER_OVERLAP_WITH_COMPUTE, and the one-cuMemcpyAsync-per-copy loop.
               GPU time by CUDA events; CPU submit time of the batch call(s) beside it.
  pipeline     the full path. Offload: a kernel gathers chunk k of the device pages into a staging buffer
               laid out like the host pool while copy stream(s) move chunk k-1 with one batched call per
               chunk and stream. Load-back: batched H2D into staging, then a scatter kernel into scattered
               device slots. Chunks of --chunks-mib; 1/2/4 copy streams, each chunk "split" over them or
               chunks dealt round-robin ("rr"). Planning (runs -> flat copy arrays) is timed apart (plan_ms).
  baselines    the Triton kernel straight into / out of the scattered host slots (today's best), and the
               gather / scatter kernels alone (device to device, what the pipeline has to hide).
ratio_median = this run's best contiguous-ceiling time / our median time (GB/s median / ceiling GB/s).
Every result is checked bit-exact (poisoned destination first). Each case is wrapped so a failure records
its error and the run goes on; --budget-s skips what is left once the run gets long. On a machine without
CUDA it runs a tiny CPU planning smoke instead (and --help / import work anywhere).
Its recorded results (bench/results/dma_batch_probe-*) came from an earlier version, before dma.py was split.

Decision it informed: the CUDA engine's staged "dma" pipeline (kvfsm/dataplane/copy/pipeline.py) and
the thresholds of its "auto" policy (AutoPolicy in kvfsm/dataplane/copy/cuda.py).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repo (bench/probes/ -> ..)
for p in (str(ROOT), str(ROOT / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import result_path  # noqa: E402
from offload_bandwidth import (  # noqa: E402
    Timer,
    contiguous_ceilings,
    machine_info,
    random_pages,
    same_bits,
    slug,
    stats,
)

from kvfsm.dataplane import HAVE_TRITON, DeviceKVPool, HostKVPool, KVCacheConfig  # noqa: E402
from kvfsm.dataplane.copy import cuda_driver, dma  # noqa: E402
from kvfsm.dataplane.copy.triton_kernels import default_config, kv_rows_copy  # noqa: E402

GiB, MiB, KiB = 2**30, 2**20, 2**10
DEVICE, PIN = "cuda", True  # where the measurement runs (a CPU simulation of the plumbing swaps these)


def parse_bytes(s: str) -> int:
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": KiB, "M": MiB, "G": GiB}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


Run = tuple[int, int, int]  # (position in the batch, first host slot, length in tokens), as dma.host_runs_array


def chunk_runs(runs: list[Run], bytes_per_token: int, chunk_bytes: int) -> list[tuple[int, int, list[Run]]]:
    """Whole runs grouped into chunks of about chunk_bytes: (first position, end position, runs). The probe's
    own chunking (the engine cuts runs at chunk edges instead: dma.chunk_bounds, dma.clip_runs)."""
    chunks: list[tuple[int, int, list[Run]]] = []
    cur: list[Run] = []
    size = 0
    for r in runs:
        cur.append(r)
        size += r[2] * bytes_per_token
        if size >= chunk_bytes:
            chunks.append((cur[0][0], cur[-1][0] + cur[-1][2], cur))
            cur, size = [], 0
    if cur:
        chunks.append((cur[0][0], cur[-1][0] + cur[-1][2], cur))
    return chunks


# ---- diagnostics of the batch API (no risky calls) -----------------------------------------------

BATCH_SYMBOLS = (
    "cuMemcpyBatchAsync",
    "cuMemcpyBatchAsync_v2",
    "cuMemcpyBatchAsync_ptsz",
    "cuMemcpyBatchAsync_v2_ptsz",
    "cuMemcpy3DBatchAsync",
    "cuMemcpy3DBatchAsync_v2",
    "cuGetProcAddress_v2",
    "cuMemcpyWithAttributesAsync",
)


def driver_diagnostics() -> dict[str, Any]:
    """Driver version, exported symbols and cuGetProcAddress answers, to pin down the ABI without calling it."""
    d: dict[str, Any] = {
        "torch_cuda": torch.version.cuda,
        "sizeof_CUmemcpyAttributes": ctypes.sizeof(cuda_driver.MemcpyAttributes),
        "sizeof_CUmemLocation": ctypes.sizeof(cuda_driver.MemLocation),
    }
    lib = ctypes.CDLL("libcuda.so.1")
    ver = ctypes.c_int(0)
    lib.cuDriverGetVersion(ctypes.byref(ver))
    d["driver_api_version"] = ver.value
    exported: dict[str, str | None] = {}
    for name in BATCH_SYMBOLS:
        fn = getattr(lib, name, None)
        exported[name] = hex(ctypes.cast(fn, ctypes.c_void_p).value or 0) if fn is not None else None
    d["exported"] = exported
    gpa = getattr(lib, "cuGetProcAddress_v2", None)
    if gpa is not None:
        gpa.argtypes = [
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.POINTER(ctypes.c_int),
        ]
        gpa.restype = ctypes.c_int
        proc: dict[str, Any] = {}
        for v in sorted({12080, 12090, 13000, ver.value}):
            pfn, status = ctypes.c_void_p(0), ctypes.c_int(-1)
            rc = gpa(b"cuMemcpyBatchAsync", ctypes.byref(pfn), v, 0, ctypes.byref(status))
            addr = pfn.value or 0
            same = [n for n, a in exported.items() if a is not None and int(a, 16) == addr]
            proc[str(v)] = {"rc": rc, "status": status.value, "ptr": hex(addr), "same_as_export": same}
        d["cuGetProcAddress(cuMemcpyBatchAsync)"] = proc
        d["note"] = (
            "status 0 = found; same_as_export tells which exported symbol cuGetProcAddress hands out "
            "for a CUDA version (12080 should be the 9-argument ABI, 13000 the 8-argument _v2); an empty "
            "list only means the export is a distinct stub"
        )
    try:
        import cuda.bindings as cb  # type: ignore[import-not-found]

        d["cuda_bindings"] = getattr(cb, "__version__", "present")
    except Exception as e:  # noqa: BLE001
        d["cuda_bindings"] = f"absent ({type(e).__name__})"
    try:
        d["batch_resolved_auto"] = cuda_driver.resolve_batch(lib, ver.value, "auto")[2]
    except Exception as e:  # noqa: BLE001
        d["batch_resolved_auto"] = repr(e)
    return d


def selftest(abi: str) -> dict[str, Any]:
    """Small batched copies through one ABI (run in a subprocess by the parent). Checks every variant."""
    out: dict[str, Any] = {"abi": abi, "ok": False}
    if not torch.cuda.is_available():
        out["error"] = "no CUDA"
        return out
    dev = torch.device("cuda")
    torch.cuda.init()
    drv = cuda_driver.CudaDriver(batch_abi=abi)
    out.update(resolved=drv.batch_abi, status=drv.batch_status, driver_api_version=drv.driver_version)
    if drv.batch_abi != abi:
        out["error"] = "ABI not resolvable here"
        return out
    stream = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(1)

    def trial(
        n: int, size: int, flags: int = 0, hint: str | None = None, on_stream: int | None = None
    ) -> dict[str, Any]:
        src = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen).to(dev)
        host = torch.zeros(4 * n * size, dtype=torch.uint8, pin_memory=True)
        back = torch.zeros_like(src)
        slots = torch.randperm(4 * n, generator=gen)[:n]
        h = host.data_ptr() + slots.numpy().astype(np.int64) * size
        s = src.data_ptr() + np.arange(n, dtype=np.int64) * size
        z = np.full(n, size, dtype=np.int64)
        f = dma.merge_adjacent(h, s, z, merge=False)
        b = dma.merge_adjacent(back.data_ptr() + np.arange(n, dtype=np.int64) * size, h, z, merge=False)
        sh = stream.cuda_stream if on_stream is None else on_stream
        r: dict[str, Any] = {"n": n, "size": size, "flags": flags, "hint": hint, "stream": sh}
        rc, fail = drv.batch_raw(f.dst, f.src, f.size, sh, flags, hint)  # type: ignore[arg-type]
        torch.cuda.synchronize()
        r.update(d2h_rc=rc, d2h_err=drv.error_string(rc) if rc else "", fail_idx=fail)
        r["d2h_ok"] = rc == 0 and torch.equal(host.view(-1, size)[slots], src.cpu().view(-1, size))
        if rc == 0:
            hint_back = "h2d" if hint else None
            rc2, fail2 = drv.batch_raw(b.dst, b.src, b.size, sh, flags, hint_back)  # type: ignore[arg-type]
            torch.cuda.synchronize()
            r.update(h2d_rc=rc2, h2d_err=drv.error_string(rc2) if rc2 else "", h2d_fail_idx=fail2)
            r["h2d_ok"] = rc2 == 0 and torch.equal(back, src)
        return r

    try:
        out["plain"] = trial(64, 4096)
        out["flags_overlap"] = trial(64, 4096, flags=cuda_driver.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)
        out["location_hints"] = trial(64, 4096, hint="d2h")
        out["many_small"] = trial(32768, 256)  # 32768 copies in one call
        out["null_stream"] = trial(8, 4096, on_stream=0)  # documented to be rejected (run_batch never does this)
        need = ("plain", "many_small")
        out["ok"] = all(out[k]["d2h_ok"] and out[k].get("h2d_ok") for k in need)
    except Exception as e:  # noqa: BLE001
        out["error"] = repr(e)
        out["traceback"] = traceback.format_exc()[-2000:]
    return out


def run_selftests(timeout: float) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for abi in ("v2", "v1"):
        t0 = time.perf_counter()
        try:
            p = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--selftest-abi", abi],
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=str(ROOT),
            )
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("SELFTEST ")), None)
            r: dict[str, Any] = (
                json.loads(line[len("SELFTEST ") :]) if line else {"ok": False, "error": "no result line"}
            )
            r["returncode"] = p.returncode  # negative: killed by that signal (-11 = SIGSEGV: wrong signature?)
            if p.returncode != 0 or not line:
                r["stderr_tail"] = p.stderr[-3000:]
                r["stdout_tail"] = p.stdout[-1000:]
        except subprocess.TimeoutExpired:
            r = {"ok": False, "error": f"timeout after {timeout} s"}
        r["wall_s"] = round(time.perf_counter() - t0, 2)
        res[abi] = r
        print(
            f"  selftest {abi}: ok={r.get('ok')} rc={r.get('returncode')} status={r.get('status', r.get('error'))}",
            flush=True,
        )
        for k in ("plain", "flags_overlap", "location_hints", "many_small", "null_stream"):
            if isinstance(r.get(k), dict):
                c = r[k]
                print(
                    f"    {k:15s} d2h rc={c.get('d2h_rc')} ok={c.get('d2h_ok')}  h2d rc={c.get('h2d_rc')} "
                    f"ok={c.get('h2d_ok')} {c.get('d2h_err') or c.get('h2d_err') or ''}",
                    flush=True,
                )
    return res


# ---- helpers ---------------------------------------------------------------------------------------


@contextmanager
def case(rows: list[dict[str, Any]], meta: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Yields a row (meta copied) that the body fills; an exception is recorded in it, not raised."""
    row = dict(meta)
    try:
        yield row
    except Exception as e:  # noqa: BLE001 - a probe keeps going and reports
        traceback.print_exc()
        row.update(error=repr(e)[:500], verified=False)
    rows.append(row)


class Poison:
    """Fill pinned host memory with 0xFF through plain D2H copies (fast; no CPU memset of GiBs)."""

    def __init__(self, device: torch.device, piece: int = 256 * MiB) -> None:
        self.buf = torch.full((piece,), 0xFF, dtype=torch.uint8, device=device)

    def host(self, t: torch.Tensor) -> None:
        flat = t.view(-1).view(torch.uint8)
        for a in range(0, flat.numel(), self.buf.numel()):
            b = min(a + self.buf.numel(), flat.numel())
            flat[a:b].copy_(self.buf[: b - a], non_blocking=True)
        torch.cuda.synchronize()


def row_line(r: dict[str, Any]) -> str:
    what = r.get("page_size", r.get("copy_bytes"))
    if r["section"] == "dma":
        what = f"{int(what) // KiB}K"
    gb = f"{r['GBps_median']:6.1f}" if "GBps_median" in r else "     -"
    ratio = f"{r['ratio_median']:.3f}" if "ratio_median" in r else "  -  "
    sub = f"{r['submit_ms_median']:7.2f}" if "submit_ms_median" in r else "      -"
    tail = r.get("error", "")[:60] if "error" in r else r.get("skipped", "")
    return (
        f"{r['section']:9s} {r['direction']:4s} {str(what):>5s} {r['variant']:14s} {r.get('streams', '-')!s:>2s} "
        f"{r.get('chunk_mib', '-')!s:>4s} | {gb} {ratio} {str(r.get('verified', '-')):5s} {sub} "
        f"{r.get('driver_calls', '-')!s:>6s} {r.get('copies', '-')!s:>6s} {tail}"
    )


# ---- sections --------------------------------------------------------------------------------------


class Probe:
    def __init__(
        self, args: argparse.Namespace, drv: cuda_driver.CudaDriver, out: Path, result: dict[str, Any]
    ) -> None:
        self.args, self.drv, self.out, self.result = args, drv, out, result
        self.device = torch.device(DEVICE)
        self.timer = Timer(True)
        self.reps = args.reps
        self.t_start = time.perf_counter()
        self.rows: list[dict[str, Any]] = result.setdefault("rows", [])
        self.poison = Poison(self.device)
        self.copy_streams = [torch.cuda.Stream() for _ in range(max(args.streams))]
        self.kern = torch.cuda.Stream()

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t_start > self.args.budget_s

    def write(self, complete: bool = False) -> None:
        self.result["complete"] = complete
        self.result["wall_s"] = round(time.perf_counter() - self.t_start, 1)
        self.result["timestamp"] = datetime.now(timezone.utc).isoformat()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.result, indent=2, default=str) + "\n")

    def timed(self, fn: Callable[[], None]) -> list[float]:
        secs = self.timer(fn, self.reps)
        torch.cuda.synchronize()
        return secs

    def add_stats(
        self,
        row: dict[str, Any],
        nbytes: int,
        secs: list[float],
        ceiling: float,
        cpu: list[float] | None = None,
        calls: list[int] | None = None,
    ) -> None:
        row.update(stats(nbytes, secs, ceiling))
        if cpu:
            row["submit_ms_median"] = statistics.median(cpu[-self.reps :]) * 1e3
        if calls:
            row["driver_calls"] = calls[-1]

    # -- b: pure batched DMA -----------------------------------------------------------------------
    def dma_section(self, host_buf: torch.Tensor, nbytes: int, ceil: dict[str, Any], gen: torch.Generator) -> None:
        a, drv, dev = self.args, self.drv, self.device
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 256)
        back = torch.empty_like(src)
        hb = host_buf.data_ptr()
        for size in a.sizes:
            n = nbytes // size
            nslots = host_buf.numel() // size
            slots = torch.randperm(nslots, generator=gen)[:n]
            slots_d = slots.to(dev)
            host_addr = hb + slots.numpy().astype(np.int64) * size
            dev_off = np.arange(n, dtype=np.int64) * size
            sizes = np.full(n, size, dtype=np.int64)
            plans = {
                "d2h": dma.merge_adjacent(host_addr, src.data_ptr() + dev_off, sizes, merge=False),
                "h2d": dma.merge_adjacent(back.data_ptr() + dev_off, host_addr, sizes, merge=False),
            }
            hview = host_buf[: nslots * size].view(nslots, size)

            def host_ok() -> bool:
                return same_bits(hview.to(dev).index_select(0, slots_d), src[: n * size].view(n, size))

            variants = [(f"batch_x{s}", s, 0) for s in a.streams]
            variants += [
                ("batch_overlapflag", 1, cuda_driver.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE),
                ("per_copy_loop", 1, 0),
            ]
            for direction in ("d2h", "h2d"):
                ceiling = ceil[direction]["GBps_best"]
                if direction == "h2d":  # the host slots must hold src: put it there by a CPU scatter (independent path)
                    hview.index_copy_(0, slots, src[: n * size].view(n, size).cpu())
                for name, ns, flags in variants:
                    meta = {
                        "section": "dma",
                        "direction": direction,
                        "copy_bytes": size,
                        "variant": name,
                        "streams": ns,
                        "copies": n,
                        "bytes": n * size,
                    }
                    with case(self.rows, meta) as row:
                        if self.over_budget():
                            row["skipped"] = "time budget"
                            continue
                        flat = plans[direction]
                        parts = dma.split_by_bytes(flat, ns)
                        streams = self.copy_streams[: len(parts)]
                        cpu: list[float] = []
                        calls: list[int] = []
                        loop = name == "per_copy_loop"

                        def fn() -> None:
                            main = torch.cuda.current_stream()
                            for s in streams:
                                s.wait_stream(main)
                            t0 = time.perf_counter()
                            c = 0
                            for s, p in zip(streams, parts):
                                if loop:
                                    c += drv.run_each(p.dst, p.src, p.size, s.cuda_stream)
                                else:
                                    c += drv.run_batch(p.dst, p.src, p.size, s.cuda_stream, flags=flags)
                            cpu.append(time.perf_counter() - t0)
                            calls.append(c)
                            for s in streams:
                                main.wait_stream(s)

                        if direction == "d2h":
                            self.poison.host(host_buf)
                        else:
                            back.fill_(0xFF)
                        secs = self.timed(fn)
                        self.add_stats(row, n * size, secs, ceiling, cpu, calls)
                        row["verified"] = (
                            host_ok() if direction == "d2h" else same_bits(back[: n * size], src[: n * size])
                        )
                    print("  " + row_line(row), flush=True)
            self.write()
        src = back = None  # freed before the next size (the closures above hold the names, so not `del`)

    # -- c: the pipelined path ----------------------------------------------------------------------
    def pipeline_section(
        self, dev: DeviceKVPool, host: HostKVPool, tokens: int, ps: int, ceil: dict[str, Any], gen: torch.Generator
    ) -> None:
        a, drv, device = self.args, self.drv, self.device
        cfg = dev.config
        k = tokens // ps
        nbytes = tokens * cfg.bytes_per_token
        src_slots = random_pages(dev.size // ps, k, ps, None, gen)
        dst_slots = random_pages(dev.size // ps, k, ps, src_slots.view(-1, ps)[:, 0] // ps, gen)
        host_slots = random_pages(host.size // ps, k, ps, None, gen)
        src_d, dst_d, host_d = (t.to(device) for t in (src_slots, dst_slots, host_slots))
        dview, hview = dev.token_view(), host.token_view()
        expected = dview.index_select(2, src_d)
        geo = dma.geometry(host, tokens)
        staging = torch.empty(geo.stage_shape, dtype=cfg.dtype, device=device)
        sview = geo.stage_view(staging)
        pos = torch.arange(tokens, device=device)
        kcfg = default_config(host.layout)
        c_d2h, c_h2d = ceil["d2h"]["GBps_best"], ceil["h2d"]["GBps_best"]
        base = {"section": "pipeline", "page_size": ps, "layout": host.layout, "bytes": nbytes}

        def rows_copy(src5: torch.Tensor, sidx: torch.Tensor, dst5: torch.Tensor, didx: torch.Tensor) -> None:
            if HAVE_TRITON:
                kv_rows_copy(src5, sidx, dst5, didx, kcfg)
            else:
                dst5.index_copy_(2, didx, src5.index_select(2, sidx))

        def host_ok() -> bool:
            buf = host.kv_buffer.to(device)
            v = buf if host.layout == "layer_first" else buf.transpose(1, 2)
            ok = same_bits(expected, v.index_select(2, host_d))
            del buf, v
            return ok

        def dev_ok() -> bool:
            return same_bits(expected, dview.index_select(2, dst_d))

        def poison_dst() -> None:
            dview.index_fill_(2, dst_d, float("nan"))

        t0 = time.perf_counter()
        runs = dma.host_runs_array(host_slots)
        runs_ms = (time.perf_counter() - t0) * 1e3
        self.result.setdefault("runs", {})[str(ps)] = {"runs": int(runs.shape[0]), "host_runs_ms": runs_ms}

        # baselines: the Triton kernel straight to / from the scattered host slots; the gather/scatter alone
        for direction in ("d2h", "h2d"):
            if not HAVE_TRITON:
                break
            with case(
                self.rows, {**base, "section": "baseline", "direction": direction, "variant": "triton_direct"}
            ) as row:
                if direction == "d2h":
                    self.poison.host(host.kv_buffer)
                    secs = self.timed(lambda: rows_copy(dview, src_d, hview, host_d))
                    self.add_stats(row, nbytes, secs, c_d2h)
                    row["verified"] = host_ok()
                else:
                    hview.index_copy_(2, host_slots, expected.cpu())  # independent (CPU) placement of the source
                    poison_dst()
                    secs = self.timed(lambda: rows_copy(hview, host_d, dview, dst_d))
                    self.add_stats(row, nbytes, secs, c_h2d)
                    row["verified"] = dev_ok()
            print("  " + row_line(row), flush=True)
        for direction in ("d2h", "h2d"):
            with case(
                self.rows,
                {
                    **base,
                    "section": "baseline",
                    "direction": direction,
                    "variant": "gather_only" if direction == "d2h" else "scatter_only",
                },
            ) as row:
                if direction == "d2h":
                    secs = self.timed(lambda: rows_copy(dview, src_d, sview, pos))
                    row["verified"] = same_bits(expected, sview)
                else:
                    poison_dst()
                    secs = self.timed(lambda: rows_copy(sview, pos, dview, dst_d))
                    row["verified"] = dev_ok()
                self.add_stats(row, nbytes, secs, c_d2h if direction == "d2h" else c_h2d)
                row["note"] = "device to device only; ratio vs the PCIe ceiling shows how much a chunk exposes"
            print("  " + row_line(row), flush=True)

        hb, sb = host.kv_buffer.data_ptr(), staging.data_ptr()
        run_list = [tuple(r) for r in runs.tolist()]
        for direction in ("d2h", "h2d"):
            ceiling = c_d2h if direction == "d2h" else c_h2d
            if direction == "h2d":
                hview.index_copy_(2, host_slots, expected.cpu())  # the load-back source, placed independently
                if not host_ok():
                    print("  WARNING: host slots do not hold the expected rows before load-back", flush=True)
                    self.result.setdefault("errors", []).append(f"ps={ps}: load-back source not in place")
            for chunk_mib in a.chunks_mib:
                t0 = time.perf_counter()
                chunks = chunk_runs(run_list, cfg.bytes_per_token, chunk_mib * MiB)
                plan = [(ca, cb, dma.flat_plan(geo, cr, hb, sb, direction)) for ca, cb, cr in chunks]  # type: ignore[arg-type]
                plan_ms = (time.perf_counter() - t0) * 1e3
                idx_dev = [(src_d if direction == "d2h" else dst_d)[ca:cb] for ca, cb, _ in plan]
                idx_pos = [pos[ca:cb] for ca, cb, _ in plan]
                copies = sum(f.count for _, _, f in plan)
                for ns in a.streams:
                    for mode in ("split",) if ns == 1 else ("split", "rr"):
                        meta = {
                            **base,
                            "direction": direction,
                            "variant": f"batch_{mode}",
                            "streams": ns,
                            "chunk_mib": chunk_mib,
                            "chunks": len(plan),
                            "copies": copies,
                            "plan_ms": plan_ms,
                        }
                        with case(self.rows, meta) as row:
                            if self.over_budget():
                                row["skipped"] = "time budget"
                                continue
                            streams = self.copy_streams[:ns]
                            if mode == "split":
                                targets = [list(zip(streams, dma.split_by_bytes(f, ns))) for _, _, f in plan]
                            else:
                                targets = [[(streams[i % ns], f)] for i, (_, _, f) in enumerate(plan)]
                            used = streams
                            cpu: list[float] = []
                            calls: list[int] = []
                            kern = self.kern

                            def offload() -> None:
                                main = torch.cuda.current_stream()
                                kern.wait_stream(main)
                                for s in used:
                                    s.wait_stream(main)
                                t0 = time.perf_counter()
                                c = 0
                                for i, tgt in enumerate(targets):
                                    with torch.cuda.stream(kern):
                                        rows_copy(dview, idx_dev[i], sview, idx_pos[i])
                                    ev = torch.cuda.Event()
                                    ev.record(kern)
                                    for s, p in tgt:
                                        s.wait_event(ev)
                                        c += drv.run_batch(p.dst, p.src, p.size, s.cuda_stream)
                                cpu.append(time.perf_counter() - t0)
                                calls.append(c)
                                for s in used:
                                    main.wait_stream(s)

                            def loadback() -> None:
                                main = torch.cuda.current_stream()
                                kern.wait_stream(main)
                                for s in used:
                                    s.wait_stream(main)
                                t0 = time.perf_counter()
                                c = 0
                                for i, tgt in enumerate(targets):
                                    evs = []
                                    for s, p in tgt:
                                        c += drv.run_batch(p.dst, p.src, p.size, s.cuda_stream)
                                        e = torch.cuda.Event()
                                        e.record(s)
                                        evs.append(e)
                                    for e in evs:
                                        kern.wait_event(e)
                                    with torch.cuda.stream(kern):
                                        rows_copy(sview, idx_pos[i], dview, idx_dev[i])
                                cpu.append(time.perf_counter() - t0)
                                calls.append(c)
                                main.wait_stream(kern)
                                for s in used:
                                    main.wait_stream(s)

                            if direction == "d2h":
                                self.poison.host(host.kv_buffer)
                                secs = self.timed(offload)
                                row["verified"] = host_ok()
                            else:
                                poison_dst()
                                secs = self.timed(loadback)
                                row["verified"] = dev_ok()
                            self.add_stats(row, nbytes, secs, ceiling, cpu, calls)
                        print("  " + row_line(row), flush=True)
                self.write()
        staging = expected = None  # freed before the next size (the closures above hold the names, so not `del`)


# ---- CPU smoke ---------------------------------------------------------------------------------------


def cpu_smoke() -> dict[str, Any]:
    """Tiny round trip of the planning through memmove_batch (no CUDA): checks the script's plumbing."""
    cfg = KVCacheConfig.tiny("mha")
    out: dict[str, Any] = {}
    for ps in (1, 16):
        host = HostKVPool(cfg, 256, ps, "page_first", pin_memory=False)
        host.kv_buffer.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (host.nbytes,), dtype=torch.uint8))
        k = 64 // ps
        slots = (torch.randperm(host.size // ps)[:k, None] * ps + torch.arange(ps)).reshape(-1)
        geo = dma.geometry(host, slots.numel())
        staging = torch.zeros(geo.stage_shape, dtype=cfg.dtype)
        f = dma.flat_plan(geo, dma.host_runs_array(slots), host.kv_buffer.data_ptr(), staging.data_ptr(), "h2d")
        cuda_driver.memmove_batch(f.dst, f.src, f.size)
        ok = torch.equal(
            geo.stage_view(staging).view(torch.uint8),
            host.token_view().index_select(2, slots).contiguous().view(torch.uint8),
        )
        out[str(ps)] = {"copies": f.count, "bytes": f.nbytes, "verified": bool(ok)}
    return out


# ---- main -----------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON output (default bench/results/dma_batch_probe-<gpu>.json; with --quick, under bench/results/quick/)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="0.25 GiB, 3 reps, page sizes 1,64, 64 MiB chunks, 1-2 streams, sizes 64K,2M",
    )
    ap.add_argument("--gib", type=float, default=None, help="GiB per batch (default 1)")
    ap.add_argument("--page-sizes", default=None, help="default 1,16,64")
    ap.add_argument("--sizes", default=None, help="pure-DMA copy sizes (default 64K,128K,2M)")
    ap.add_argument("--chunks-mib", default=None, help="pipeline chunk sizes in MiB (default 64,256)")
    ap.add_argument("--streams", default=None, help="copy stream counts (default 1,2,4)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per case (default 7)")
    ap.add_argument("--layout", default="page_first", choices=["page_first", "layer_first"])
    ap.add_argument(
        "--batch-abi",
        default="selftest",
        choices=["selftest", "v2", "v1", "off"],
        help="which cuMemcpyBatchAsync ABI to use: the first whose subprocess self-test passes (default)",
    )
    ap.add_argument("--skip", default="", help="comma list of sections to skip: dma,pipeline")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip remaining cases after this many seconds")
    ap.add_argument("--selftest-abi", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.selftest_abi:
        print("SELFTEST " + json.dumps(selftest(args.selftest_abi), default=str), flush=True)
        return 0

    q = args.quick
    args.gib = args.gib or (0.25 if q else 1.0)
    args.page_sizes = ints(args.page_sizes or ("1,64" if q else "1,16,64"))
    args.sizes = [parse_bytes(s) for s in (args.sizes or ("64K,2M" if q else "64K,128K,2M")).split(",")]
    args.chunks_mib = ints(args.chunks_mib or ("64" if q else "64,256"))
    args.streams = ints(args.streams or ("1,2" if q else "1,2,4"))
    args.reps = args.reps or (3 if q else 7)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    cuda = torch.cuda.is_available()
    result: dict[str, Any] = {
        "benchmark": "dma_batch_probe",
        "complete": False,
        "machine": machine_info(cuda),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "ratios_use": "GB/s median of the case / best GB/s of this run's contiguous pinned copy",
    }
    if not cuda:
        print("CUDA not available: CPU planning smoke only (the measurements need a GPU)")
        result["cpu_smoke"] = cpu_smoke()
        print(json.dumps(result["cpu_smoke"]))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        return 0 if all(v["verified"] for v in result["cpu_smoke"].values()) else 1

    t_start = time.perf_counter()
    out = result_path("dma_batch_probe", slug(torch.cuda.get_device_name()), quick=q, out=args.out)
    result["quick"] = q
    torch.cuda.init()
    print("diagnostics:", flush=True)
    try:
        result["diagnostics"] = driver_diagnostics()
    except Exception as e:  # noqa: BLE001
        result["diagnostics"] = {"error": repr(e)}
    print(json.dumps(result["diagnostics"], indent=1), flush=True)

    if args.batch_abi == "selftest":
        result["selftest"] = run_selftests(timeout=60)
        abi = next((x for x in ("v2", "v1") if result["selftest"][x].get("ok")), "off")
    else:
        abi = args.batch_abi
    drv = cuda_driver.CudaDriver(batch_abi=abi)
    result["batch"] = {"abi_used": drv.batch_abi, "status": drv.batch_status, "driver_api_version": drv.driver_version}
    print(
        f"batched copies: abi={drv.batch_abi} ({drv.batch_status})"
        + (
            "  ** NO WORKING BATCH ABI: every 'batch' row below is the per-copy fallback **"
            if drv.batch_abi is None
            else ""
        ),
        flush=True,
    )

    cfg = KVCacheConfig.llama3_8b()
    lcm = max(args.page_sizes)
    if any(lcm % p for p in args.page_sizes):
        raise SystemExit("the largest page size must be a multiple of the others")
    tokens = int(args.gib * GiB) // cfg.bytes_per_token
    tokens = max(lcm, tokens // lcm * lcm)
    nbytes = tokens * cfg.bytes_per_token
    result.update(
        kv={
            "layers": cfg.num_layers,
            "kv_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "dtype": str(cfg.dtype),
            "bytes_per_token": cfg.bytes_per_token,
        },
        tokens_per_batch=tokens,
        bytes_per_batch=nbytes,
        reps=args.reps,
    )
    timer = Timer(True)
    gen = torch.Generator().manual_seed(0)
    ceil = contiguous_ceilings(nbytes, torch.device(DEVICE), timer, max(args.reps, 10))
    result["ceilings"] = ceil
    print(
        f"ceilings ({nbytes / GiB:.2f} GiB contiguous, pinned): D2H {ceil['d2h']['GBps_best']:.1f} GB/s, "
        f"H2D {ceil['h2d']['GBps_best']:.1f} GB/s",
        flush=True,
    )

    host = HostKVPool(cfg, 2 * tokens, lcm, args.layout, pin_memory=PIN)
    probe = Probe(args, drv, out, result)
    probe.t_start = t_start
    probe.write()
    hdr = (
        f"{'section':9s} {'dir':4s} {'ps/S':>5s} {'variant':14s} {'st':>2s} {'chnk':>4s} | {'GB/s':>6s} {'ratio':5s} "
        f"{'ok':5s} {'sub_ms':>7s} {'calls':>6s} {'copies':>6s}"
    )
    print(hdr, flush=True)
    if "dma" not in skip:
        try:
            probe.dma_section(host.kv_buffer.view(-1).view(torch.uint8), nbytes, ceil, gen)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            result.setdefault("errors", []).append(f"dma section: {e!r}")
    if "pipeline" not in skip:
        dev = DeviceKVPool.create(cfg, 4 * tokens + lcm, DEVICE)
        dev.storage.view(torch.uint8).random_(0, 256)
        for ps in args.page_sizes:
            try:
                probe.pipeline_section(dev, host, tokens, ps, ceil, gen)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                result.setdefault("errors", []).append(f"pipeline ps={ps}: {e!r}")
    result["batch"].update(
        status_end=drv.batch_status, batch_calls=drv.batch_calls, fallback_copies=drv.fallback_copies
    )
    probe.write(complete=True)

    rows = result["rows"]
    print(
        f"\nsummary (ratio = GB/s median / ceiling: D2H {ceil['d2h']['GBps_best']:.1f}, H2D {ceil['h2d']['GBps_best']:.1f}; "
        f"targets offload 0.97, load-back 0.95; batch abi {drv.batch_abi})"
    )
    print(hdr)
    for r in rows:
        print(row_line(r))
    for direction, target in (("d2h", 0.97), ("h2d", 0.95)):
        for ps in args.page_sizes:
            good = [
                r
                for r in rows
                if r["section"] == "pipeline"
                and r["direction"] == direction
                and r.get("page_size") == ps
                and r.get("verified")
                and "ratio_median" in r
            ]
            base = [
                r
                for r in rows
                if r["section"] == "baseline"
                and r["direction"] == direction
                and r.get("page_size") == ps
                and r["variant"] == "triton_direct"
                and "ratio_median" in r
            ]
            if good:
                b = max(good, key=lambda r: r["ratio_median"])
                tri = f"{base[0]['ratio_median']:.3f}" if base else "-"
                print(
                    f"best {direction} ps={ps:3d}: {b['ratio_median']:.3f} ({b['variant']} x{b['streams']}, "
                    f"{b['chunk_mib']} MiB) vs triton_direct {tri}; target {target}"
                )
    bad = [r for r in rows if r.get("verified") is False]
    print(f"rows {len(rows)}, not verified/failed {len(bad)}, wall {time.perf_counter() - t_start:.0f} s; wrote {out}")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
