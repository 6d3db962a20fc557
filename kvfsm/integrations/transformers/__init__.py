"""kvfsm as the KV offloading manager of Hugging Face transformers' continuous batching.

transformers' `generate_batch` (a `ContinuousBatchingManager`) schedules requests over a paged KV cache;
under cache pressure its `OffloadingManager` evicts requests ("victims"), copies their blocks to a pinned
CPU pool and copies them back when they are rescheduled. `install(model_or_manager)` replaces that
manager, per batch processor, with `KvfsmOffloadingManager`: the victim choice and the requeue logic
stay transformers' own, and every swap-out, swap-in, free and cancellation of a request's blocks is an
event of its `CbSwapMachine`, generated from spec/cb_swap.yaml, whose actions (`SwapEffects`) move the
bytes with kvfsm's data plane:

- the engine's cache tensor is viewed, without a copy, as a kvfsm `DeviceKVPool` whose slots are the
  engine's blocks (`PagedCachePool`); host blocks live in a kvfsm `HostKVPool` (pinned under CUDA);
- copies go through a kvfsm `CopyEngine` (`CudaCopyEngine` on a CUDA cache, `CpuCopyEngine` on the CPU),
  whose row copies use index_select/index_copy_ (never `dst[idx].copy_`, which moved nothing: B15);
- a victim's device blocks go back to the engine at its swap-out, fenced: the engine's compute stream, the
  only stream it writes KV blocks on, waits on the copy's event, so no reused block is written before the
  copy has read it and the host does not wait (`SwapConfig.fenced`, on when the copy engine fences); without
  fences, only once its swap-out has been acknowledged (B2). A request finished or cancelled while a copy
  is in flight has the rest of its release deferred to the ack;
- checked mode (`SwapConfig(checked=True)`) verifies the spec's invariants after every transition, keeps a
  block ledger (no block reused under a copy unless fenced and its fence waited on, no host block freed
  twice or by another request) and compares every landed copy with its source (a device-side snapshot
  taken at submit) and every restore with the KV read at swap-out (B15).

The engine reaches this package through four seams, all on its own objects (no class or module is patched):
`ContinuousBatchProcessor.offloading_manager` (replaced), `PagedAttentionCache.free_blocks` and
`Scheduler.clear_cancelled_requests` (wrapped on the instance, so a swapped request's free and
cancellation reach its machine), and `ContinuousBatchingManager._create_batch_processor` (wrapped on the
instance, to install the manager on each new batch processor). Checked mode also wraps, on the cache
instance, the three calls that name the blocks the next kernels write (`extend_read_and_write_indices`,
`fill_block_table`, `perform_cache_copy`), for the ledger. Supported: one process (no tensor
parallelism) and models whose layers all use full attention (one cache allocator), e.g. Llama.

Layout, one concern per module: `compat` (the guarded transformers imports and the tested version range),
`config` (SwapConfig, SwapMetrics), `pool` (PagedCachePool), `ledger` (SwapLedger), `effects` (the spec's
actions, SwapEffects, and the per-request records), `manager` (KvfsmOffloadingManager) and
`installer` (install, installed, SwapInstallation). Every name is re-exported here.
"""

from __future__ import annotations

# compat first: without transformers, importing this package fails there, with the extra to install.
# The private names stay importable from here, as they were from the single module.
from .compat import _TESTED_MAX, _TESTED_MIN, TESTED_VERSIONS, _version_tuple, transformers_version_tested  # noqa: F401
from .config import SwapConfig, SwapMetrics, _size_host_pool  # noqa: F401
from .effects import SwapCopy, SwapEffects, SwapRecord, _engine_for  # noqa: F401
from .installer import SwapInstallation, _install_on_manager, install, installed  # noqa: F401
from .ledger import SwapLedger
from .manager import KvfsmOffloadingManager, _serials  # noqa: F401
from .pool import PagedCachePool

__all__ = [
    "KvfsmOffloadingManager",
    "PagedCachePool",
    "SwapConfig",
    "SwapInstallation",
    "SwapLedger",
    "SwapMetrics",
    "TESTED_VERSIONS",
    "install",
    "installed",
    "transformers_version_tested",
]
