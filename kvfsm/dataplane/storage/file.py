"""FileStorage: the embedded default L3 store, one checksummed file per page.

Keys are suffixed like SGLang's HiCacheFile backend (`{hash}_{model}_{tp_rank}_{tp_size}`, `{hash}_{model}`
for MLA whose latent is identical on every TP rank; "/" in the model name becomes "-") and stored as
`{key}.bin`. Each file is a small header (magic, crc32 of the payload, key and payload lengths), the key,
then the payload. Writes go to a temp file in the same directory and are published with os.replace, so a
reader sees a whole page or none; a torn or corrupted file (bad length, bad magic, other key, bad
checksum) is counted, logged, moved aside as `*.corrupt` and reported as None: never returned. Failed
writes (OSError: disk full, read-only dir) are counted and reported per page as False, never raised
(B13: a failed store is never visible as stored).

A writer killed between its write and its publish leaves only its temp file
(`.{key}.bin.{pid}.{tag}.{serial}.tmp`), which no reader or later writer looks at. A new FileStorage of TP
rank 0 (one per deployment) removes, once at start-up, the temp files of writers that are gone: older than
`stale_temp_age_s` (600 s; no page write takes that long, so a writer on another host sharing the
directory is never cut off mid-write) and named by a pid that is not a live process here
(`sweep_stale_temps`; one directory scan, about 1 ms per thousand files). `*.corrupt` files are left for an
operator to inspect. The byte layout of a page file is docs/page-layout.md.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .base import StorageStats, _check_batch, storage_key_suffix

logger = logging.getLogger(__name__)

_KEY_RE = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,199}$")
_MAGIC = b"KVFSPG01"
_HEADER = struct.Struct("<8sIIQ")  # magic, crc32(payload), key length, payload length
# what _set_one names its temp files: ".{final name}.{pid}.{12 hex}.{serial}.tmp"
_TMP_RE = re.compile(r"^\..+\.bin\.(?P<pid>\d+)\.[0-9a-f]{12}\.\d+\.tmp$")


def _pid_alive(pid: int) -> bool:
    """Whether `pid` names a live process on this host (one of another user's counts as alive)."""
    if pid <= 0:
        return True  # not a pid we could have written: never treat it as dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


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
        writers: int = 1,
        stale_temp_age_s: float | None = 600.0,
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
        self.swept_temps = 0
        if stale_temp_age_s is not None and tp_rank == 0:  # one sweep per deployment: the ranks share the directory
            self.swept_temps = self.sweep_stale_temps(stale_temp_age_s)

    def sweep_stale_temps(self, older_than_s: float) -> int:
        """Remove the temp files of dead writers: named like ours, last modified more than `older_than_s`
        ago, by a pid that is not alive on this host (never this process's own). Returns how many went.

        One directory scan (names only; a stat for each temp-file name): about 1 ms per thousand files
        (100 ms for 100k pages), so about as much as listing the directory. A file another sweeper removed first, or one that cannot be removed, is
        skipped: the sweep never raises for a file, and a directory it cannot list sweeps nothing."""
        now = time.time()
        me = os.getpid()
        removed = 0
        try:
            entries = os.scandir(self.directory)
        except OSError as e:
            logger.warning("storage directory %s could not be scanned for stale temp files: %s", self.directory, e)
            return 0
        with entries:
            for entry in entries:
                name = entry.name
                if not (name.startswith(".") and name.endswith(".tmp")):
                    continue
                m = _TMP_RE.match(name)
                if m is None or int(m["pid"]) == me:
                    continue
                try:
                    if now - entry.stat(follow_symlinks=False).st_mtime <= older_than_s or _pid_alive(int(m["pid"])):
                        continue
                    os.unlink(entry.path)
                except OSError:
                    continue
                removed += 1
        if removed:
            logger.info("removed %d temp file(s) of dead writers from %s", removed, self.directory)
        return removed

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
        """Each page to its file; with `writers` > 1 a batch is spread over that many threads.

        A trade, measured on the H200 host in bench/serving_loop.py (4096 live, 32 MiB decoded per step):
        one writer stores ~650 MB/s and falls behind (bench/results/serving_loop-h200-before-policy.json);
        four keep up at stride 16 (bench/results/serving_loop-h200.json, run with --store-writers 4), but
        their share of the interpreter lock stretched each decode iteration from 43 to 81 ms there. The
        default is one writer: a lagging store only delays backups, a slower scheduler slows decoding."""
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

    def close(self) -> None:
        """Shut down the writer threads (`writers` > 1), after the writes they run; a later write starts
        them again. The manager calls it for a store it built (DecodeOffloadManager.close)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

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
