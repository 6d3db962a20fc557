"""L3 storage: page-keyed backends for host pages serialised as flat uint8 tensors.

`StorageBackend` is the protocol the runtime depends on (same shape as SGLang's HiCacheStorage batch
API): batch_set reports success per page, batch_get returns None for anything it cannot vouch for, and
batch_exists is the length of the stored prefix (pages are chained by hash, so only a prefix is usable).

`FileStorage` is the embedded default. Keys are suffixed like SGLang's HiCacheFile backend
(`{hash}_{model}_{tp_rank}_{tp_size}`, `{hash}_{model}` for MLA whose latent is identical on every TP
rank; "/" in the model name becomes "-") and stored as `{key}.bin`. Each file is a small header (magic,
crc32 of the payload, key and payload lengths), the key, then the payload. Writes go to a temp file in
the same directory and are published with os.replace, so a reader sees a whole page or none; a torn or
corrupted file (bad length, bad magic, other key, bad checksum) is counted, logged, moved aside as
`*.corrupt` and reported as None: never returned. Failed writes (OSError: disk full, read-only dir) are
counted and reported per page as False, never raised (B13: a failed store is never visible as stored).

`FaultyStorage` wraps any backend and fails chosen writes / corrupts or drops chosen reads,
deterministically, for tests. `MemoryStorage` is a dict-backed backend for fast tests.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import struct
import threading
import uuid
import zlib
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

import torch

logger = logging.getLogger(__name__)

_KEY_RE = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,199}$")
_MAGIC = b"KVFSPG01"
_HEADER = struct.Struct("<8sIIQ")  # magic, crc32(payload), key length, payload length


@runtime_checkable
class StorageBackend(Protocol):
    """Page-keyed L3 store."""

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Store each page under its key; one success flag per page (a False page is not stored)."""
        ...

    def batch_get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """The stored uint8 page per key, or None when missing or not intact."""
        ...

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored (stops at the first missing one)."""
        ...


def _check_batch(keys: Sequence[str], pages: Sequence[torch.Tensor]) -> None:
    if len(keys) != len(pages):
        raise ValueError(f"{len(keys)} keys but {len(pages)} pages")
    for p in pages:
        if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8:
            raise ValueError("pages must be uint8 tensors (HostKVPool.get_pages_bytes rows)")


def storage_key_suffix(model_name: str = "", tp_rank: int = 0, tp_size: int = 1, is_mla: bool = False) -> str:
    """SGLang HiCacheFile's per-deployment key suffix."""
    model = "-".join(model_name.split("/")) if model_name else ""
    return f"_{model}" if is_mla else f"_{model}_{tp_rank}_{tp_size}"


@dataclass
class StorageStats:
    writes_ok: int = 0
    writes_skipped: int = 0  # key already stored (content-addressed: same key, same bytes)
    writes_failed: int = 0
    reads_ok: int = 0
    reads_missing: int = 0
    reads_corrupt: int = 0


class FileStorage:
    """One file per page in `directory`, published atomically, verified by crc32 on read."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        model_name: str = "",
        tp_rank: int = 0,
        tp_size: int = 1,
        is_mla: bool = False,
        fsync: bool = False,
        writers: int = 4,
    ) -> None:
        if writers < 1:
            raise ValueError(f"writers must be >= 1, got {writers}")
        self.writers = writers
        self._pool: ThreadPoolExecutor | None = None
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.suffix = storage_key_suffix(model_name, tp_rank, tp_size, is_mla)
        self.fsync = fsync
        self.stats = StorageStats()
        self._lock = threading.Lock()
        # temp names unique per process, instance and write (a counter: cheaper than a uuid per page)
        self._tmp_tag = f"{os.getpid()}.{uuid.uuid4().hex[:12]}"
        self._tmp_serial = itertools.count()

    def path_of(self, key: str) -> str:
        """The file that holds `key` (after the deployment suffix)."""
        full = key + self.suffix
        if not _KEY_RE.match(full) or ".." in full:
            raise ValueError(f"storage key {key!r} has characters a file name cannot carry safely")
        return os.path.join(self.directory, full + ".bin")

    def _count(self, field: str) -> None:
        with self._lock:
            setattr(self.stats, field, getattr(self.stats, field) + 1)

    # ---- writes -----------------------------------------------------------------------------------
    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        _check_batch(keys, pages)
        return self._write(keys, [page.detach().to("cpu").contiguous().reshape(-1).numpy() for page in pages])

    def batch_set_from_host(self, keys: Sequence[str], host_pool: Any, host_indices: Any) -> list[bool]:
        """Store the whole pages at `host_indices` of a HostKVPool under `keys` (one per page, in order),
        gathered in one call: the backup worker's path, which runs beside the scheduler thread and should
        hold the interpreter lock as little as it can (no tensor call per page)."""
        data = host_pool.get_pages_bytes(host_indices).numpy()
        if data.shape[0] != len(keys):
            raise ValueError(f"{len(keys)} keys for {data.shape[0]} pages")
        return self._write(keys, data)

    def _write(self, keys: Sequence[str], payloads: Sequence[np.ndarray] | np.ndarray) -> list[bool]:
        """Each page to its file; a batch is spread over `writers` threads. Why: one thread wrote ~650 MB/s
        of 512 KiB pages on the H200 host, half of what 4096 live requests decode into a file store
        (bench/results/serving_loop-h200.json); checksums, copies and file writes release the interpreter
        lock, so writers overlap."""
        paths = [self.path_of(k) for k in keys]  # a bad key rejects the batch before anything is written
        if self.writers > 1 and len(keys) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.writers, thread_name_prefix="kvfsm-file-store")
            results = list(self._pool.map(self._set_one, keys, paths, payloads))
        else:
            results = [self._set_one(k, p, payload) for k, p, payload in zip(keys, paths, payloads)]
        with self._lock:
            self.stats.writes_ok += results.count("writes_ok")
            self.stats.writes_skipped += results.count("writes_skipped")
            self.stats.writes_failed += results.count("writes_failed")
        return [r != "writes_failed" for r in results]

    def _set_one(self, key: str, path: str, payload: np.ndarray) -> str:
        """Write one page; returns the stats field it counts as."""
        if os.path.exists(path):
            return "writes_skipped"
        kb = (key + self.suffix).encode()
        header = _HEADER.pack(_MAGIC, zlib.crc32(payload) & 0xFFFFFFFF, len(kb), payload.nbytes)
        tmp = os.path.join(self.directory, f".{os.path.basename(path)}.{self._tmp_tag}.{next(self._tmp_serial)}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(kb)
                f.write(memoryview(payload))
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            if self.fsync:
                self._fsync_dir()
        except OSError as e:
            logger.warning("storage write of %s failed: %s", key, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return "writes_failed"
        return "writes_ok"

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ---- reads ------------------------------------------------------------------------------------
    def batch_get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        return [self._get_one(k) for k in keys]

    def _get_one(self, key: str) -> torch.Tensor | None:
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                n = f.readinto(buf)
        except FileNotFoundError:
            self._count("reads_missing")
            return None
        except OSError as e:
            logger.warning("storage read of %s failed: %s", key, e)
            self._count("reads_missing")
            return None
        problem = self._verify(buf, n, (key + self.suffix).encode())
        if problem is not None:
            logger.warning("storage page %s is corrupt (%s); moved aside, not returned", key, problem)
            self._count("reads_corrupt")
            try:
                os.replace(path, path + ".corrupt")
            except OSError:
                pass
            return None
        self._count("reads_ok")
        start = _HEADER.size + len(key + self.suffix)
        return torch.frombuffer(buf, dtype=torch.uint8, offset=start) if len(buf) > start else torch.empty(0, dtype=torch.uint8)

    @staticmethod
    def _verify(buf: bytearray, n: int, key: bytes) -> str | None:
        if n != len(buf) or n < _HEADER.size:
            return "truncated header"
        magic, crc, klen, plen = _HEADER.unpack_from(buf)
        if magic != _MAGIC:
            return "bad magic"
        if n != _HEADER.size + klen + plen:
            return f"length {n} != {_HEADER.size + klen + plen} (torn write?)"
        if bytes(buf[_HEADER.size : _HEADER.size + klen]) != key:
            return "file holds another key"
        if zlib.crc32(memoryview(buf)[_HEADER.size + klen :]) & 0xFFFFFFFF != crc:
            return "checksum mismatch"
        return None

    def batch_exists(self, keys: Sequence[str]) -> int:
        for i, k in enumerate(keys):
            if not os.path.exists(self.path_of(k)):
                return i
        return len(keys)


class MemoryStorage:
    """Dict-backed backend (copies pages in and out), for tests and single-process demos."""

    def __init__(self) -> None:
        self.pages: dict[str, torch.Tensor] = {}

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        _check_batch(keys, pages)
        for k, p in zip(keys, pages):
            self.pages.setdefault(k, p.detach().to("cpu").reshape(-1).clone())
        return [True] * len(keys)

    def batch_get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        return [None if (p := self.pages.get(k)) is None else p.clone() for k in keys]

    def batch_exists(self, keys: Sequence[str]) -> int:
        for i, k in enumerate(keys):
            if k not in self.pages:
                return i
        return len(keys)


KeySelector = Collection[str] | Callable[[str], bool]


def _selector(spec: KeySelector | None) -> Callable[[str], bool]:
    if spec is None:
        return lambda _k: False
    if callable(spec):
        return spec
    chosen = frozenset(spec)
    return chosen.__contains__


class FaultyStorage:
    """Wraps a backend and injects faults chosen up front, deterministically.

    fail_writes: keys (or a predicate) whose writes fail (reported False, never reach the inner store);
    fail_write_ordinals: 0-based positions, counted over all pages ever passed to batch_set, that fail;
    corrupt_reads: keys whose read returns the stored page with byte 0 flipped (silent corruption);
    drop_reads: keys whose read returns None (a lost or detected-bad page).
    """

    def __init__(
        self,
        inner: StorageBackend,
        fail_writes: KeySelector | None = None,
        fail_write_ordinals: Collection[int] = (),
        corrupt_reads: KeySelector | None = None,
        drop_reads: KeySelector | None = None,
    ) -> None:
        self.inner = inner
        self._fail = _selector(fail_writes)
        self._fail_ordinals = frozenset(fail_write_ordinals)
        self._corrupt = _selector(corrupt_reads)
        self._drop = _selector(drop_reads)
        self.pages_written = 0
        self.failed_writes: list[str] = []
        self.corrupted_reads: list[str] = []
        self.dropped_reads: list[str] = []

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        _check_batch(keys, pages)
        ok = [True] * len(keys)
        passed: list[int] = []
        for i, k in enumerate(keys):
            ordinal = self.pages_written + i
            if self._fail(k) or ordinal in self._fail_ordinals:
                ok[i] = False
                self.failed_writes.append(k)
            else:
                passed.append(i)
        self.pages_written += len(keys)
        if passed:
            inner_ok = self.inner.batch_set([keys[i] for i in passed], [pages[i] for i in passed])
            for i, r in zip(passed, inner_ok):
                ok[i] = bool(r)
        return ok

    def batch_get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        out = self.inner.batch_get(keys)
        for i, k in enumerate(keys):
            if out[i] is None:
                continue
            if self._drop(k):
                out[i] = None
                self.dropped_reads.append(k)
            elif self._corrupt(k):
                bad = out[i].clone()  # type: ignore[union-attr]
                if bad.numel():
                    bad[0] ^= 0xFF
                out[i] = bad
                self.corrupted_reads.append(k)
        return out

    def batch_exists(self, keys: Sequence[str]) -> int:
        return self.inner.batch_exists(keys)
