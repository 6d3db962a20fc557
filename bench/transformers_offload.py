"""transformers' continuous batching under KV-cache pressure: its own CPU offloading vs kvfsm's.

One workload (random prompts, greedy decoding of a fixed number of tokens, no EOS) on a random-weight
Llama whose paged cache is far smaller than the requests need, so the engine preempts and restores
requests all along. It runs with:

- `engine`: transformers' own OffloadingManager (`cpu_offload_space` GiB of pinned host memory);
- `kvfsm`: the same engine with `kvfsm.integrations.transformers.install` (same host capacity), where every
  swap goes through spec/cb_swap.yaml and kvfsm's CUDA copy engine (checked mode off, as in production),
  with the release deferred (`SwapConfig(fenced=False)`): the host waits for each swap-out before the
  victim's blocks go back to the engine;
- `kvfsm_fenced`: the same with the fenced release (`fenced=True`, the default): the blocks go back at the
  swap-out, the compute stream waits on the copy's event, the host does not, and the copy is acknowledged
  at a later progress check;
- `soft_reset` (optional, --soft-reset): no host pool at all, victims are re-prefilled.

Per mode: wall time and throughput (generated tokens / s, warmup and CUDA-graph capture excluded),
preemptions swapped out, soft resets, restores, blocks and bytes moved each way, and time in offload:
host wall time inside the offloading manager's `offload_requests` + `restore_scheduled_requests`. The
engine's copies and kvfsm_fenced's are asynchronous on the device while kvfsm (deferred) waits for each
swap-out before the victim's blocks go back to the engine, so `--sync-timing` adds a second set of runs in
which the device is synchronised around those calls: their time then includes the copies themselves
(their throughput is not reported as representative). Outputs of the modes are compared token for token.

  python bench/transformers_offload.py             # CUDA when present: ~0.14B-parameter random Llama, bf16
  python bench/transformers_offload.py --quick     # CPU: the tests' tiny Llama (the engine's own CPU
                                                    # offloading needs pinned memory, so it soft-resets there)
Writes bench/results/transformers_offload-<machine>.json (or --out); `--quick` writes
bench/results/quick/transformers_offload-quick-<machine>.json instead.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import transformers  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

from common import write_result  # noqa: E402

import kvfsm.integrations.transformers as kt  # noqa: E402

GiB = 2**30


def build_model(args: argparse.Namespace, device: str) -> Any:
    torch.manual_seed(0)
    common = dict(max_position_embeddings=4096, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    if args.model == "tiny":  # the tests' model
        cfg = LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            **common,
        )
    elif args.model == "small":  # ~0.14B: 8 layers, 4 KV heads of dim 128 (16 KiB of KV per token in bf16)
        cfg = LlamaConfig(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            **common,
        )
    else:  # "medium", ~0.9B: 16 layers, 8 KV heads of dim 128 (64 KiB of KV per token in bf16)
        cfg = LlamaConfig(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=8,
            **common,
        )
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(args.prompt_min, args.prompt_max + 1, (args.requests,), generator=g)
    return [torch.randint(1, vocab, (int(n),), generator=g).tolist() for n in lens]


class Probe:
    """Counts and times one run's offloading manager, whichever it is, from the outside."""

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.offload_time = 0.0
        self.restore_time = 0.0
        self.offload_calls = self.restore_calls = 0
        self.swapped = self.soft_resets = self.restored = 0
        self.blocks_out = self.blocks_in = 0
        self.block_bytes = 0
        self.managers: list[Any] = []

    def _barrier(self) -> None:
        if self.sync and torch.cuda.is_available():
            torch.cuda.synchronize()

    def attach(self, manager: Any) -> None:
        original = manager._create_batch_processor

        def create() -> Any:
            processor = original()
            om = processor.offloading_manager
            if om not in self.managers:
                self.managers.append(om)
                self._wrap(processor, om)
            return processor

        manager._create_batch_processor = create

    def _wrap(self, processor: Any, om: Any) -> None:
        allocator = next(iter(processor.cache.cache_allocators.values()))
        self.block_bytes = allocator.bytes_per_block
        offload, restore = om.offload_requests, om.restore_scheduled_requests

        def offload_requests() -> bool:
            self._barrier()
            t0 = time.perf_counter()
            out = offload()
            self._barrier()
            self.offload_time += time.perf_counter() - t0
            self.offload_calls += 1
            return out

        def restore_scheduled_requests(batch: list[Any]) -> None:
            self._barrier()
            t0 = time.perf_counter()
            restore(batch)
            self._barrier()
            self.restore_time += time.perf_counter() - t0
            self.restore_calls += 1

        om.offload_requests, om.restore_scheduled_requests = offload_requests, restore_scheduled_requests
        if isinstance(om, kt.KvfsmOffloadingManager):
            return
        to_cpu = om._offload_to_cpu  # transformers' own: count what it moves

        def _offload_to_cpu(victims: list[Any], tables: dict[str, dict[str, list[int]]]) -> set[str]:
            done = to_cpu(victims, tables)
            self.swapped += len(done)
            self.soft_resets += len(victims) - len(done)
            self.blocks_out += sum(len(b) for rid in done for b in tables[rid].values())
            return done

        def restore_counting(batch: list[Any]) -> None:
            for fs in batch:
                st = fs.state
                if st.is_cpu_offloaded and om._cpu_pool is not None:
                    cpu = om._request_id_to_cpu_blocks.get(st.request_id, {})
                    self.restored += 1
                    self.blocks_in += sum(
                        min(len(ids), len(allocator.block_table.get(st.request_id, []))) for ids in cpu.values()
                    )
            restore_scheduled_requests(batch)

        om._offload_to_cpu = _offload_to_cpu
        om.restore_scheduled_requests = restore_counting


def run(model: Any, inputs: list[list[int]], args: argparse.Namespace, mode: str, sync: bool) -> dict[str, Any]:
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cuda = model.device.type == "cuda"
    engine_space = args.host_gib if (mode == "engine" and cuda) else 0.0
    cb_kwargs: dict[str, Any] = {}
    if args.async_batching is not None:
        cb_kwargs["use_async_batching"] = args.async_batching
    if not cuda or not args.cuda_graphs:
        cb_kwargs["use_cuda_graph"] = False
    cb = ContinuousBatchingConfig(
        page_size=args.page_size,
        num_blocks=args.num_blocks,
        max_batch_tokens=args.max_batch_tokens,
        allow_block_sharing=False,
        cpu_offload_space=engine_space,
        **cb_kwargs,
    )
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    inst = None
    if mode in ("kvfsm", "kvfsm_fenced"):
        engine: Any = "auto"
        if getattr(args, "kvfsm_backend", "auto") != "auto" and cuda:
            from kvfsm.dataplane import CudaCopyEngine

            engine = CudaCopyEngine(model.device, backend=args.kvfsm_backend)
        on_compute = getattr(args, "kvfsm_copy_stream", "compute") == "compute"
        inst = kt.install(
            manager,
            kt.SwapConfig(
                host_bytes=int(args.host_gib * GiB),
                checked=args.checked,
                fenced=mode == "kvfsm_fenced",
                copy_engine=engine,
                copy_on_compute_stream=on_compute,
            ),
        )
    probe = Probe(sync)
    probe.attach(manager)
    manager.warmup()
    outputs: dict[str, list[int]] = {}
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    manager.start()
    try:
        ids = manager.add_requests(inputs, max_new_tokens=args.new_tokens)
        while len(outputs) < len(ids):
            r = manager.get_result(timeout=120)
            if r is None:
                raise RuntimeError(f"{mode}: engine stopped after {len(outputs)} of {len(ids)} results")
            if r.is_finished():
                if r.error is not None:
                    raise RuntimeError(f"{mode}: request {r.request_id} failed: {r.error}")
                outputs[r.request_id] = list(r.generated_tokens)
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=60)
        manager.destroy()
    generated = sum(len(v) for v in outputs.values())
    row: dict[str, Any] = {
        "mode": mode,
        "sync_timing": sync,
        "wall_s": round(wall, 4),
        "generated_tokens": generated,
        "throughput_tok_s": round(generated / wall, 2),
        "offload_calls": probe.offload_calls,
        "restore_calls": probe.restore_calls,
        "time_in_offload_s": round(probe.offload_time + probe.restore_time, 5),
        "time_offload_requests_s": round(probe.offload_time, 5),
        "time_restore_s": round(probe.restore_time, 5),
        "block_bytes": probe.block_bytes,
    }
    if inst is not None:
        m = inst.metrics
        row.update(
            swapped_out=m.preempts,
            soft_resets=m.soft_resets,
            restores=m.restores,
            blocks_out=m.blocks_out,
            blocks_in=m.blocks_in,
            bytes_d2h=m.bytes_d2h,
            bytes_h2d=m.bytes_h2d,
            host_blocks_peak=m.host_blocks_peak,
            fenced_releases=m.fenced_releases,
            restore_waits=m.restore_waits,
            leaks=inst.leaks(),
            copy_engine=type(inst.managers[0].engine).__name__ if inst.managers else None,
            spec_transitions_covered=sorted(inst.coverage),
        )
    else:
        row.update(
            swapped_out=probe.swapped,
            soft_resets=probe.soft_resets,
            restores=probe.restored,
            blocks_out=probe.blocks_out,
            blocks_in=probe.blocks_in,
            bytes_d2h=probe.blocks_out * probe.block_bytes,
            bytes_h2d=probe.blocks_in * probe.block_bytes,
        )
        if mode == "engine" and not cuda:
            row["note"] = (
                "transformers' CPU offloading pins its pool (pin_memory=True), which needs an "
                "accelerator: on a CPU-only machine every victim is soft reset"
            )
    row["_outputs"] = [outputs[i] for i in ids]
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def warm_repeats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every repeat but the first (whose first run pays the cold start), for each kvfsm mode against the
    engine: the ratios of their host times in offload and throughputs repeat by repeat (the two runs of one
    repeat are neighbours in time), and the median of each. Empty with fewer than two repeats."""
    warm = [r for r in runs if r["repeat"] > 0 and not r["sync_timing"]]
    engine = {r["repeat"]: r for r in warm if r["mode"] == "engine"}
    out: dict[str, Any] = {}
    for mode in ("kvfsm", "kvfsm_fenced"):
        pairs = [(engine[r["repeat"]], r) for r in warm if r["mode"] == mode and r["repeat"] in engine]
        if not pairs:
            continue
        offload = [k["time_in_offload_s"] / e["time_in_offload_s"] for e, k in pairs if e["time_in_offload_s"]]
        tput = [k["throughput_tok_s"] / e["throughput_tok_s"] for e, k in pairs]
        out[f"{mode}_vs_engine_warm"] = {
            "repeats": [k["repeat"] for _, k in pairs],
            "time_in_offload_ratios": [round(x, 4) for x in offload],
            "time_in_offload_ratio_median": round(statistics.median(offload), 4) if offload else None,
            "throughput_ratios": [round(x, 4) for x in tput],
            "throughput_ratio_median": round(statistics.median(tput), 4),
        }
    return out


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="tiny model on the CPU, seconds; results under bench/results/quick/"
    )
    p.add_argument(
        "--model",
        choices=("tiny", "small", "medium"),
        default=None,
        help="random Llama size (default: small on CUDA, tiny with --quick)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="let the engine capture CUDA graphs (and so batch asynchronously); off by default: capturing "
        "a graph per new batch shape dominates runs this short, the same for both modes",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present, cpu with --quick)")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--prompt-min", type=int, default=None)
    p.add_argument("--prompt-max", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None, help="cache capacity in blocks of page-size tokens")
    p.add_argument("--max-batch-tokens", type=int, default=None)
    p.add_argument("--host-gib", type=float, default=None, help="host pool of both offloading managers")
    p.add_argument("--repeats", type=int, default=None, help="runs per mode, alternating (the last is reported)")
    p.add_argument("--soft-reset", action="store_true", help="also run without any host pool")
    p.add_argument("--sync-timing", action="store_true", help="also run with the device synchronised around offloads")
    p.add_argument("--checked", action="store_true", help="kvfsm's checked mode (slower: verifies every copy)")
    p.add_argument("--async-batching", dest="async_batching", action="store_true", default=None)
    p.add_argument("--no-async-batching", dest="async_batching", action="store_false")
    p.add_argument(
        "--kvfsm-backend",
        default="auto",
        choices=("auto", "triton", "torch", "dma"),
        help="CudaCopyEngine backend of the kvfsm modes (a probe: the default is what users get)",
    )
    p.add_argument(
        "--kvfsm-copy-stream",
        default="compute",
        choices=("compute", "own"),
        help="where the kvfsm modes' CUDA engine runs a swap's copy: on the engine's compute stream "
        "(SwapConfig.copy_on_compute_stream, the default) or on its own copy stream (a probe)",
    )
    p.add_argument("--modes", nargs="+", default=None, help="a subset of engine, kvfsm, kvfsm_fenced (a probe)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    device = args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    big = not args.quick
    defaults = dict(
        model="small" if big else "tiny",
        requests=64 if big else 16,
        new_tokens=256 if big else 24,
        prompt_min=32 if big else 5,
        prompt_max=256 if big else 29,
        page_size=32 if big else 4,
        num_blocks=192 if big else 16,
        max_batch_tokens=1024 if big else 64,
        host_gib=4.0 if big else 0.01,
        repeats=2 if device == "cuda" else 1,
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if device == "cpu":
        torch.set_num_threads(max(1, min(4, torch.get_num_threads())))

    model = build_model(args, device)
    inputs = workload(args, model.config.vocab_size)
    params = {
        k: getattr(args, k)
        for k in (
            "requests",
            "new_tokens",
            "prompt_min",
            "prompt_max",
            "page_size",
            "num_blocks",
            "max_batch_tokens",
            "host_gib",
            "repeats",
            "checked",
            "async_batching",
            "cuda_graphs",
            "model",
            "kvfsm_backend",
            "kvfsm_copy_stream",
        )
    }
    params.update(
        device=device,
        dtype=str(model.dtype),
        model_params=sum(p.numel() for p in model.parameters()),
        layers=model.config.num_hidden_layers,
        kv_heads=model.config.num_key_value_heads,
        head_dim=model.config.hidden_size // model.config.num_attention_heads,
        transformers=transformers.__version__,
    )
    name = "transformers_offload"
    modes = args.modes or ["engine", "kvfsm", "kvfsm_fenced"] + (["soft_reset"] if args.soft_reset else [])
    timings = [False] + ([True] if args.sync_timing and device == "cuda" else [])
    runs: list[dict[str, Any]] = []
    for sync in timings:
        for rep in range(1 if sync else args.repeats):
            for mode in modes:
                row = run(model, inputs, args, mode, sync)
                row["repeat"] = rep
                runs.append(row)
                write_result(
                    name,
                    {
                        "params": params,
                        "partial": True,
                        "runs": [{k: v for k, v in r.items() if k != "_outputs"} for r in runs],
                    },
                    args.out,
                    quick=args.quick,
                )
                print(
                    f"{mode:12s} sync={sync!s:5s} rep={rep} wall={row['wall_s']:.2f}s "
                    f"{row['throughput_tok_s']:.0f} tok/s out={row['swapped_out']} soft={row['soft_resets']} "
                    f"in={row['restores']} d2h={row['bytes_d2h'] / 2**20:.1f}MiB "
                    f"offload={row['time_in_offload_s'] * 1e3:.1f}ms",
                    flush=True,
                )

    reference = next(r["_outputs"] for r in runs if r["mode"] == "engine")
    for r in runs:
        r["outputs_equal_engine"] = r["_outputs"] == reference
    identical = all(r["outputs_equal_engine"] for r in runs)
    for r in runs:
        del r["_outputs"]
    last = {(r["mode"], r["sync_timing"]): r for r in runs}  # the last repeat of each (kernels warm)
    summary: dict[str, Any] = {"outputs_identical_across_modes": identical}
    for (mode, sync), r in last.items():
        key = f"{mode}{'_synced' if sync else ''}"
        summary[key] = {
            k: r[k]
            for k in (
                "throughput_tok_s",
                "wall_s",
                "swapped_out",
                "soft_resets",
                "restores",
                "bytes_d2h",
                "bytes_h2d",
                "time_in_offload_s",
                "outputs_equal_engine",
            )
        }
        if "restore_waits" in r:
            summary[key].update(fenced_releases=r["fenced_releases"], restore_waits=r["restore_waits"])
    if ("engine", False) in last:
        e = last[("engine", False)]
        for mode in ("kvfsm", "kvfsm_fenced"):
            if (mode, False) in last:
                k = last[(mode, False)]
                summary[f"{mode}_vs_engine_throughput"] = round(k["throughput_tok_s"] / e["throughput_tok_s"], 4)
                summary[f"{mode}_vs_engine_time_in_offload"] = (
                    round(k["time_in_offload_s"] / e["time_in_offload_s"], 4) if e["time_in_offload_s"] else None
                )
    summary.update(warm_repeats(runs))
    path = write_result(name, {"params": params, "summary": summary, "runs": runs}, args.out, quick=args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
