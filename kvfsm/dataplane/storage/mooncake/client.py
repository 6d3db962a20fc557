"""L3 storage on Mooncake Store: the `StorageBackend` protocol over `mooncake.store.MooncakeDistributedStore`.

Install with `pip install 'kvfsm[mooncake]'` (the non-CUDA wheel; CUDA hosts install the
`mooncake-transfer-engine` wheel instead). `mooncake` is imported only when a `MooncakeStorage` is built, so
kvfsm imports without it. The binaries need `libibverbs1` even for the TCP protocol.

Keys are `{page hash}{suffix}` with FileStorage's suffix (`_{model}_{tp_rank}_{tp_size}`, `_{model}` for MLA),
so engines of one deployment (same model, same TP rank) share pages and nothing else does.

Data path (one client call per batch, no per-page round trips):
  * batch_set -> `batch_put_from` with each page's own address. A page inside a registered region
    (`register_buffer`, `register_host_pool`, the read pool) is always sent in place; any other page too
    when the protocol lets the transfer engine read unregistered host memory (`tcp`), else it is staged
    through a registered buffer first (one memcpy). `batch_set_from_host` gathers pages straight out of a
    registered HostKVPool (`batch_put_from_multi_buffers`, one range per plane and layer, per token for
    page_first), no serialisation copy at all.
  * batch_get -> `batch_get_into` straight into recycled page buffers (registered when the transport
    needs it) that the returned tensors alias; a buffer is reused only once nothing references it any
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
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import queue
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import torch

from ..base import StorageStats, _check_batch, storage_key_suffix

logger = logging.getLogger(__name__)

# Status codes the client returns (mooncake-store ErrorCode); anything else is logged by number.
OK = 0
NO_AVAILABLE_HANDLE = -200  # no space in any mounted segment: the store is full
INVALID_PARAMS = -600  # e.g. the destination is smaller than the object
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
RPC_FAIL = -900
RPC_TIMEOUT = -901
ERROR_NAMES = {NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE (store full)", INVALID_PARAMS: "INVALID_PARAMS",
               OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND", OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
               RPC_FAIL: "RPC_FAIL (master unreachable?)", RPC_TIMEOUT: "RPC_TIMEOUT"}
TIMEOUT = "TIMEOUT"  # the call did not return within op_timeout_s
WEDGED = "WEDGED"  # every worker is stuck in an earlier call; not attempted

_INSTALL_HINT = ("pip install 'kvfsm[mooncake]' (CPU wheel mooncake-transfer-engine-non-cuda; on CUDA hosts "
                 "pip install mooncake-transfer-engine) and apt-get install libibverbs1")


class MooncakeUnavailable(RuntimeError):
    """The Mooncake client cannot be used: not installed, master or metadata server unreachable, setup failed."""


def error_name(code: int | str) -> str:
    return code if isinstance(code, str) else ERROR_NAMES.get(code, f"error {code}")


def import_store_class() -> Any:
    """`mooncake.store.MooncakeDistributedStore`, or MooncakeUnavailable saying what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except (ImportError, OSError) as e:
        raise MooncakeUnavailable(f"mooncake is not usable ({e}); {_INSTALL_HINT}") from e
    return MooncakeDistributedStore


def _host_port(addr: str, default_port: int) -> tuple[str, int]:
    if "://" in addr:
        u = urlsplit(addr)
        return u.hostname or "127.0.0.1", u.port or default_port
    host, _, port = addr.rpartition(":")
    if not host:
        return addr, default_port
    return host.strip("[]"), int(port)


def probe(addr: str, what: str, timeout: float, default_port: int) -> None:
    """Raise MooncakeUnavailable unless a TCP connection to `addr` opens within `timeout` seconds."""
    host, port = _host_port(addr, default_port)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise MooncakeUnavailable(f"Mooncake {what} at {host}:{port} is unreachable ({e}); "
                                  f"is mooncake_master running there?") from e


@dataclass
class MooncakeStats(StorageStats):
    timeouts: int = 0  # client calls abandoned after op_timeout_s
    late_removed: int = 0  # pages an abandoned put wrote after it was reported failed, removed again
    errors: Counter = field(default_factory=Counter)  # per-page failure reasons by name


# ---- bounded calls ----------------------------------------------------------------------------------
_PENDING, _RUNNING, _FINISHED, _CANCELLED, _ABANDONED = range(5)


class _Job:
    """One client call; `done` is released when it has finished (the cheapest thing to wait on)."""

    __slots__ = ("fn", "on_late", "done", "state", "result", "error")

    def __init__(self, fn: Callable[[], Any], on_late: Callable[[Any], None] | None) -> None:
        self.fn, self.on_late = fn, on_late
        self.done = threading.Lock()
        self.done.acquire()
        self.state = _PENDING
        self.result: Any = None
        self.error: BaseException | None = None


class _Runner:
    """A few daemon threads running client calls; callers wait at most a timeout (never joined at exit)."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers = workers
        self._q: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.stuck = 0  # abandoned calls still running
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            with self._lock:
                if job.state == _CANCELLED:  # its caller gave up before it started: never run it
                    continue
                job.state = _RUNNING
            try:
                job.result = job.fn()
            except BaseException as e:  # reported to the caller, never kills the worker
                job.error = e
            with self._lock:
                late = job.state == _ABANDONED
                job.state = _FINISHED
                if late:
                    self.stuck -= 1
            job.done.release()
            if late and job.on_late is not None and job.error is None:
                try:
                    job.on_late(job.result)
                except Exception:  # cleanup of an abandoned call is best effort
                    logger.exception("cleanup after a late Mooncake call failed")
            job.fn = job.on_late = None  # type: ignore[assignment]  # drop buffer references now

    def submit(self, fn: Callable[[], Any], on_late: Callable[[Any], None] | None = None) -> _Job | None:
        """Queue a call; None when every worker is stuck in an abandoned call (then nothing is queued)."""
        if self.stuck >= self.workers:
            return None
        job = _Job(fn, on_late)
        self._q.put(job)
        return job

    def call(self, fn: Callable[[], Any], timeout: float, on_late: Callable[[Any], None] | None = None) -> tuple[str, Any]:
        return self.wait(self.submit(fn, on_late), timeout)

    def wait(self, job: _Job | None, timeout: float) -> tuple[str, Any]:
        """("ok", result) | ("error", exc) | (TIMEOUT, None) | (WEDGED, None)."""
        if job is None:
            return WEDGED, None
        if not job.done.acquire(timeout=max(0.0, timeout)):
            with self._lock:
                if job.state == _PENDING:
                    job.state = _CANCELLED
                    return TIMEOUT, None
                if job.state == _RUNNING:  # it may still complete: on_late undoes what it did
                    job.state = _ABANDONED
                    self.stuck += 1
                    return TIMEOUT, None
            # finished just as the wait timed out: its result is set
        if job.error is not None:
            return "error", job.error
        return "ok", job.result

    def close(self) -> None:
        """Workers exit once the calls queued so far are done."""
        for _ in self._threads:
            self._q.put(None)

    def join(self) -> None:
        for t in self._threads:
            t.join()


# ---- recycled receive buffers -------------------------------------------------------------------------
class _Slab:
    __slots__ = ("mm", "anchor", "whole", "base", "free")

    def __init__(self, pages: int, page_nbytes: int) -> None:
        self.mm = mmap.mmap(-1, pages * page_nbytes)
        self.anchor = ctypes.c_char.from_buffer(self.mm)  # keeps the mapping exported (its address stable)
        self.base = ctypes.addressof(self.anchor)
        self.whole = memoryview(self.mm)
        self.free = bytearray(b"\x01" * pages)  # 1: no lease covers the page


class _ReadPool:
    """Page buffers for reads, handed out as leases and reused once nothing references them.

    Buffers live in anonymous mmap slabs (registered with the client when the transport needs it). A
    lease is a memoryview over a run of consecutive pages; the tensors returned for it are rows of one
    `torch.frombuffer` of the lease, so any row or view derived from one keeps the lease referenced, and
    the lease's reference count says when its pages are free again.
    """

    def __init__(self, page_nbytes: int, cap_bytes: int, register: Callable[[int, int], bool] | None) -> None:
        self.page_nbytes = page_nbytes
        self.cap_pages = max(0, cap_bytes // page_nbytes)
        self._register = register
        self.slabs: list[_Slab] = []
        self.pages = 0
        self._leases: list[tuple[memoryview, int, int, int]] = []  # (lease, slab, first page, pages)
        self._probe = [(memoryview(b""), 0, 0, 0)]  # never handed out: what "unreferenced" counts as
        self._lock = threading.Lock()

    @staticmethod
    def _refs(buf: memoryview) -> int:
        return sys.getrefcount(buf)

    def _reclaim(self) -> None:
        entry = self._probe[0]
        lease = entry[0]
        baseline = self._refs(lease)  # measured exactly as each lease is below
        keep = []
        for entry in self._leases:
            lease = entry[0]
            if self._refs(lease) <= baseline:
                _, si, first, n = entry
                self.slabs[si].free[first:first + n] = b"\x01" * n
            else:
                keep.append(entry)
        del lease, entry
        self._leases = keep

    def _grow(self, want: int) -> bool:
        n = min(self.cap_pages - self.pages, max(want, min((64 << 20) // self.page_nbytes, 1024)))
        if n < want:
            return False
        slab = _Slab(n, self.page_nbytes)
        if self._register is not None and not self._register(slab.base, n * self.page_nbytes):
            return False  # not registered now (client busy or master away): fresh memory this time
        self.slabs.append(slab)
        self.pages += n
        return True

    def _lease(self, si: int, first: int, n: int) -> tuple[memoryview, int]:
        slab, pb = self.slabs[si], self.page_nbytes
        slab.free[first:first + n] = bytes(n)
        lease = slab.whole[first * pb:(first + n) * pb]
        self._leases.append((lease, si, first, n))
        return lease, slab.base + first * pb

    def take(self, n: int) -> list[tuple[memoryview, int, int]]:
        """Leases covering up to n pages: (lease, address, pages); fewer pages once the cap is reached."""
        with self._lock:
            self._reclaim()
            run = b"\x01" * n
            for si, slab in enumerate(self.slabs):  # one run of n free pages: one lease
                first = slab.free.find(run)
                if first >= 0:
                    lease, addr = self._lease(si, first, n)
                    return [(lease, addr, n)]
            if self._grow(n):
                lease, addr = self._lease(len(self.slabs) - 1, 0, n)
                return [(lease, addr, n)]
            out: list[tuple[memoryview, int, int]] = []  # fragmented or full: whatever runs are free
            need = n
            for si, slab in enumerate(self.slabs):
                first = slab.free.find(1)
                while first >= 0 and need:
                    end = slab.free.find(0, first)
                    k = min((len(slab.free) if end < 0 else end) - first, need)
                    lease, addr = self._lease(si, first, k)
                    out.append((lease, addr, k))
                    need -= k
                    first = slab.free.find(1, first + k)
                if not need:
                    break
            return out


# ---- the backend ----------------------------------------------------------------------------------------
class MooncakeStorage:
    """`StorageBackend` on a Mooncake Store cluster (master + clients that mount memory segments).

    master_server_addr: "host:port" of mooncake_master's RPC service.
    metadata_server: transfer-engine metadata URL; default `http://{master host}:8080/metadata`, the
        master's own HTTP metadata server (`--enable_http_metadata_server=true`).
    local_hostname: address this client advertises to its peers (loopback only works on one host).
    global_segment_size: bytes of this process's memory given to the store (0: a pure client).
    page_nbytes: page size for reads (learned from the first write or the first stored key otherwise).
    """

    def __init__(
        self,
        master_server_addr: str,
        metadata_server: str | None = None,
        *,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        global_segment_size: int = 512 << 20,
        local_buffer_size: int = 64 << 20,
        model_name: str = "",
        tp_rank: int = 0,
        tp_size: int = 1,
        is_mla: bool = False,
        page_nbytes: int | None = None,
        replica_num: int = 1,
        op_timeout_s: float = 10.0,
        setup_timeout_s: float = 30.0,
        connect_timeout_s: float = 3.0,
        close_timeout_s: float = 5.0,
        workers: int = 2,
        read_pool_bytes: int = 256 << 20,
        direct_unregistered: bool | None = None,
        client: Any = None,
    ) -> None:
        self.master_server_addr = master_server_addr
        host, _ = _host_port(master_server_addr, 50051)
        self.metadata_server = metadata_server or f"http://{host}:8080/metadata"
        self.protocol = protocol
        self.suffix = storage_key_suffix(model_name, tp_rank, tp_size, is_mla)
        self.page_nbytes = page_nbytes
        self.op_timeout_s = float(op_timeout_s)
        self.close_timeout_s = float(close_timeout_s)
        self.read_pool_bytes = int(read_pool_bytes)
        # The TCP transport reads and writes any host address; RDMA and the like need registered memory.
        self.direct_unregistered = protocol == "tcp" if direct_unregistered is None else bool(direct_unregistered)
        self.stats = MooncakeStats()
        self._lock = threading.Lock()
        self._regions: list[tuple[int, int]] = []  # registered [start, end) address ranges
        self._pools: dict[int, _ReadPool] = {}
        self._registered_pools: set[int] = set()  # id() of host pools registered whole
        self._closed = False
        self._put_config = None
        if client is None:
            store_cls = import_store_class()
            from mooncake.store import ReplicateConfig
            self._put_config = ReplicateConfig()
            self._put_config.replica_num = int(replica_num)
            probe(master_server_addr, "master", connect_timeout_s, 50051)
            if self.metadata_server.startswith(("http://", "https://")):
                probe(self.metadata_server, "metadata server", connect_timeout_s, 8080)
            # The client's setup holds the GIL (no Python-side timeout can fire during it): bound it by its own
            # retry count and RPC timeout, unless the environment already says otherwise.
            os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(max(1, int(setup_timeout_s // 5))))
            os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(1000, int(op_timeout_s * 1000))))
            client = self._setup(store_cls, local_hostname, global_segment_size, local_buffer_size, device_name,
                                 setup_timeout_s)
        self.client = client
        self._runner = _Runner(max(1, int(workers)), "kvfsm-mooncake")

    def _setup(self, store_cls: Any, local_hostname: str, global_segment_size: int, local_buffer_size: int,
               device_name: str, timeout: float) -> Any:
        client = store_cls()
        box: dict[str, Any] = {}

        def go() -> None:
            try:
                box["rc"] = client.setup(local_hostname, self.metadata_server, int(global_segment_size),
                                         int(local_buffer_size), self.protocol, device_name, self.master_server_addr)
            except BaseException as e:  # reported below
                box["error"] = e

        t = threading.Thread(target=go, name="kvfsm-mooncake-setup", daemon=True)
        t.start()
        t.join(timeout)
        where = f"master {self.master_server_addr}, metadata {self.metadata_server}"
        if t.is_alive():
            raise MooncakeUnavailable(f"Mooncake client setup did not finish within {timeout:g}s ({where})")
        if "error" in box:
            raise MooncakeUnavailable(f"Mooncake client setup failed ({where}): {box['error']}") from box["error"]
        if box.get("rc") != 0:
            raise MooncakeUnavailable(f"Mooncake client setup returned {box.get('rc')} ({where})")
        return client

    @classmethod
    def from_config(cls, config: Any, *, tp_rank: int = 0, tp_size: int = 1, is_mla: bool = False,
                    **overrides: Any) -> MooncakeStorage:
        """Build from an OffloadConfig: `storage_extra` holds the constructor's keyword arguments."""
        extra: dict[str, Any] = dict(getattr(config, "storage_extra", None) or {})
        extra.update(overrides)
        extra.setdefault("model_name", getattr(config, "model_name", ""))
        if "master_server_addr" not in extra:
            raise ValueError("storage_extra needs master_server_addr for the Mooncake backend")
        return cls(extra.pop("master_server_addr"), tp_rank=tp_rank, tp_size=tp_size, is_mla=is_mla, **extra)

    # ---- keys, regions ----------------------------------------------------------------------------------
    def key_of(self, key: str) -> str:
        """The Mooncake object key of page hash `key` (deployment suffix: model, TP rank and size)."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"storage key must be a non-empty string, got {key!r}")
        return key + self.suffix

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """Register a CPU tensor's memory with the client: pages inside it are sent in place."""
        if tensor.device.type != "cpu":
            raise ValueError("only host memory can be registered with the Mooncake client")
        self._register(tensor.data_ptr(), tensor.numel() * tensor.element_size(), strict=True)

    def register_host_pool(self, host_pool: Any) -> None:
        """Register a HostKVPool's buffer (for batch_set_from_host and in-place puts from it)."""
        if id(host_pool) not in self._registered_pools:
            self.register_buffer(host_pool.kv_buffer)
            self._registered_pools.add(id(host_pool))

    def unregister_buffer(self, tensor: torch.Tensor) -> None:
        """Undo register_buffer (before the tensor's memory is freed)."""
        addr = tensor.data_ptr()
        with self._lock:
            if not any(s == addr for s, _ in self._regions):
                return
            self._regions = [r for r in self._regions if r[0] != addr]
        client = self.client
        self._runner.call(lambda: client.unregister_buffer(addr), self.op_timeout_s)

    def unregister_host_pool(self, host_pool: Any) -> None:
        if id(host_pool) in self._registered_pools:
            self._registered_pools.discard(id(host_pool))
            self.unregister_buffer(host_pool.kv_buffer)

    def _register(self, addr: int, nbytes: int, strict: bool = False) -> bool:
        if any(s <= addr and addr + nbytes <= e for s, e in self._regions):
            return True
        client = self.client
        status, rc = self._runner.call(lambda: client.register_buffer(addr, nbytes), self.op_timeout_s)
        if status != "ok" or rc != 0:
            if strict:
                raise RuntimeError(f"Mooncake register_buffer({nbytes} bytes) failed: {status} {rc}")
            logger.warning("Mooncake register_buffer(%d bytes) failed: %s %s", nbytes, status, rc)
            return False
        with self._lock:
            self._regions.append((addr, addr + nbytes))
        return True

    def _registered(self, addr: int, nbytes: int) -> bool:
        return any(s <= addr and addr + nbytes <= e for s, e in self._regions)

    def _pool(self, page_nbytes: int) -> _ReadPool:
        with self._lock:
            pool = self._pools.get(page_nbytes)
            if pool is None:
                register = None if self.direct_unregistered else self._register  # TCP needs no registration
                pool = self._pools[page_nbytes] = _ReadPool(page_nbytes, self.read_pool_bytes, register)
            return pool

    # ---- accounting ----------------------------------------------------------------------------------------
    def _note(self, op: str, codes: Sequence[int | str], n: int) -> None:
        bad = Counter(error_name(c) for c in codes)
        with self._lock:
            self.stats.errors.update(bad)
        if bad:
            what = ", ".join(f"{k} x{v}" for k, v in bad.most_common())
            logger.warning("mooncake %s: %d of %d pages failed (%s)", op, sum(bad.values()), n, what)

    def _call(self, fn: Callable[[], Any], on_late: Callable[[Any], None] | None = None) -> tuple[str | int, Any]:
        return self._wait(self._submit(fn, on_late))

    def _submit(self, fn: Callable[[], Any], on_late: Callable[[Any], None] | None = None) -> tuple[Any, float]:
        """Start a bounded call (the caller may work meanwhile); `_wait` collects it."""
        if self._closed:
            return "CLOSED", 0.0
        return self._runner.submit(fn, on_late), time.monotonic() + self.op_timeout_s

    def _wait(self, started: tuple[Any, float]) -> tuple[str | int, Any]:
        job, deadline = started
        if isinstance(job, str):  # closed: nothing was started
            return job, None
        status, value = self._runner.wait(job, deadline - time.monotonic())
        if status == TIMEOUT:
            with self._lock:
                self.stats.timeouts += 1
            logger.error("mooncake call did not return within %.1fs (master %s); reported failed",
                         self.op_timeout_s, self.master_server_addr)
        elif status == "error":
            logger.error("mooncake call raised %r", value)
            return f"ERROR {type(value).__name__}", None
        return status, value

    def _late_put_cleanup(self, keys: list[str]) -> Callable[[Any], None]:
        """After an abandoned put returns: remove what it wrote, since it was reported not stored."""

        def undo(rcs: Any) -> None:
            written = [k for k, rc in zip(keys, rcs or ()) if rc == OK]
            if written:
                self.client.batch_remove(written, True)
                with self._lock:
                    self.stats.late_removed += len(written)
                logger.warning("mooncake: removed %d pages a timed-out put wrote late", len(written))

        return undo

    # ---- writes ----------------------------------------------------------------------------------------------
    def _mkeys(self, keys: Sequence[str]) -> list[str]:
        suffix = self.suffix
        try:
            mkeys = [k + suffix for k in keys]
        except TypeError:
            mkeys = []
        if len(mkeys) != len(keys) or not all(keys):
            bad = next(k for k in keys if not isinstance(k, str) or not k)
            raise ValueError(f"storage key must be a non-empty string, got {bad!r}")
        return mkeys

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        _check_batch(keys, pages)
        if not keys:
            return []
        mkeys = self._mkeys(keys)
        held: list[Any] = list(pages)  # everything the client reads stays referenced until the call returns
        ptrs: list[int] = []
        sizes: list[int] = []
        for i, t in enumerate(held):
            if not (t.is_cpu and t.is_contiguous()):
                t = held[i] = t.detach().to("cpu").contiguous()
            ptrs.append(t.data_ptr())
            sizes.append(t.numel())
        if not self.direct_unregistered:
            self._stage(held, ptrs, sizes)
        n = len(mkeys)
        if 0 in sizes:
            todo = [i for i in range(n) if sizes[i] > 0]
            tk, tp, ts = [mkeys[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo]
        else:
            todo, tk, tp, ts = None, mkeys, ptrs, sizes
        codes: list[int | str]
        if tk:
            cfg, client = self._put_config, self.client

            def put() -> Any:
                _ = held
                return client.batch_put_from(tk, tp, ts, cfg) if cfg is not None else client.batch_put_from(tk, tp, ts)

            status, rcs = self._call(put, self._late_put_cleanup(tk))
            if not (status == "ok" and isinstance(rcs, (list, tuple)) and len(rcs) == len(tk)):
                rcs = [status if status != "ok" else f"bad reply {rcs!r:.40}"] * len(tk)
        else:
            rcs = []
        if todo is None:
            codes = list(rcs)
        else:
            codes = [INVALID_PARAMS] * n
            for i, rc in zip(todo, rcs):
                codes[i] = rc
        ok = [c == OK or c == OBJECT_ALREADY_EXISTS for c in codes]
        n_ok = ok.count(True)
        with self._lock:
            self.stats.writes_ok += n_ok
            self.stats.writes_failed += n - n_ok
        if n_ok and self.page_nbytes is None and len(set(sizes)) == 1:
            self.page_nbytes = sizes[0]
        if n_ok < n:
            self._note("put", [c for c, good in zip(codes, ok) if not good], n)
        return ok

    def _stage(self, held: list[Any], ptrs: list[int], sizes: list[int]) -> None:
        """Copy pages outside registered memory into registered read-pool buffers (transports that need it);
        a page that finds no registered room gets size 0 (reported failed)."""
        by_size: dict[int, list[int]] = {}
        for i, (ptr, size) in enumerate(zip(ptrs, sizes)):
            if not self._registered(ptr, size):
                by_size.setdefault(size, []).append(i)
        for nbytes, idx in by_size.items():
            at = 0
            for lease, addr, k in self._pool(nbytes).take(len(idx)) if nbytes else []:
                block = torch.frombuffer(lease, dtype=torch.uint8).view(k, nbytes)
                for j in range(k):
                    i = idx[at + j]
                    block[j].copy_(held[i].reshape(-1))
                    ptrs[i] = addr + j * nbytes
                held.append(block)  # reserved until the call returns
                at += k
            for i in idx[at:]:
                sizes[i] = 0

    def batch_set_from_host(self, keys: Sequence[str], host_pool: Any, host_indices: Any) -> list[bool]:
        """Store host pages straight from a registered HostKVPool (no serialisation copy), per-page success.

        The object bytes are the canonical page order of `HostKVPool.get_pages_bytes`, so pages stored here
        read back with batch_get / set_pages_bytes like any other. The pages must stay allocated (and
        unchanged) until this returns.
        """
        if not keys:
            return []
        idx = host_pool._page_index(host_indices)  # whole, allocated pages, in order (raises otherwise)
        ps = host_pool.page_size
        starts = idx.view(-1, ps)[:, 0]
        if len(keys) != starts.numel():
            raise ValueError(f"{len(keys)} keys but {starts.numel()} pages")
        self.register_host_pool(host_pool)
        mkeys = self._mkeys(keys)
        tv = host_pool.token_view()  # (planes, L, size, H, D)
        es = tv.element_size()
        token_bytes = tv.shape[3] * tv.shape[4] * es
        st = tv.stride()
        grid = (torch.arange(tv.shape[0]).view(-1, 1) * st[0] + torch.arange(tv.shape[1]).view(1, -1) * st[1]).view(1, -1)
        if st[2] * es == token_bytes:  # a page's tokens are contiguous per (plane, layer): one range each
            addrs = (tv.data_ptr() + (starts.view(-1, 1) * st[2] + grid) * es).tolist()
            piece = ps * token_bytes
        else:  # page_first: one range per token
            tok = starts.view(-1, 1, 1) + torch.arange(ps).view(1, 1, -1)
            addrs = (tv.data_ptr() + (tok * st[2] + grid.view(1, -1, 1)) * es).reshape(starts.numel(), -1).tolist()
            piece = token_bytes
        sizes = [[piece] * len(addrs[0]) for _ in addrs]
        client, held = self.client, host_pool.kv_buffer

        def put() -> Any:
            _ = held
            return client.batch_put_from_multi_buffers(mkeys, addrs, sizes)

        status, rcs = self._call(put, self._late_put_cleanup(mkeys))
        codes: list[int | str] = ([int(rc) for rc in rcs] if status == "ok" and len(rcs) == len(mkeys)
                                  else [status] * len(mkeys))
        ok = [c == OK or c == OBJECT_ALREADY_EXISTS for c in codes]
        with self._lock:
            self.stats.writes_ok += sum(ok)
            self.stats.writes_failed += len(ok) - sum(ok)
        if any(ok) and self.page_nbytes is None:
            self.page_nbytes = host_pool.page_nbytes
        self._note("put", [c for c, good in zip(codes, ok) if not good], len(keys))
        return ok

    # ---- reads -------------------------------------------------------------------------------------------------
    def _sizes(self, mkeys: list[str]) -> list[int]:
        """Stored object sizes (negative: the client's error, e.g. not found); one worker call."""
        client = self.client
        status, sizes = self._call(lambda: [int(client.get_size(k)) for k in mkeys])
        return sizes if status == "ok" else [RPC_FAIL] * len(mkeys)

    def _get_into(self, mkeys: list[str], sizes: list[int]) -> tuple[list[int | str], list[Any]]:
        """One batch_get_into into read buffers of the given sizes: (codes, one uint8 row tensor per key).

        The row tensors are built while the transfer runs (they only alias the buffers)."""
        n = len(mkeys)
        addrs = [0] * n
        by_size: dict[int, list[int]] = {}
        if sizes.count(sizes[0]) == n:
            by_size[sizes[0]] = list(range(n))
        else:
            for i, size in enumerate(sizes):
                by_size.setdefault(size, []).append(i)
        plan: list[tuple[Any, int, int, list[int]]] = []  # (lease memoryview or extra tensor, pages, size, keys)
        for size, idx in by_size.items():
            at = 0
            for lease, addr, k in self._pool(size).take(len(idx)):
                mine = idx[at:at + k]
                if len(mine) == n:
                    addrs = list(range(addr, addr + n * size, size))
                else:
                    for j, i in enumerate(mine):
                        addrs[i] = addr + j * size
                plan.append((lease, k, size, mine))
                at += k
            rest = idx[at:]
            if rest:  # the pool is at its cap: fresh memory for the rest
                extra = torch.empty((len(rest), size), dtype=torch.uint8)
                if not self.direct_unregistered and not self._register(extra.data_ptr(), extra.numel()):
                    continue
                for j, i in enumerate(rest):
                    addrs[i] = extra.data_ptr() + j * size
                plan.append((extra, len(rest), size, rest))
        filled = sum(k for _, k, _, _ in plan)
        if filled < n:
            todo: list[int] | None = sorted(i for _, _, _, mine in plan for i in mine)
            tk, ta, ts = [mkeys[i] for i in todo], [addrs[i] for i in todo], [sizes[i] for i in todo]
        else:
            todo, tk, ta, ts = None, mkeys, addrs, sizes
        rows: list[Any] = [None] * n
        if not tk:
            return [INVALID_PARAMS] * n, rows
        client = self.client
        unregister = [] if self.direct_unregistered else [m.data_ptr() for m, *_ in plan if isinstance(m, torch.Tensor)]

        def get() -> Any:
            try:
                return client.batch_get_into(tk, ta, ts)
            finally:
                _ = plan  # an abandoned call keeps its buffers referenced (reserved)
                for addr in unregister:
                    client.unregister_buffer(addr)
                if unregister:
                    with self._lock:
                        self._regions = [r for r in self._regions if r[0] not in unregister]

        started = self._submit(get)
        for mem, k, size, mine in plan:
            block = (torch.frombuffer(mem, dtype=torch.uint8).view(k, size) if isinstance(mem, memoryview) else mem).unbind(0)
            if len(mine) == n:
                rows = list(block)
            else:
                for i, row in zip(mine, block):
                    rows[i] = row
        status, rcs = self._wait(started)
        if not (status == "ok" and isinstance(rcs, (list, tuple)) and len(rcs) == len(tk)):
            rcs = [status] * len(tk)
        if todo is None:
            return list(rcs), rows
        codes: list[int | str] = [INVALID_PARAMS] * n
        for i, rc in zip(todo, rcs):
            codes[i] = rc
        return codes, rows

    def batch_get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        if not keys:
            return []
        mkeys = self._mkeys(keys)
        n = len(mkeys)
        nbytes = self.page_nbytes
        if nbytes:
            codes, rows = self._get_into(mkeys, [nbytes] * n)
            if codes.count(nbytes) == n:  # the common case: every page there, of the expected size
                with self._lock:
                    self.stats.reads_ok += n
                return rows
            sizes = [nbytes] * n
        else:  # nothing written or configured yet: ask the store
            codes, rows, sizes = [INVALID_PARAMS] * n, [None] * n, [0] * n
        # Objects of another size than expected (buffer too small, or no size known): ask and fetch again.
        again = [i for i, c in enumerate(codes) if c == INVALID_PARAMS]
        if again:
            found = self._sizes([mkeys[i] for i in again])
            fetch = [(i, sz) for i, sz in zip(again, found) if sz > 0]
            for i, sz in zip(again, found):
                if sz <= 0:
                    codes[i] = sz if sz < 0 else INVALID_PARAMS
            if fetch:
                c2, r2 = self._get_into([mkeys[i] for i, _ in fetch], [sz for _, sz in fetch])
                for (i, sz), c, r in zip(fetch, c2, r2):
                    codes[i], rows[i], sizes[i] = c, r, sz
                if self.page_nbytes is None and len({sz for _, sz in fetch}) == 1:
                    self.page_nbytes = fetch[0][1]
        out: list[torch.Tensor | None] = []
        bad: list[int | str] = []
        ok = missing = 0
        for c, r, size in zip(codes, rows, sizes):
            if isinstance(c, int) and 0 <= c <= size and r is not None:
                ok += 1
                out.append(r if c == size else r[:c])  # a smaller object than the buffer: its bytes
                continue
            out.append(None)
            missing += 1
            if c != OBJECT_NOT_FOUND:
                bad.append(c)
        with self._lock:
            self.stats.reads_ok += ok
            self.stats.reads_missing += missing
        if bad:
            self._note("get", bad, n)
        return out

    def batch_exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        mkeys = self._mkeys(keys)
        client = self.client
        status, rcs = self._call(lambda: client.batch_is_exist(mkeys))
        if status != "ok" or not isinstance(rcs, (list, tuple)):
            self._note("exists", [status], len(keys))
            return 0
        for i, rc in enumerate(rcs):
            if rc != 1:
                if rc != 0:
                    self._note("exists", [int(rc)], len(keys))
                return i
        return len(rcs)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def health(self) -> int:
        """The client's health_check: 0 healthy, 1 not set up or closed, 2 master unreachable (-1: no answer)."""
        status, rc = self._call(self.client.health_check)
        return int(rc) if status == "ok" else -1

    def remove(self, keys: Sequence[str]) -> list[int]:
        """Remove pages by page hash (tests and tools); the client's status per key."""
        mkeys = self._mkeys(keys)
        client = self.client
        status, rcs = self._call(lambda: client.batch_remove(mkeys, True))
        return list(rcs) if status == "ok" else [RPC_FAIL] * len(mkeys)

    def close(self) -> None:
        """Close the client once no call is running; waits at most close_timeout_s for that.

        Caveat: the Mooncake client's own close() holds the GIL while it runs (about 1-2 s, ~10 s when the
        master is gone and its unmount RPCs time out), so the process stalls that long whatever the timeout.
        """
        if self._closed:
            return
        self._closed = True
        runner, client = self._runner, self.client

        def finish() -> None:
            runner.close()
            runner.join()  # never close the client under a call still running (abandoned ones included)
            client.close()

        t = threading.Thread(target=finish, name="kvfsm-mooncake-close", daemon=True)
        t.start()
        t.join(self.close_timeout_s)
        if t.is_alive():
            logger.warning("Mooncake client close did not finish within %.1fs; left to finish in the background",
                           self.close_timeout_s)

    def __enter__(self) -> MooncakeStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def master_command(binary: str, rpc_port: int, http_port: int, metrics_port: int, host: str = "127.0.0.1",
                   extra: Sequence[str] = ()) -> list[str]:
    """The mooncake_master command line kvfsm's tests and benchmark use: RPC, HTTP metadata and metrics on `host`."""
    return [binary, f"--rpc_address={host}", f"--rpc_port={rpc_port}", "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={host}", f"--http_metadata_server_port={http_port}",
            f"--metrics_host={host}", f"--metrics_port={metrics_port}", "--enable_metric_reporting=false",
            "--logtostderr", *extra]


def master_binary() -> str | None:
    """Path of the mooncake_master binary shipped in the mooncake wheel (None when not installed)."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return None
    for d in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(d, "mooncake_master")
        if os.path.isfile(path):
            if not os.access(path, os.X_OK):
                os.chmod(path, os.stat(path).st_mode | 0o111)
            return path
    return None


LOOPBACK_ENV: Mapping[str, str] = {
    "MC_TE_FILTERS": "lo",  # the transfer engine picks the loopback interface
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",  # and binds its TCP transport there
}

__all__ = ["ERROR_NAMES", "LOOPBACK_ENV", "MooncakeStats", "MooncakeStorage", "MooncakeUnavailable", "error_name",
           "import_store_class", "master_binary", "master_command", "probe"]
