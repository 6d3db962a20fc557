"""A small ctypes binding of the CUDA driver's copy calls, and their CPU stand-in.

Why the driver and not torch: one driver call per copy makes short runs CPU-launch bound (page size 1 is
8192-16384 copies per GiB), so `CudaDriver.run_batch` enqueues a whole list of 1-D copies (dma.FlatCopies'
three arrays) with ONE `cuMemcpyBatchAsync` call (driver >= 12.8), which torch does not expose. libcuda is
loaded in every CUDA process, and unified addressing lets pinned host and device pointers mix.

The driver exports two ABIs: `cuMemcpyBatchAsync` (CUDA 12.8: 9 arguments, with `size_t *failIdx`) and
`cuMemcpyBatchAsync_v2` (CUDA 13: failIdx removed, 8 arguments). We bind by exported symbol name, which
pins the ABI: `_v2` when exported, else the 12.8 one (override with KVFSM_CU_BATCH=v2|v1|off). Where
neither works (old driver, CUDA_ERROR_NOT_SUPPORTED, the legacy NULL stream, which the batch API rejects)
run_batch falls back to one cuMemcpyAsync per copy. `memmove_batch` runs the same arrays on the CPU
(tests, and CPU smoke runs).
"""

from __future__ import annotations

import array
import ctypes
import os
from typing import Any, Literal

import numpy as np
import torch

from ..errors import CopyError

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
        fn.argtypes = (
            [ctypes.c_void_p] * 3
            + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
            + ([ctypes.c_void_p] if fail_idx else [])
            + [ctypes.c_void_p]
        )
        fn.restype = ctypes.c_int
        return fn, abi, f"{name} ({9 if fail_idx else 8} arguments), driver API {driver_version}"
    return (
        None,
        None,
        f"libcuda exports no {' / '.join(BATCH_ABIS[a][0] for a in BATCH_ABIS)} (driver API {driver_version})",
    )


class CudaDriver:
    """cuMemcpyAsync / cuMemcpyBatchAsync on a given stream handle, errors raised as CopyError. `lib` and
    `device` exist for tests (a stand-in for libcuda); `batch_abi` as resolve_batch."""

    _instance: CudaDriver | None = None

    def __init__(self, lib: Any = None, device: int | None = None, batch_abi: str | None = None) -> None:
        lib = ctypes.CDLL("libcuda.so.1") if lib is None else lib
        self.lib = lib
        self._copy = lib.cuMemcpyAsync
        self._copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._copy.restype = ctypes.c_int
        self._err = lib.cuGetErrorString
        self._err.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.device = torch.cuda.current_device() if device is None else int(device)
        ver = ctypes.c_int(0)
        get_version = getattr(lib, "cuDriverGetVersion", None)
        self.driver_version = ver.value if get_version is not None and get_version(ctypes.byref(ver)) == 0 else 0
        self._batch, self.batch_abi, self.batch_status = resolve_batch(lib, self.driver_version, batch_abi)
        self.batch_calls = 0  # batched driver calls made
        self.fallback_copies = 0  # copies run_batch had to issue one by one
        self._attrs: dict[tuple[int, str | None], tuple[Any, Any, int, int]] = {}  # (flags, hint) -> attribute entry

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
        return self._batch_at(
            dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, int(sizes.size), stream, flags, hint
        )

    def _batch_at(
        self,
        dsts: int,
        srcs: int,
        sizes: int,
        count: int,
        stream: int,
        flags: int = 0,
        hint: Literal["d2h", "h2d"] | None = None,
    ) -> tuple[int, int | None]:
        """batch_raw over the three arrays' addresses."""
        if self._batch is None:
            raise CopyError(f"cuMemcpyBatchAsync unavailable: {self.batch_status}")
        # The attribute entry and its index array are the same for every call with these flags and hint:
        # built once (the driver reads them during the call only), which spares a swap's submit four ctypes
        # objects.
        key = (flags, hint)
        cached = self._attrs.get(key)
        if cached is None:
            attrs = MemcpyAttributes()
            attrs.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
            attrs.flags = flags
            if hint is not None:
                dev = MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, self.device)
                host = MemLocation(CU_MEM_LOCATION_TYPE_HOST, 0)
                attrs.srcLocHint, attrs.dstLocHint = (dev, host) if hint == "d2h" else (host, dev)
            idx = ctypes.c_size_t(0)
            cached = self._attrs[key] = (attrs, idx, ctypes.addressof(attrs), ctypes.addressof(idx))
        args: list[Any] = [dsts, srcs, sizes, count, cached[2], cached[3], 1]
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
        return self._enqueue((d, s, z), lambda a: a.ctypes.data, n, stream, flags, hint)

    def run_batch_buffers(
        self, dsts: array.array[int], srcs: array.array[int], sizes: array.array[int], stream: int
    ) -> int:
        """run_batch for copies listed in three `array.array("Q")` (dma.row_copies): their buffers' addresses go
        to the driver as they are, sparing the numpy conversions (the "dma_rows" backend's few copies)."""
        n = len(sizes)
        if not (len(dsts) == len(srcs) == n) or not dsts.typecode == srcs.typecode == sizes.typecode == "Q":
            raise ValueError("dst/src/size must be array('Q') of one length")
        return self._enqueue((dsts, srcs, sizes), _buffer_address, n, stream)

    def _enqueue(
        self,
        arrays: tuple[Any, Any, Any],
        address: Any,
        n: int,
        stream: int,
        flags: int = 0,
        hint: Literal["d2h", "h2d"] | None = None,
    ) -> int:
        """What run_batch and run_batch_buffers share once their arrays are checked: one batched call (given
        the arrays' buffer addresses), or the per-copy fallback; returns the driver calls made."""
        if n == 0:
            return 0
        stream = int(stream or 0)
        if self._batch is not None and stream != 0:
            dsts, srcs, sizes = arrays
            rc, fail = self._batch_at(address(dsts), address(srcs), address(sizes), n, stream, flags, hint)
            if rc == 0:
                return 1
            if rc != CUDA_ERROR_NOT_SUPPORTED:
                where = f", failIdx {fail}" if fail is not None else ""
                self._check(rc, f"cuMemcpyBatchAsync[{self.batch_abi}] of {n} copies{where}")
            self._batch = None
            self.batch_status = f"{self.batch_status}: answered CUDA_ERROR_NOT_SUPPORTED, per-copy fallback"
        self.fallback_copies += n
        return self.run_each(*arrays, stream)

    def run_each(self, dsts: Any, srcs: Any, sizes: Any, stream: int) -> int:
        """The same 1-D copies with one cuMemcpyAsync each (the fallback, and a baseline)."""
        d, s, z = (np.asarray(v).astype(np.uint64).reshape(-1).tolist() for v in (dsts, srcs, sizes))
        if not (len(d) == len(s) == len(z)):
            raise ValueError("dst/src/size lengths differ")
        for a, b, m in zip(d, s, z):
            self._check(self._copy(a, b, m, stream), "cuMemcpyAsync")
        return len(z)


def _buffer_address(a: array.array[int]) -> int:
    return a.buffer_info()[0]


def memmove_batch(dsts: Any, srcs: Any, sizes: Any) -> int:
    """Execute flat copies on the CPU (tests): the same arrays run_batch hands to the driver."""
    d, s, z = (np.asarray(v).astype(np.uint64).reshape(-1).tolist() for v in (dsts, srcs, sizes))
    if not (len(d) == len(s) == len(z)):
        raise ValueError("dst/src/size lengths differ")
    for a, b, n in zip(d, s, z):
        ctypes.memmove(a, b, n)
    return len(z)
