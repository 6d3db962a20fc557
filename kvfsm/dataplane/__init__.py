"""kvfsm data plane: device and host KV pools, slot allocators, copy engines, page hashing, L3 storage.

Depends on torch and numpy only (no pydantic, no other kvfsm package), so it imports on GPU hosts that
carry nothing else. Nothing here knows about requests' lifecycles: the runtime above drives it.
"""

from .copy.base import CopyEngine, CopyHandle
from .copy.cpu import CpuCopyEngine, DeferredCpuCopyEngine, DeferredHandle, ThreadCpuCopyEngine
from .copy.cuda import CudaCopyEngine, CudaCopyHandle
from .copy.triton_kernels import HAVE_TRITON, KernelConfig
from .errors import (
    ConservationError,
    CopyError,
    DoubleAlloc,
    DoubleFree,
    DuplicateIndex,
    HostMemoryError,
    NeverAllocated,
    NotAllocated,
    OutOfRange,
    PartialPage,
    SlotError,
)
from .fences import SlotFence, wait_fences
from .hashing import PageRun, page_hash, page_hashes, request_namespace, storage_namespace_seed
from .pools.allocator import TokenSlotAllocator
from .pools.config import KVCacheConfig
from .pools.device_pool import DeviceKVPool, MHADeviceKVPool, MLADeviceKVPool
from .pools.host_pool import HostKVPool, available_host_memory
from .pools.req_to_token import ReqToTokenPool
from .storage import FaultyStorage, FileStorage, MemoryStorage, StorageBackend, storage_key_suffix


def make_copy_engine(device: str | None = None) -> CopyEngine:
    """CudaCopyEngine (Triton when it imports) when CUDA is present and `device` is not "cpu", else CPU
    (a WARNING when a CUDA `device` was named: the CPU engine is then a fallback, not a choice)."""
    import logging

    import torch

    if device != "cpu" and torch.cuda.is_available():
        return CudaCopyEngine(device)
    if device not in (None, "cpu"):
        logging.getLogger(__name__).warning(
            "make_copy_engine(%r): CUDA is not available, using the CPU copy engine", device
        )
    return CpuCopyEngine()


__all__ = [
    "HAVE_TRITON",
    "ConservationError",
    "CopyEngine",
    "CopyError",
    "CopyHandle",
    "CpuCopyEngine",
    "CudaCopyEngine",
    "CudaCopyHandle",
    "DeferredCpuCopyEngine",
    "DeferredHandle",
    "DeviceKVPool",
    "DoubleAlloc",
    "DoubleFree",
    "DuplicateIndex",
    "FaultyStorage",
    "FileStorage",
    "HostKVPool",
    "HostMemoryError",
    "KVCacheConfig",
    "KernelConfig",
    "MHADeviceKVPool",
    "MLADeviceKVPool",
    "MemoryStorage",
    "NeverAllocated",
    "NotAllocated",
    "OutOfRange",
    "PartialPage",
    "ReqToTokenPool",
    "SlotError",
    "SlotFence",
    "StorageBackend",
    "ThreadCpuCopyEngine",
    "wait_fences",
    "TokenSlotAllocator",
    "available_host_memory",
    "make_copy_engine",
    "page_hash",
    "page_hashes",
    "request_namespace",
    "storage_namespace_seed",
    "PageRun",
    "storage_key_suffix",
]
