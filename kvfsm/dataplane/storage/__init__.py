"""L3 storage: page-keyed backends for host pages serialised as flat uint8 tensors."""

from .file import FaultyStorage, FileStorage, MemoryStorage, StorageBackend, StorageStats, storage_key_suffix

__all__ = ["FaultyStorage", "FileStorage", "MemoryStorage", "StorageBackend", "StorageStats", "storage_key_suffix"]
