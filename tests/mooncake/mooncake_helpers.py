"""Helpers of the Mooncake tests: free loopback ports, and a SimEngine whose manager backs up into a given storage (MooncakeStorage here), with a configurable KV shape."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvfsm.dataplane import page_hashes
from kvfsm.verify.engine import SimEngine, SimRequest, kv_value


def free_port() -> int:
    """A port nothing listens on now (bound to 127.0.0.1 port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class StoreEngine(SimEngine):
    """A SimEngine whose manager backs up into `backend` (the KV shape is chosen by the test)."""

    backend: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.requests: dict[str, SimRequest] = {}

    def make_storage(self) -> Any:
        self.store = None
        return self.backend

    # --- driving -----------------------------------------------------------------------------------
    def admit_all(self, n: int, prompt_len: int) -> list[SimRequest]:
        reqs = []
        for i in range(n):  # distinct prompts: equal tokens would mean equal page hashes (content addressing)
            r = self.admit(
                f"r{i}", prompt_len, req=SimRequest(f"r{i}", [1000 * (i + 1) + j for j in range(prompt_len)])
            )
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
