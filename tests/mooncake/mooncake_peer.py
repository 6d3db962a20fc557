"""A second engine process sharing the Mooncake Store (run by the tests as `python mooncake_peer.py`).

Reads one JSON request from stdin: {"master", "metadata", "model", "tp_rank", "tp_size", "read": [hashes],
"write": {hash: seed}, "page_nbytes" (of the written pages)}. It reads the `read` pages and reports, per page, the sha256 of what it
got (null when missing) and the stored prefix; then it writes the `write` pages (bytes from the seed), prints
the JSON report on one line, and keeps its client (whose memory segment may hold those pages) open until
stdin closes.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch


def seeded_page(seed: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def main() -> None:
    req = json.loads(sys.stdin.readline())
    from kvfsm.dataplane.storage.mooncake import MooncakeStorage

    s = MooncakeStorage(
        req["master"],
        req["metadata"],
        model_name=req["model"],
        tp_rank=req.get("tp_rank", 0),
        tp_size=req.get("tp_size", 1),  # page size: learned from the store
        global_segment_size=req.get("segment", 32 << 20),
        local_buffer_size=16 << 20,
        op_timeout_s=5.0,
        setup_timeout_s=15.0,
        close_timeout_s=3.0,
        read_pool_bytes=8 << 20,
    )
    try:
        keys = req.get("read", [])
        pages = s.batch_get(keys)
        report = {
            "exists": s.batch_exists(keys),
            "sha256": [None if p is None else hashlib.sha256(p.numpy().tobytes()).hexdigest() for p in pages],
        }
        writes = req.get("write", {})
        if writes:
            ks = list(writes)
            report["written"] = s.batch_set(ks, [seeded_page(writes[k], req["page_nbytes"]) for k in ks])
        print(json.dumps(report), flush=True)
        sys.stdin.read()  # hold the client (and its segment) until the test is done reading
    finally:
        s.close()


if __name__ == "__main__":
    main()
