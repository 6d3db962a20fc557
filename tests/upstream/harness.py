"""Drive a decode KV offload manager over upstream SGLang's real objects on a CPU, as its scheduler would.

`run_scenario(scenario, manager_cls)` builds sglang 0.5.23's `ReqToTokenPool`, `MHATokenToKVPool` /
`MLATokenToKVPool` with its allocator, a `RadixCache`, a gloo TP group (world 1 here, or one spawned
process per rank for TP > 1) and a `HiCacheFile` store in a temp dir, publishes the server config the
manager reads, constructs `manager_cls(req_to_token_pool=, token_to_kv_pool_allocator=, tp_group=,
tree_cache=)`, and plays the scenario step by step (docs/sglang-upstream.md, "Where the scheduler calls
it"). The class is a parameter so that kvfsm's drop-in adapter runs the very same script.

A step runs as SGLang's decode iteration does: the progress check, the batch's new slots (`prepare_for_decode`),
then the offload and release calls for its results inside the allocator's free group
(`process_batch_result_decode` opens one around them, so a free made there goes back to the allocator at the
group's end). `free_group=False` plays every step without the group, each free taking effect at once, as a
caller outside result processing frees.

Each step records what a differential test compares: which requests' offloads were accepted, which rows
were released, the device slots returned to the allocator (instrumented below the tree, so any release
path is seen), host slots taken and returned, the storage keys that appeared and their bytes. Backups run
on the manager's own thread; the harness waits for them to settle before each progress check and at the
end of each step (`Probe.settle`), so the record is deterministic.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.append(str(Path(__file__).parents[1]))  # tests/, last: timing's calibrated hang guards

from cuda_only import install  # noqa: E402  (must precede any sglang import)

install()

from array import array  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sglang.srt.disaggregation.decode_kvcache_offload_manager import (  # noqa: E402
    DecodeKVCacheOffloadManager as UpstreamManager,
)
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed  # noqa: E402
from sglang.srt.runtime_context import get_context, get_parallel  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from scenarios import BY_NAME, ReqSpec, Scenario  # noqa: E402
from timing import wait_for  # noqa: E402

MODEL = "kvfsm-diff"
STRIDE_ENV = "SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE"
DTYPE = torch.float32  # integers below 2**24 are exact, so stored bytes compare exactly
# Where SGLang's pools live: "cpu" (CI), or "cuda" on the device machine (tests/upstream/test_adapter_gpu.py:
# the SGLang server's own layout, req_to_token and KV on the GPU). Set with `on_device`.
DEVICE = "cpu"
SYNC_CHECK = False  # on CUDA: every manager call runs under torch.cuda.set_sync_debug_mode("error")


@contextmanager
def on_device(device: str, sync_check: bool = False) -> Iterator[None]:
    """Build the scenario's pools on `device`; with `sync_check`, fail any manager call that waits for the GPU."""
    global DEVICE, SYNC_CHECK
    old = DEVICE, SYNC_CHECK
    DEVICE, SYNC_CHECK = device, sync_check and device.startswith("cuda")
    try:
        yield
    finally:
        DEVICE, SYNC_CHECK = old


@contextmanager
def manager_call() -> Iterator[None]:
    """A call into the manager under test: with SYNC_CHECK, one that waits for the GPU raises."""
    if not SYNC_CHECK:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@contextmanager
def free_group(allocator: Any, on: bool = True) -> Iterator[None]:
    """The allocator's free group, which SGLang's `process_batch_result_decode` opens around a decode step's offload
    and finish calls: a free made inside it goes back to the allocator at its end. `on=False`: no group, every
    free goes back at once."""
    if not on:
        yield
        return
    allocator.free_group_begin()
    try:
        yield
    finally:
        allocator.free_group_end()


@contextmanager
def observing() -> Iterator[None]:
    """The harness's own reads of device values inside a manager call (which slots were freed) may wait for
    the GPU: they observe the manager and are not part of it."""
    if not SYNC_CHECK:
        yield
        return
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def upstream_page_hash(tokens: list[int], prior: str | None) -> str:
    """Upstream's page hash (its native extension). On the device machine, which cannot build that
    extension, kvfsm's page_hash stands in: tests/upstream/test_keys_vs_upstream.py proves the two
    bit-identical on CPU, and the device runs compare kvfsm on CUDA with kvfsm on the CPU."""
    try:
        return get_hash_str(tokens, prior)
    except RuntimeError:
        if DEVICE == "cpu":
            raise
        from kvfsm.dataplane.hashing import page_hash

        return page_hash(tokens, prior)


# ----------------------------------------------------------------------------------------------- records


@dataclasses.dataclass
class Step:
    step: int
    offloads: list[str] = dataclasses.field(default_factory=list)  # rids whose offload_kv_cache was True
    released: list[str] = dataclasses.field(default_factory=list)  # rids whose row went back this step
    device_freed: list[int] = dataclasses.field(default_factory=list)  # slots returned to the allocator
    # The same frees as (owner, row position): comparable across managers whose frees reorder the free list.
    # The owner is a rid, "<tree>:rid" for a prefix the tree held for rid, or "?" for a slot nobody held.
    freed_at: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    freed_ranges: list[tuple[str, list[tuple[int, int]]]] = dataclasses.field(default_factory=list)
    host_alloc: int = 0
    host_freed: int = 0
    keys: list[str] = dataclasses.field(default_factory=list)  # storage keys that appeared, sorted
    retract: str | None = None  # "ok" or the refusal, where the step asked to retract


@dataclasses.dataclass
class RunResult:
    scenario: str
    rank: int
    tp: int
    manager: str
    steps: list[Step]
    stored: dict[str, bytes]  # key -> file content, at the end
    expected: dict[str, tuple[str, int, bytes]]  # key -> (a rid, page index in its sequence, bytes)
    chains: dict[str, list[tuple[str, int]]]  # rid -> its decode-offloadable pages' (key, page index), in order
    owned: dict[str, list[int]]  # rid -> device slots the request allocated itself
    tree_slots: dict[str, list[int]]  # rid -> device slots of the prefix the tree held for it
    final: dict[str, dict[str, Any]]  # rid -> req.kv and lock state at the end
    host_free_at_start: int | None
    host_free_at_end: int | None
    offload_stride: int | None

    def all_freed(self) -> list[int]:
        return [s for st in self.steps for s in st.device_freed]

    def all_keys(self) -> list[str]:
        return [k for st in self.steps for k in st.keys]


# ------------------------------------------------------------------------------------------------ probes


class Probe:
    """What the harness needs to know of a manager beyond upstream's public surface."""

    def settle(self, mgr: Any) -> None:
        """Return once every backup the manager has started is done (acknowledged, not yet consumed)."""

    def before_check(self, mgr: Any) -> None:
        """Right before a progress check or a drain: make what the call will acknowledge independent of how
        fast the device is (nothing, unless the manager submits copies that land later than a CPU's)."""

    def host_pool(self, mgr: Any) -> Any | None:
        return None

    def storage(self, mgr: Any) -> Any | None:
        """The object whose `set(key, value)` writes a page, for fault injection; None: not injectable."""
        return None

    def close(self, mgr: Any) -> None:
        pass


# A hang guard, not a latency: a scenario's backups take milliseconds. It is this many seconds of the idle CI
# machine, scaled by tests/timing.py's calibration, and each backup that completes restarts it.
SETTLE_S = 10.0


class UpstreamProbe(Probe):
    def settle(self, mgr: Any) -> None:
        cc = mgr.cache_controller
        wait_for(
            lambda: cc.ack_backup_queue.qsize() >= len(mgr.ongoing_backup),
            "upstream's backups to settle",
            SETTLE_S,
            progress=cc.ack_backup_queue.qsize,
            poll_s=0.002,
        )

    def host_pool(self, mgr: Any) -> Any:
        return mgr.decode_host_mem_pool

    def storage(self, mgr: Any) -> Any:
        return mgr.cache_controller.storage_backend

    def close(self, mgr: Any) -> None:
        mgr.cache_controller._stop_storage_threads()
        mgr.release_host_resources()


def probe_for(manager_cls: type) -> Probe:
    if manager_cls is UpstreamManager:
        return UpstreamProbe()
    factory = getattr(manager_cls, "harness_probe", None)
    return factory() if factory is not None else Probe()


# ---------------------------------------------------------------------------------------- the KV content


def position_tags(spec: ReqSpec) -> torch.Tensor:
    """Per position, a rolling digest of the tokens up to it: KV depends on the prefix, as a model's does,
    so two requests with the same tokens hold the same KV (and may share a storage key)."""
    tags, h = [], 0
    for tok in list(spec.prompt) + list(spec.outputs()):
        h = (h * 1_000_003 + tok) % (2**31 - 1)
        tags.append(h)
    return torch.tensor(tags, dtype=torch.int64)


def kv_values(tags: torch.Tensor, layer: int, which: int, rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic KV for positions with these tags ([n] -> [n, *shape]); distinct per layer, K/V, rank
    (TP shard) and element, exact in float32."""
    n = tags.numel()
    inner = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int64).reshape(shape)
    tag = (tags * 16 + layer * 4 + which * 2 + rank) % (2**23)
    vals = (tag.reshape(n, *([1] * len(shape))) * 131 + inner) % (2**23)
    return vals.to(DTYPE)


def _kv_shape(sc: Scenario) -> tuple[int, ...]:
    return (sc.heads, sc.head_dim) if sc.pool == "mha" else (1, 3 * sc.head_dim)


def expected_page_bytes(sc: Scenario, tags: torch.Tensor, rank: int) -> bytes:
    """A page as upstream's `layer_first` host pool hands it to storage: MHA `[K|V, layer, token, head,
    dim]`, MLA `[layer, token, 1, dim]`."""
    shape = _kv_shape(sc)
    if sc.pool == "mha":
        page = torch.stack(
            [
                torch.stack([kv_values(tags, layer, which, rank, shape) for layer in range(sc.layers)])
                for which in (0, 1)
            ]
        )
    else:
        page = torch.stack([kv_values(tags, layer, 0, rank, shape) for layer in range(sc.layers)])
    return page.contiguous().numpy().tobytes()


def _namespace(spec: ReqSpec) -> tuple[str | None, str | None]:
    extra_key = spec.extra_key
    if spec.lora_id is not None:
        extra_key = (extra_key or "") + spec.lora_id
    return extra_key, (spec.cache_salt or None)


def expected_keys(sc: Scenario, spec: ReqSpec, rank: int) -> dict[str, tuple[str, int, bytes]]:
    """Every page of the request that decode could offload, keyed as upstream hashes it (the chain over the
    aligned prompt, continued over the decoded tokens that have KV)."""
    ps = sc.page_size
    tokens = list(spec.prompt) + list(spec.outputs()[:-1])
    last = storage_namespace_seed(*_namespace(spec))
    tags = position_tags(spec)
    out = {}
    for page in range(len(tokens) // ps):
        last = upstream_page_hash(tokens[page * ps : (page + 1) * ps], last)
        if (page + 1) * ps > len(spec.prompt) // ps * ps:
            out[last] = (spec.rid, page, expected_page_bytes(sc, tags[page * ps : (page + 1) * ps], rank))
    return out


# -------------------------------------------------------------------------------------- process and config

_WORLD1_DIR: str | None = None


def _tp_group_world1():
    global _WORLD1_DIR
    if not dist.is_initialized():
        _WORLD1_DIR = tempfile.mkdtemp(prefix="kvfsm-gloo-")
        atexit.register(shutil.rmtree, _WORLD1_DIR, True)  # the group's file store lives as long as the process
        dist.init_process_group("gloo", init_method=f"file://{_WORLD1_DIR}/pg", rank=0, world_size=1)
    return dist.group.WORLD


@contextmanager
def published(sc: Scenario, rank: int, store_dir: str) -> Iterator[None]:
    """Publish the server config the manager reads (page size, HiCache file store, host ratio, TP rank)."""
    ratio = sc.rank_host_ratio[rank] if sc.rank_host_ratio else sc.host_ratio
    override = get_context().override_server_args(
        page_size=sc.page_size,
        tp_size=sc.tp,
        hicache_storage_backend="file",
        hicache_io_backend="direct",
        hicache_mem_layout="layer_first",
        hicache_ratio=ratio,
        served_model_name=MODEL,
        hicache_storage_backend_extra_config=json.dumps({"file_storage_path": store_dir}),
    )
    override.install()
    get_parallel().override_permanently(tp_rank=rank, pp_rank=0, attn_dcp_rank=0)
    old_stride = os.environ.pop(STRIDE_ENV, None)
    if sc.stride is not None:
        os.environ[STRIDE_ENV] = str(sc.stride)
    try:
        yield
    finally:
        os.environ.pop(STRIDE_ENV, None)
        if old_stride is not None:
            os.environ[STRIDE_ENV] = old_stride
        override.restore()


def build_pools(sc: Scenario):
    ps = sc.page_size
    max_ctx = max(len(r.prompt) + r.decode + 1 + r.spec_extra + 2 * ps for r in sc.requests) + 2 * ps
    dev = DEVICE
    r2t = ReqToTokenPool(size=len(sc.requests) + 2, max_context_len=max_ctx, device=dev, enable_memory_saver=False)
    if sc.pool == "mha":
        kv = MHATokenToKVPool(
            size=sc.device_tokens,
            page_size=ps,
            dtype=DTYPE,
            head_num=sc.heads,
            head_dim=sc.head_dim,
            layer_num=sc.layers,
            device=dev,
            enable_memory_saver=False,
        )
    else:
        kv = MLATokenToKVPool(
            size=sc.device_tokens,
            page_size=ps,
            dtype=DTYPE,
            kv_lora_rank=2 * sc.head_dim,
            qk_rope_head_dim=sc.head_dim,
            layer_num=sc.layers,
            device=dev,
            enable_memory_saver=False,
        )
    if ps == 1:
        allocator = TokenToKVPoolAllocator(sc.device_tokens, DTYPE, dev, kv, need_sort=False)
    else:
        allocator = PagedTokenToKVPoolAllocator(sc.device_tokens, ps, DTYPE, dev, kv, need_sort=False)
    return r2t, kv, allocator


# ------------------------------------------------------------------------------------------------ runner


class _Run:
    def __init__(
        self, sc: Scenario, manager_cls: type, rank: int, tp_group, store_dir: str, free_group: bool = True
    ) -> None:
        self.sc, self.rank, self.store_dir = sc, rank, store_dir
        self.free_group = free_group
        self.r2t, self.kv, self.allocator = build_pools(sc)
        self.tree = RadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=self.r2t,
                token_to_kv_pool_allocator=self.allocator,
                page_size=sc.page_size,
                tp_cache_group=tp_group,
            )
        )
        self.cur = Step(-1)
        self.owned: dict[str, list[int]] = {}
        self.tree_slots: dict[str, list[int]] = {}
        self.reqs: dict[str, Req] = {}
        self.slot_owner: dict[int, tuple[str, int]] = {}
        self._instrument_device()
        self._seed_tree()
        self.mgr = manager_cls(
            req_to_token_pool=self.r2t,
            token_to_kv_pool_allocator=self.allocator,
            tp_group=tp_group,
            tree_cache=self.tree,
        )
        self.probe = probe_for(manager_cls)
        self.host = self.probe.host_pool(self.mgr)
        self._instrument_host()
        self._inject_backup_failures()
        self.seen_files: set[str] = set()

    # --- instrumentation: below the tree, so a free through any path is seen once per page
    def _instrument_device(self) -> None:
        a, ps = self.allocator, self.sc.page_size
        if isinstance(a, PagedTokenToKVPoolAllocator):
            release = a._release_page_ids

            def _release_page_ids(*page_ids):
                with observing():
                    for ids in page_ids:
                        for p in ids.tolist():
                            self._freed(range(p * ps, (p + 1) * ps))
                return release(*page_ids)

            a._release_page_ids = _release_page_ids
        else:
            free = a.free

            def _free(free_index):
                if a.free_group is None:  # in a free group the slots go back at its end, through here again
                    with observing():
                        self._freed(free_index.tolist())
                return free(free_index)

            a.free = _free
        free_kv_row = self.tree.free_kv_row

        def _free_kv_row(kv, ranges):
            rid = next((r for r, req in self.reqs.items() if req.kv is kv), "?")
            with observing():
                self.cur.freed_ranges.append((rid, [tuple(map(int, x)) for x in ranges]))
            return free_kv_row(kv, ranges)

        self.tree.free_kv_row = _free_kv_row

    def _freed(self, slots) -> None:
        for slot in slots:
            self.cur.device_freed.append(slot)
            self.cur.freed_at.append(self.slot_owner.pop(slot, ("?", slot)))

    def _own(self, owner: str, slots: torch.Tensor, first_pos: int) -> None:
        for k, slot in enumerate(slots.tolist()):
            self.slot_owner[slot] = (owner, first_pos + k)

    def _instrument_host(self) -> None:
        host = self.host
        if host is None:
            self.host_free_at_start = None
            return
        self.host_free_at_start = host.available_size()
        alloc, free = host.alloc, host.free

        def _alloc(n):
            got = alloc(n)
            if got is not None:
                self.cur.host_alloc += len(got)
            return got

        def _free(indices):
            self.cur.host_freed += len(indices)
            return free(indices)

        host.alloc, host.free = _alloc, _free

    def _inject_backup_failures(self) -> None:
        if not self.sc.fail_backup_pages:
            return
        storage = self.probe.storage(self.mgr)
        if storage is None:
            raise NotImplementedError(f"{type(self.mgr).__name__}: the probe names no storage to fail")
        original, counter, failing = storage.set, [0], self.sc.fail_backup_pages

        def _set(key, value=None, *args, **kwargs):
            ordinal = counter[0]
            counter[0] += 1
            if ordinal in failing:
                return False
            return original(key, value, *args, **kwargs)

        storage.set = _set

    # --- KV
    def _write_kv(self, spec: ReqSpec, slots: torch.Tensor, positions: torch.Tensor) -> None:
        shape = _kv_shape(self.sc)
        tags = position_tags(spec)[positions]
        dev = slots.device
        for layer in range(self.sc.layers):
            if self.sc.pool == "mha":
                self.kv.k_buffer[layer][slots] = kv_values(tags, layer, 0, self.rank, shape).to(dev)
                self.kv.v_buffer[layer][slots] = kv_values(tags, layer, 1, self.rank, shape).to(dev)
            else:
                self.kv.kv_buffer[layer][slots] = kv_values(tags, layer, 0, self.rank, shape).to(dev)

    def _alloc(self, n: int) -> torch.Tensor:
        ps = self.sc.page_size
        got = self.allocator.alloc(-(-n // ps) * ps)
        assert got is not None, "device pool too small for the scenario"
        return got

    def _seed_tree(self) -> None:
        """The decode-side radix tree holds each request's `prefix`, written earlier (owned by the tree)."""
        for spec in self.sc.requests:
            if not spec.prefix:
                continue
            assert spec.prefix % self.sc.page_size == 0 and spec.prefix <= len(spec.prompt)
            slots = self._alloc(spec.prefix)[: spec.prefix]
            self._write_kv(spec, slots, torch.arange(spec.prefix))
            extra_key, cache_salt = _namespace(spec)
            key = RadixKey(array("q", spec.prompt[: spec.prefix]), extra_key=extra_key, cache_salt=cache_salt)
            self.tree.insert(InsertParams(key=key, value=slots.clone()))
            self.tree_slots[spec.rid] = slots.tolist()
            self._own(f"<tree>:{spec.rid}", slots, 0)

    # --- scheduler actions
    def admit(self, spec: ReqSpec) -> None:
        """A request whose prompt KV the prefill instance transferred, with its first token sampled."""
        req = Req(
            spec.rid,
            "",
            array("q", spec.prompt),
            SamplingParams(max_new_tokens=spec.decode + 1),
            extra_key=spec.extra_key,
            cache_salt=spec.cache_salt,
            lora_id=spec.lora_id,
        )
        self.reqs[spec.rid] = req
        self.r2t.alloc([req])
        row = req.kv.req_pool_idx
        prefix = 0
        if spec.prefix:
            key = RadixKey(array("q", spec.prompt), extra_key=req.extra_key, cache_salt=req.cache_salt)
            match = self.tree.match_prefix(MatchPrefixParams(key=key))
            prefix = match.device_prefix_len
            assert prefix == spec.prefix, (prefix, spec.prefix)
            req.lock = self.tree.lock(match.last_device_node)
            matched = self.tree.path_device_indices(match.last_device_node)[:prefix]
            self.r2t.write((row, slice(0, prefix)), matched.to(torch.int32))
        req.kv.cache_protected_len = prefix
        own = len(spec.prompt) + 1 - prefix + spec.spec_extra  # the prompt and the first decode position
        slots = self._alloc(own)
        n = slots.numel()
        self.r2t.write((row, slice(prefix, prefix + n)), slots.to(torch.int32))
        self.owned[spec.rid] = slots.tolist()
        self._own(spec.rid, slots, prefix)
        req.kv.kv_allocated_len = prefix + n
        fresh = torch.arange(prefix, len(spec.prompt))  # positions (host): they pick the KV values
        self._write_kv(spec, self.r2t.req_to_token[row, prefix : len(spec.prompt)].to(torch.int64), fresh)
        req.kv.kv_committed_len = len(spec.prompt)
        req.output_ids.append(spec.outputs()[0])

    def decode(self, spec: ReqSpec) -> None:
        req = self.reqs[spec.rid]
        row = req.kv.req_pool_idx
        pos = len(req.origin_input_ids) + len(req.output_ids) - 1  # the token fed to this forward
        if pos >= req.kv.kv_allocated_len:
            slots = self._alloc(pos + 1 - req.kv.kv_allocated_len + spec.spec_extra)
            start = req.kv.kv_allocated_len
            self.r2t.write((row, slice(start, start + slots.numel())), slots.to(torch.int32))
            self.owned[spec.rid] += slots.tolist()
            self._own(spec.rid, slots, start)
            req.kv.kv_allocated_len = start + slots.numel()
        slot = self.r2t.req_to_token[row, pos : pos + 1].to(torch.int64)
        self._write_kv(spec, slot, torch.tensor([pos]))
        req.kv.kv_committed_len = pos + 1
        req.output_ids.append(spec.outputs()[len(req.output_ids)])

    def finish(self, spec: ReqSpec) -> None:
        req = self.reqs[spec.rid]
        if spec.end == "abort":
            req.finished_reason = FINISH_ABORT("aborted by the scenario")
        else:
            req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))

    def decode_and_offload(self, spec: ReqSpec, t: int) -> None:
        """Step t of `spec`'s decode, then the manager calls of SGLang's result processing for it."""
        self.decode_step(spec, t)
        self.result_calls(spec, t)

    def decode_step(self, spec: ReqSpec, t: int) -> None:
        """Step t of `spec`'s decode: its token's slot and KV, and its finish when this is its last step."""
        self.decode(spec)
        if t == spec.start + spec.decode:
            self.finish(spec)

    def result_calls(self, spec: ReqSpec, t: int) -> None:
        """The manager calls of SGLang's result processing for `spec` at step t: its offload, and for a request
        that finished with this step its release when no chunk was submitted."""
        req = self.reqs[spec.rid]
        finished = t == spec.start + spec.decode
        with manager_call():
            ok = self.mgr.offload_kv_cache(req)
            if finished and not ok:
                self.mgr.finalize_release_on_finish(req)
        if ok:
            self.cur.offloads.append(spec.rid)

    def end_step(self, live: dict[str, bool], steps: list[Step]) -> None:
        """After the step's calls: settle the backups, record the requests released and the keys stored."""
        self.settle()
        for rid, req in self.reqs.items():
            if live.get(rid) and req.kv.req_pool_idx is None:
                live[rid] = False
                self.cur.released.append(rid)
        self.cur.keys = self._new_keys()
        steps.append(self.cur)

    def settle(self) -> None:
        self.probe.settle(self.mgr)

    def _new_keys(self) -> list[str]:
        # Ranks share the directory; MHA pages carry the rank in their name, MLA pages are shared.
        suffix = f"_{MODEL}.bin" if self.sc.pool == "mla" else f"_{MODEL}_{self.rank}_{self.sc.tp}.bin"
        names = {n for n in os.listdir(self.store_dir) if n.endswith(suffix)}
        new = names - self.seen_files
        self.seen_files |= new
        return sorted(n.split("_", 1)[0] for n in new)

    def stored(self) -> dict[str, bytes]:
        out = {}
        for name in sorted(self.seen_files):
            out[name.split("_", 1)[0]] = (Path(self.store_dir) / name).read_bytes()
        return out

    def run(self, manager_name: str) -> RunResult:
        sc = self.sc
        steps = []
        live_rows = {}
        for t in range(sc.steps):
            self.cur = Step(t)
            if t not in sc.skip_progress:
                self.settle()
                self.probe.before_check(self.mgr)
                with manager_call():
                    self.mgr.check_offload_progress()
            for spec in sc.requests:
                if spec.start == t:
                    self.admit(spec)
                    live_rows[spec.rid] = True
            if t in sc.retract_at:
                self.settle()
                self.probe.before_check(self.mgr)
                try:
                    with manager_call():
                        self.mgr.drain_before_retraction()
                    self.cur.retract = "ok"
                except RuntimeError as e:
                    self.cur.retract = f"refused: {e}"
            batch = [spec for spec in sc.requests if spec.start < t <= spec.start + spec.decode]
            if self.free_group:
                for spec in batch:
                    self.decode_step(spec, t)
                with free_group(self.allocator):
                    for spec in batch:
                        self.result_calls(spec, t)
            else:
                for spec in batch:
                    self.decode_and_offload(spec, t)
            self.end_step(live_rows, steps)
        self.cur = Step(sc.steps)
        expected, chains = {}, {}
        for spec in sc.requests:
            mine = expected_keys(sc, spec, self.rank)
            assert all(expected[k][2] == v[2] for k, v in mine.items() if k in expected), "one key, two contents"
            expected.update(mine)
            chains[spec.rid] = [(k, page) for k, (_, page, _) in mine.items()]
        final = {
            rid: {
                "req_pool_idx": r.kv.req_pool_idx,
                "kv_allocated_len": r.kv.kv_allocated_len,
                "cache_protected_len": r.kv.cache_protected_len,
                "lock": r.lock is not None,
            }
            for rid, r in self.reqs.items()
        }
        final["<tree>"] = {"protected": self.tree.protected_size(), "evictable": self.tree.evictable_size()}
        result = RunResult(
            scenario=sc.name,
            rank=self.rank,
            tp=sc.tp,
            manager=manager_name,
            steps=steps,
            stored=self.stored(),
            expected=expected,
            chains=chains,
            owned=self.owned,
            tree_slots=self.tree_slots,
            final=final,
            host_free_at_start=self.host_free_at_start,
            host_free_at_end=self.host.available_size() if self.host is not None else None,
            offload_stride=getattr(self.mgr, "offload_stride", None),
        )
        self.probe.close(self.mgr)
        return result


def _run_rank(sc: Scenario, manager_cls: type, rank: int, tp_group, store_dir: str, free_group: bool) -> RunResult:
    with published(sc, rank, store_dir):
        run = _Run(sc, manager_cls, rank, tp_group, store_dir, free_group)
        return run.run(f"{manager_cls.__module__}.{manager_cls.__qualname__}")


def _tp_worker(rank: int, sc: Scenario, manager_cls: type, workdir: str, free_group: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{workdir}/pg", rank=rank, world_size=sc.tp)
    try:
        result = _run_rank(sc, manager_cls, rank, dist.group.WORLD, f"{workdir}/l3", free_group)
        with open(f"{workdir}/rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def _start_forkserver() -> None:
    """The TP ranks fork from a server that has imported this harness, sglang and torch once (about 12 s of CPU
    on the 2-core CI machine, which spawn paid for every rank of every TP run), and nothing is forked from the
    multi-threaded pytest process. Python 3.11's forkserver ignores the sys.path it is given, so the server
    finds this module through PYTHONPATH, set for its start alone."""
    import multiprocessing
    import multiprocessing.forkserver

    multiprocessing.set_forkserver_preload([__name__])
    before = os.environ.get("PYTHONPATH")
    here = Path(__file__).parent
    os.environ["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent)] + ([before] if before else []))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def run_scenario(
    sc: Scenario | str, manager_cls: type = UpstreamManager, *, free_group: bool = True
) -> list[RunResult]:
    """Run one scenario; one result per TP rank. `free_group`: each step's result calls inside the allocator's
    free group, as SGLang's decode result processing makes them (see the module's docstring)."""
    if isinstance(sc, str):
        sc = BY_NAME[sc]
    workdir = tempfile.mkdtemp(prefix=f"kvfsm-{sc.name}-")
    try:
        if sc.tp == 1:
            return [_run_rank(sc, manager_cls, 0, _tp_group_world1(), f"{workdir}/l3", free_group)]
        import torch.multiprocessing as mp

        _start_forkserver()
        mp.start_processes(
            _tp_worker, args=(sc, manager_cls, workdir, free_group), nprocs=sc.tp, join=True, start_method="forkserver"
        )
        out = []
        for rank in range(sc.tp):
            with open(f"{workdir}/rank{rank}.pkl", "rb") as f:
                out.append(pickle.load(f))
        return out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def diff_runs(a: list[RunResult], b: list[RunResult]) -> list[str]:
    """What differs between two runs of one scenario, in the fields the differential test compares, per
    rank and step: accepted offloads, releases, device frees by (owner, row position), host slots taken
    and returned, storage keys, and at the end the stored bytes. Empty when they match."""
    out: list[str] = []
    if len(a) != len(b):
        return [f"{len(a)} ranks vs {len(b)}"]
    for ra, rb in zip(a, b):
        where = f"{ra.scenario} rank {ra.rank}"
        if len(ra.steps) != len(rb.steps):
            out.append(f"{where}: {len(ra.steps)} steps vs {len(rb.steps)}")
        for sa, sb in zip(ra.steps, rb.steps):
            for name in ("offloads", "released", "host_alloc", "host_freed", "keys", "retract"):
                va, vb = getattr(sa, name), getattr(sb, name)
                if va != vb:
                    out.append(f"{where} step {sa.step}: {name} {va!r} vs {vb!r}")
            if sorted(sa.freed_at) != sorted(sb.freed_at):
                out.append(f"{where} step {sa.step}: device frees {sorted(sa.freed_at)} vs {sorted(sb.freed_at)}")
        for key in sorted(set(ra.stored) | set(rb.stored)):
            if ra.stored.get(key) != rb.stored.get(key):
                out.append(f"{where}: stored bytes of {key} differ")
    return out


def warm() -> None:
    """Build upstream's native page hash once (a JIT C++ extension), so tests do not pay for it."""
    assert get_hash_str([1, 2, 3], None)


if __name__ == "__main__":
    if sys.argv[1:] == ["--warm"]:
        warm()
    else:
        for name in sys.argv[1:] or list(BY_NAME):
            for r in run_scenario(name):
                print(
                    r.scenario,
                    r.rank,
                    [
                        (s.step, s.offloads, s.released, len(s.device_freed), s.host_alloc, s.host_freed, len(s.keys))
                        for s in r.steps
                    ],
                )
