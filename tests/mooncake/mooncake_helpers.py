"""Helpers of the Mooncake tests: free loopback ports, and a SimEngine whose manager backs up into a given storage (MooncakeStorage here), with a configurable KV shape."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvfsm.dataplane import (DeferredCpuCopyEngine, HostKVPool, KVCacheConfig, ReqToTokenPool, TokenSlotAllocator,
                             page_hashes)
from kvfsm.dataplane.device_pool import DeviceKVPool
from kvfsm.runtime import DecodeOffloadManager, OffloadConfig, ProtectedSize, SteppedBackupWorker
from kvfsm.verify.engine import SimEngine, SimRequest, kv_value


def free_port() -> int:
    """A port nothing listens on now (bound to 127.0.0.1 port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class StoreEngine(SimEngine):
    """SimEngine.__post_init__, with `backend` as the manager's storage and the KV shape chosen by the test."""

    backend: Any = None
    num_layers: int = 2
    kv_heads: int = 1
    head_dim: int = 2
    host_layout: str = "layer_first"

    def __post_init__(self) -> None:
        self.kv = KVCacheConfig(num_layers=self.num_layers, kv_heads=self.kv_heads, head_dim=self.head_dim,
                                attention="mha", dtype=torch.float32)
        self.device_pool = DeviceKVPool.create(self.kv, self.device_slots)
        self.allocator = TokenSlotAllocator(self.device_slots, self.page_size)
        self.req_to_token = ReqToTokenPool(self.rows, self.max_context)
        self.protected = ProtectedSize()
        self.host_pool = HostKVPool(self.kv, self.host_slots, self.page_size, layout=self.host_layout)
        self.copies = DeferredCpuCopyEngine()
        self.worker = SteppedBackupWorker(self.backup_queue)
        self.store = None
        self.storage = self.backend
        self.config = OffloadConfig(page_size=self.page_size, offload_stride=self.stride, host_pool_ratio=1.0,
                                    copy_backend="deferred", storage_backend="none", checked=self.checked,
                                    backup_queue_size=self.backup_queue, trace_path=self.trace_path)
        self.manager = DecodeOffloadManager(
            self.config, device_pool=self.device_pool, allocator=self.allocator, req_to_token=self.req_to_token,
            prefix_cache=self.protected, host_pool=self.host_pool, copy_engine=self.copies, storage=self.storage,
            backup_worker=self.worker)
        self.live: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}

    # --- driving -----------------------------------------------------------------------------------
    def admit_all(self, n: int, prompt_len: int) -> list[SimRequest]:
        reqs = []
        for i in range(n):  # distinct prompts: equal tokens would mean equal page hashes (content addressing)
            r = self.admit(f"r{i}", prompt_len, req=SimRequest(f"r{i}", [1000 * (i + 1) + j for j in range(prompt_len)]))
            assert r is not None, "no room to admit"
            self.requests[r.rid] = r
            reqs.append(r)
        return reqs

    def step(self, reqs: list[SimRequest], backups: bool = True) -> None:
        """One decode step for each request, offload, copies land, progress, backups run, progress."""
        for r in reqs:
            assert self.decode(r)
            self.manager.offload(r)
        self.copies.complete_all()
        self.manager.check_progress()
        if backups:
            self.worker.run_all()
            self.manager.check_progress()

    def finish(self, reqs: list[SimRequest]) -> None:
        for r in reqs:
            self.end(r)
        for _ in range(1000):
            if self.manager.idle():
                break
            self.copies.complete_all()
            self.worker.run_all()
            self.manager.check_progress()
        assert self.manager.idle()

    # --- expectations ------------------------------------------------------------------------------
    def expected_page(self, serial: int, pos: int) -> torch.Tensor:
        """Canonical storage bytes of the page at `pos` written by request `serial` ((planes, L, ps, H, D))."""
        c = self.kv
        vals = torch.tensor([kv_value(serial, p) for p in range(pos, pos + self.page_size)], dtype=torch.float32)
        page = vals.view(1, 1, -1, 1, 1).expand(c.num_planes, c.num_layers, self.page_size, c.kv_heads, c.head_dim)
        return page.contiguous().view(torch.uint8).reshape(-1)

    def stored_pages(self) -> dict[str, tuple[int, int]]:
        """page hash -> (writer serial, position) for everything the manager reports stored."""
        out = {}
        for h, (key, pos) in self.manager.fx.stored.items():
            out[h] = (self.requests[key.split("#")[0]].serial, pos)
        return out

    def chain(self, req: SimRequest) -> list[str]:
        """The request's whole page-hash chain (prompt and committed decode tokens), in order."""
        tokens = (req.origin_input_ids + req.output_ids)[: req.kv_committed_len]
        n = len(tokens) // self.page_size * self.page_size
        return page_hashes(tokens[:n], self.page_size)

    def load_back(self, hashes: list[str], pages: list[Optional[torch.Tensor]]) -> torch.Tensor:
        """Write fetched pages into freshly allocated host pages; return the host indices (caller frees)."""
        host = self.host_pool.alloc(len(hashes) * self.page_size)
        assert host is not None, "no host room to load back"
        self.host_pool.set_pages_bytes(host, torch.stack([p for p in pages if p is not None]))
        return host
