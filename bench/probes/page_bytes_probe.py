"""Development probe: how fast a host pool's pages turn into storage bytes (`HostKVPool.get_pages_bytes`).

Decision it informed: the backup worker gathers every page it writes out of the pinned pool, on a thread
that shares the interpreter with the scheduler, so the gather must be a plain copy. It compares the
earlier implementation (a torch index_select of the strided (P, L, S, H, D) token view, then a permute
to page order) with the current one (one numpy copy per page), for both host layouts, on one thread.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common
from common import write_result  # noqa: E402

from kvfsm.dataplane import HostKVPool, KVCacheConfig  # noqa: E402


def index_select_gather(pool: HostKVPool, slots: torch.Tensor) -> torch.Tensor:
    """The earlier get_pages_bytes."""
    c, ps = pool.config, pool.page_size
    k = slots.numel() // ps
    g = pool.token_view().index_select(2, slots)
    g = g.view(c.num_planes, c.num_layers, k, ps, *c.token_shape).permute(2, 0, 1, 3, 4, 5).contiguous()
    return g.view(torch.uint8).reshape(k, pool.page_nbytes)


def best_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    kv = KVCacheConfig(num_layers=args.layers, kv_heads=8, head_dim=128, attention="mha")
    rows = []
    for layout in ("page_first", "layer_first"):
        for page in (64, 16):
            n_pages = args.mib * 2**20 // (page * kv.bytes_per_token)
            pool = HostKVPool(kv, 4 * n_pages * page, page, layout=layout, pin_memory=False)
            pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.kv_buffer.dtype))
            slots = pool.page_slots(pool.allocator.alloc_pages(n_pages))
            assert torch.equal(pool.get_pages_bytes(slots), index_select_gather(pool, slots.slots))
            before = best_ms(lambda: index_select_gather(pool, slots.slots), args.reps)
            now = best_ms(lambda: pool.get_pages_bytes(slots), args.reps)
            rows.append(
                {
                    "layout": layout,
                    "page": page,
                    "mib": args.mib,
                    "index_select_ms": before,
                    "per_page_copy_ms": now,
                    "speedup": before / now,
                }
            )
            print(rows[-1])
    print(write_result("page_bytes_probe", {"rows": rows}, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
