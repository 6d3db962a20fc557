"""What the manager builds from its config when the engine does not pass it: host pool, copy engine, store.

Everything that can be wrong with the config on this machine and with these pools is checked first, and
only then is anything allocated or connected, so a ConfigError (naming the field) leaves no host pool,
no copy-engine staging and no half-made store behind. A fallback the config allows is logged as a WARNING.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from kvfsm.dataplane import (
    CopyEngine,
    CpuCopyEngine,
    CudaCopyEngine,
    DeferredCpuCopyEngine,
    DeviceKVPool,
    FileStorage,
    HostKVPool,
    StorageBackend,
    available_host_memory,
)
from kvfsm.dataplane.storage.process import CHILD_FILE_WRITERS, in_processes
from kvfsm.errors import ConfigError
from kvfsm.runtime.config import OffloadConfig

logger = logging.getLogger(__name__)


@dataclass
class Components:
    """The manager's host pool, copy engine and store; `owns_storage`: built here, so the manager closes it."""

    host_pool: HostKVPool
    copy_engine: CopyEngine
    storage: Optional[StorageBackend]
    owns_storage: bool


def build_components(
    config: OffloadConfig,
    *,
    device_pool: DeviceKVPool,
    host_pool: Optional[HostKVPool] = None,
    copy_engine: Optional[CopyEngine] = None,
    storage: Optional[StorageBackend] = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> Components:
    """The given components, and the missing ones built from `config`; every check comes before any build."""
    if host_pool is not None:
        if host_pool.page_size != config.page_size:
            raise ConfigError(
                "page_size", f"the host pool given has page size {host_pool.page_size}, the config {config.page_size}"
            )
        host_slots = host_pool.capacity
    else:
        host_slots = planned_host_slots(config, device_pool)
    check_stride(config, host_slots)
    if copy_engine is not None:
        check_fences(config, copy_engine)
    make_engine = copy_engine_factory(config, device_pool) if copy_engine is None else None
    make_storage = storage_factory(config, device_pool, tp_rank, tp_size) if storage is None else None
    # Nothing is allocated yet. The store first: it can fail on its own (an unreachable master) and holds
    # little until it is used.
    built = make_storage() if make_storage is not None else None
    try:
        if host_pool is None:
            host_pool = HostKVPool.for_device_pool(
                device_pool,
                page_size=config.page_size,
                ratio=None if config.host_pool_bytes else config.host_pool_ratio,
                size_bytes=config.host_pool_bytes,
                layout=config.host_layout,
                shared=config.storage_process,  # the store process reads it
            )
        if make_engine is not None:
            copy_engine = make_engine()
    except BaseException:
        close_storage(built)
        raise
    assert copy_engine is not None
    if make_engine is not None:
        try:
            check_fences(config, copy_engine)  # an engine built from the config: known only now
        except ConfigError:
            close_storage(built)
            raise
    return Components(host_pool, copy_engine, storage if storage is not None else built, built is not None)


def check_fences(config: OffloadConfig, copy_engine: CopyEngine) -> None:
    """`fenced_release` needs an engine whose handles are fences (kvfsm.dataplane.fences)."""
    if config.fenced_release and not getattr(copy_engine, "fences", False):
        raise ConfigError(
            "fenced_release",
            f"the copy engine {type(copy_engine).__name__} does not fence its copies "
            "(CopyEngine.fences is false): slots under a copy cannot be released fenced",
        )


def close_storage(storage: object) -> None:
    """Close a store that has a close() (Mooncake's client and ProcessStorage's child do; FileStorage's writer
    threads)."""
    close = getattr(storage, "close", None)
    if close is not None:
        close()


def planned_host_slots(config: OffloadConfig, device_pool: DeviceKVPool) -> int:
    """The slots `HostKVPool.for_device_pool` would allocate for `config`, checked without allocating:
    at least one page, and no more than the host's available memory."""
    kv = device_pool.config
    if config.host_pool_bytes is not None:
        field, slots = "host_pool_bytes", config.host_pool_bytes // kv.bytes_per_token
    else:
        assert config.host_pool_ratio is not None  # the config's own check
        field, slots = "host_pool_ratio", int(device_pool.size * config.host_pool_ratio)
    slots -= slots % config.page_size
    if slots < config.page_size:
        raise ConfigError(
            field,
            f"the host pool would hold {slots} tokens of {kv.bytes_per_token} bytes, "
            f"less than one page of {config.page_size}",
        )
    need, available = slots * kv.bytes_per_token, available_host_memory()
    if available is not None and need > available:
        raise ConfigError(
            field,
            f"the host pool needs {need} bytes ({need / 2**30:.2f} GiB) but only {available} "
            f"({available / 2**30:.2f} GiB) are available (MemAvailable)",
        )
    return slots


def check_stride(config: OffloadConfig, host_slots: int) -> None:
    """A chunk must fit the host pool: a larger one would find no room even in an empty pool, forever."""
    if config.stride > host_slots:
        raise ConfigError(
            "offload_stride",
            f"a chunk of {config.stride} tokens does not fit the host pool's "
            f"{host_slots} slots, so nothing would ever be offloaded; lower it "
            f"or enlarge the pool (host_pool_bytes, host_pool_ratio)",
        )


def copy_engine_factory(config: OffloadConfig, device_pool: DeviceKVPool) -> Callable[[], CopyEngine]:
    """How to build the configured copy engine; 'cuda' that cannot work is a ConfigError, 'auto' that
    lands on the CPU engine a WARNING."""
    backend = config.copy_backend
    if backend == "cpu":
        return CpuCopyEngine
    if backend == "deferred":
        return DeferredCpuCopyEngine
    device = device_pool.device
    if device.type == "cuda":
        return lambda: CudaCopyEngine(device)
    why = "CUDA is not available" if not torch.cuda.is_available() else f"the device pool is on {device}"
    if backend == "cuda":
        raise ConfigError(
            "copy_backend", f"'cuda' needs a device pool on a CUDA device, but {why}; use 'cpu' (or 'auto')"
        )
    logger.warning(
        "copy_backend='auto': %s, so copies run on the CPU copy engine "
        "(copy_backend='cpu' chooses it without this warning)",
        why,
    )
    return CpuCopyEngine


def storage_factory(
    config: OffloadConfig, device_pool: DeviceKVPool, tp_rank: int, tp_size: int
) -> Optional[Callable[[], StorageBackend]]:
    """How to build the configured store (None for 'none'); checks that it can be built here."""
    is_mla = device_pool.config.is_mla
    if config.storage_backend == "file":
        check_storage_dir(config.storage_dir)
        if "storage_dir" not in config.model_fields_set:
            logger.warning(
                "storage_dir is not set: FileStorage writes pages to %s (the default, relative to the "
                "working directory)",
                config.storage_dir.absolute(),
            )
        # in a child process the writers take none of the scheduler's interpreter time (CHILD_FILE_WRITERS);
        # storage_extra's own `writers` wins
        options = (
            {"writers": CHILD_FILE_WRITERS, **config.storage_extra} if config.storage_process else config.storage_extra
        )
        make = functools.partial(
            FileStorage,
            config.storage_dir,
            model_name=config.model_name,
            tp_rank=tp_rank,
            tp_size=tp_size,
            is_mla=is_mla,
            **options,
        )
        if config.storage_process:
            return functools.partial(in_processes, make, config.storage_processes)
        return make
    if config.storage_backend == "mooncake":
        from kvfsm.dataplane.storage.mooncake import MooncakeStorage, MooncakeUnavailable, import_store_class

        try:
            import_store_class()
        except MooncakeUnavailable as exc:
            raise ConfigError("storage_backend", f"'mooncake' needs the Mooncake client: {exc}") from exc
        return lambda: MooncakeStorage.from_config(config, tp_rank=tp_rank, tp_size=tp_size, is_mla=is_mla)
    logger.warning(
        "storage_backend='none' and no storage= given: chunks are copied to host memory and freed, "
        "every backup is reported failed, nothing is stored"
    )
    return None


def check_storage_dir(path: Path) -> None:
    """`storage_dir` is a writable directory, or can be made one (its nearest existing ancestor is)."""
    if path.exists():
        if not path.is_dir():
            raise ConfigError("storage_dir", f"{path} exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError("storage_dir", f"{path} is not writable")
        return
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError("storage_dir", f"{path} cannot be created: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError("storage_dir", f"{path} cannot be created: {parent} is not writable")
