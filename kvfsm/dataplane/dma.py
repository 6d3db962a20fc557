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
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

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


# ---- CUDA driver binding --------------------------------------------------------------------------

_CU_MEMORYTYPE_UNIFIED = 4
_CU_DEVICE_ATTRIBUTE_MAX_PITCH = 11


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


class CudaDriver:
    """cuMemcpyAsync / cuMemcpy2DAsync_v2 on a given stream handle, errors raised as CopyError."""

    _instance: CudaDriver | None = None

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
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
        ok = attr(ctypes.byref(v), _CU_DEVICE_ATTRIBUTE_MAX_PITCH, torch.cuda.current_device()) == 0
        self.max_pitch = v.value if ok and v.value > 0 else 2**31 - 1
        self._desc = _Memcpy2D()
        self._desc.srcMemoryType = _CU_MEMORYTYPE_UNIFIED
        self._desc.dstMemoryType = _CU_MEMORYTYPE_UNIFIED

    @classmethod
    def get(cls) -> CudaDriver:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            s = ctypes.c_char_p()
            self._err(rc, ctypes.byref(s))
            raise CopyError(f"{what} failed: CUDA driver error {rc} ({(s.value or b'?').decode()})")

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


def dma_worthwhile(runs: Sequence[Run], geo: Geometry, min_width: int, max_calls: int) -> bool:
    """The DMA path pays when runs are wide (few long DMA rows) and few (host call overhead)."""
    if not runs:
        return False
    mean_width = sum(r[2] for r in runs) * geo.unit / len(runs)
    return mean_width >= min_width and len(runs) <= max_calls
