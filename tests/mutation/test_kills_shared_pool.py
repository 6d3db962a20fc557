"""Tests written to kill survivors of `make mutate` in kvfsm/dataplane/pools/shared_memory.py and
kvfsm/dataplane/pools/host_pool.py (docs/mutation.md)."""

from __future__ import annotations

import gc
import os
import sys

import numpy as np
import pytest
import torch

from kvfsm.dataplane import DeviceKVPool, HostKVPool, KVCacheConfig
from kvfsm.dataplane.pools.shared_memory import shared_buffer


def open_descriptors() -> int:
    """How many file descriptors this process holds now."""
    return len(os.listdir("/proc/self/fd"))


def test_a_shared_buffer_of_no_bytes_is_refused_without_leaking_its_descriptor() -> None:
    """An empty memory file cannot be mapped: the caller gets mmap's ValueError and the descriptor is closed,
    so a process that retries does not run out of descriptors."""
    before = open_descriptors()
    with pytest.raises(ValueError, match="empty"):
        shared_buffer(0, False)
    assert open_descriptors() == before


def test_a_shared_buffer_of_a_negative_size_is_refused_without_leaking_its_descriptor() -> None:
    """A negative size is the kernel's EINVAL (OSError), and the memory file made for it is closed."""
    before = open_descriptors()
    with pytest.raises(OSError):
        shared_buffer(-1, False)
    assert open_descriptors() == before


def test_a_shared_pool_shows_as_the_kvfsm_host_pool_memory_file() -> None:
    """The pool's memory is named `memfd:kvfsm-host-pool` in /proc/PID/fd and /proc/PID/maps (lsof, pmap), so
    an operator can tell which process's memory is the host tier, in the engine and in the store child."""
    pool = HostKVPool(KVCacheConfig.tiny(), 16, 4, pin_memory=False, shared=True)
    assert pool.share_fd is not None
    assert os.readlink(f"/proc/self/fd/{pool.share_fd}").startswith("/memfd:kvfsm-host-pool ")
    with open("/proc/self/maps", encoding="ascii") as maps:
        assert any(line.rstrip().endswith("/memfd:kvfsm-host-pool (deleted)") for line in maps)


def test_asking_for_a_pinned_shared_pool_gives_pinned_memory_or_an_error_naming_cuda() -> None:
    """pin_memory=True with shared=True never quietly gives pageable memory that claims to be pinned: on a CUDA
    host the memory file is page-locked, on a host without CUDA the error is the RuntimeError an unshared pinned
    pool gets, and says CUDA is what is missing."""
    cfg = KVCacheConfig.tiny()
    if torch.cuda.is_available():
        pool = HostKVPool(cfg, 16, 4, pin_memory=True, shared=True)
        assert pool.pinned is True and pool.kv_buffer.is_pinned()
    else:
        before = open_descriptors()
        for shared in (True, False):  # one error type, shared or not, and no memory file left open
            with pytest.raises(RuntimeError, match="CUDA"):
                HostKVPool(cfg, 16, 4, pin_memory=True, shared=shared)
        assert open_descriptors() == before


@pytest.mark.gpu
def test_dropped_pinned_shared_pools_give_their_page_locks_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pinned shared pool is unregistered (cudaHostUnregister) when its last view goes, without an error in its
    finalizer: a process that drops and rebuilds its host tier pins the new one, and locked pages do not pile up."""
    errors: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", errors.append)
    for _ in range(3):
        pool = HostKVPool(KVCacheConfig.tiny(), 64, 4, pin_memory=True, shared=True)
        assert pool.kv_buffer.is_pinned()
        pool.kv_buffer.view(torch.uint8).fill_(1)
        del pool
        gc.collect()
    assert errors == []


class RecordingCudaRuntime:
    """Stands in for `torch.cuda.cudart()` on a host without CUDA: records each call and what it was given."""

    def __init__(self, register_rc: int = 0) -> None:
        self.register_rc = register_rc
        self.calls: list[tuple[str, tuple[object, ...]]] = []
        self.open_at_unregister: list[bool] = []  # whether the memory file was still open when unregistered
        self.fd = -1

    def cudaHostRegister(self, *args: object) -> int:  # noqa: N802  the CUDA runtime's name
        self.calls.append(("register", args))
        return self.register_rc

    def cudaHostUnregister(self, *args: object) -> int:  # noqa: N802
        self.calls.append(("unregister", args))
        try:
            os.fstat(self.fd)
            self.open_at_unregister.append(True)
        except OSError:
            self.open_at_unregister.append(False)
        return 0


def test_a_pinned_shared_buffer_registers_its_mapping_and_unregisters_it_when_the_last_view_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CPU twin of the test above, through a recording CUDA runtime: cudaHostRegister is given the mapping's
    address, its whole size and the portable and mapped flags (1 | 2); when the last view is collected,
    cudaHostUnregister is given the same address while the memory file is still open, and the finalizer raises
    nothing. A non-zero return from cudaHostRegister is an error that names the call and its code."""
    runtime = RecordingCudaRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    errors: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", errors.append)
    buf, runtime.fd = shared_buffer(8192, True)
    ptr = buf.data_ptr()
    assert runtime.calls == [("register", (ptr, 8192, 3))]
    view = buf[4096:]
    del buf
    gc.collect()
    assert len(runtime.calls) == 1  # a view still holds the mapping
    del view
    gc.collect()
    assert runtime.calls[1:] == [("unregister", (ptr,))] and runtime.open_at_unregister == [True]
    assert errors == []
    refused = RecordingCudaRuntime(register_rc=1)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: refused)
    before = open_descriptors()
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of the shared host pool \(8192 bytes\) failed: error 1"):
        shared_buffer(8192, True)
    gc.collect()
    assert open_descriptors() == before  # the refused buffer's memory file is closed


def test_a_pinned_shared_pool_page_locks_its_whole_memory_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """HostKVPool(pin_memory=True, shared=True) on a CUDA host registers the memory file it maps, all of it, and
    says it is pinned: checked on the CPU with CUDA reported available and the recording runtime above."""
    runtime = RecordingCudaRuntime()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    pool = HostKVPool(KVCacheConfig.tiny(), 16, 4, pin_memory=True, shared=True)
    assert pool.pinned is True and pool.share_fd is not None
    nbytes = pool.kv_buffer.numel() * pool.kv_buffer.element_size()
    ptr = pool.kv_buffer.data_ptr()
    assert runtime.calls == [("register", (ptr, nbytes, 3))]
    del pool
    gc.collect()  # while the recording runtime is in place: the finalizer unregisters through it
    assert runtime.calls[1:] == [("unregister", (ptr,))]


def test_a_pool_attached_from_a_descriptor_says_it_is_not_pinned() -> None:
    """An attached pool maps memory it did not pin: `pinned` is the bool False, as every pool's `pinned` is a bool
    (what a caller compares or reports, not a None)."""
    pool = HostKVPool(KVCacheConfig.tiny(), 16, 4, pin_memory=False, shared=True)
    assert pool.share_fd is not None
    twin = HostKVPool(KVCacheConfig.tiny(), 16, 4, attach_fd=os.dup(pool.share_fd))
    assert twin.pinned is False and pool.pinned is False


def test_a_host_pool_sized_for_a_device_pool_is_shared_only_when_asked() -> None:
    """for_device_pool(shared=True) gives a pool another process can map (its pages seen through the descriptor);
    by default the pool is ordinary memory with no descriptor to hand out."""
    device_pool = DeviceKVPool(KVCacheConfig.tiny(), 8)
    plain = HostKVPool.for_device_pool(device_pool, page_size=4, pin_memory=False)
    assert plain.share_fd is None
    shared = HostKVPool.for_device_pool(device_pool, page_size=4, pin_memory=False, shared=True)
    assert shared.share_fd is not None and shared.size == 16
    twin = HostKVPool(device_pool.config, 16, 4, attach_fd=os.dup(shared.share_fd))
    shared.kv_buffer.view(torch.uint8)[-3:] = 7
    assert (twin.kv_buffer.view(torch.uint8)[-3:] == 7).all()
    fd = shared.share_fd
    del shared, twin
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed with the last view of the pool's buffer


def test_page_bytes_gather_into_an_out_buffer_of_exactly_their_size() -> None:
    """`out` needs at least the pages' bytes: a staging buffer of exactly that size (ProcessStorage's, sized to
    the batch) is filled, and its head is the result."""
    pool = HostKVPool(KVCacheConfig.tiny(), 16, 4, pin_memory=False)
    pages = pool.alloc_pages(2)
    assert pages is not None
    slots = pool.page_slots(pages)
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 256, (2, pool.page_nbytes), dtype=torch.uint8, generator=g)
    pool.set_pages_bytes(slots, data)
    out = np.zeros(2 * pool.page_nbytes, dtype=np.uint8)
    got = pool.get_pages_bytes(slots, out=out)
    assert torch.equal(got, data) and np.array_equal(out, data.numpy().reshape(-1))
    with pytest.raises(ValueError, match="at least"):
        pool.get_pages_bytes(slots, out=out[:-1])
