"""The adapter's configuration, read from where upstream's manager reads it in a running SGLang server.

`read_settings(kv_pool, tp_group)` takes page size from `get_schedule()`, the stride from
`SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE` (rounded as upstream: unset or <= 0 is one page, else whole pages,
at least one), the host pool size from `get_memory().hicache_size` (GB, when > 0) or `hicache_ratio` (x
the device pool's tokens) plus upstream's one extra page, the host layout from `hicache_mem_layout`, the
store from `hicache_storage_backend` with `hicache_storage_backend_extra_config` (JSON), the model name
from `get_serving().served_model_name`, and the TP rank and size as upstream's storage config does (the
attention-TP ones under DP attention). Anything kvfsm cannot do as upstream does is a ConfigError naming
the server argument, raised before anything is allocated.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from kvfsm.dataplane.pools.host_pool import Layout
from kvfsm.errors import ConfigError

SOURCE = "kvfsm.integrations.sglang"
STRIDE_ENV = "SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE"
FILE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
DEFAULT_FILE_DIR = "/tmp/hicache"  # HiCacheFile's default
# kvfsm's own key in the extra config (HiCacheFile reads only its own): true runs the file store in a child
# process over a shared host pool (kvfsm.dataplane.storage.ProcessStorage); a number n, in n of them, each key
# always in the same one (kvfsm.dataplane.storage.ShardedStorage)
STORE_PROCESS_KEY = "kvfsm_store_process"
# SGLang's --hicache-mem-layout -> kvfsm's host layout and FileStorage page order (docs/page-layout.md)
LAYOUTS: dict[str, Layout] = {
    "layer_first": "layer_first",
    "page_first": "page_first",
    "page_first_direct": "layer_first",
}


def config_error(field_name: str, reason: str) -> ConfigError:
    return ConfigError(field_name, reason, SOURCE)


@dataclass(frozen=True)
class Settings:
    page_size: int
    stride: int
    host_slots: int  # tokens of the host pool, whole pages (upstream's size, its extra page included)
    host_layout: Layout  # kvfsm's HostKVPool layout (internal: any layout gives the same page bytes)
    file_layout: str  # FileStorage page order: what SGLang peers of the server's layout read and write
    storage_backend: Optional[str]
    storage_extra: dict[str, Any] = field(default_factory=dict)
    file_dir: str = DEFAULT_FILE_DIR
    model_name: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    store_process: bool = False  # `kvfsm_store_process` of the extra config: the file store in a child process
    store_processes: int = 1  # how many, when `kvfsm_store_process` is a number: the writes sharded by key


def offload_stride(page_size: int, env: Optional[str] = None) -> int:
    """Upstream's stride: unset or <= 0 gives one page, else whole pages of it, at least one page."""
    raw = os.environ.get(STRIDE_ENV) if env is None else env
    if raw is None or raw.strip() == "":
        return page_size
    try:
        stride = int(raw)
    except ValueError:
        raise config_error(STRIDE_ENV, f"must be an integer, got {raw!r}") from None
    if stride <= 0:
        return page_size
    return max(page_size, stride // page_size * page_size)


def host_slots(memory: Any, device_tokens: int, bytes_per_token: int, page_size: int) -> int:
    """Upstream's host pool size (`HostKVCache.__init__`): hicache_size GB when > 0, else the ratio times the
    device pool's tokens; then whole pages plus one more page."""
    size_gb = getattr(memory, "hicache_size", 0) or 0
    if size_gb > 0:
        tokens = int(size_gb * 1e9 // bytes_per_token)
    else:
        ratio = getattr(memory, "hicache_ratio", None)
        if ratio is None or ratio <= 0:
            raise config_error("hicache_ratio", f"must be > 0 when hicache_size is not set, got {ratio!r}")
        tokens = int(device_tokens * ratio)
    return (tokens // page_size + 1) * page_size


def _tp_rank_size() -> tuple[int, int]:
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    try:
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled

        dp_attention = bool(is_dp_attention_enabled())
    except Exception:  # not initialised outside a server: plain TP, as upstream's storage config then is
        dp_attention = False
    if dp_attention:
        rank, size = parallel.attn_tp_rank, parallel.attn_tp_size
    else:
        rank, size = parallel.tp_rank, parallel.tp_size
    for name in ("pp_size", "attn_cp_size", "attn_dcp_size"):
        value = _get(parallel, name, 1)
        if value not in (None, 1):
            raise config_error(
                name,
                f"{value}: kvfsm's SGLang adapter names pages as HiCacheFile does without "
                f"pipeline or context parallelism (the suffixes for {name} > 1 are not "
                f"implemented)",
            )
    return int(rank or 0), int(size or 1)


def _get(obj: Any, name: str, default: Any) -> Any:
    try:
        return getattr(obj, name)
    except (AttributeError, ValueError, RuntimeError):
        return default


def read_settings(device_tokens: int, bytes_per_token: int, tp_group: Any) -> Settings:
    """Everything the adapter configures, from SGLang's published server config (see the module docstring)."""
    from sglang.srt.runtime_context import get_memory, get_schedule, get_serving

    page_size = int(get_schedule().page_size)
    memory = get_memory()
    extra_raw = getattr(memory, "hicache_storage_backend_extra_config", None)
    extra: dict[str, Any] = {}
    if extra_raw:
        try:
            extra = json.loads(extra_raw)
        except json.JSONDecodeError as exc:
            raise config_error("hicache_storage_backend_extra_config", f"invalid JSON: {exc}") from exc
        if not isinstance(extra, dict):
            raise config_error("hicache_storage_backend_extra_config", f"must be a JSON object, got {extra_raw!r}")
    backend = getattr(memory, "hicache_storage_backend", None)
    if backend not in ("file",):
        raise config_error(
            "hicache_storage_backend",
            f"{backend!r}: kvfsm's SGLang adapter stores pages with "
            f"'file' (HiCacheFile's names and bytes) only; decode offload "
            f"needs a store (upstream fails without one too)",
        )
    layout = getattr(memory, "hicache_mem_layout", "layer_first")
    if layout not in LAYOUTS:
        raise config_error("hicache_mem_layout", f"{layout!r}: kvfsm supports {sorted(LAYOUTS)}")
    if tp_group is not None and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size(group=tp_group)
    else:
        world = 1
    tp_rank, tp_size = _tp_rank_size()
    if tp_size != world:
        raise config_error("tp_size", f"the published TP size {tp_size} differs from tp_group's world size {world}")
    file_dir = os.environ.get(FILE_DIR_ENV) or extra.get("file_storage_path") or DEFAULT_FILE_DIR
    store_process = extra.get(STORE_PROCESS_KEY, False)
    # true: one store process; a whole number n >= 1: n of them, sharing the writes by key (ShardedStorage)
    if isinstance(store_process, bool):
        processes = 1
    elif isinstance(store_process, int) and store_process >= 1:
        store_process, processes = True, store_process
    else:
        raise config_error(
            "hicache_storage_backend_extra_config",
            f"{STORE_PROCESS_KEY} must be true or false, or a whole number of processes >= 1, got {store_process!r}",
        )
    model = get_serving().served_model_name or ""
    return Settings(
        page_size=page_size,
        stride=offload_stride(page_size),
        host_slots=host_slots(memory, device_tokens, bytes_per_token, page_size),
        host_layout=LAYOUTS[layout],
        file_layout=LAYOUTS[layout],
        storage_backend=backend,
        storage_extra=extra,
        file_dir=str(file_dir),
        model_name=str(model),
        tp_rank=tp_rank,
        tp_size=tp_size,
        store_process=store_process,
        store_processes=processes,
    )
