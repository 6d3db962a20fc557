"""L3 storage on Mooncake Store: the `StorageBackend` protocol over `mooncake.store.MooncakeDistributedStore`.

Install with `pip install 'kvfsm[mooncake]'` (the non-CUDA wheel; CUDA hosts install the
`mooncake-transfer-engine` wheel instead). `mooncake` is imported only when a `MooncakeStorage` is built, so
kvfsm imports without it. The binaries need `libibverbs1` even for the TCP protocol.

Keys are SGLang 0.5.23 MooncakeStore's (`sglang_mooncake_keys`): an MHA page is two objects,
`{model}_{hash}_{tp_rank}_k` and `..._v` (its K and V planes), an MLA page one, `{model}_{hash}__k`, so a kvfsm
decode and an SGLang prefill of one deployment see each other's pages (the object bytes follow SGLang's
`--hicache-mem-layout`: MooncakeStorage(layout=...), docs/page-layout.md). A page is stored, found or read
only when all of its objects are.

Data path (one client call per batch, no per-page round trips):
  * batch_set -> `batch_put_from` with each object's own address. A page inside a registered region
    (`register_buffer`, `register_host_pool`, the read pool) is always sent in place; any other page too
    when the protocol lets the transfer engine read unregistered host memory (`tcp`), else it is staged
    through a registered buffer first (one memcpy). `batch_set_from_host` gathers pages straight out of a
    registered HostKVPool (`batch_put_from_multi_buffers`, each object as few ranges as the two layouts
    allow: one when the pool's layout and the store's agree), no serialisation copy at all.
  * batch_get -> `batch_get_into` straight into recycled object buffers (registered when the transport
    needs it) that the returned tensors alias (a page's K and V land side by side and are returned as one
    view; a page_first store reorders, one copy); a buffer is reused only once nothing references it any
    more, so a read neither copies nor page-faults fresh memory.
  * batch_exists -> `batch_is_exist`, counted as a prefix.

Failures are reported per page, never raised (B13: a page is reported stored only when the store said so):
a full store (NO_AVAILABLE_HANDLE, with eviction off or nothing evictable), an RPC failure, a dead master
all become False / None / a shorter prefix, counted in `stats` and logged once per call. An object of
another size than `page_nbytes` is fetched again at its own size (one get_size round trip).

Mooncake is a cache: under memory pressure the master evicts objects (`--eviction_high_watermark_ratio`),
and a restarted master starts with an empty index. A page once reported stored can therefore go missing
later; reads then return None and the stored-prefix query stops there, as for a page never stored.

Bounded time: construction probes the master and the metadata server with a TCP connect and raises
`MooncakeUnavailable` with the address when either is unreachable (instead of the client's ~90 s of setup
retries). The client's setup() and close() hold the GIL, so no Python timeout can cut them short: setup is
bounded through the client's own settings, which construction sets when the environment does not
(`MC_STORE_CLIENT_SETUP_RETRIES` from setup_timeout_s, `MC_RPC_TIMEOUT_MS` from op_timeout_s; both are read
at setup). Every other client call runs on one of a few daemon worker threads and is waited for at most
`op_timeout_s`; past that the call is reported failed. If such an abandoned put finishes later, the keys
it wrote are removed again (the pages may have changed meanwhile), and the buffers an abandoned get
writes into stay reserved until it returns. While every worker is stuck, calls fail at once instead of
queueing. close() waits for running calls before closing the client (never under one).

Modules: `errors` (status codes, error_name, MooncakeUnavailable), `connect` (import_store_class, probe,
bounded client setup), `runner` (bounded calls on worker threads), `read_pool` (recycled receive buffers),
`keys` (SGLang's object keys of a page), `objects` (a page split into its objects and joined back),
`regions` (host memory registered with the client), `client` (MooncakeStorage, MooncakeStats: the data path),
`master` (mooncake_master command line, binary, loopback env).
Every name the former single module defined is re-exported here; importing the package never imports `mooncake`.
"""

from __future__ import annotations

import logging

from .client import MooncakeStats, MooncakeStorage
from .connect import _INSTALL_HINT, _host_port, import_store_class, probe  # noqa: F401
from .errors import (  # noqa: F401
    ERROR_NAMES,
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    OK,
    RPC_FAIL,
    RPC_TIMEOUT,
    TIMEOUT,
    WEDGED,
    MooncakeUnavailable,
    error_name,
)
from .keys import sglang_mooncake_keys, sglang_mooncake_prefix
from .master import LOOPBACK_ENV, master_binary, master_command
from .read_pool import _ReadPool, _Slab  # noqa: F401
from .runner import _ABANDONED, _CANCELLED, _FINISHED, _PENDING, _RUNNING, _Job, _Runner  # noqa: F401

logger = logging.getLogger(__name__)  # the logger every submodule logs to

__all__ = [
    "ERROR_NAMES",
    "LOOPBACK_ENV",
    "MooncakeStats",
    "MooncakeStorage",
    "MooncakeUnavailable",
    "error_name",
    "import_store_class",
    "master_binary",
    "master_command",
    "probe",
    "sglang_mooncake_keys",
    "sglang_mooncake_prefix",
]
