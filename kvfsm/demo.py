"""`kvfsm demo`: the spec tool chain, then a real decode workload served twice, with and without offload.

1. Validate the spec, check the runtime's generated machine is what it generates, write the auditor docs.
2. Serve many concurrent requests of mixed lengths (admission, decode, finish, abort, retraction under
   memory pressure, slot reuse) with a tiny paged-attention decoder: once freeing KV itself, once with
   the DecodeOffloadManager streaming KV device -> host -> a file store (checked mode on, trace on).
3. Require identical generated tokens, then load every stored page back storage -> host -> device
   and require it bit-exact with the KV the request computed.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvfsm.codegen import runtime_mismatch
from kvfsm.dataplane import HostKVPool, ReqToTokenPool, TokenSlotAllocator, make_copy_engine
from kvfsm.dataplane.pools.device_pool import DeviceKVPool
from kvfsm.dataplane.storage import FileStorage
from kvfsm.docsgen import markdown
from kvfsm.engine.model import TinyDecoder, TinyModelConfig
from kvfsm.engine.scheduler import DecodeEngine, EngineRequest, make_workload
from kvfsm.runtime import DecodeOffloadManager, OffloadConfig, SimplePrefixCache, ThreadBackupWorker
from kvfsm.spec import load_spec
from kvfsm.spec.locations import packaged_spec, spec_stamp

PAGE = 16


@dataclass
class DemoReport:
    device: str
    requests: int
    tokens: int
    retractions: int
    aborted: int
    outputs_identical: bool
    offloaded_bytes: int
    copy_seconds: float
    stored_pages: int
    storage_hits: int
    pages_loaded_back: int
    backup_failures: int
    transitions_checked: int
    seconds: float
    trace: Path
    docs: Path


class _Pools:
    def __init__(self, model_cfg: TinyModelConfig, slots: int, rows: int, device: str) -> None:
        self.pool = DeviceKVPool.create(model_cfg.kv_config(), slots, device)
        self.allocator = TokenSlotAllocator(slots, PAGE, device)
        self.table = ReqToTokenPool(rows, 512, device)
        self.protected = SimplePrefixCache(self.allocator)

    def full(self) -> bool:
        return (
            self.allocator.free_slots == self.allocator.capacity
            and self.table.free_rows == self.table.rows
            and self.protected.size == 0
        )


def _serve(
    model: TinyDecoder,
    pools: _Pools,
    requests: list[EngineRequest],
    batch: int,
    manager: Optional[DecodeOffloadManager],
    progress: Progress,
    label: str,
    snapshot: Optional[dict[str, torch.Tensor]] = None,
):
    engine = DecodeEngine(
        model, pools.pool, pools.allocator, pools.table, pools.protected, batch, manager, speculative=2
    )
    if snapshot is not None:  # keep every request's final KV to check load-back against
        release = engine._release_without_manager

        def keep(req: EngineRequest) -> None:
            idx = pools.table.read(req.row, 0, req.kv_committed_len)
            snapshot[req.rid] = pools.pool.token_view()[:, :, idx].to("cpu")
            release(req)

        engine._release_without_manager = keep  # type: ignore[method-assign]
    task = progress.add_task(label, total=len(requests))
    return engine.run(requests, on_step=lambda n: progress.advance(task, n))


def run_demo(
    workdir: Path,
    requests: int = 48,
    batch: int = 16,
    device: Optional[str] = None,
    console: Optional[Console] = None,
    spec_path: Optional[Path] = None,
) -> DemoReport:
    console = console or Console()
    spec_path = Path(spec_path or packaged_spec())
    spec = load_spec(spec_path)
    mismatch = runtime_mismatch(spec_path)
    if mismatch is not None:
        raise SystemExit(mismatch)
    docs = workdir / "decode_offload.md"
    docs.write_text(markdown(spec, spec_stamp(spec_path)))
    console.print(
        f"spec {spec_path}: valid ({len(spec.states)} states, {len(spec.transitions)} transitions); "
        f"generated code fresh; auditor docs -> {docs}"
    )

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TinyModelConfig()
    model = TinyDecoder(cfg, dev)
    slots = 16 * 4 * PAGE  # tight enough that the engine must retract now and then
    t0 = time.perf_counter()
    snapshot: dict[str, torch.Tensor] = {}
    with Progress(console=console, transient=True) as progress:
        plain = _Pools(cfg, slots, batch, dev)
        base = _serve(
            model, plain, make_workload(requests, 7, cfg.vocab), batch, None, progress, "without offload", snapshot
        )
        assert plain.full(), "the engine leaked without offload"

        pools = _Pools(cfg, slots, batch, dev)
        trace = workdir / "trace.jsonl"
        config = OffloadConfig(
            page_size=PAGE,
            offload_stride=2 * PAGE,
            checked=True,
            trace_path=trace,
            storage_dir=workdir / "store",
            model_name="tiny-demo",
            backup_queue_size=8,
        )
        host = HostKVPool(cfg.kv_config(), slots // 2, PAGE)
        storage = FileStorage(workdir / "store", model_name="tiny-demo")
        copy_engine = make_copy_engine(dev)
        manager = DecodeOffloadManager(
            config,
            device_pool=pools.pool,
            allocator=pools.allocator,
            req_to_token=pools.table,
            prefix_cache=pools.protected,
            host_pool=host,
            copy_engine=copy_engine,
            storage=storage,
            backup_worker=ThreadBackupWorker(8),
        )
        workload = make_workload(requests, 7, cfg.vocab)
        copy_time = _time_copies(copy_engine)
        run = _serve(model, pools, workload, batch, manager, progress, "with offload")
        assert pools.full() and host.free_slots == host.capacity, "offload leaked device, host or prefix"
    identical = run.outputs == base.outputs
    if not identical:
        bad = [rid for rid in base.outputs if base.outputs[rid] != run.outputs.get(rid)]
        raise SystemExit(f"generated tokens differ with offload for {len(bad)} requests, e.g. {bad[:3]}")

    hits, loaded = _load_back(manager, storage, host, pools, snapshot, workload, dev)
    manager.close()
    return DemoReport(
        dev,
        requests,
        run.tokens,
        run.retractions,
        run.aborted,
        identical,
        manager.metrics.offloaded_bytes,
        _busy_seconds(copy_time),
        manager.metrics.stored_pages,
        hits,
        loaded,
        manager.metrics.backup_failures,
        sum(1 for _ in trace.open()) - 1,
        time.perf_counter() - t0,
        trace,
        docs,
    )


class _TimedHandle:
    """Delegates to a copy handle and records when its completion was first observed."""

    def __init__(self, handle, span: list[float]) -> None:
        self._h, self._span = handle, span

    def done(self) -> bool:
        ok = self._h.done()
        if ok and not self._span[1]:
            self._span[1] = time.perf_counter()
        return ok

    def wait(self) -> None:
        self._h.wait()
        self.done()


def _time_copies(engine) -> list[list[float]]:
    """Record [submitted, completion observed] per device-to-host copy; their union is the copy busy time
    as the scheduler sees it (an upper bound on the real transfer time, so bandwidth is a lower bound)."""
    intervals: list[list[float]] = []
    submit = engine.submit_d2h

    def timed(*args):  # type: ignore[no-untyped-def]
        span = [time.perf_counter(), 0.0]
        intervals.append(span)
        handle = _TimedHandle(submit(*args), span)
        handle.done()  # a synchronous (CPU) copy is complete on return
        return handle

    engine.submit_d2h = timed
    return intervals


def _busy_seconds(intervals: list[list[float]]) -> float:
    total, end = 0.0, 0.0
    for start, stop in sorted(i for i in intervals if i[1]):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _load_back(
    manager: DecodeOffloadManager,
    storage: FileStorage,
    host: HostKVPool,
    pools: _Pools,
    snapshot: dict[str, torch.Tensor],
    workload: list[EngineRequest],
    dev: str,
) -> tuple[int, int]:
    """Storage -> host pool -> device for every stored page; each must equal what its request computed."""
    stored = manager.fx.stored
    by_request: dict[str, list[tuple[int, str]]] = {}
    for h, (key, pos) in stored.items():
        by_request.setdefault(key.rsplit("#", 1)[0], []).append((pos, h))
    hits = loaded = 0
    engine = manager.fx.copy_engine
    for rid, pages in sorted(by_request.items()):
        pages.sort()
        hits += storage.batch_exists([h for _, h in pages])
        for pos, data in zip((p for p, _ in pages), storage.batch_get([h for _, h in pages])):
            if data is None:
                raise SystemExit(f"{rid}: page at {pos} could not be read back from storage")
            host_idx = host.alloc(PAGE)
            dev_idx = pools.allocator.alloc(PAGE)
            if host_idx is None or dev_idx is None:
                raise SystemExit(f"{rid}: no free host or device page to load the page at {pos} back into")
            host.set_pages_bytes(host_idx, data.view(1, -1))
            engine.submit_h2d(host, host_idx, pools.pool, dev_idx).wait()
            got = pools.pool.token_view()[:, :, dev_idx].to("cpu")
            want = snapshot[rid][:, :, pos : pos + PAGE]
            if got.shape != want.shape or not torch.equal(got, want):
                raise SystemExit(f"{rid}: page at position {pos} differs after storage -> host -> device load-back")
            host.free(host_idx)
            pools.allocator.free(dev_idx)
            loaded += 1
    return hits, loaded


def main(
    workdir: Optional[Path] = None,
    requests: int = 48,
    json_out: Optional[Path] = None,
    spec_path: Optional[Path] = None,
) -> None:
    torch.set_num_threads(1)  # one-token steps on tiny tensors: threads only add synchronisation
    console = Console()
    load_spec(Path(spec_path or packaged_spec()))  # an invalid spec is refused before anything is written
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="kvfsm-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    r = run_demo(root, requests=requests, console=console, spec_path=spec_path)
    t = Table(title=f"kvfsm demo ({r.device})", show_header=False)
    rows = [
        ("requests (aborted)", f"{r.requests} ({r.aborted})"),
        ("decode tokens", r.tokens),
        ("retractions under memory pressure", r.retractions),
        ("tokens identical with and without offload", "yes" if r.outputs_identical else "NO"),
        ("bytes offloaded", f"{r.offloaded_bytes:,}"),
        (
            "offload bandwidth (bytes / copy busy time seen by the scheduler)",
            f"{r.offloaded_bytes / max(r.copy_seconds, 1e-9) / 1e9:.3f} GB/s",
        ),
        ("pages stored / storage prefix hits", f"{r.stored_pages} / {r.storage_hits}"),
        ("pages loaded back storage->host->device, bit-exact", r.pages_loaded_back),
        ("backup failures", r.backup_failures),
        ("transitions traced, invariants + ledger checked", r.transitions_checked),
        ("pools back to full", "yes"),
        ("wall time", f"{r.seconds:.1f} s"),
        ("trace", r.trace),
        ("auditor docs", r.docs),
    ]
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t)
    if json_out is not None:
        import dataclasses
        import json
        import platform

        doc = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(r).items()}
        doc["machine"] = {
            "hostname": platform.node(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        }
        Path(json_out).write_text(json.dumps(doc, indent=2) + "\n")
