"""FileStorage: the embedded default L3 store, one raw page file per page plus a checksum sidecar.

The page file is what SGLang 0.5.23's `HiCacheFile` reads and writes: `{key}.bin` holding exactly the page's
bytes and nothing else (`HiCacheFile.get` reads the page's byte count from offset 0), under its names (the
key is `{hash}_{model}_{tp_rank}_{tp_size}`, `{hash}_{model}` for MLA; "/" in the model name becomes "-").
So an SGLang prefill loads the pages a kvfsm decode stored, and kvfsm loads SGLang's. The byte order inside
is SGLang's flat page for the writer's host layout (`layout`): "layer_first" is kvfsm's canonical order
(also SGLang's `page_first_direct`), "page_first" (SGLang's default `--hicache-mem-layout`) puts each
plane's tokens before its layers; a kvfsm store must be told which one its SGLang peers run.

kvfsm's integrity check lives beside it in `{key}.kvfsm`, which no SGLang reader opens (HiCacheFile and its
evictor only look at `*.bin`): magic, crc32 and length of the page file, the key, and the page format. A
read returns a page only when its sidecar agrees with it; a torn or corrupted page (bad length, other key,
bad checksum, other format) is counted, logged, moved aside as `*.corrupt` with its sidecar, and reported
as None: never returned. A page file without a sidecar was written by SGLang (or by a kvfsm writer killed
between its two publishes): it is returned when its length is the page size, and counted as unverified
(`stats.reads_unverified`, `unverified_reads`), since nothing vouches for its bytes; another length is a
miss, left in place (it is not ours to move). Failed writes (OSError: disk full, read-only dir) are counted
and reported per page as False, never raised (B13: a failed store is never visible as stored).

Writes go to temp files in the same directory and are published with os.replace, sidecar first, then the
page, so a page file under its final name is always whole and, once its sidecar is published, checked.
A writer killed before its publishes leaves only temp files (`.{name}.{pid}.{tag}.{serial}.tmp`), which no
reader or later writer looks at. A new FileStorage of TP rank 0 (one per deployment) removes, once at
start-up, the temp files of writers that are gone: older than `stale_temp_age_s` (600 s; no page write
takes that long, so a writer on another host sharing the directory is never cut off mid-write) and named by
a pid that is not a live process here (`sweep_stale_temps`; one directory scan, about 1 ms per thousand
files). `*.corrupt` files are left for an operator to inspect. The byte layout is docs/page-layout.md.
"""

from __future__ import annotations

import errno
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

from kvfsm.errors import InputRejected
from kvfsm.input_limits import open_regular

from .base import StorageStats, _check_batch, storage_key_suffix

logger = logging.getLogger(__name__)

_KEY_RE = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,199}$")
PAGE_EXT, SIDECAR_EXT = ".bin", ".kvfsm"
_MAGIC = b"KVFSSC01"
# sidecar header: magic, crc32(page file), crc32(key + format), page file length, key length, format length;
# then the key and the format
_SIDECAR = struct.Struct("<8sIIQII")
_SIDECAR_MAX = 4096  # a sidecar is ~100 bytes; anything larger is not one of ours
# The largest page file a read takes into memory (a page of a large model is tens of MiB). A page file is
# read only when its length is the one its sidecar records (or, without one, the store's page size), so a
# file grown past it is rejected by its size, unread.
MAX_PAGE_BYTES = 1 << 30
# what _set_one names its temp files: ".{final name}.{pid}.{12 hex}.{serial}.tmp"
_TMP_RE = re.compile(r"^\..+\.(?:bin|kvfsm)\.(?P<pid>\d+)\.[0-9a-f]{12}\.\d+\.tmp$")
LAYOUTS = ("layer_first", "page_first")


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


def page_format(layout: str, page_dims: tuple[int, int, int] | None = None, dtype: Any = None) -> str:
    """The format string a sidecar records: `layout=...` and, when known, `;dims=PxLxT` and `;dtype=...`.

    Two deployments whose formats differ in a field both know must never exchange pages under one key."""
    parts = [f"layout={layout}"]
    if page_dims is not None:
        parts.append("dims=" + "x".join(str(int(d)) for d in page_dims))
    if dtype is not None:
        parts.append("dtype=" + str(dtype).removeprefix("torch."))
    return ";".join(parts)


def _formats_agree(mine: str, theirs: str) -> bool:
    a = dict(p.split("=", 1) for p in mine.split(";") if "=" in p)
    b = dict(p.split("=", 1) for p in theirs.split(";") if "=" in p)
    same_layout = a.get("layout", "layer_first") == b.get("layout", "layer_first")
    return same_layout and all(a[k] == b[k] for k in a.keys() & b.keys())


class FileStorage:
    """One raw page file per page in `directory` (SGLang HiCacheFile compatible), each checked against a
    crc32 sidecar on read; pages without a sidecar (SGLang's) are length-checked and counted unverified.

    layout: the byte order of the page files, as SGLang's `--hicache-mem-layout` of the peers that share
        the directory: "layer_first" (kvfsm's canonical page bytes; SGLang layer_first and
        page_first_direct) or "page_first" (SGLang's default; needs `page_dims`).
    page_dims: (planes, layers, page_size) of a page (planes 2 for MHA, 1 for MLA); needed to reorder for
        "page_first", and recorded in each sidecar.
    page_nbytes: the page size in bytes, to length-check pages without a sidecar; learned from the first
        write or checked read otherwise (until then such a page is a miss).
    dtype: the KV dtype, recorded in each sidecar and checked against a sidecar that records one.
    """

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
        *,
        layout: str = "layer_first",
        page_dims: tuple[int, int, int] | None = None,
        page_nbytes: int | None = None,
        dtype: Any = None,
    ) -> None:
        if writers < 1:
            raise ValueError(f"writers must be >= 1, got {writers}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if page_dims is not None:
            if (
                len(page_dims) != 3
                or not all(isinstance(d, int) and d > 0 for d in page_dims)
                or page_dims[0] not in (1, 2)
            ):
                raise ValueError(
                    f"page_dims must be (planes 1 or 2, layers, page_size) positive ints, got {page_dims!r}"
                )
            page_dims = tuple(page_dims)  # type: ignore[assignment]
        elif layout == "page_first":
            raise ValueError("layout='page_first' needs page_dims=(planes, layers, page_size) to reorder pages")
        if page_nbytes is not None and (not isinstance(page_nbytes, int) or page_nbytes <= 0):
            raise ValueError(f"page_nbytes must be a positive int, got {page_nbytes!r}")
        self.writers = writers
        self._pool: ThreadPoolExecutor | None = None
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.suffix = storage_key_suffix(model_name, tp_rank, tp_size, is_mla)
        self.fsync = fsync
        self.layout = layout
        self.page_dims: tuple[int, int, int] | None = page_dims
        self.page_nbytes = page_nbytes
        self.dtype = None if dtype is None else str(dtype).removeprefix("torch.")
        self.stats = StorageStats()
        self._lock = threading.Lock()
        # temp names unique per process, instance and write (a counter: cheaper than a uuid per page)
        self._tmp_tag = f"{os.getpid()}.{uuid.uuid4().hex[:12]}"
        self._tmp_serial = itertools.count()
        self.swept_temps = 0
        if stale_temp_age_s is not None and tp_rank == 0:  # one sweep per deployment: the ranks share the directory
            self.swept_temps = self.sweep_stale_temps(stale_temp_age_s)

    @property
    def unverified_reads(self) -> int:
        """Pages returned without a sidecar to check them against (written by SGLang): length-checked only."""
        return self.stats.reads_unverified

    @property
    def format(self) -> str:
        """What this store's sidecars record (see `page_format`)."""
        return page_format(self.layout, self.page_dims, self.dtype)

    def sweep_stale_temps(self, older_than_s: float) -> int:
        """Remove the temp files of dead writers: named like ours, last modified more than `older_than_s`
        ago, by a pid that is not alive on this host (never this process's own). Returns how many went.

        One directory scan (names only; a stat for each temp-file name): about 1 ms per thousand files
        (100 ms for 100k pages), so about as much as listing the directory. A file another sweeper removed
        first, or one that cannot be removed, is skipped: the sweep never raises for a file, and a directory
        it cannot list sweeps nothing. SGLang's own temp files (`.{uuid}.tmp`) are not ours and stay."""
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
        """The page file that holds `key` (after the deployment suffix): what HiCacheFile opens."""
        if not isinstance(key, str):
            raise ValueError(f"storage key must be a str, got {type(key).__name__}")
        full = key + self.suffix
        if not _KEY_RE.match(full) or ".." in full:
            raise ValueError(f"storage key {key!r} has characters a file name cannot carry safely")
        return os.path.join(self.directory, full + PAGE_EXT)

    @staticmethod
    def sidecar_of(page_path: str) -> str:
        """The sidecar of a page file (`{key}.kvfsm` beside `{key}.bin`)."""
        return page_path[: -len(PAGE_EXT)] + SIDECAR_EXT

    def _count(self, field: str) -> None:
        with self._lock:
            setattr(self.stats, field, getattr(self.stats, field) + 1)

    # ---- byte order -------------------------------------------------------------------------------
    def _to_file_order(self, payload: np.ndarray) -> np.ndarray:
        """Canonical (P, L, T, row) bytes to the file's order ((P, T, L, row) for page_first)."""
        if self.layout == "layer_first":
            return payload
        p, l, t = self.page_dims  # type: ignore[misc]
        if payload.size % (p * l * t):
            raise ValueError(f"a {payload.size}-byte page does not split into page_dims {self.page_dims}")
        return np.ascontiguousarray(payload.reshape(p, l, t, -1).transpose(0, 2, 1, 3)).reshape(-1)

    def _from_file_order(self, buf: bytearray) -> torch.Tensor:
        if self.layout == "layer_first" or not buf:
            return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        p, l, t = self.page_dims  # type: ignore[misc]
        arr = np.frombuffer(buf, dtype=np.uint8).reshape(p, t, l, -1).transpose(0, 2, 1, 3)
        return torch.from_numpy(np.ascontiguousarray(arr).reshape(-1))

    # ---- writes -----------------------------------------------------------------------------------
    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        _check_batch(keys, pages)
        return self._write(keys, [page.detach().to("cpu").contiguous().reshape(-1).numpy() for page in pages])

    def batch_set_from_host(self, keys: Sequence[str], host_pool: Any, host_indices: Any) -> list[bool]:
        """Store the whole pages at `host_indices` of a HostKVPool under `keys` (one per page, in order),
        gathered in one call: the backup worker's path, which runs beside the scheduler thread and should
        hold the interpreter lock as little as it can (no tensor call per page). The pool's geometry must
        agree with `page_dims` when that is set."""
        c = host_pool.config
        dims = (c.num_planes, c.num_layers, host_pool.page_size)
        if self.page_dims is None:
            self.page_dims = dims
        elif self.page_dims != dims:
            raise ValueError(
                f"host pool pages are {dims} (planes, layers, page_size), this store's page_dims {self.page_dims}"
            )
        if self.dtype is None:
            self.dtype = str(c.dtype).removeprefix("torch.")
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
        if self.layout != "layer_first":
            payloads = [self._to_file_order(p) for p in payloads]  # a bad size rejects it too
        fmt = self.format.encode()
        if self.writers > 1 and len(keys) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.writers, thread_name_prefix="kvfsm-file-store")
            results = list(self._pool.map(self._set_one, keys, paths, payloads, itertools.repeat(fmt)))
        else:
            results = [self._set_one(k, p, payload, fmt) for k, p, payload in zip(keys, paths, payloads)]
        with self._lock:
            self.stats.writes_ok += results.count("writes_ok")
            self.stats.writes_skipped += results.count("writes_skipped")
            self.stats.writes_failed += results.count("writes_failed")
            if self.page_nbytes is None and "writes_ok" in results:
                self.page_nbytes = int(payloads[results.index("writes_ok")].nbytes) or None
        return [r != "writes_failed" for r in results]

    def close(self) -> None:
        """Shut down the writer threads (`writers` > 1), after the writes they run; a later write starts
        them again. The manager calls it for a store it built (DecodeOffloadManager.close)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _tmp_name(self, final: str) -> str:
        return os.path.join(self.directory, f".{os.path.basename(final)}.{self._tmp_tag}.{next(self._tmp_serial)}.tmp")

    def _set_one(self, key: str, path: str, payload: np.ndarray, fmt: bytes) -> str:
        """Write one page and its sidecar; returns the stats field it counts as.

        Sidecar first (replacing), then the page (created only if absent: the first writer's page stays).
        A crash between the two leaves a sidecar without its page (a miss; the next write of the key
        publishes both), never a kvfsm page without its check. Writers of one key with the same bytes (the
        normal case: content-addressed) write equal sidecars; a writer whose page lost the race to other
        bytes rewrites the sidecar from the page that won, so the pair agrees once the writers are done."""
        if os.path.exists(path):
            return "writes_skipped"  # content-addressed: the key's bytes are there (ours or SGLang's)
        kb = (key + self.suffix).encode()
        side_path = self.sidecar_of(path)
        tmp_side, tmp = self._tmp_name(side_path), self._tmp_name(path)
        try:
            self._write_file(tmp_side, self._sidecar(kb, payload, fmt))
            self._write_file(tmp, payload)
            os.replace(tmp_side, side_path)
            if self.fsync:
                self._fsync_dir()  # the sidecar's name is durable before the page's (power loss keeps the order)
            won = self._publish_if_absent(tmp, path)
            if not won:
                self._repair_sidecar(path, side_path, kb, fmt, payload)
            if self.fsync:
                self._fsync_dir()
        except OSError as e:
            logger.warning("storage write of %s failed: %s", key, e)
            for leftover in (tmp_side, tmp):
                try:
                    os.unlink(leftover)
                except OSError:
                    pass
            return "writes_failed"
        return "writes_ok" if won else "writes_skipped"

    @staticmethod
    def _sidecar(kb: bytes, data: Any, fmt: bytes) -> bytes:
        n = memoryview(data).nbytes
        return (
            _SIDECAR.pack(
                _MAGIC, zlib.crc32(data) & 0xFFFFFFFF, zlib.crc32(kb + fmt) & 0xFFFFFFFF, n, len(kb), len(fmt)
            )
            + kb
            + fmt
        )

    def _write_file(self, tmp: str, data: Any) -> None:
        with open(tmp, "wb") as f:
            f.write(memoryview(data))
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())

    @staticmethod
    def _publish_if_absent(tmp: str, path: str) -> bool:
        """Move `tmp` to `path` unless `path` exists (atomic: a hard link fails on an existing name)."""
        try:
            os.link(tmp, path)
        except FileExistsError:
            os.unlink(tmp)
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            os.replace(tmp, path)  # no hard links here: last writer wins (the bytes are the same but for races)
            return True
        os.unlink(tmp)
        return True

    def _repair_sidecar(self, path: str, side_path: str, kb: bytes, fmt: bytes, payload: np.ndarray) -> None:
        """Another writer's page is under `path`; ours lost. If its bytes differ from ours, the sidecar we
        published describes ours: rewrite it from the page that is there (its writer's sidecar came first)."""
        try:
            with open(path, "rb") as f:
                there = f.read()
        except FileNotFoundError:
            return  # moved aside or evicted meanwhile: nothing to describe
        if there == payload.data:  # the array's bytes, as a memoryview
            return
        tmp_side = self._tmp_name(side_path)
        self._write_file(tmp_side, self._sidecar(kb, there, fmt))
        os.replace(tmp_side, side_path)

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ---- reads ------------------------------------------------------------------------------------
    def batch_get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        return [self._get_one(k) for k in keys]

    def _expected_len(self, side: bytes | None) -> int | None:
        """The page length worth reading: what the sidecar records (when it is one of ours) or, without a
        sidecar, this store's page size; never more than MAX_PAGE_BYTES. None: nothing to read."""
        if side is None:
            want = self.page_nbytes
        elif len(side) >= _SIDECAR.size and side[:8] == _MAGIC:
            want = _SIDECAR.unpack_from(side)[3]
        else:
            return 0  # not a sidecar of ours: the page is rejected on the sidecar alone
        return want if want is not None and want <= MAX_PAGE_BYTES else None

    def _get_one(self, key: str) -> torch.Tensor | None:
        path = self.path_of(key)
        side_path = self.sidecar_of(path)
        try:
            with open_regular(side_path, "sidecar") as f:
                side: bytes | None = f.read(_SIDECAR_MAX + 1)
        except FileNotFoundError:
            side = None
        except (OSError, InputRejected) as e:  # a FIFO or a device under a sidecar's name is never waited on
            logger.warning("storage read of %s's sidecar failed: %s", key, e)
            self._count("reads_missing")
            return None
        try:
            with open_regular(path, "page file") as f:
                size = os.fstat(f.fileno()).st_size
                # Read only a page of the length expected: a file grown to gigabytes (by a bug, or by whoever
                # else writes the directory) is rejected by its size, never read into memory.
                want = self._expected_len(side)
                buf = bytearray(size if size == want else 0)
                n = f.readinto(buf) if buf else size
        except FileNotFoundError:
            self._count("reads_missing")
            return None
        except (OSError, InputRejected) as e:
            logger.warning("storage read of %s failed: %s", key, e)
            self._count("reads_missing")
            return None
        if side is None:
            return self._unverified(key, buf, n)
        problem = self._verify(side, buf, n, (key + self.suffix).encode())
        if problem is not None and problem.startswith("page format"):
            # intact, but another deployment's format: not ours to read, and not ours to move aside
            logger.warning("storage page %s is in %s; reported missing", key, problem)
            self._count("reads_missing")
            return None
        if problem is not None:
            logger.warning("storage page %s is corrupt (%s); moved aside, not returned", key, problem)
            self._count("reads_corrupt")
            for p in (path, side_path):
                try:
                    os.replace(p, p + ".corrupt")
                except OSError:
                    pass
            return None
        with self._lock:
            self.stats.reads_ok += 1
            if self.page_nbytes is None and n:
                self.page_nbytes = n
        return self._from_file_order(buf)

    def _unverified(self, key: str, buf: bytearray, n: int) -> torch.Tensor | None:
        """A page file with no sidecar (SGLang's HiCacheFile wrote it): its length is all there is to check."""
        want = self.page_nbytes
        if n != len(buf) or want is None or n != want:
            why = "page size unknown" if want is None else f"{n} bytes, a page is {want}"
            logger.warning("storage page %s has no sidecar and cannot be accepted (%s); reported missing", key, why)
            self._count("reads_corrupt" if want is not None else "reads_missing")
            return None
        with self._lock:
            self.stats.reads_ok += 1
            self.stats.reads_unverified += 1
        return self._from_file_order(buf)

    def _verify(self, side: bytes, buf: bytearray, n: int, key: bytes) -> str | None:
        if len(side) < _SIDECAR.size or len(side) > _SIDECAR_MAX:
            return "truncated sidecar"
        magic, crc, side_crc, plen, klen, flen = _SIDECAR.unpack_from(side)
        if magic != _MAGIC:
            return "bad sidecar magic"
        if len(side) != _SIDECAR.size + klen + flen:
            return f"sidecar length {len(side)} != {_SIDECAR.size + klen + flen} (torn write?)"
        if zlib.crc32(side[_SIDECAR.size :]) & 0xFFFFFFFF != side_crc:
            return "sidecar checksum mismatch"
        if side[_SIDECAR.size : _SIDECAR.size + klen] != key:
            return "sidecar names another key"
        if n != len(buf) or n != plen:
            return f"length {n} != {plen} (torn write?)"
        fmt = side[_SIDECAR.size + klen :].decode("ascii", "replace")
        if not _formats_agree(self.format, fmt):
            return f"page format {fmt!r}, this store reads {self.format!r}"
        if self.page_dims is not None and n % (self.page_dims[0] * self.page_dims[1] * self.page_dims[2]):
            return f"page format: {n} bytes do not split into page_dims {self.page_dims}"
        if zlib.crc32(buf) & 0xFFFFFFFF != crc:
            return "checksum mismatch"
        return None

    def batch_exists(self, keys: Sequence[str]) -> int:
        for i, k in enumerate(keys):
            if not os.path.exists(self.path_of(k)):
                return i
        return len(keys)
