"""ProcessStorage: a store run in a child process, so that its writes take no interpreter time from the
scheduler.

The backup worker's store call runs in the scheduler's interpreter. A page write is Python: a path, a temp
name, a sidecar, two publishes; with several writer threads to keep up with decoding, their share of the
interpreter lock lands on the scheduler's calls (FileStorage's `_write` records four writers stretching a
decode iteration from 43 to 81 ms on the H200 host; writing nothing took the 4096-live median from 4.6 to
3.6 ms, bench/results/serving_loop_probes-h200.json). With one writer the store falls behind, and the chunks
parked behind it are half of what the collector walks (docs/performance.md).

Here the store lives in its own interpreter. Over a shared host pool (`HostKVPool(shared=True)`, which
`storage_process=True` builds) the caller's share of a write is one small message of page ids and keys: the
child maps the same memory and reads the pages in place. Any other pool's pages are first gathered into a
shared staging buffer (numpy copies, which release the lock). Either way the child's store sees the pages
through the host pool interface it already takes (`config`, `page_size`, `get_pages_bytes`) and writes them
with as many threads as it needs.

What it guarantees, as a `StorageBackend`:
- a page is reported stored only when the child's store said so;
- a child that raises, dies or hangs past `call_timeout_s` fails the call (`RemoteStoreError`), which the
  backup worker counts as a failed backup (B13); a dead child is started again at the next call, at most
  once per `restart_interval_s`;
- the child ends when its parent does (it reads end-of-file) or at `close()`.

The child is forked by this process's fork server (`fork_server.py`), a fresh interpreter that has imported
torch and the data plane once, so a child starts in about 10 ms where a fresh interpreter of its own takes
1.6 s of wall time and 2.1 s of CPU (bench/probes/fork_server_probe.py, the 2-core development machine): a
restart after a crash, or each shard of a sharded store. Without the server (no pidfds) the child is a fresh
interpreter (`python -c`). Never a multiprocessing spawn or forkserver: those re-run the parent's `__main__`
in the child, which an engine's launcher need not guard. The store is built in the child by `factory`, which
must pickle (a class, or a `functools.partial` of one).
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..pools.host_pool import HostKVPool
from ..pools.shared_memory import identity
from .base import StorageBackend, StorageStats, store_host_pages
from .fork_server import ForkedProcess, child_env, start_store_process

if TYPE_CHECKING:
    from .sharded import ShardedStorage

logger = logging.getLogger(__name__)

# The file store's writer threads when it runs in a child process. In the scheduler's process each writer takes
# the scheduler's interpreter lock, so FileStorage defaults to one; in the child they take only the child's.
# On the H200 host one writer stored about 650 MB/s, short of the 1.3 GB/s that 4096 live requests decode
# (FileStorage._write); a child with four kept up at 64/64, one with one did not (docs/performance.md, "The
# child's writers"). At 16/16, 256 files an iteration, four fell behind too.
CHILD_FILE_WRITERS = 4

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None  # tmpfs where there is one: the staging never hits a disk


_Process = subprocess.Popen[bytes] | ForkedProcess  # a store process: forked by the fork server, or its own interpreter


class RemoteStoreError(RuntimeError):
    """The store process raised, died or did not answer in time: the call's pages are not stored."""


@dataclass(frozen=True)
class _PageConfig:
    """What a store reads of a host pool's config: the page geometry and dtype."""

    num_planes: int
    num_layers: int
    dtype: str


class _StagedPages:
    """In the child: one write's pages, as a host pool looks to a store's `batch_set_from_host` (rows of the
    shared staging buffer, read in place)."""

    def __init__(self, config: _PageConfig, page_size: int, rows: np.ndarray) -> None:
        self.config, self.page_size, self._rows = config, page_size, rows

    def get_pages_bytes(self, host_indices: slice) -> torch.Tensor:
        return torch.from_numpy(self._rows[host_indices])


class _Staging:
    """A file on tmpfs mapped by both processes, its name removed once the child has mapped it (so a crash
    leaves nothing behind after that); replaced by a new one to grow it, or for a child started again."""

    def __init__(self, nbytes: int) -> None:
        fd, self.path = tempfile.mkstemp(prefix="kvfsm-store-staging-", dir=_SHM_DIR)
        try:
            os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.named = True

    def unlink(self) -> None:
        if self.named:
            self.named = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _send(conn: Connection, obj: Any) -> None:
    """Plain pickle, not the Connection's own: with torch imported that one passes tensors as shared-memory
    handles through multiprocessing's resource sharer, which a process not started by multiprocessing
    cannot answer."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _kill(proc: _Process, conn: Connection, staging: _Staging | None) -> None:
    """Stop a store process and remove its staging file (also what runs when a ProcessStorage is collected)."""
    conn.close()
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if staging is not None:
        staging.unlink()


class ProcessStorage:
    """A `StorageBackend` whose store (`factory()`) runs in a child process.

    staging_bytes: the shared buffer a write's pages pass through, grown to one page if a page is larger;
        a larger write goes in rounds.
    call_timeout_s: how long one exchange may take before the child counts as hung (killed, the call fails).
    start_timeout_s: how long the child may take to import its store and build it.
    """

    def __init__(
        self,
        factory: Callable[[], StorageBackend],
        *,
        staging_bytes: int = 64 << 20,
        call_timeout_s: float = 120.0,
        start_timeout_s: float = 120.0,
        restart_interval_s: float = 10.0,
    ) -> None:
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {staging_bytes!r}")
        try:
            self._factory = pickle.dumps(factory)
        except Exception as exc:
            raise TypeError(
                f"ProcessStorage needs a factory that pickles (a class or a functools.partial of one), "
                f"got {factory!r}: {exc}"
            ) from exc
        self.staging_bytes, self.call_timeout_s = staging_bytes, call_timeout_s
        self.start_timeout_s, self.restart_interval_s = start_timeout_s, restart_interval_s
        self._lock = threading.Lock()  # one exchange at a time (the backup worker writes, a load-back reads)
        self._staging: _Staging | None = None
        self._child_has: str | None = None  # the staging path the child has mapped
        self._child_pool: Any = None  # the shared host pool the child has mapped (its memory file's identity)
        self._proc: _Process | None = None
        self._conn: Connection | None = None
        self._finalizer: Any = None
        self._started_at = -float("inf")
        self._closed = False
        self.restarts = 0
        self._start()  # a factory that fails, fails here, where the store is configured

    # ---- the child's life ------------------------------------------------------------------------
    def _start(self) -> None:
        self._started_at = time.monotonic()
        mine, theirs = socket.socketpair()
        try:
            # forked by this process's fork server (fork_server.py: its imports paid once), else its own interpreter
            proc: _Process | None = start_store_process(theirs.fileno(), self.start_timeout_s)
            if proc is None:
                code = f"from {__name__} import _serve; _serve({theirs.fileno()})"
                proc = subprocess.Popen(
                    [sys.executable, "-c", code], pass_fds=(theirs.fileno(),), env=child_env(), stdin=subprocess.DEVNULL
                )
        finally:
            theirs.close()
        conn = Connection(mine.detach())
        self._proc, self._conn, self._child_has, self._child_pool = proc, conn, None, None
        self._finalizer = weakref.finalize(self, _kill, proc, conn, self._staging)
        try:
            conn.send_bytes(self._factory)
            reply = self._receive("start", self.start_timeout_s)
        except RemoteStoreError:
            self._stop()
            raise
        if reply[0] != "ready":
            self._stop()
            raise RemoteStoreError(f"the store process could not build its store: {reply[1]}")

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._proc is not None and self._conn is not None:
            _kill(self._proc, self._conn, None)
        self._proc = self._conn = None

    def _receive(self, what: str, timeout_s: float) -> tuple[Any, ...]:
        conn = self._conn
        assert conn is not None
        try:
            if not conn.poll(timeout_s):
                raise RemoteStoreError(
                    f"the store process gave no answer to {what} within {timeout_s:g} s: stopped as hung"
                )
            return _recv(conn)  # type: ignore[no-any-return]
        except (EOFError, OSError) as exc:
            code = self._proc.poll() if self._proc is not None else None
            how = (
                f" (exit code {code})" if isinstance(self._proc, subprocess.Popen) else ""
            )  # a fork's goes to its server
            raise RemoteStoreError(f"the store process ended during {what}{how}") from exc

    def _ensure_started(self) -> Connection:
        """The connection to a live child: one started again if it died (at most once per
        `restart_interval_s`), none after `close()`."""
        if self._conn is None:
            if self._closed:
                raise RemoteStoreError("the store process was closed")
            if time.monotonic() - self._started_at < self.restart_interval_s:
                raise RemoteStoreError(
                    f"the store process is down (started again at most once per {self.restart_interval_s:g} s)"
                )
            self.restarts += 1
            logger.warning("starting the store process again (restart %d)", self.restarts)
            self._start()
        assert self._conn is not None
        return self._conn

    def _call(self, what: str, *msg: Any) -> Any:
        """One exchange with the child, started again first if it died; the child's answer, or its error as
        RemoteStoreError (a hung or dead child is stopped, so the next call starts a fresh one)."""
        conn = self._ensure_started()
        try:
            _send(conn, (what, *msg))
        except OSError as exc:
            self._stop()
            raise RemoteStoreError(f"the store process is gone ({exc})") from exc
        return self._reply(what)

    def _reply(self, what: str) -> Any:
        try:
            reply = self._receive(what, self.call_timeout_s)
        except RemoteStoreError:
            self._stop()
            raise
        if reply[0] == "raised":
            raise RemoteStoreError(f"the store raised {reply[1]}")
        return reply[1]

    def close(self) -> None:
        """Close the child's store and end the child (after the write in progress); idempotent. A closed
        store answers every later call with RemoteStoreError."""
        with self._lock:
            self._closed = True
            if self._conn is not None:
                try:
                    _send(self._conn, ("close",))
                    self._receive("close", self.call_timeout_s)
                except (RemoteStoreError, OSError):
                    pass
                if self._proc is not None:
                    try:
                        self._proc.wait(self.call_timeout_s)
                    except subprocess.TimeoutExpired:
                        pass
                self._stop()
            if self._staging is not None:
                self._staging.unlink()
                self._staging = None

    @property
    def pid(self) -> int | None:
        """The store process's pid (None while it is down)."""
        return None if self._proc is None else self._proc.pid

    # ---- the StorageBackend protocol --------------------------------------------------------------
    def batch_set_from_host(self, keys: Sequence[str], host_pool: Any, host_indices: Any) -> list[bool]:
        """Store the whole pages at `host_indices` of `host_pool` under `keys`. A pool made with `shared=True`
        is read by the child in place (this call sends page ids); any other pool's pages are gathered here
        into the staging buffer, in rounds when they do not fit."""
        keys = list(keys)
        if not keys and not len(host_indices):
            return []
        pages = host_pool.pages_of(host_indices)  # whole pages, allocated: checked before anything is sent
        if len(pages) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        with self._lock:
            fd = getattr(host_pool, "share_fd", None)
            if fd is not None:
                self._attach(host_pool, fd)
                return list(self._call("set_pool", keys, pages))
            return self._set_staged(keys, host_pool, pages)

    def _attach(self, host_pool: Any, fd: int) -> None:
        """Hand the child the pool's memory file (once per pool and child): it maps the same pages."""
        ident = identity(fd)
        conn = self._ensure_started()  # a fresh child has mapped no pool
        if self._child_pool == ident:
            return
        _send(conn, ("attach", host_pool.config, host_pool.size, host_pool.page_size, host_pool.layout))
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            socket.send_fds(sock, [b"F"], [fd])
        self._reply("attach")
        self._child_pool = ident

    def _set_staged(self, keys: list[str], host_pool: Any, pages: list[int]) -> list[bool]:
        c = host_pool.config
        config = _PageConfig(c.num_planes, c.num_layers, str(c.dtype))
        nbytes = host_pool.page_nbytes
        self._ensure_started()  # before the staging file is chosen: a fresh child has mapped none
        staging = self._staging_for(nbytes)
        per_round = staging.nbytes // nbytes
        out: list[bool] = []
        for at in range(0, len(pages), per_round):
            part = pages[at : at + per_round]
            host_pool.get_pages_bytes(host_pool.page_slots(part), out=staging.array)
            self._ensure_started()
            if self._child_has != staging.path and not staging.named:
                raise RemoteStoreError("the store process was started again during this write")
            path = None if self._child_has == staging.path else staging.path
            out += self._call(
                "set", keys[at : at + per_round], len(part), nbytes, config, host_pool.page_size, path, staging.nbytes
            )
            self._child_has = staging.path
            staging.unlink()  # both processes have it mapped: the name is no longer needed
        return out

    def _staging_for(self, page_nbytes: int) -> _Staging:
        staging = self._staging
        # a new file to grow it, or for a child that has not mapped this one now that its name is gone
        if staging is None or staging.nbytes < page_nbytes or (not staging.named and self._child_has != staging.path):
            if staging is not None:
                staging.unlink()
            staging = self._staging = _Staging(max(self.staging_bytes, page_nbytes))
            if self._finalizer is not None and self._proc is not None and self._conn is not None:
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _kill, self._proc, self._conn, staging)
        return staging

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Store each page under its key (the pages travel pickled: the load path's rate, not the backups')."""
        with self._lock:
            return list(self._call("set_pages", list(keys), [p.detach().to("cpu").contiguous() for p in pages]))

    def batch_get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        with self._lock:
            return list(self._call("get", list(keys)))

    def batch_exists(self, keys: Sequence[str]) -> int:
        with self._lock:
            return int(self._call("exists", list(keys)))

    @property
    def stats(self) -> StorageStats:
        """The child store's counters (a StorageStats of zeros for a store that keeps none)."""
        with self._lock:
            return self._call("stats")  # type: ignore[no-any-return]


def in_processes(make: Callable[[], StorageBackend], processes: int = 1) -> ProcessStorage | ShardedStorage:
    """`make`'s store in a child process, or for `processes` > 1 in that many, each key always in the same one
    (`ShardedStorage` of `ProcessStorage`s). `make` is picklable: each child builds its own store from it."""
    from .sharded import ShardedStorage  # sharded.py needs nothing of this module; the import stays one-way

    if processes > 1:
        return ShardedStorage.of(functools.partial(ProcessStorage, make), processes)
    return ProcessStorage(make)


# ---- the child ----------------------------------------------------------------------------------------
def _serve(fd: int) -> None:
    """The store process: build the store, then answer one message at a time until end-of-file or close."""
    conn = Connection(fd)
    try:
        store = pickle.loads(conn.recv_bytes())()
    except BaseException as exc:  # noqa: B036  every failure to build reaches the parent as text
        _send(conn, ("raised", f"{type(exc).__name__}: {exc}"))
        return
    _send(conn, ("ready", os.getpid()))
    rows: np.ndarray | None = None
    mapped: mmap.mmap | None = None
    pool: HostKVPool | None = None
    while True:
        try:
            msg = _recv(conn)
        except (EOFError, OSError):
            break  # the parent is gone
        op = msg[0]
        try:
            if op == "set":
                keys, n, nbytes, config, page_size, path, size = msg[1:]
                if path is not None:
                    with open(path, "r+b") as f:
                        mapped = mmap.mmap(f.fileno(), size)
                    rows = np.frombuffer(mapped, dtype=np.uint8)
                assert rows is not None, "no staging buffer mapped"
                staged = _StagedPages(config, page_size, rows[: n * nbytes].reshape(n, nbytes))
                result: Any = store_host_pages(store, keys, staged, slice(0, n))
            elif op == "attach":
                config, size, page_size, layout = msg[1:]
                with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
                pool = HostKVPool(config, size, page_size, layout, attach_fd=fds[0])
                result = None
            elif op == "set_pool":
                keys, pages = msg[1:]
                assert pool is not None, "no host pool attached"
                result = store_host_pages(store, keys, pool, pool.page_slots(pages))
            elif op == "set_pages":
                result = list(store.batch_set(*msg[1:]))
            elif op == "get":
                result = store.batch_get(*msg[1:])
            elif op == "exists":
                result = store.batch_exists(*msg[1:])
            elif op == "stats":
                result = getattr(store, "stats", None) or StorageStats()
            elif op == "close":
                close = getattr(store, "close", None)
                if close is not None:
                    close()
                _send(conn, ("ok", None))
                break
            else:
                raise ValueError(f"unknown message {op!r}")
        except BaseException as exc:  # noqa: B036  a store's own error fails the call, never the process
            _send(conn, ("raised", f"{type(exc).__name__}: {exc}"))
            continue
        _send(conn, ("ok", result))
    conn.close()


__all__ = ["CHILD_FILE_WRITERS", "ProcessStorage", "RemoteStoreError", "in_processes"]
