"""The floor of any offload manager in bench/serving_loop.py: what every iteration must do, and nothing else.

Per iteration it picks the due requests from the engine's batch arrays (one numpy compare), gathers the due
chunks' device slots from the request table's host mirror, allocates host pages, submits ONE device-to-host
copy through the same `CudaCopyEngine`, and on completion frees the host pages. It keeps no lifecycle, no
checks, no hashes and no storage: its time is the limit that a spec, a ledger or a backup path is measured
against (the serving loop reports kvfsm's time as a ratio to it). Finished requests are released once every
copy submitted before their finish has landed, so slots are never reused early even here.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

from kvfsm.dataplane import CopyEngine, HostKVPool, ReqToTokenPool, TokenSlotAllocator
from kvfsm.dataplane.pools.device_pool import DeviceKVPool


class BareOffload:
    """Selection, one copy per iteration, host frees on completion; deferred release of finished rows."""

    def __init__(
        self,
        *,
        page_size: int,
        stride: int,
        device_pool: DeviceKVPool,
        allocator: TokenSlotAllocator,
        req_to_token: ReqToTokenPool,
        host_pool: HostKVPool,
        copy_engine: CopyEngine,
    ) -> None:
        self.page_size, self.stride = page_size, stride
        self.device_pool, self.allocator, self.table = device_pool, allocator, req_to_token
        self.host_pool, self.copy_engine = host_pool, copy_engine
        rows = req_to_token.rows
        self.start = np.full(rows, -1, dtype=np.int64)  # per row: offloaded length (-1: a new request)
        self.due = np.zeros(rows, dtype=np.int64)  # per row: committed length at which a chunk is due
        self.flat = req_to_token.host_table.numpy().reshape(-1)
        self.width = req_to_token.max_context
        self.offsets = np.arange(page_size, dtype=np.int64)
        self.inflight: deque[tuple[int, Any, list[int]]] = deque()  # (serial, handle, host pages)
        self.finished: deque[tuple[int, Any]] = deque()  # (serial of the last copy before it, request)
        self.serial = 0
        self.offloaded_tokens = 0

    def offload_batch(self, reqs: list[Any], rows: np.ndarray, committed: np.ndarray) -> int:
        ps, stride = self.page_size, self.stride
        picked = np.flatnonzero(committed >= self.due[rows])
        firsts: list[int] = []
        chunks = 0
        for i in picked.tolist():
            req, row = reqs[i], int(rows[i])
            start = int(self.start[row])
            if start < 0:
                start = len(req.origin_input_ids) // ps * ps  # the prefill side stored the aligned prompt
            n = (min(int(committed[i]), len(req.origin_input_ids) + len(req.output_ids) - 1) - start) // stride * stride
            if n > 0:
                base = row * self.width + start
                firsts += range(base, base + n, ps)
                start += n
                chunks += 1
            self.start[row] = start
            self.due[row] = start + stride
        if not firsts:
            return 0
        pages = self.host_pool.allocator.alloc_pages(len(firsts))
        if pages is None:  # no host room: the chunks wait (a real manager would retry them)
            return 0
        starts = self.flat[firsts]
        device = torch.from_numpy(np.add.outer(starts, self.offsets).reshape(-1))
        handle = self.copy_engine.submit_d2h(self.device_pool, device, self.host_pool, self.host_pool.page_slots(pages))
        self.serial += 1
        self.inflight.append((self.serial, handle, pages))
        self.offloaded_tokens += len(firsts) * ps
        return chunks

    def finalize(self, req: Any) -> None:
        self.finished.append((self.serial, req))

    def check_progress(self) -> None:
        while self.inflight and self.inflight[0][1].done():
            _, _, pages = self.inflight.popleft()
            self.host_pool.free_pages(pages)
        landed = self.inflight[0][0] - 1 if self.inflight else self.serial
        while self.finished and self.finished[0][0] <= landed:
            self._release(self.finished.popleft()[1])

    def _release(self, req: Any) -> None:
        ps, row = self.page_size, req.req_pool_idx
        held = -(-req.kv_allocated_len // ps) * ps
        self.allocator.free_pages((self.table.read_host(row, 0, held)[::ps] // ps).tolist())
        self.table.free(row)
        self.start[row], self.due[row] = -1, 0
        req.req_pool_idx = None

    def idle(self) -> bool:
        return not self.inflight and not self.finished

    def close(self) -> None:
        pass


__all__ = ["BareOffload"]
