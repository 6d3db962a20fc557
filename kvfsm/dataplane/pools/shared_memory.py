"""Host memory another process can map: what a host pool is made of when a store process reads its pages.

The buffer is an anonymous memory file (`memfd_create`, Linux): it has no name in any file system, so a
crash leaves nothing behind in /dev/shm, and another process maps it only through the file descriptor it
is handed (ProcessStorage passes it over its socket). Pinned for CUDA by `cudaHostRegister` (portable and
mapped, so copy engines and device kernels address it as they do a `pin_memory=True` tensor), unregistered
when the buffer is collected.
"""

from __future__ import annotations

import mmap
import os
import weakref
from typing import Any

import torch

_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02


class SharedMemoryUnavailable(RuntimeError):
    """This platform has no anonymous memory files (memfd_create): a shared host pool needs Linux."""


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _map(fd: int, nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    """A uint8 tensor over a shared mapping of `fd`; the descriptor is closed when the mapping is collected
    (the mapping, not the tensor: every view of the pool's buffer keeps it alive)."""
    try:
        mapping = mmap.mmap(fd, nbytes)
        buf = torch.frombuffer(mapping, dtype=torch.uint8)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(mapping, os.close, fd)
    return buf, mapping


def shared_buffer(nbytes: int, pin: bool) -> tuple[torch.Tensor, int]:
    """A zeroed uint8 tensor of `nbytes` in an anonymous memory file, and the file's descriptor (open as long
    as any view of the tensor lives); pinned for CUDA when `pin`."""
    if not hasattr(os, "memfd_create"):
        raise SharedMemoryUnavailable("a shared host pool needs os.memfd_create (Linux)")
    fd = os.memfd_create("kvfsm-host-pool", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    buf, mapping = _map(fd, nbytes)
    if pin:
        rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, _CUDA_HOST_REGISTER_PORTABLE_MAPPED)
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister of the shared host pool ({nbytes} bytes) failed: error {int(rc)}")
        weakref.finalize(mapping, _unregister, buf.data_ptr())  # last registered, first run: before the close
    return buf, fd


def attach_buffer(fd: int, nbytes: int) -> torch.Tensor:
    """The uint8 tensor of `nbytes` another process's `shared_buffer` made, mapped from its descriptor (which
    this call owns from here on)."""
    size = os.fstat(fd).st_size
    if size < nbytes:
        os.close(fd)
        raise ValueError(f"the shared buffer is {size} bytes, not the {nbytes} its pool needs")
    return _map(fd, nbytes)[0]


def identity(fd: int) -> Any:
    """What names a shared buffer across processes (the memory file's inode), so a peer maps it once."""
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)
