"""Tensor-parallel demo workload on real GPUs: TP=2 over NCCL, offload through kvfsm on every rank.

Run with `torchrun --nproc_per_node=2 bench/tp_nccl.py --out tp.json` (NCCL_NVLS_ENABLE=0). Each rank
holds half of the attention heads (and so half of the KV), runs the same scheduler, and its
DecodeOffloadManager agrees on completion counts with the other rank over NCCL. The script records
every rank's sequence of device frees, host frees and storage writes and requires them identical, and
requires the generated tokens to match a TP=1 run of the same model and workload.
With `--backend gloo --device cpu` it runs on CPU processes (a functional check, no GPU numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvfsm.dataplane import HostKVPool, KVCacheConfig, ReqToTokenPool, TokenSlotAllocator, make_copy_engine  # noqa: E402
from kvfsm.dataplane.pools.device_pool import DeviceKVPool  # noqa: E402
from kvfsm.dataplane.storage import FileStorage  # noqa: E402
from kvfsm.engine.model import TinyDecoder, TinyModelConfig  # noqa: E402
from kvfsm.engine.scheduler import DecodeEngine, make_workload  # noqa: E402
from kvfsm.runtime import DecodeOffloadManager, OffloadConfig, SimplePrefixCache, ThreadBackupWorker  # noqa: E402

PAGE = 16


class ShardedDecoder(TinyDecoder):
    """Megatron-style split of TinyDecoder: heads (and KV heads) and the MLP's hidden units per rank;
    attention and MLP outputs are summed with all_reduce. Weights are slices of the TP=1 model's."""

    def __init__(self, cfg: TinyModelConfig, device: torch.device | str, rank: int, world: int) -> None:
        super().__init__(cfg, device)
        self.rank, self.world = rank, world
        hq, hk, d = cfg.heads // world, cfg.kv_heads // world, cfg.head_dim
        f = 2 * cfg.hidden // world
        self.local_heads, self.local_kv = hq, hk
        self.wq = [w[:, rank * hq * d : (rank + 1) * hq * d] for w in self.wq]
        self.wk = [w[:, rank * hk * d : (rank + 1) * hk * d] for w in self.wk]
        self.wv = [w[:, rank * hk * d : (rank + 1) * hk * d] for w in self.wv]
        self.wo = [w[rank * hq * d : (rank + 1) * hq * d, :] for w in self.wo]
        self.w1 = [w[:, rank * f : (rank + 1) * f] for w in self.w1]
        self.w2 = [w[rank * f : (rank + 1) * f, :] for w in self.w2]

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial)
        return partial


def serve(
    model: TinyDecoder, kv: KVCacheConfig, device: str, requests: int, manager_kwargs: dict | None, log: list
) -> tuple[dict, dict]:
    slots = 16 * 4 * PAGE
    pool = DeviceKVPool.create(kv, slots, device)
    allocator = TokenSlotAllocator(slots, PAGE, device)
    table = ReqToTokenPool(8, 512, device)
    protected = SimplePrefixCache(allocator)
    manager = None
    if manager_kwargs is not None:
        host = HostKVPool(kv, slots // 2, PAGE)
        storage = FileStorage(
            manager_kwargs["dir"], model_name="tiny-tp", tp_rank=manager_kwargs["rank"], tp_size=manager_kwargs["world"]
        )
        free, hfree, put = allocator.free, host.free_pages, storage.batch_set
        allocator.free = lambda idx: (log.append(["device_free", sorted(torch.as_tensor(idx).tolist())]), free(idx))[1]
        host.free_pages = lambda pages: (
            log.append(["host_free", sorted(host.slots_of(pages).tolist())]),
            hfree(pages),
        )[1]
        put_host = storage.batch_set_from_host  # the backup worker's path
        storage.batch_set = lambda keys, pages: (log.append(["store", list(keys)]), put(keys, pages))[1]
        storage.batch_set_from_host = lambda keys, pool, idx: (
            log.append(["store", list(keys)]),
            put_host(keys, pool, idx),
        )[1]
        config = OffloadConfig(
            page_size=PAGE,
            offload_stride=2 * PAGE,
            checked=True,
            storage_dir=manager_kwargs["dir"],
            backup_queue_size=4,
        )
        manager = DecodeOffloadManager(
            config,
            device_pool=pool,
            allocator=allocator,
            req_to_token=table,
            prefix_cache=protected,
            host_pool=host,
            copy_engine=make_copy_engine(device),
            storage=storage,
            backup_worker=ThreadBackupWorker(4),
            tp_group=manager_kwargs["group"],
            tp_rank=manager_kwargs["rank"],
            tp_size=manager_kwargs["world"],
        )
    engine = DecodeEngine(model, pool, allocator, table, protected, max_batch=8, manager=manager, speculative=2)
    stats = engine.run(make_workload(requests, 11, model.cfg.vocab))
    metrics = manager.metrics.as_dict() if manager else {}
    if manager:
        manager.close()
    assert allocator.free_slots == allocator.capacity and protected.size == 0
    return stats.outputs, {"tokens": stats.tokens, "retractions": stats.retractions, **metrics}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--out", default="tp.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    cfg = TinyModelConfig()
    tmp = Path(tempfile.mkdtemp(prefix=f"kvfsm-tp{rank}-"))
    t0 = time.perf_counter()
    log: list = []
    kv = KVCacheConfig(
        num_layers=cfg.layers,
        kv_heads=cfg.kv_heads // world,
        head_dim=cfg.head_dim,
        attention="mha",
        dtype=torch.float32,
    )
    outputs, stats = serve(
        ShardedDecoder(cfg, device, rank, world),
        kv,
        device,
        args.requests,
        {"dir": tmp / "store", "rank": rank, "world": world, "group": dist.group.WORLD},
        log,
    )
    tp_seconds = time.perf_counter() - t0
    logs: list = [None] * world
    dist.all_gather_object(logs, log)
    outs: list = [None] * world
    dist.all_gather_object(outs, outputs)
    if rank == 0:
        ref, _ = serve(TinyDecoder(cfg, device), cfg.kv_config(), device, args.requests, None, [])
        identical_ranks = all(lg == logs[0] for lg in logs[1:])
        tokens_match = all(o == ref for o in outs)
        differing = [rid for rid in ref if outs[0].get(rid) != ref[rid]]
        doc = {
            "benchmark": "tp_nccl",
            "world": world,
            "backend": args.backend,
            "machine": {
                "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
                "gpus": torch.cuda.device_count() if args.device == "cuda" else 0,
                "torch": torch.__version__,
                "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
            },
            "requests": args.requests,
            "rank0_stats": stats,
            "events_per_rank": [len(lg) for lg in logs],
            "device_frees": sum(e[0] == "device_free" for e in logs[0]),
            "host_frees": sum(e[0] == "host_free" for e in logs[0]),
            "storage_writes": sum(e[0] == "store" for e in logs[0]),
            "identical_free_and_write_sequences": identical_ranks,
            "tokens_match_tp1": tokens_match,
            "requests_differing_from_tp1": differing,
            "tp_run_seconds": tp_seconds,
        }
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(json.dumps({k: v for k, v in doc.items() if k != "requests_differing_from_tp1"}, indent=1))
        if not identical_ranks:
            raise SystemExit("TP ranks applied different frees or writes")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
