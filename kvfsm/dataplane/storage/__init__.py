"""L3 storage: page-keyed backends for host pages serialised as flat uint8 tensors.

- `base`: the `StorageBackend` protocol the runtime depends on, key suffixes, shared stats.
- `file`: `FileStorage`, the embedded default (SGLang HiCacheFile's raw page files plus checksum sidecars,
  atomic publish).
- `memory`: `MemoryStorage`, a dict, for tests and demos.
- `process`: `ProcessStorage`, any of these run in a child process, so that its writes take no
  interpreter time from the scheduler thread.
- `sharded`: `ShardedStorage`, one store spread over several by key, called at once (several store
  processes, where one cannot keep up).
- `faulty`: `FaultyStorage`, fault injection around any backend, for tests.
- `mooncake`: `MooncakeStorage`, a shared distributed store (`pip install 'kvfsm[mooncake]'`; imported
  from `kvfsm.dataplane.storage.mooncake`, not here, so that this package never needs the extra).

A new backend goes in its own module here, implementing `StorageBackend`.
"""

from .base import StorageBackend, StorageStats, storage_key_suffix
from .faulty import FaultyStorage
from .file import FileStorage
from .memory import MemoryStorage
from .process import ProcessStorage, RemoteStoreError
from .sharded import ShardedStorage

__all__ = [
    "FaultyStorage",
    "FileStorage",
    "MemoryStorage",
    "ProcessStorage",
    "RemoteStoreError",
    "ShardedStorage",
    "StorageBackend",
    "StorageStats",
    "storage_key_suffix",
]
