"""Copy-engine (DMA) transfers between a contiguous device staging buffer and runs of host slots.

Why: copies driven by SM loads/stores over PCIe top out a few percent below what the GPU's DMA engines
reach for the same bytes (smaller transactions), while the DMA engines cannot gather scattered rows
cheaply. So the "dma" backend splits the work: a device kernel gathers (or scatters) rows between the
pool and a staging buffer laid out like the host pool, at HBM speed, and the DMA engines move each run
of consecutive host slots with one 2-D copy (one row per plane x layer; or one 1-D copy per plane for
page_first). Chunks pipeline the two, so only one chunk's gather is exposed.

This module is pure planning (runs, geometry, copy list; testable on CPU by executing the list with
memmove) plus a small ctypes binding of the CUDA driver's cuMemcpyAsync / cuMemcpy2DAsync_v2 (libcuda
is loaded in every CUDA process; unified addressing lets pinned host and device pointers mix).

Batched submission (issue #3): one driver call per copy makes short runs CPU-launch bound (page size 1 is
8192-16384 copies per GiB). `flat_plan` / `flatten` turn a plan into three numpy arrays of 1-D copies
(dst, src, size; 2-D copies expanded row by row, copies adjacent in both source and destination merged),
and `CudaDriver.run_batch` enqueues them with ONE `cuMemcpyBatchAsync` call (driver >= 12.8). The driver
exports two ABIs: `cuMemcpyBatchAsync` (CUDA 12.8: 9 arguments, with `size_t *failIdx`) and
`cuMemcpyBatchAsync_v2` (CUDA 13: failIdx removed, 8 arguments). We bind by exported symbol name, which
pins the ABI: `_v2` when exported, else the 12.8 one (override with KVFSM_CU_BATCH=v2|v1|off). Where
neither works (old driver, CUDA_ERROR_NOT_SUPPORTED, the legacy NULL stream, which the batch API rejects)
run_batch falls back to one cuMemcpyAsync per copy. `memmove_batch` runs the same arrays on the CPU.

Pipeline planning (used by cuda_copy.launch_pipeline, the "dma" and "hybrid" backends): `plan_pipeline`
stages a copy in host-slot order (`order_by_host`: each chunk's copies walk host memory upwards, and
host neighbours become one run) and can hand the shortest runs to the direct kernel (`select_short_runs`);
`chunk_bounds` cuts the staged tokens into chunks that ramp up to the chunk size, `clip_runs` gives each
chunk its runs (splitting runs at chunk edges), and `split_by_bytes` / `split_by_count` spread a chunk's
flat copies over copy streams and driver calls.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from .errors import CopyError
from .host_pool import HostKVPool

Run = tuple[int, int, int]  # (position in the batch, first host slot, length in tokens)


def host_runs(host_idx: torch.Tensor) -> list[Run]:
    """Maximal runs of consecutive host slots in batch order (O(n) torch ops)."""
    n = int(host_idx.numel())
    if n == 0:
        return []
    idx = host_idx.reshape(-1).to("cpu", torch.int64)
    brk = torch.ones(n, dtype=torch.bool)
    brk[1:] = idx[1:] != idx[:-1] + 1
    starts = brk.nonzero().reshape(-1)
    lengths = torch.diff(starts, append=torch.tensor([n]))
    return list(zip(starts.tolist(), idx[starts].tolist(), lengths.tolist()))


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
    return Geometry(layers * row, planes, size * layers * row, n * layers * row, (planes, n, layers, *c.token_shape), True)


@dataclass(frozen=True)
class Copy:
    """A strided copy of `height` rows of `width` bytes (height 1: a plain copy)."""

    dst: int
    dpitch: int
    src: int
    spitch: int
    width: int
    height: int


def plan_copies(
    geo: Geometry, runs: Sequence[Run], host_base: int, stage_base: int, direction: Literal["d2h", "h2d"]
) -> list[Copy]:
    out = []
    for pos, slot, length in runs:
        h = host_base + slot * geo.unit
        s = stage_base + pos * geo.unit
        w = length * geo.unit
        if direction == "d2h":
            out.append(Copy(h, geo.host_pitch, s, geo.stage_pitch, w, geo.rows))
        else:
            out.append(Copy(s, geo.stage_pitch, h, geo.host_pitch, w, geo.rows))
    return out


def chunk_runs(runs: Sequence[Run], bytes_per_token: int, chunk_bytes: int) -> list[tuple[int, int, list[Run]]]:
    """Group runs into chunks of about chunk_bytes: (first position, end position, runs)."""
    chunks: list[tuple[int, int, list[Run]]] = []
    cur: list[Run] = []
    size = 0
    for r in runs:
        cur.append(r)
        size += r[2] * bytes_per_token
        if size >= chunk_bytes:
            chunks.append((cur[0][0], cur[-1][0] + cur[-1][2], cur))
            cur, size = [], 0
    if cur:
        chunks.append((cur[0][0], cur[-1][0] + cur[-1][2], cur))
    return chunks


def memmove_copies(copies: Sequence[Copy]) -> None:
    """Execute a copy list on the CPU (tests): the same address arithmetic, done by memmove."""
    for c in copies:
        for r in range(c.height):
            ctypes.memmove(c.dst + r * c.dpitch, c.src + r * c.spitch, c.width)


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
    """host_runs as an `(k, 3)` int64 array of (position in the batch, first host slot, length)."""
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


def _expand(dst: Any, dpitch: Any, src: Any, spitch: Any, width: Any, height: Any) -> tuple[np.ndarray, ...]:
    """Rows of strided copies as 1-D copies, row-major (row 0 of every copy, then row 1, ...)."""
    dst, dpitch, src, spitch, width, height = (_i64(v) for v in (dst, dpitch, src, spitch, width, height))
    if height.size == 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e
    which = np.repeat(np.arange(height.size), height)
    row = np.arange(which.size, dtype=np.int64) - (np.cumsum(height) - height)[which]
    order = np.lexsort((which, row))
    which, row = which[order], row[order]
    return dst[which] + row * dpitch[which], src[which] + row * spitch[which], width[which]


def flatten(copies: Sequence[Copy], merge: bool = True) -> FlatCopies:
    """A list of (strided) Copy as 1-D copies, adjacent ones merged (see merge_adjacent)."""
    cols = np.array([(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height) for c in copies], dtype=np.int64)
    cols = cols.reshape(-1, 6)
    return merge_adjacent(*_expand(*cols.T), merge=merge)


def flat_plan(
    geo: Geometry,
    runs: Sequence[Run] | np.ndarray,
    host_base: int,
    stage_base: int,
    direction: Literal["d2h", "h2d"],
    merge: bool = True,
) -> FlatCopies:
    """flatten(plan_copies(...)) without the Copy objects: every (row, run) as one 1-D copy, vectorized."""
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    rows = np.arange(geo.rows, dtype=np.int64)[:, None]
    host = (host_base + r[:, 1] * geo.unit)[None, :] + rows * geo.host_pitch
    stage = (stage_base + r[:, 0] * geo.unit)[None, :] + rows * geo.stage_pitch
    width = np.broadcast_to(r[:, 2] * geo.unit, host.shape)
    if direction not in ("d2h", "h2d"):
        raise ValueError(f"direction must be 'd2h' or 'h2d', got {direction!r}")
    dst, src = (host, stage) if direction == "d2h" else (stage, host)
    return merge_adjacent(dst.reshape(-1), src.reshape(-1), width.reshape(-1), merge=merge)


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


# ---- pipeline planning: host order, hybrid split, ramped chunks (pure numpy; used by cuda_copy) --------


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
        mask[starts[j]: starts[j] + rem] = True
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


def chunk_bounds(n: int, bytes_per_token: int, chunk_bytes: int, first_bytes: int = 0, last_bytes: int = 0) -> list[int]:
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


def split_by_count(flat: FlatCopies, max_count: int) -> list[FlatCopies]:
    """Consecutive slices of at most max_count copies (one driver call each); [] for an empty list."""
    n = flat.count
    step = max(1, int(max_count))
    return [flat.part(a, min(n, a + step)) for a in range(0, n, step)]


def memmove_batch(dsts: Any, srcs: Any, sizes: Any) -> int:
    """Execute flat copies on the CPU (tests): the same arrays run_batch hands to the driver."""
    d, s, z = (np.asarray(v).astype(np.uint64).reshape(-1).tolist() for v in (dsts, srcs, sizes))
    if not (len(d) == len(s) == len(z)):
        raise ValueError("dst/src/size lengths differ")
    for a, b, n in zip(d, s, z):
        ctypes.memmove(a, b, n)
    return len(z)


# ---- CUDA driver binding --------------------------------------------------------------------------

_CU_MEMORYTYPE_UNIFIED = 4
_CU_DEVICE_ATTRIBUTE_MAX_PITCH = 11
CUDA_ERROR_NOT_SUPPORTED = 801
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_LOCATION_TYPE_HOST = 2

# ABI name -> (exported symbol, takes `size_t *failIdx` before the stream)
BATCH_ABIS: dict[str, tuple[str, bool]] = {
    "v2": ("cuMemcpyBatchAsync_v2", False),  # CUDA 13: (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)
    "v1": ("cuMemcpyBatchAsync", True),  # CUDA 12.8: (..., numAttrs, failIdx, stream)
}


class _Memcpy2D(ctypes.Structure):
    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


class MemLocation(ctypes.Structure):
    """CUmemLocation: {CUmemLocationType type; int id;} (8 bytes)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes_v1: {srcAccessOrder; CUmemLocation srcLocHint, dstLocHint; unsigned flags} (24 bytes).
    Location hints are ignored unless a pointer is managed or not CUDA-allocated, so zero (INVALID) is fine."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


assert ctypes.sizeof(MemcpyAttributes) == 24


def resolve_batch(lib: Any, driver_version: int, choice: str | None = None) -> tuple[Any, str | None, str]:
    """(function, abi, why) for the batched copy: "v2" when the driver exports cuMemcpyBatchAsync_v2, else
    "v1" (cuMemcpyBatchAsync, the 12.8 ABI); (None, None, why) when neither is usable. `choice` (default:
    env KVFSM_CU_BATCH, else "auto") forces "v2", "v1" or "off"."""
    choice = (choice or os.environ.get("KVFSM_CU_BATCH") or "auto").lower()
    if choice == "off":
        return None, None, "batched copies disabled (off)"
    if choice not in ("auto", *BATCH_ABIS):
        raise ValueError(f"batch ABI must be auto, off, {' or '.join(BATCH_ABIS)}; got {choice!r}")
    if choice == "auto" and driver_version and driver_version < 12080:
        return None, None, f"driver API {driver_version} < 12080 has no cuMemcpyBatchAsync"
    for abi in ("v2", "v1") if choice == "auto" else (choice,):
        name, fail_idx = BATCH_ABIS[abi]
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t] + (
            [ctypes.c_void_p] if fail_idx else []) + [ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return fn, abi, f"{name} ({9 if fail_idx else 8} arguments), driver API {driver_version}"
    return None, None, f"libcuda exports no {' / '.join(BATCH_ABIS[a][0] for a in BATCH_ABIS)} (driver API {driver_version})"


class CudaDriver:
    """cuMemcpyAsync / cuMemcpy2DAsync_v2 / cuMemcpyBatchAsync on a given stream handle, errors raised as
    CopyError. `lib` and `device` exist for tests (a stand-in for libcuda); `batch_abi` as resolve_batch."""

    _instance: CudaDriver | None = None

    def __init__(self, lib: Any = None, device: int | None = None, batch_abi: str | None = None) -> None:
        lib = ctypes.CDLL("libcuda.so.1") if lib is None else lib
        self.lib = lib
        self._copy = lib.cuMemcpyAsync
        self._copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._copy.restype = ctypes.c_int
        self._copy2d = lib.cuMemcpy2DAsync_v2
        self._copy2d.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
        self._copy2d.restype = ctypes.c_int
        self._err = lib.cuGetErrorString
        self._err.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        attr = lib.cuDeviceGetAttribute
        attr.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        v = ctypes.c_int(0)
        self.device = torch.cuda.current_device() if device is None else int(device)
        ok = attr(ctypes.byref(v), _CU_DEVICE_ATTRIBUTE_MAX_PITCH, self.device) == 0
        self.max_pitch = v.value if ok and v.value > 0 else 2**31 - 1
        self._desc = _Memcpy2D()
        self._desc.srcMemoryType = _CU_MEMORYTYPE_UNIFIED
        self._desc.dstMemoryType = _CU_MEMORYTYPE_UNIFIED
        ver = ctypes.c_int(0)
        get_version = getattr(lib, "cuDriverGetVersion", None)
        self.driver_version = ver.value if get_version is not None and get_version(ctypes.byref(ver)) == 0 else 0
        self._batch, self.batch_abi, self.batch_status = resolve_batch(lib, self.driver_version, batch_abi)
        self.batch_calls = 0  # batched driver calls made
        self.fallback_copies = 0  # copies run_batch had to issue one by one

    @classmethod
    def get(cls) -> CudaDriver:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    @property
    def batch_available(self) -> bool:
        return self._batch is not None

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise CopyError(f"{what} failed: CUDA driver error {rc} ({self.error_string(rc)})")

    def error_string(self, rc: int) -> str:
        s = ctypes.c_char_p()
        self._err(rc, ctypes.byref(s))
        return (s.value or b"?").decode()

    def run(self, copies: Sequence[Copy], stream: int) -> int:
        """Enqueue every copy on `stream`; returns the number of driver calls made."""
        calls = 0
        d = self._desc
        for c in copies:
            if c.height == 1 or max(c.dpitch, c.spitch) > self.max_pitch:
                for r in range(c.height):
                    self._check(self._copy(c.dst + r * c.dpitch, c.src + r * c.spitch, c.width, stream), "cuMemcpyAsync")
                    calls += 1
            else:
                d.srcDevice, d.srcPitch, d.dstDevice, d.dstPitch = c.src, c.spitch, c.dst, c.dpitch
                d.WidthInBytes, d.Height = c.width, c.height
                self._check(self._copy2d(ctypes.byref(d), stream), "cuMemcpy2DAsync")
                calls += 1
        return calls

    def batch_raw(
        self,
        dsts: np.ndarray,
        srcs: np.ndarray,
        sizes: np.ndarray,
        stream: int,
        flags: int = 0,
        hint: Literal["d2h", "h2d"] | None = None,
    ) -> tuple[int, int | None]:
        """One cuMemcpyBatchAsync call, no fallback: (CUresult, failIdx or None). The arrays must be
        contiguous uint64 of one length. srcAccessOrder STREAM; one attribute entry for every copy."""
        if self._batch is None:
            raise CopyError(f"cuMemcpyBatchAsync unavailable: {self.batch_status}")
        attrs = MemcpyAttributes()
        attrs.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attrs.flags = flags
        if hint is not None:
            dev = MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, self.device)
            host = MemLocation(CU_MEM_LOCATION_TYPE_HOST, 0)
            attrs.srcLocHint, attrs.dstLocHint = (dev, host) if hint == "d2h" else (host, dev)
        idx = ctypes.c_size_t(0)
        args: list[Any] = [dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, int(sizes.size),
                           ctypes.addressof(attrs), ctypes.addressof(idx), 1]
        fail = None
        if self.batch_abi == "v1":
            fail = ctypes.c_size_t(2**64 - 1)
            args.append(ctypes.addressof(fail))
        rc = int(self._batch(*args, stream))
        self.batch_calls += 1
        return rc, (None if fail is None or fail.value == 2**64 - 1 else int(fail.value))

    def run_batch(
        self,
        dsts: Any,
        srcs: Any,
        sizes: Any,
        stream: int,
        flags: int = 0,
        hint: Literal["d2h", "h2d"] | None = None,
    ) -> int:
        """Enqueue 1-D copies dsts[i] <- srcs[i] (sizes[i] bytes) on `stream` with ONE cuMemcpyBatchAsync
        call; returns the number of driver calls made. Falls back to one cuMemcpyAsync per copy when the
        batch API is missing, answers CUDA_ERROR_NOT_SUPPORTED (then never tried again), or the stream is
        the legacy NULL stream (which it rejects). Any other error is raised as CopyError."""
        d, s, z = (np.ascontiguousarray(np.asarray(v).reshape(-1), dtype=np.uint64) for v in (dsts, srcs, sizes))
        n = int(z.size)
        if not (d.size == s.size == n):
            raise ValueError(f"dst/src/size lengths differ: {d.size}, {s.size}, {n}")
        if n == 0:
            return 0
        stream = int(stream or 0)
        if self._batch is not None and stream != 0:
            rc, fail = self.batch_raw(d, s, z, stream, flags, hint)
            if rc == 0:
                return 1
            if rc != CUDA_ERROR_NOT_SUPPORTED:
                where = f", failIdx {fail}" if fail is not None else ""
                self._check(rc, f"cuMemcpyBatchAsync[{self.batch_abi}] of {n} copies{where}")
            self._batch = None
            self.batch_status = f"{self.batch_status}: answered CUDA_ERROR_NOT_SUPPORTED, per-copy fallback"
        self.fallback_copies += n
        return self.run_each(d, s, z, stream)

    def run_each(self, dsts: Any, srcs: Any, sizes: Any, stream: int) -> int:
        """The same 1-D copies with one cuMemcpyAsync each (the fallback, and a baseline)."""
        d, s, z = (np.asarray(v).astype(np.uint64).reshape(-1).tolist() for v in (dsts, srcs, sizes))
        if not (len(d) == len(s) == len(z)):
            raise ValueError("dst/src/size lengths differ")
        for a, b, m in zip(d, s, z):
            self._check(self._copy(a, b, m, stream), "cuMemcpyAsync")
        return len(z)


def dma_worthwhile(runs: Sequence[Run], geo: Geometry, min_width: int, max_calls: int) -> bool:
    """The DMA path pays when runs are wide (few long DMA rows) and few (host call overhead)."""
    if not runs:
        return False
    mean_width = sum(r[2] for r in runs) * geo.unit / len(runs)
    return mean_width >= min_width and len(runs) <= max_calls
