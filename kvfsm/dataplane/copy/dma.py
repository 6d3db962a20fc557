"""Planning of the staged pipeline's copies (pipeline.py) between a contiguous device staging buffer laid
out like the host pool and runs of consecutive host slots. Pure numpy, so it is tested on CPU; the copy
lists it makes are executed by cuda_driver.

- Geometry: `geometry` says how a run maps to rows of bytes in the host pool and the staging buffer.
- Flat copy lists: `flat_plan` turns runs (`host_runs_array`) into FlatCopies, three numpy arrays of 1-D
  copies (dst, src, size) that one cuMemcpyBatchAsync call takes; `merge_adjacent` fuses copies adjacent
  in both source and destination; `split_by_bytes` / `split_by_count` spread a list over copy streams and
  driver calls.
- Pipeline planning: `plan_pipeline` stages a copy in host-slot order (`order_by_host`: each chunk's
  copies walk host memory upwards, and host neighbours become one run) and can hand the shortest runs to
  the direct kernel (`select_short_runs`); `chunk_bounds` cuts the staged tokens into chunks that ramp up
  to the chunk size, and `clip_runs` gives each chunk its runs (splitting runs at chunk edges).
  `mean_run_tokens` is the "auto" policy's cheap estimate of the mean copy (cuda_copy.mean_copy_bytes).
- Direct row copies: `row_copies` addresses every token row of a copy straight between the two pools, for
  the "dma_rows" backend (rows large enough that one DMA copy each is efficient).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ..pools.host_pool import HostKVPool

Run = tuple[int, int, int]  # (position in the batch, first host slot, length in tokens)


@dataclass(frozen=True)
class Geometry:
    """How a run of host slots maps to rows of bytes, for one host layout and batch size n."""

    unit: int  # bytes per token within one row of a run
    rows: int  # rows per run: planes x layers (layer_first) or planes (page_first)
    host_pitch: int  # bytes between consecutive rows in the host pool
    stage_pitch: int  # bytes between consecutive rows in the staging buffer
    stage_shape: tuple[int, ...]
    page_first: bool

    def stage_view(self, staging: torch.Tensor) -> torch.Tensor:
        """The staging buffer as `(planes, layers, n, H, D)`, the copy kernels' view."""
        return staging.transpose(1, 2) if self.page_first else staging


def geometry(host: HostKVPool, n: int) -> Geometry:
    c = host.config
    row, planes, layers, size = c.row_bytes, c.num_planes, c.num_layers, host.size
    if host.layout == "layer_first":
        return Geometry(row, planes * layers, size * row, n * row, (planes, layers, n, *c.token_shape), False)
    return Geometry(
        layers * row, planes, size * layers * row, n * layers * row, (planes, n, layers, *c.token_shape), True
    )


# ---- flat (1-D) copy lists: one batched driver call per chunk ---------------------------------------


@dataclass(frozen=True, eq=False)
class FlatCopies:
    """1-D copies as three equally long arrays: dst and src addresses, sizes in bytes (all uint64, the
    layout cuMemcpyBatchAsync reads: CUdeviceptr and size_t are 64-bit)."""

    dst: np.ndarray
    src: np.ndarray
    size: np.ndarray

    @property
    def count(self) -> int:
        return int(self.size.size)

    @property
    def nbytes(self) -> int:
        return int(self.size.sum(dtype=np.uint64))

    def part(self, a: int, b: int) -> FlatCopies:
        return FlatCopies(self.dst[a:b], self.src[a:b], self.size[a:b])


def host_runs_array(host_idx: torch.Tensor | np.ndarray | Sequence[int]) -> np.ndarray:
    """Maximal runs of consecutive host slots in batch order, as an `(k, 3)` int64 array of (position in the
    batch, first host slot, length)."""
    if isinstance(host_idx, torch.Tensor):
        idx = host_idx.reshape(-1).to("cpu", torch.int64).numpy()
    else:
        idx = np.asarray(host_idx, dtype=np.int64).reshape(-1)
    n = idx.size
    if n == 0:
        return np.zeros((0, 3), dtype=np.int64)
    brk = np.ones(n, dtype=bool)
    brk[1:] = idx[1:] != idx[:-1] + 1
    starts = np.flatnonzero(brk)
    lengths = np.diff(starts, append=n)
    return np.stack([starts, idx[starts], lengths], axis=1).astype(np.int64)


def _i64(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.int64).reshape(-1)


def merge_adjacent(dst: np.ndarray, src: np.ndarray, size: np.ndarray, merge: bool = True) -> FlatCopies:
    """Drop empty copies; with merge, order by source address and fuse each copy that continues the
    previous one in BOTH source and destination (so the result moves exactly the same bytes)."""
    dst, src, size = _i64(dst), _i64(src), _i64(size)
    if not (dst.size == src.size == size.size):
        raise ValueError(f"dst/src/size lengths differ: {dst.size}, {src.size}, {size.size}")
    if (size < 0).any():
        raise ValueError("negative copy size")
    keep = size > 0
    dst, src, size = dst[keep], src[keep], size[keep]
    if merge and size.size > 1:
        order = np.argsort(src, kind="stable")
        dst, src, size = dst[order], src[order], size[order]
        cont = (src[:-1] + size[:-1] == src[1:]) & (dst[:-1] + size[:-1] == dst[1:])
        starts = np.flatnonzero(np.concatenate(([True], ~cont)))
        size = np.add.reduceat(size, starts)
        dst, src = dst[starts], src[starts]
    u = np.uint64
    return FlatCopies(np.ascontiguousarray(dst, u), np.ascontiguousarray(src, u), np.ascontiguousarray(size, u))


def flat_plan(
    geo: Geometry,
    runs: Sequence[Run] | np.ndarray,
    host_base: int,
    stage_base: int,
    direction: Literal["d2h", "h2d"],
    merge: bool = True,
) -> FlatCopies:
    """Every (row, run) as one 1-D copy (vectorized), adjacent ones merged (see merge_adjacent)."""
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    rows = np.arange(geo.rows, dtype=np.int64)[:, None]
    host = (host_base + r[:, 1] * geo.unit)[None, :] + rows * geo.host_pitch
    stage = (stage_base + r[:, 0] * geo.unit)[None, :] + rows * geo.stage_pitch
    width = np.broadcast_to(r[:, 2] * geo.unit, host.shape)
    if direction not in ("d2h", "h2d"):
        raise ValueError(f"direction must be 'd2h' or 'h2d', got {direction!r}")
    dst, src = (host, stage) if direction == "d2h" else (stage, host)
    return merge_adjacent(dst.reshape(-1), src.reshape(-1), width.reshape(-1), merge=merge)


@dataclass(frozen=True, eq=False)
class RowCopies:
    """`row_copies`' list of 1-D copies: dst and src addresses and sizes, each an `array.array("Q")` whose
    buffer goes to the driver as it is (`CudaDriver.run_batch_buffers`)."""

    dst: array.array[int]
    src: array.array[int]
    size: array.array[int]

    @property
    def count(self) -> int:
        return len(self.size)

    @property
    def nbytes(self) -> int:
        return sum(self.size)


@dataclass(frozen=True)
class RowGeometry:
    """Where the token rows of one `(P, L, S, H, D)` view lie: one base address per (plane, layer), in that
    order, the bytes between two slots' rows, and the bytes of a row. Fixed for as long as the view's memory
    is: the "dma_rows" backend keeps one per pool (CudaCopyEngine), so a copy only adds slot offsets."""

    bases: tuple[int, ...]
    step: int
    row: int
    rows_of: tuple[Any, ...]  # (P, L, H, D, dtype): two views' rows pair only when these match

    @classmethod
    def of(cls, view: torch.Tensor) -> RowGeometry:
        st, shape, es = view.stride(), tuple(view.shape), view.element_size()
        if len(shape) != 5:
            raise ValueError(f"a (P, L, S, H, D) view, got shape {shape}")
        if st[4] != 1 or st[3] != shape[4]:
            raise ValueError("token rows must be contiguous (heads x head_dim)")
        base = view.data_ptr()
        bases = tuple(base + (p * st[0] + layer * st[1]) * es for p in range(shape[0]) for layer in range(shape[1]))
        return cls(bases, st[2] * es, shape[3] * shape[4] * es, (shape[0], shape[1], shape[3], shape[4], view.dtype))


def row_copies(
    src5: torch.Tensor | RowGeometry,
    src_idx: Sequence[int] | np.ndarray,
    dst5: torch.Tensor | RowGeometry,
    dst_idx: Sequence[int] | np.ndarray,
) -> RowCopies:
    """Every token row as one 1-D copy, `dst5[p, l, dst_idx[i]] <- src5[p, l, src_idx[i]]` for every plane p,
    layer l and position i, addressed from the two `(P, L, S, H, D)` views' pointers and strides (or their
    RowGeometry): what the "dma_rows" backend hands the driver in one call (no staging buffer, no kernel, no
    index upload). Each view's rows (H x D) must be contiguous; the indices (ints, already checked by
    plan_copy) come in order.

    Built with Python ints into `array.array`s, not numpy: the copies are few (the backend's cap is 1024),
    and on the H200's host each small numpy call costs several microseconds, a large share of a swap's
    submit (bench/results/transformers_host_time-h200.json)."""
    src = src5 if isinstance(src5, RowGeometry) else RowGeometry.of(src5)
    dst = dst5 if isinstance(dst5, RowGeometry) else RowGeometry.of(dst5)
    if src.rows_of != dst.rows_of:
        raise ValueError(f"views differ: rows {src.rows_of} vs {dst.rows_of} (P, L, H, D, dtype)")
    si = src_idx.tolist() if isinstance(src_idx, np.ndarray) else src_idx
    di = dst_idx.tolist() if isinstance(dst_idx, np.ndarray) else dst_idx
    if len(si) != len(di):
        raise ValueError(f"{len(si)} source rows vs {len(di)} destination rows")
    ss, ds = src.step, dst.step
    return RowCopies(
        array.array("Q", [b + i * ds for b in dst.bases for i in di]),
        array.array("Q", [b + i * ss for b in src.bases for i in si]),
        array.array("Q", [src.row]) * (len(si) * len(src.bases)),
    )


def split_by_bytes(flat: FlatCopies, parts: int) -> list[FlatCopies]:
    """Up to `parts` consecutive, non-empty slices of about equal bytes (one per copy stream)."""
    n = flat.count
    if parts <= 1 or n <= 1:
        return [flat] if n else []
    cum = np.concatenate(([0], np.cumsum(flat.size.astype(np.int64))))  # cum[j]: bytes of the first j copies
    targets = cum[-1] * np.arange(1, parts) / parts
    hi = np.clip(np.searchsorted(cum, targets, side="left"), 1, n)
    cuts = np.where(np.abs(cum[hi] - targets) <= np.abs(cum[hi - 1] - targets), hi, hi - 1)  # the nearer boundary
    bounds = np.unique(np.concatenate(([0], cuts, [n])))
    return [flat.part(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def split_by_count(flat: FlatCopies, max_count: int) -> list[FlatCopies]:
    """Consecutive slices of at most max_count copies (one driver call each); [] for an empty list."""
    n = flat.count
    step = max(1, int(max_count))
    return [flat.part(a, min(n, a + step)) for a in range(0, n, step)]


# ---- pipeline planning: host order, hybrid split, ramped chunks (used by pipeline) ---------------------


def order_by_host(host_idx: Any) -> np.ndarray:
    """Positions that put the host slots in ascending order (ties keep batch order).

    Staging in host order makes each chunk's DMA walk host memory upwards and turns host slots that are
    neighbours (not only neighbours in batch order) into one run, so fewer and longer copies. One value
    sort of `slot * n + position` (numpy's vectorised sort) is a few times cheaper than a stable argsort,
    which matters because this runs before the first GPU work of a copy is enqueued."""
    h = _i64(host_idx)
    n = h.size
    if n < 2 or bool((h[1:] > h[:-1]).all()):
        return np.arange(n, dtype=np.int64)
    if int(h.min()) >= 0 and (int(h.max()) + 1) * n < 2**62:
        key = h * n + np.arange(n, dtype=np.int64)
        key.sort()
        return key % n
    return np.argsort(h, kind="stable").astype(np.int64)


def mean_run_tokens(host_idx: Any) -> float:
    """Mean length of the runs of consecutive host slots in batch order (cheap: no sort). A lower bound
    of the mean run length after order_by_host, which can only join runs."""
    h = _i64(host_idx)
    if h.size == 0:
        return 0.0
    return h.size / (1 + int(np.count_nonzero(np.diff(h) != 1)))


def select_short_runs(lengths: Any, tokens: int) -> np.ndarray:
    """Per-token mask (tokens laid out run after run) choosing exactly `tokens` tokens, shortest runs first
    (ties: earlier runs first); the last run chosen may be taken in part (its first tokens)."""
    ln = _i64(lengths)
    total = int(ln.sum())
    tokens = max(0, min(int(tokens), total))
    mask = np.zeros(total, dtype=bool)
    if tokens == 0:
        return mask
    order = np.argsort(ln, kind="stable")
    cum = np.cumsum(ln[order])
    full = int(np.searchsorted(cum, tokens, side="right"))  # runs taken whole: cum[full - 1] <= tokens
    starts = np.cumsum(ln) - ln
    take = np.zeros(ln.size, dtype=bool)
    take[order[:full]] = True
    mask[:] = np.repeat(take, ln)
    rem = tokens - (int(cum[full - 1]) if full else 0)
    if rem:
        j = int(order[full])
        mask[starts[j] : starts[j] + rem] = True
    return mask


@dataclass(frozen=True, eq=False)
class PipelinePlan:
    """How one copy is spread over the paths of the staged pipeline.

    Batch positions [0, head) go through the direct kernel first (enqueued before this plan is even made).
    `perm` lists every other batch position: the first `n_staged` in staging order (staging position j
    holds batch position perm[j]), then the ones the direct kernel also carries (hybrid). `runs` are the
    staged part's runs of consecutive host slots, as (staging position, first host slot, length)."""

    head: int
    perm: np.ndarray
    n_staged: int
    runs: np.ndarray

    @property
    def n_direct(self) -> int:
        """Direct tokens besides the head."""
        return int(self.perm.size) - self.n_staged


def plan_pipeline(host_idx: Any, head: int = 0, direct_tokens: int = 0, host_order: bool = True) -> PipelinePlan:
    """Split a copy: `head` tokens (batch order) and `direct_tokens` more (the shortest host runs: the DMA
    engines are slowest on short copies, the kernel does not care) for the direct kernel, the rest staged,
    in host-slot order when `host_order`."""
    h = _i64(host_idx)
    n = h.size
    head = max(0, min(int(head), n))
    rest = np.arange(head, n, dtype=np.int64)
    if host_order:
        rest = rest[order_by_host(h[head:])]
    runs = host_runs_array(h[rest])
    direct_tokens = max(0, min(int(direct_tokens), rest.size))
    if direct_tokens == 0:
        return PipelinePlan(head, rest, int(rest.size), runs)
    tok = select_short_runs(runs[:, 2], direct_tokens)
    staged, direct = rest[~tok], rest[tok]
    return PipelinePlan(head, np.concatenate([staged, direct]), int(staged.size), host_runs_array(h[staged]))


def _ramp(first: int, full: int) -> list[int]:
    """first, 2 first, 4 first, ... while below full (empty when first is 0 or >= full)."""
    out: list[int] = []
    size = first
    while 0 < size < full:
        out.append(size)
        size *= 2
    return out


def chunk_bounds(
    n: int, bytes_per_token: int, chunk_bytes: int, first_bytes: int = 0, last_bytes: int = 0
) -> list[int]:
    """Token boundaries [0, ..., n] of chunks of about chunk_bytes. With first_bytes the chunks start at
    first_bytes and double up to chunk_bytes, so the first DMA (or scatter) starts after little work; with
    last_bytes they also halve down to last_bytes at the end, so little work is left after the last DMA
    (the load-back's final scatter). Every chunk holds at least one token."""
    if n <= 0:
        return [0]
    bpt = max(1, int(bytes_per_token))
    full = max(1, int(chunk_bytes) // bpt)
    up = _ramp(max(1, int(first_bytes) // bpt), full) if first_bytes > 0 else []
    down = _ramp(max(1, int(last_bytes) // bpt), full) if last_bytes > 0 else []
    rest = n - sum(up) - sum(down)
    if rest >= 0:
        sizes = up + [full] * (rest // full) + ([rest % full] if rest % full else []) + down[::-1]
    else:  # too short for both ramps: ramp up only, as far as it goes
        sizes, left = [], n
        for size in up + [full] * n:
            if left <= 0:
                break
            sizes.append(min(size, left))
            left -= sizes[-1]
    return [0, *np.cumsum(sizes).astype(int).tolist()]


def clip_runs(runs: np.ndarray, a: int, b: int) -> np.ndarray:
    """The parts of `runs` (ascending, contiguous positions, as host_runs_array) inside positions [a, b)."""
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    starts = r[:, 0]
    ends = starts + r[:, 2]
    i0 = int(np.searchsorted(ends, a, side="right"))
    i1 = int(np.searchsorted(starts, b, side="left"))
    c = r[i0:i1].copy()
    if c.size:
        lo = np.maximum(c[:, 0], a)
        hi = np.minimum(c[:, 0] + c[:, 2], b)
        c[:, 1] += lo - c[:, 0]
        c[:, 0] = lo
        c[:, 2] = hi - lo
        c = c[c[:, 2] > 0]
    return c
