"""The CUDA driver binding's batched copies: ABI choice, one call per list, and the per-copy fallback, on
CPU (libcuda replaced by a fake whose copies are memmoves)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvfsm.dataplane.copy import cuda_driver, dma
from kvfsm.dataplane.errors import CopyError


def fake_libcuda(exports: tuple[str, ...] = ("v2",), batch_rc: int = 0, version: int = 13000) -> SimpleNamespace:
    """A stand-in for libcuda whose copies are memmoves on CPU memory; records every call."""
    log: dict[str, list[Any]] = {"batch": [], "copy": []}

    def cu_memcpy_async(dst: int, src: int, n: int, stream: int) -> int:
        log["copy"].append((dst, src, n, stream))
        ctypes.memmove(dst, src, n)
        return 0

    def batch(dsts: int, srcs: int, sizes: int, count: int, attrs: int, idxs: int, nattrs: int, *rest: int) -> int:
        *fail, stream = rest
        a = cuda_driver.MemcpyAttributes.from_address(attrs)
        log["batch"].append(
            {
                "count": count,
                "nattrs": nattrs,
                "idx0": ctypes.c_size_t.from_address(idxs).value,
                "order": a.srcAccessOrder,
                "flags": a.flags,
                "src_hint": a.srcLocHint.type,
                "dst_hint": a.dstLocHint.type,
                "nargs": 8 + len(fail),
                "stream": stream,
                "attrs": attrs,
            }
        )
        if batch_rc:
            return batch_rc
        d = (ctypes.c_uint64 * count).from_address(dsts)
        s = (ctypes.c_uint64 * count).from_address(srcs)
        z = (ctypes.c_uint64 * count).from_address(sizes)
        for i in range(count):
            ctypes.memmove(d[i], s[i], z[i])
        return 0

    def get_version(p: Any) -> int:
        p._obj.value = version
        return 0

    def v2(*args: int) -> int:
        assert len(args) == 8, "v2 ABI takes 8 arguments"
        return batch(*args)

    def v1(*args: int) -> int:
        assert len(args) == 9, "v1 ABI takes 9 arguments"
        return batch(*args)

    lib = SimpleNamespace(
        log=log,
        cuMemcpyAsync=cu_memcpy_async,
        cuGetErrorString=lambda rc, p: 0,
        cuDriverGetVersion=get_version,
    )
    if "v2" in exports:
        lib.cuMemcpyBatchAsync_v2 = v2
    if "v1" in exports:
        lib.cuMemcpyBatchAsync = v1
    return lib


def scattered(n: int = 37, size: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dma.FlatCopies]:
    """A source buffer, a zeroed destination and n copies of `size` bytes into scattered destination slots."""
    src = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    dst = torch.zeros(4 * n * size, dtype=torch.uint8)
    slots = torch.randperm(4 * n, generator=torch.Generator().manual_seed(seed + 1))[:n].numpy()
    f = dma.merge_adjacent(dst.data_ptr() + slots * size, src.data_ptr() + np.arange(n) * size, [size] * n, merge=False)
    return src, dst, f


def check_scattered(src: torch.Tensor, dst: torch.Tensor, f: dma.FlatCopies) -> None:
    size = int(f.size[0])
    slots = (f.dst.astype(np.int64) - dst.data_ptr()) // size
    assert torch.equal(dst.view(-1, size)[torch.from_numpy(slots)], src.view(-1, size))


@pytest.mark.parametrize("exports, abi, nargs", [(("v2", "v1"), "v2", 8), (("v1",), "v1", 9)])
def test_run_batch_makes_one_call(
    monkeypatch: pytest.MonkeyPatch, exports: tuple[str, ...], abi: str, nargs: int
) -> None:
    monkeypatch.delenv("KVFSM_CU_BATCH", raising=False)
    lib = fake_libcuda(exports)
    drv = cuda_driver.CudaDriver(lib=lib, device=0)
    assert drv.batch_abi == abi and drv.batch_available and drv.driver_version == 13000
    src, dst, f = scattered()
    assert drv.run_batch(f.dst, f.src, f.size, stream=1234) == 1
    check_scattered(src, dst, f)
    (call,) = lib.log["batch"]
    first_attrs = call.pop("attrs")
    assert call == {
        "count": f.count,
        "nattrs": 1,
        "idx0": 0,
        "order": cuda_driver.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        "flags": 0,
        "src_hint": 0,
        "dst_hint": 0,
        "nargs": nargs,
        "stream": 1234,
    }
    assert lib.log["copy"] == []
    drv.run_batch(f.dst, f.src, f.size, stream=7, flags=1, hint="d2h")
    last = lib.log["batch"][-1]
    assert (last["flags"], last["src_hint"], last["dst_hint"]) == (
        1,
        cuda_driver.CU_MEM_LOCATION_TYPE_DEVICE,
        cuda_driver.CU_MEM_LOCATION_TYPE_HOST,
    )
    assert last["attrs"] != first_attrs  # another flags/hint: another entry
    drv.run_batch(f.dst, f.src, f.size, stream=7, hint="h2d")
    last = lib.log["batch"][-1]
    assert (last["flags"], last["src_hint"], last["dst_hint"]) == (
        0,
        cuda_driver.CU_MEM_LOCATION_TYPE_HOST,
        cuda_driver.CU_MEM_LOCATION_TYPE_DEVICE,
    )
    # the entry of a (flags, hint) is built once and reused unchanged by the calls that follow
    drv.run_batch(f.dst, f.src, f.size, stream=8)
    again = lib.log["batch"][-1]
    assert again["attrs"] == first_attrs and (again["flags"], again["src_hint"], again["dst_hint"]) == (0, 0, 0)
    assert again["order"] == cuda_driver.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM and again["idx0"] == 0
    assert drv.run_batch([], [], [], stream=7) == 0


def test_run_batch_falls_back_when_not_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFSM_CU_BATCH", raising=False)
    lib = fake_libcuda(batch_rc=cuda_driver.CUDA_ERROR_NOT_SUPPORTED)
    drv = cuda_driver.CudaDriver(lib=lib, device=0)
    src, dst, f = scattered()
    assert drv.run_batch(f.dst, f.src, f.size, stream=5) == f.count
    check_scattered(src, dst, f)
    assert len(lib.log["batch"]) == 1 and not drv.batch_available and "NOT_SUPPORTED" in drv.batch_status
    src, dst, f = scattered(seed=9)
    assert drv.run_batch(f.dst, f.src, f.size, stream=5) == f.count  # not tried again
    check_scattered(src, dst, f)
    assert len(lib.log["batch"]) == 1 and drv.fallback_copies == 2 * f.count


def test_run_batch_other_errors_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFSM_CU_BATCH", raising=False)
    drv = cuda_driver.CudaDriver(lib=fake_libcuda(batch_rc=1), device=0)
    _, _, f = scattered()
    with pytest.raises(CopyError, match="cuMemcpyBatchAsync"):
        drv.run_batch(f.dst, f.src, f.size, stream=5)


@pytest.mark.parametrize("case", ["no symbol", "old driver", "off", "null stream"])
def test_run_batch_per_copy_fallback(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    monkeypatch.delenv("KVFSM_CU_BATCH", raising=False)
    lib = fake_libcuda(
        exports=() if case == "no symbol" else ("v2", "v1"), version=12040 if case == "old driver" else 13000
    )
    if case == "off":
        monkeypatch.setenv("KVFSM_CU_BATCH", "off")
    drv = cuda_driver.CudaDriver(lib=lib, device=0)
    assert drv.batch_available == (case == "null stream")
    src, dst, f = scattered()
    stream = 0 if case == "null stream" else 3
    assert drv.run_batch(f.dst, f.src, f.size, stream) == f.count
    check_scattered(src, dst, f)
    assert lib.log["batch"] == [] and len(lib.log["copy"]) == f.count


def test_resolve_batch_choice() -> None:
    lib = fake_libcuda(exports=("v2", "v1"))
    assert cuda_driver.resolve_batch(lib, 13000, "v1")[1] == "v1"
    assert cuda_driver.resolve_batch(lib, 13000, "auto")[1] == "v2"
    assert cuda_driver.resolve_batch(fake_libcuda(exports=("v1",)), 12080, "v2")[1] is None
    with pytest.raises(ValueError):
        cuda_driver.resolve_batch(lib, 13000, "v3")


def as_buffers(f: dma.FlatCopies) -> tuple[Any, Any, Any]:
    import array

    return tuple(array.array("Q", v.tolist()) for v in (f.dst, f.src, f.size))  # type: ignore[return-value]


@pytest.mark.parametrize("case", ["batched", "not supported", "null stream", "error"])
def test_run_batch_buffers_is_run_batch_over_array_buffers(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """The dma_rows path's entry: the same single call, fallbacks and errors as run_batch, from array('Q')s."""
    monkeypatch.delenv("KVFSM_CU_BATCH", raising=False)
    rc = {"not supported": cuda_driver.CUDA_ERROR_NOT_SUPPORTED, "error": 1}.get(case, 0)
    lib = fake_libcuda(batch_rc=rc)
    drv = cuda_driver.CudaDriver(lib=lib, device=0)
    src, dst, f = scattered()
    d, s, z = as_buffers(f)
    stream = 0 if case == "null stream" else 9
    if case == "error":
        with pytest.raises(CopyError, match="cuMemcpyBatchAsync"):
            drv.run_batch_buffers(d, s, z, stream)
        return
    calls = drv.run_batch_buffers(d, s, z, stream)
    check_scattered(src, dst, f)
    if case == "batched":
        assert calls == 1 and lib.log["copy"] == [] and lib.log["batch"][0]["count"] == f.count
        assert lib.log["batch"][0]["stream"] == 9
    else:
        assert calls == f.count == len(lib.log["copy"]) == drv.fallback_copies
        assert len(lib.log["batch"]) == (1 if case == "not supported" else 0)
    assert drv.run_batch_buffers(*(type(d)("Q") for _ in range(3)), stream=9) == 0
    with pytest.raises(ValueError, match="array"):
        drv.run_batch_buffers(d, s, type(z)("Q", z.tolist()[:-1]), 9)
