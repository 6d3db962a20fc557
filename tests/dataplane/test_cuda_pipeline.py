"""The staged copy pipeline (CudaCopyEngine backends "dma" and "hybrid") and the "auto" choice.

CPU: the planning (host order, hybrid split, ramped chunks, run clipping), the backend policy, and the
whole pipeline launch run through a stream simulator (random interleavings allowed by the events, DMA by
memmove), bit-exact. GPU (marked, skipped without CUDA): round trips through the real engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfsm.dataplane import HAVE_TRITON, DeviceKVPool, HostKVPool, KVCacheConfig
from kvfsm.dataplane.copy import dma
from kvfsm.dataplane.copy.base import plan_copy
from kvfsm.dataplane.copy.cuda import AutoPolicy, choose_backend, mean_copy_bytes
from kvfsm.dataplane.copy.pipeline import PipelineSettings, head_tokens, launch_pipeline

from .helpers import bits, check_orders_after_compute_and_never_blocks, fill_random, make_device_pool
from .stream_sim import SimOps

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MiB, KiB = 2**20, 2**10


# ---- planning ---------------------------------------------------------------------------------------


def test_order_by_host_matches_stable_argsort() -> None:
    rng = np.random.default_rng(0)
    for h in (
        np.array([], dtype=np.int64),
        np.array([5]),
        np.arange(10),
        rng.permutation(1000)[:300],
        np.array([7, 3, 3, 1, 7, 0]),
        np.array([2**50, 3, 2**49]),
    ):
        assert np.array_equal(dma.order_by_host(h), np.argsort(h, kind="stable"))


def test_mean_run_tokens_is_a_lower_bound_of_the_sorted_runs() -> None:
    assert dma.mean_run_tokens([]) == 0.0
    assert dma.mean_run_tokens([4, 5, 6, 7, 0, 1, 2, 3]) == 4.0
    rng = np.random.default_rng(1)
    for _ in range(20):
        h = rng.permutation(200)[:80]
        sorted_runs = dma.host_runs_array(np.sort(h)).shape[0]
        assert dma.mean_run_tokens(h) <= h.size / sorted_runs + 1e-9


def test_select_short_runs_takes_exact_counts_shortest_first() -> None:
    lengths = [3, 1, 2, 1, 5]
    m = dma.select_short_runs(lengths, 2)  # tokens: run 0 at 0-2, run 1 at 3, run 2 at 4-5, run 3 at 6, run 4 at 7-11
    assert np.flatnonzero(m).tolist() == [3, 6]  # the two single-token runs
    m = dma.select_short_runs(lengths, 3)  # both singles, then the first token of the 2-run
    assert m.sum() == 3 and m[3] and m[6] and m[4] and not m[5]
    assert dma.select_short_runs(lengths, 100).all()
    assert not dma.select_short_runs(lengths, 0).any()


@pytest.mark.parametrize(
    "head,direct,order",
    [(0, 0, True), (5, 0, True), (0, 20, True), (7, 13, True), (0, 0, False), (3, 9, False), (0, 200, True)],
)
def test_plan_pipeline_partitions_the_batch(head: int, direct: int, order: bool) -> None:
    rng = np.random.default_rng(head * 31 + direct)
    pages = rng.permutation(60)[:25]
    h = (pages[:, None] * 4 + np.arange(4)).reshape(-1)[:97]  # page 4 with a ragged tail
    n = h.size
    pp = dma.plan_pipeline(h, head=head, direct_tokens=direct, host_order=order)
    assert pp.head == min(head, n)
    assert sorted(pp.perm.tolist()) == list(range(pp.head, n))  # every other position exactly once
    assert pp.n_direct == min(direct, n - pp.head)
    staged = h[pp.perm[: pp.n_staged]]
    if order:
        assert (np.diff(staged) > 0).all()  # staging walks host slots upwards
    r = pp.runs
    assert r[:, 2].sum() == pp.n_staged and (r[:, 0] == np.cumsum(r[:, 2]) - r[:, 2]).all()
    for p, slot, length in r.tolist():
        assert staged[p : p + length].tolist() == list(range(slot, slot + length))
    if pp.n_direct and order:  # the direct share is made of the shortest runs of the rest
        rest = np.sort(h[pp.head :])
        runs = dma.host_runs_array(rest)
        lens_direct = set(np.repeat(runs[:, 2], runs[:, 2])[np.isin(rest, h[pp.perm[pp.n_staged :]])].tolist())
        lens_staged = set(np.repeat(runs[:, 2], runs[:, 2])[np.isin(rest, staged)].tolist())
        assert max(lens_direct) <= min(lens_staged, default=10**9)  # a run split in two has the same length


def test_chunk_bounds_ramp_and_cover() -> None:
    assert dma.chunk_bounds(0, 10, 100) == [0]
    assert dma.chunk_bounds(35, 10, 100) == [0, 10, 20, 30, 35]
    assert dma.chunk_bounds(100, 10, 80, first_bytes=10) == [
        0,
        1,
        3,
        7,
        15,
        23,
        31,
        39,
        47,
        55,
        63,
        71,
        79,
        87,
        95,
        100,
    ]
    b = dma.chunk_bounds(8192, 128 * KiB, 256 * MiB, 8 * MiB)
    sizes = np.diff(b) * 128 * KiB // MiB
    assert b[-1] == 8192 and sizes[:6].tolist() == [8, 16, 32, 64, 128, 256] and sizes.max() == 256
    assert dma.chunk_bounds(5, 10 * MiB, 1, 1) == [0, 1, 2, 3, 4, 5]  # chunks of at least one token
    b = dma.chunk_bounds(8192, 128 * KiB, 256 * MiB, 8 * MiB, 8 * MiB)  # ramp up and down
    sizes = (np.diff(b) * 128 * KiB // MiB).tolist()
    assert b[-1] == 8192 and sizes[:6] == [8, 16, 32, 64, 128, 256] and sizes[-5:] == [128, 64, 32, 16, 8]
    assert dma.chunk_bounds(10, 1, 8, 1, 1) == [0, 1, 3, 7, 10]  # too short for both ramps
    for n in range(1, 60):
        for args in ((3, 1, 1), (8, 2, 1), (5, 0, 2), (4, 1, 0)):
            b = dma.chunk_bounds(n, 1, *args)
            assert b[0] == 0 and b[-1] == n and (np.diff(b) >= 1).all() and (np.diff(b) <= max(1, args[0])).all()


def test_clip_runs_splits_runs_at_chunk_edges() -> None:
    runs = dma.host_runs_array([10, 11, 12, 13, 40, 41, 7, 90, 91, 92])
    bounds = [0, 3, 5, 6, 10]
    pieces = [dma.clip_runs(runs, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    assert pieces[0].tolist() == [[0, 10, 3]]
    assert pieces[1].tolist() == [[3, 13, 1], [4, 40, 1]]
    assert pieces[2].tolist() == [[5, 41, 1]]
    assert pieces[3].tolist() == [[6, 7, 1], [7, 90, 3]]
    assert dma.clip_runs(runs, 10, 10).shape == (0, 3)


def test_split_by_count() -> None:
    f = dma.merge_adjacent(np.arange(10) * 100, np.arange(10) * 1000, [8] * 10, merge=False)
    parts = dma.split_by_count(f, 4)
    assert [p.count for p in parts] == [4, 4, 2]
    assert np.concatenate([p.dst for p in parts]).tolist() == f.dst.tolist()
    assert dma.split_by_count(f.part(0, 0), 4) == []


# ---- policy -------------------------------------------------------------------------------------------


def _llama_host(layout: str, page_size: int) -> HostKVPool:
    return HostKVPool(KVCacheConfig.llama3_8b(), 64, page_size, layout, pin_memory=False)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "layout,ps,d2h,h2d",
    [
        ("page_first", 1, "triton", "dma"),  # 64 KiB copies: DMA only pays for load-back
        ("page_first", 16, "dma", "dma"),  # 1 MiB copies
        ("page_first", 64, "dma", "dma"),
        ("layer_first", 1, "triton", "triton"),  # 2 KiB rows
        ("layer_first", 16, "triton", "dma"),  # 32 KiB: DMA pays for load-back
        ("layer_first", 64, "triton", "dma"),  # 128 KiB
    ],
)
def test_auto_choice_for_llama_shapes(layout: str, ps: int, d2h: str, h2d: str) -> None:
    host = _llama_host(layout, ps)
    rng = np.random.default_rng(ps)
    pages = rng.permutation(host.size // ps)[: max(1, 32 // ps)]
    hi = (pages[:, None] * ps + np.arange(ps)).reshape(-1)
    if ps == 1:  # random single slots rarely touch: runs of one
        hi = rng.permutation(host.size)[:32]
    mean = mean_copy_bytes(host, hi)
    gib = 4 * 2**30  # past AutoPolicy.d2h_min_bytes: offload weighs link efficiency too
    assert choose_backend("auto", "d2h", gib, mean, True) == d2h
    assert choose_backend("auto", "h2d", gib, mean, True) == h2d


def test_policy_edges() -> None:
    p = AutoPolicy()
    big, wide = 4 * 2**30, 4 * MiB
    assert choose_backend("auto", "d2h", 1 * MiB, wide, True) == "triton"  # too small for the pipeline
    # a decode step's offload (32 MiB at 4096 live): host time beats the pipeline's last percent of link
    assert choose_backend("auto", "d2h", 32 * MiB, wide, True) == "triton"
    assert choose_backend("auto", "h2d", 32 * MiB, wide, True) == "dma"
    assert choose_backend("auto", "d2h", p.d2h_min_bytes, wide, True) == "dma"
    # a full-model chunk (2048 tokens x 32 layers of Llama-3-8B): the scheduler's host time decides
    assert choose_backend("auto", "d2h", 256 * MiB, wide, True) == "triton"
    assert choose_backend("auto", "h2d", 256 * MiB, wide, True) == "dma"
    assert choose_backend("auto", "d2h", 0, wide, True) == "triton"
    assert choose_backend("auto", "d2h", big, wide, False) == "dma"  # no Triton: anything beats the torch path
    assert choose_backend("auto", "h2d", big, 4 * KiB, False) == "torch"
    for forced in ("triton", "torch", "dma", "hybrid"):
        assert choose_backend(forced, "d2h", big, wide, True) == forced
    # Very many tiny DMA copies never take the pipeline, forced or not (a driver crash on the H200); a few
    # tiny ones still do (the small-KV GPU tests exercise the pipeline that way).
    for forced in ("dma", "hybrid"):
        assert choose_backend(forced, "h2d", big, 2 * KiB, True) == "triton"
        assert choose_backend(forced, "h2d", big, 2 * KiB, False) == "torch"
        assert choose_backend(forced, "h2d", big, p.dma_floor_copy_bytes, True) == forced
        assert choose_backend(forced, "h2d", p.dma_max_small_copies * 16, 16, True) == forced
        assert choose_backend(forced, "h2d", 48 * MiB, 2 * KiB, True) == "triton"  # crashed intermittently
    hp = AutoPolicy(hybrid_fraction=0.5)
    assert choose_backend("auto", "d2h", big, 64 * KiB, True, hp) == "hybrid"
    assert choose_backend("auto", "h2d", big, 8 * KiB, True, hp) == "triton"
    assert choose_backend("auto", "h2d", big, p.h2d_min_copy_bytes, True) == "dma"
    assert choose_backend("auto", "d2h", big, p.d2h_min_copy_bytes, True) == "dma"
    assert choose_backend("auto", "d2h", big, p.d2h_min_copy_bytes - 1, True) == "triton"


def test_dma_rows_policy() -> None:
    """Big rows, few of them, addressable on the CPU: one DMA copy per row; anything else as before."""
    p, big = AutoPolicy(), 4 * 2**30
    block = 512 * KiB  # a transformers engine block, one row
    assert choose_backend("auto", "d2h", 8 * block, block, True, p, row_bytes=block, rows=8) == "dma_rows"
    assert choose_backend("auto", "h2d", 8 * block, block, False, p, row_bytes=block, rows=8) == "dma_rows"
    assert (
        choose_backend("auto", "d2h", 8 * block, block, True, p, row_bytes=p.rows_min_row_bytes - 1, rows=8) == "triton"
    )
    assert choose_backend("auto", "d2h", big, block, True, p, row_bytes=block, rows=p.rows_max_copies + 1) == "dma"
    assert choose_backend("auto", "d2h", 8 * block, block, True, p, row_bytes=block, rows=0) == "triton"  # GPU idx
    assert choose_backend("auto", "d2h", 32 * MiB, 4 * MiB, True, p, row_bytes=2 * KiB, rows=16384) == "triton"
    # forced: honoured up to the cap, else the direct kernel (tiny batched copies crashed the driver)
    assert choose_backend("dma_rows", "d2h", 4 * KiB, 2 * KiB, True, p, row_bytes=2 * KiB, rows=2) == "dma_rows"
    assert choose_backend("dma_rows", "h2d", big, 2 * KiB, True, p, row_bytes=2 * KiB, rows=24576) == "triton"
    assert choose_backend("dma_rows", "h2d", big, 2 * KiB, False, p, row_bytes=2 * KiB, rows=0) == "torch"


def test_head_tokens() -> None:
    assert head_tokens(8192, 128 * KiB, 32 * MiB, 256 * MiB) == 256
    assert head_tokens(1024, 128 * KiB, 32 * MiB, 256 * MiB) == 0  # 128 MiB copy: no head
    assert head_tokens(100, 10, 0, 0) == 0
    assert head_tokens(10, 10, 10**6, 0) == 5  # never more than half


# ---- the pipeline through the stream simulator ------------------------------------------------------


SETTINGS = {
    "one_chunk": dict(chunk_bytes=2**40, first_chunk_bytes=0, streams=1),
    "chunks_x1": dict(chunk_bytes=7, first_chunk_bytes=0, streams=1),  # in tokens x bytes_per_token below
    "ramp_x3": dict(chunk_bytes=16, first_chunk_bytes=1, last_chunk_bytes=2, streams=3, max_copies_per_call=3),
    "head_x2": dict(chunk_bytes=8, first_chunk_bytes=2, streams=2, head_bytes=5, head_min_bytes=0),
    "hybrid": dict(chunk_bytes=8, first_chunk_bytes=2, streams=2, direct_fraction=0.4),
    "hybrid_head": dict(
        chunk_bytes=6, first_chunk_bytes=1, streams=2, direct_fraction=0.5, head_bytes=4, head_min_bytes=0
    ),
    "all_direct": dict(
        chunk_bytes=8, first_chunk_bytes=0, streams=2, direct_fraction=1.0, head_bytes=3, head_min_bytes=0
    ),
    "batch_order": dict(chunk_bytes=8, first_chunk_bytes=2, streams=2, host_order=False),
}


def _settings(name: str, bpt: int) -> PipelineSettings:
    kw = dict(SETTINGS[name])
    for k in ("chunk_bytes", "first_chunk_bytes", "last_chunk_bytes", "head_bytes", "head_min_bytes"):
        if k in kw and kw[k] < 2**40:
            kw[k] = kw[k] * bpt
    return PipelineSettings(**kw)  # type: ignore[arg-type]


def _scattered(host: HostKVPool, n_pages: int, seed: int) -> torch.Tensor:
    ps = host.page_size
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(host.size // ps - 1, generator=g)[:n_pages] + 1
    return (pages[:, None] * ps + torch.arange(ps)).reshape(-1)


@pytest.mark.parametrize("name", sorted(SETTINGS))
@pytest.mark.parametrize("page_size", [1, 4])
def test_pipeline_round_trip_in_the_stream_simulator(
    config: KVCacheConfig, layout: str, page_size: int, name: str
) -> None:
    """Offload then load back through launch_pipeline in several random interleavings: bit-exact, the
    caller's stream respected, nothing else written, completion after all work, staging recorded."""
    bpt = config.bytes_per_token
    st = _settings(name, bpt)
    for seed in range(6):
        host = HostKVPool(config, 160, page_size, layout, pin_memory=False)  # type: ignore[arg-type]
        host.kv_buffer.zero_()
        assert host.alloc(host.size) is not None
        hi = _scattered(host, 48 // page_size, seed)
        n = hi.numel()
        dev = make_device_pool(config, 200, seed=seed)
        di = torch.randperm(199, generator=torch.Generator().manual_seed(seed + 7))[:n] + 1
        fresh = fill_random(torch.empty_like(dev.storage[:, :, di]), seed + 11)

        # offload: the caller's stream writes the rows just before submitting
        ops = SimOps()
        ops.enqueue("compute", lambda: dev.storage.index_copy_(2, di, fresh))
        keep: list[object] = []
        plan = plan_copy("d2h", dev, di, host, hi)
        done, info = launch_pipeline(ops, plan, st, keep)  # type: ignore[arg-type]
        ops.run(seed, done)
        assert done.fired
        assert torch.equal(bits(host.token_view()[:, :, hi]), bits(fresh))
        untouched = torch.ones(host.size, dtype=torch.bool)
        untouched[hi] = False
        assert not bits(host.token_view()[:, :, untouched]).any()
        _check_info(ops, info, st, n, bpt)

        # load-back into other device slots, which the caller's stream still writes before submitting
        back = DeviceKVPool.create(config, 200, "cpu")
        back.storage.zero_()
        dj = torch.randperm(199, generator=torch.Generator().manual_seed(seed + 3))[:n] + 1
        ops = SimOps()
        ops.enqueue("compute", lambda: back.storage.index_fill_(2, dj, 7.0))
        plan = plan_copy("h2d", back, dj, host, hi)
        done, info = launch_pipeline(ops, plan, st, [])  # type: ignore[arg-type]
        ops.run(seed + 100, done)
        assert torch.equal(bits(back.storage[:, :, dj]), bits(fresh))
        others = torch.ones(200, dtype=torch.bool)
        others[dj] = False
        assert not bits(back.storage[:, :, others]).any()
        _check_info(ops, info, st, n, bpt)


def _check_info(ops: SimOps, info: dict, st: PipelineSettings, n: int, bpt: int) -> None:
    assert info["head_tokens"] + info["direct_tokens"] + info["staged_tokens"] == n
    assert info["direct_tokens"] + info["head_tokens"] == (
        round(st.direct_fraction * n) if st.direct_fraction else info["head_tokens"]
    )
    if info["staged_tokens"]:
        bounds = dma.chunk_bounds(info["staged_tokens"], bpt, st.chunk_bytes, st.first_chunk_bytes, st.last_chunk_bytes)
        assert info["chunks"] == len(bounds) - 1
        assert info["batch_calls"] == len(ops.batches) >= info["chunks"]
        assert sum(c for _, c in ops.batches) == info["copies"]
        assert max(c for _, c in ops.batches) <= st.max_copies_per_call
        if st.max_copies_per_call >= info["copies"]:  # one call per chunk and copy stream
            assert info["batch_calls"] <= info["chunks"] * st.streams
        (staging,) = ops.staging
        used = {s for s, _ in ops.batches}
        assert used <= ops.recorded_streams[staging.untyped_storage().data_ptr()]
    else:
        assert not ops.batches and not ops.staging


def test_head_only_when_the_callers_stream_is_idle(config: KVCacheConfig) -> None:
    """Behind compute the copy needs no head (planning is hidden): all of it goes through staging."""
    host = HostKVPool(config, 128, 1, "page_first", pin_memory=False)
    assert host.alloc(128) is not None
    dev = make_device_pool(config, 128, seed=2)
    hi, di = torch.arange(64), torch.arange(1, 65)
    st = _settings("head_x2", config.bytes_per_token)
    for idle, head in ((True, 5), (False, 0)):
        ops = SimOps()
        ops.idle = idle
        done, info = launch_pipeline(ops, plan_copy("d2h", dev, di, host, hi), st, [])  # type: ignore[arg-type]
        ops.run(0, done)
        assert (info["head_tokens"], info["staged_tokens"]) == (head, 64 - head)
        assert torch.equal(bits(host.token_view()[:, :, hi]), bits(dev.storage[:, :, di]))


def test_pipeline_with_one_chunk_makes_one_call_per_stream(config: KVCacheConfig) -> None:
    host = HostKVPool(config, 128, 16, "page_first", pin_memory=False)
    assert host.alloc(128) is not None
    hi = _scattered(host, 4, 0)
    dev = make_device_pool(config, 128, seed=1)
    di = torch.arange(1, 65)
    for streams in (1, 2, 4):
        ops = SimOps()
        st = PipelineSettings(chunk_bytes=2**40, first_chunk_bytes=0, streams=streams)
        done, info = launch_pipeline(ops, plan_copy("d2h", dev, di, host, hi), st, [])  # type: ignore[arg-type]
        ops.run(0, done)
        assert info["chunks"] == 1 and len(ops.batches) == min(streams, info["copies"])
        assert torch.equal(bits(host.token_view()[:, :, hi]), bits(dev.storage[:, :, di]))


# ---- GPU: the real engine ---------------------------------------------------------------------------


def _gpu_round_trip(
    eng: object, config: KVCacheConfig, layout: str, page_size: int, n_pages: int, expect: tuple[str, str] | None = None
) -> None:
    host = HostKVPool(config, 4 * n_pages * page_size, page_size, layout)  # type: ignore[arg-type]
    host.kv_buffer.zero_()
    assert host.alloc(host.size) is not None
    hi = _scattered(host, n_pages, 5)
    n = hi.numel()
    dev = make_device_pool(config, 3 * n + 1, "cuda", seed=3)
    g = torch.Generator().manual_seed(9)
    di = (torch.randperm(3 * n, generator=g)[:n] + 1).cuda()
    h = eng.submit_d2h(dev, di, host, hi)  # type: ignore[attr-defined]
    h.wait()
    assert h.done()
    assert torch.equal(bits(host.token_view()[:, :, hi]), bits(dev.storage[:, :, di].cpu()))
    untouched = torch.ones(host.size, dtype=torch.bool)
    untouched[hi] = False
    assert not bits(host.token_view()[:, :, untouched]).any()
    back = DeviceKVPool.create(config, 3 * n + 1, "cuda")
    back.storage.zero_()
    dj = (torch.randperm(3 * n, generator=g)[:n] + 1).cuda()
    h2 = eng.submit_h2d(host, hi, back, dj)  # type: ignore[attr-defined]
    h2.wait_stream()
    torch.cuda.synchronize()
    assert torch.equal(bits(back.storage[:, :, dj]), bits(dev.storage[:, :, di]))
    others = torch.ones(3 * n + 1, dtype=torch.bool, device="cuda")
    others[dj] = False
    assert not bool(back.storage[:, :, others].view(torch.uint8).any())
    if expect is not None:
        assert (h.backend, h2.backend) == expect, (h.backend, h2.backend, h.info)


def _small_pipeline_engine(backend: str, bpt: int, **kw: object) -> object:
    from kvfsm.dataplane import CudaCopyEngine

    args: dict[str, object] = dict(
        backend=backend,
        dma_chunk_bytes=6 * bpt,
        dma_first_chunk_bytes=bpt,
        dma_d2h_streams=2,
        dma_h2d_streams=3,
        dma_head_bytes=3 * bpt,
        dma_head_min_bytes=0,
    )
    args.update(kw)
    return CudaCopyEngine(**args)  # type: ignore[arg-type]


@gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["dma", "hybrid", "auto"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_pipeline_round_trip_tiny(backend: str, config: KVCacheConfig, layout: str, page_size: int) -> None:
    """Tiny KV with chunks of a few tokens, several copy streams, a head and (hybrid) a direct share."""
    if backend == "hybrid" and not HAVE_TRITON:
        pytest.skip("triton not installed")
    for kw in ({}, {"host_order": False}, {"hybrid_fraction": 0.3, "dma_head_bytes": 0}):
        eng = _small_pipeline_engine(backend, config.bytes_per_token, **kw)
        _gpu_round_trip(eng, config, layout, page_size, 64 // page_size if page_size > 1 else 40)


@gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["dma", "hybrid", "auto"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_pipeline_round_trip_llama(backend: str, layout: str, page_size: int) -> None:
    """Llama-3-8B KV, 48 MiB per copy (auto loads back through the pipeline and offloads through the
    direct kernel: a decode step's offload below AutoPolicy.d2h_min_bytes), default engine settings, plus
    a head."""
    from kvfsm.dataplane import CudaCopyEngine

    if backend == "hybrid" and not HAVE_TRITON:
        pytest.skip("triton not installed")
    cfg = KVCacheConfig.llama3_8b()
    expect = None
    if backend == "auto" and HAVE_TRITON:
        h2d_dma = layout == "page_first" or page_size == 16  # copies of 64 KiB / 1 MiB, 32 KiB; not 2 KiB rows
        expect = ("triton", "dma" if h2d_dma else "triton")  # 48 MiB < d2h_min_bytes: offload takes the kernel
    n_pages = 384 // page_size
    for eng in (
        CudaCopyEngine(backend=backend),  # type: ignore[arg-type]
        CudaCopyEngine(
            backend=backend,
            dma_head_min_bytes=0,
            dma_head_bytes=4 * MiB,  # type: ignore[arg-type]
            dma_chunk_bytes=8 * MiB,
            dma_d2h_streams=2,
        ),
    ):
        _gpu_round_trip(eng, cfg, layout, page_size, n_pages, expect)


@gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["dma", "hybrid"])
def test_cuda_pipeline_orders_after_compute_and_never_blocks(backend: str) -> None:
    from kvfsm.dataplane import CudaCopyEngine

    if backend == "hybrid" and not HAVE_TRITON:
        pytest.skip("triton not installed")
    cfg = KVCacheConfig.llama3_8b()
    dev = DeviceKVPool.create(cfg, 2048, "cuda")
    host = HostKVPool(cfg, 1024, 1, "page_first")
    eng = CudaCopyEngine(
        backend=backend,
        dma_chunk_bytes=8 * MiB,
        dma_head_min_bytes=0,  # type: ignore[arg-type]
        dma_head_bytes=4 * MiB,
        dma_d2h_streams=2,
    )
    g = torch.Generator().manual_seed(11)
    di = (torch.randperm(2047, generator=g)[:512] + 1).cuda()
    assert host.alloc(1024) is not None
    hi = torch.randperm(1024, generator=g)[:512]
    _, h2 = check_orders_after_compute_and_never_blocks(eng, dev, host, di, hi)
    assert h2.info["chunks"] >= 1 and h2.info["staged_tokens"] > 0


@gpu
@needs_cuda
def test_cuda_engine_triton_host_order_round_trip(config: KVCacheConfig, layout: str) -> None:
    from kvfsm.dataplane import CudaCopyEngine

    if not HAVE_TRITON:
        pytest.skip("triton not installed")
    _gpu_round_trip(
        CudaCopyEngine(backend="triton", triton_host_order=True), config, layout, 1, 40, ("triton", "triton")
    )
