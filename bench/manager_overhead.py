"""Manager work per scheduler iteration with many live requests (issue 4's budget).

Each iteration: the engine decodes one token per request (not timed), then the manager runs one
offload call per request plus one progress check (timed). Copies use the synchronous CPU engine on a
tiny KV shape, and the time inside the copy engine is measured separately and subtracted, so what is
left is the manager's bookkeeping: machines, hashing, host allocation, backup submission.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

from kvfsm.dataplane import CpuCopyEngine, HostKVPool, KVCacheConfig, ReqToTokenPool, TokenSlotAllocator  # noqa: E402
from kvfsm.dataplane.device_pool import DeviceKVPool  # noqa: E402
from kvfsm.dataplane.storage import MemoryStorage  # noqa: E402
from kvfsm.runtime import DecodeOffloadManager, OffloadConfig, ProtectedSize, ThreadBackupWorker  # noqa: E402
from kvfsm.verify.engine import SimRequest  # noqa: E402


class TimedCopyEngine(CpuCopyEngine):
    """The CPU engine, with the time spent moving bytes accumulated so it can be excluded."""

    moving = 0.0

    def submit_d2h(self, *args):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        handle = super().submit_d2h(*args)
        TimedCopyEngine.moving += time.perf_counter() - t0
        return handle


def run(live: int, iterations: int, page: int, context: int) -> dict:
    kv = KVCacheConfig(num_layers=1, kv_heads=1, head_dim=8, attention="mha", dtype=torch.float16)
    slots = (live + 1) * context
    device_pool = DeviceKVPool.create(kv, slots)
    allocator = TokenSlotAllocator(slots, page)
    table = ReqToTokenPool(live, context)
    protected = ProtectedSize()
    host = HostKVPool(kv, slots, page)
    config = OffloadConfig(page_size=page, offload_stride=page, storage_backend="none", backup_queue_size=4 * live)
    manager = DecodeOffloadManager(config, device_pool=device_pool, allocator=allocator, req_to_token=table,
                                   prefix_cache=protected, host_pool=host, copy_engine=TimedCopyEngine(),
                                   storage=MemoryStorage(), backup_worker=ThreadBackupWorker(4 * live))
    reqs = []
    for i in range(live):
        r = SimRequest(f"r{i}", list(range(100 + i % 64)))
        r.req_pool_idx = table.alloc()
        table.write(r.req_pool_idx, 0, allocator.alloc(context))
        r.kv_committed_len = r.kv_allocated_len = len(r.origin_input_ids)
        r.output_ids = [1]
        reqs.append(r)
    per_iter = []
    for it in range(iterations):
        for r in reqs:  # the engine's decode step (not timed)
            r.kv_committed_len += 1
            r.kv_allocated_len = r.kv_committed_len
            r.output_ids.append(it)
        TimedCopyEngine.moving = 0.0
        t0 = time.perf_counter()
        offload = manager.offload
        for r in reqs:
            offload(r)
        manager.check_progress()
        per_iter.append(time.perf_counter() - t0 - TimedCopyEngine.moving)
    manager.drain()
    manager.close()
    per_iter.sort()
    median = per_iter[len(per_iter) // 2]
    return {"live_requests": live, "iterations": iterations, "page_size": page,
            "manager_us_per_iteration_median": median * 1e6,
            "manager_us_per_iteration_p90": per_iter[int(len(per_iter) * 0.9)] * 1e6,
            "manager_us_per_request": median * 1e6 / live,
            "share_of_20ms_step": median / 0.020, "chunks": manager.metrics.chunks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--live", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--iterations", type=int, default=48)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [run(n, args.iterations, page=16, context=256) for n in args.live]
    for r in rows:
        print(r)
    target = {"us_per_iteration_max_at_4096": 400, "share_of_20ms_max": 0.02}
    path = write_result("manager_overhead", {"runs": rows, "targets": target}, args.out)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
