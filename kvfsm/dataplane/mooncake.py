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
    registered HostKVPool (`batch_put_from_multi_buffers`, one range per plane and layer), no copy at all.
  * batch_get -> `batch_get_into` straight into registered, recycled page buffers that the returned
    tensors alias (a buffer is reused only once nothing references it any more), so a read neither
    copies nor page-faults fresh memory.
  * batch_exists -> `batch_is_exist`, counted as a prefix.

Failures are reported per page, never raised (B13: a page is reported stored only when the store said so):
a full store (NO_AVAILABLE_HANDLE), an RPC failure, a dead master, a size mismatch on read all become
False / None / a shorter prefix, counted in `stats` and logged once per call.

Bounded time: construction probes the master and the metadata server with a TCP connect and raises
`MooncakeUnavailable` with the address when either is unreachable, and runs `setup` under
`setup_timeout_s`. Every later client call runs on one of a few daemon worker threads and is waited for
at most `op_timeout_s`; past that the call is reported failed. If such an abandoned put finishes later,
the keys it wrote are removed again (the pages may have changed meanwhile), and the buffers an abandoned
get writes into stay reserved until it returns. While every worker is stuck, calls fail at once instead
of queueing. The Mooncake client also honours `MC_RPC_TIMEOUT_MS` / `MC_RPC_CONNECT_TIMEOUT_MS` (master
RPCs) and `MC_STORE_CLIENT_SETUP_RETRIES`; set them in the environment before the first client is built.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import queue
import socket
import sys
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import torch

from .storage import StorageStats, _check_batch, storage_key_suffix

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
class _Job:
    __slots__ = ("fn", "on_late", "future", "finished", "abandoned")

    def __init__(self, fn: Callable[[], Any], on_late: Callable[[Any], None] | None) -> None:
        self.fn, self.on_late = fn, on_late
        self.future: Future = Future()
        self.finished = False
        self.abandoned = False


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
            if not job.future.set_running_or_notify_cancel():
                continue
            result: Any = None
            error: BaseException | None = None
            try:
                result = job.fn()
            except BaseException as e:  # reported to the caller, never kills the worker
                error = e
            with self._lock:
                job.finished = True
                late = job.abandoned
                if late:
                    self.stuck -= 1
            if error is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(error)
            if late and job.on_late is not None and error is None:
                try:
                    job.on_late(result)
                except Exception:  # cleanup of an abandoned call is best effort
                    logger.exception("cleanup after a late Mooncake call failed")
            job.fn = job.on_late = None  # type: ignore[assignment]  # drop buffer references now

    def call(self, fn: Callable[[], Any], timeout: float, on_late: Callable[[Any], None] | None = None) -> tuple[str, Any]:
        """("ok", result) | ("error", exc) | (TIMEOUT, None) | (WEDGED, None)."""
        with self._lock:
            if self.stuck >= self.workers:
                return WEDGED, None
        job = _Job(fn, on_late)
        self._q.put(job)
        try:
            return "ok", job.future.result(timeout)
        except FutureTimeout:
            pass
        except CancelledError:
            return TIMEOUT, None
        except Exception as e:
            return "error", e
        with self._lock:
            if not job.finished:
                if not job.future.cancel():  # running: it may still complete; let on_late undo it
                    job.abandoned = True
                    self.stuck += 1
                return TIMEOUT, None
        try:  # finished just as the wait timed out
            return "ok", job.future.result()
        except Exception as e:
            return "error", e

    def close(self) -> None:
        """Workers exit once the calls queued so far are done."""
        for _ in self._threads:
            self._q.put(None)

    def join(self) -> None:
        for t in self._threads:
            t.join()


# ---- recycled receive buffers -------------------------------------------------------------------------
class _ReadPool:
    """Registered page buffers for reads; a buffer is free again once no tensor references it.

    Each buffer is a memoryview slice of an anonymous mmap slab registered with the client; returned
    tensors are `torch.frombuffer` of the slice, and every tensor or view derived from them keeps the
    slice alive, so the slice's reference count says whether anything still uses it.
    """

    def __init__(self, page_nbytes: int, cap_bytes: int, register: Callable[[int, int], bool]) -> None:
        self.page_nbytes = page_nbytes
        self.cap_pages = max(0, cap_bytes // page_nbytes)
        self._register = register
        self._slabs: list[tuple[mmap.mmap, Any]] = []
        self.buffers: list[memoryview] = []
        self.addrs: list[int] = []
        self._probe = [memoryview(b"")]  # never handed out: its count is what "unreferenced" reads as
        self._cursor = 0
        self._lock = threading.Lock()

    def _grow(self, want: int) -> None:
        room = self.cap_pages - len(self.buffers)
        n = min(room, max(want, (64 << 20) // self.page_nbytes, 16))
        if n <= 0:
            return
        mm = mmap.mmap(-1, n * self.page_nbytes)
        anchor = ctypes.c_char.from_buffer(mm)  # keeps the mapping exported (and its address stable)
        base = ctypes.addressof(anchor)
        if not self._register(base, n * self.page_nbytes):
            anchor = None
            mm.close()
            self.cap_pages = len(self.buffers)  # cannot register more: stop growing
            return
        self._slabs.append((mm, anchor))
        whole = memoryview(mm)
        for i in range(n):
            self.buffers.append(whole[i * self.page_nbytes:(i + 1) * self.page_nbytes])
            self.addrs.append(base + i * self.page_nbytes)

    @staticmethod
    def _refs(buf: memoryview) -> int:
        return sys.getrefcount(buf)

    def take(self, n: int) -> tuple[list[memoryview], list[int]]:
        """Up to n free buffers and their addresses (fewer when the cap is reached)."""
        with self._lock:
            got: list[memoryview] = []
            addrs: list[int] = []
            probe = self._probe[0]
            baseline = self._refs(probe)  # measured exactly as each buffer is below
            total = len(self.buffers)
            i, scanned = self._cursor, 0
            while len(got) < n and scanned < total:
                buf = self.buffers[i]
                if self._refs(buf) <= baseline:
                    got.append(buf)
                    addrs.append(self.addrs[i])
                i = i + 1 if i + 1 < total else 0
                scanned += 1
            self._cursor = i if total else 0
            if len(got) < n and len(self.buffers) < self.cap_pages:
                start = len(self.buffers)
                self._grow(n - len(got))
                for j in range(start, len(self.buffers)):
                    if len(got) == n:
                        break
                    got.append(self.buffers[j])
                    addrs.append(self.addrs[j])
            return got, addrs


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
                pool = self._pools[page_nbytes] = _ReadPool(page_nbytes, self.read_pool_bytes, self._register)
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
        if self._closed:
            return "CLOSED", None
        status, value = self._runner.call(fn, self.op_timeout_s, on_late)
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
    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        _check_batch(keys, pages)
        if not keys:
            return []
        mkeys = [self.key_of(k) for k in keys]
        held: list[Any] = []  # everything the client reads from stays referenced until the call returns
        ptrs: list[int] = []
        sizes: list[int] = []
        stage: list[int] = []
        for i, p in enumerate(pages):
            t = p.detach()
            if t.device.type != "cpu" or not t.is_contiguous():
                t = t.to("cpu").contiguous()
            held.append(t)
            ptrs.append(t.data_ptr())
            sizes.append(t.numel())
            if not self.direct_unregistered and not self._registered(ptrs[-1], sizes[-1]):
                stage.append(i)
        if stage:  # registered staging for transports that need it (one memcpy per page)
            by_size: dict[int, list[int]] = {}
            for i in stage:
                by_size.setdefault(sizes[i], []).append(i)
            for nbytes, idx in by_size.items():
                bufs, addrs = self._pool(nbytes).take(len(idx)) if nbytes else ([], [])
                for j, (i, buf, addr) in enumerate(zip(idx, bufs, addrs)):
                    torch.frombuffer(buf, dtype=torch.uint8).copy_(held[i].reshape(-1))
                    held.append(buf)
                    ptrs[i] = addr
                if len(bufs) < len(idx):  # no registered room: those pages fail
                    for i in idx[len(bufs):]:
                        sizes[i] = 0
        todo = [i for i in range(len(keys)) if sizes[i] > 0]
        codes: list[int | str] = [INVALID_PARAMS] * len(keys)
        if todo:
            tk = [mkeys[i] for i in todo]
            tp, ts = [ptrs[i] for i in todo], [sizes[i] for i in todo]
            cfg = self._put_config
            client = self.client

            def put() -> Any:
                _ = held
                return client.batch_put_from(tk, tp, ts, cfg) if cfg is not None else client.batch_put_from(tk, tp, ts)

            status, rcs = self._call(put, self._late_put_cleanup(tk))
            if status == "ok" and isinstance(rcs, (list, tuple)) and len(rcs) == len(todo):
                for i, rc in zip(todo, rcs):
                    codes[i] = int(rc)
            else:
                for i in todo:
                    codes[i] = status if status != "ok" else f"bad reply {rcs!r:.40}"
        ok = [c == OK or c == OBJECT_ALREADY_EXISTS for c in codes]
        n_ok = sum(ok)
        with self._lock:
            self.stats.writes_ok += n_ok
            self.stats.writes_failed += len(ok) - n_ok
        if n_ok and self.page_nbytes is None and len(set(sizes)) == 1:
            self.page_nbytes = sizes[0]
        self._note("put", [c for c, good in zip(codes, ok) if not good], len(keys))
        return ok

    def batch_set_from_host(self, keys: Sequence[str], host_pool: Any, host_indices: Any) -> list[bool]:
        """Store host pages straight from a registered HostKVPool (no serialisation copy), per-page success.

        The object bytes are the canonical page order of `HostKVPool.get_pages_bytes`, so pages stored here
        read back with batch_get / set_pages_bytes like any other. The pages must stay allocated (and
        unchanged) until this returns.
        """
        idx = host_pool._page_index(host_indices)  # whole, allocated pages, in order (raises otherwise)
        ps = host_pool.page_size
        starts = idx.view(-1, ps)[:, 0]
        if len(keys) != starts.numel():
            raise ValueError(f"{len(keys)} keys but {starts.numel()} pages")
        if not keys:
            return []
        self.register_host_pool(host_pool)
        mkeys = [self.key_of(k) for k in keys]
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
    def _learn_page_nbytes(self, mkeys: list[str]) -> int | None:
        client = self.client

        def sizes() -> int | None:
            for k in mkeys:
                n = client.get_size(k)
                if n >= 0:
                    return int(n)
            return None

        status, n = self._call(sizes)
        if status == "ok" and n:
            self.page_nbytes = n
            return n
        return None

    def batch_get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        if not keys:
            return []
        mkeys = [self.key_of(k) for k in keys]
        nbytes = self.page_nbytes or self._learn_page_nbytes(mkeys)
        n = len(mkeys)
        if not nbytes:
            with self._lock:
                self.stats.reads_missing += n
            return [None] * n
        bufs, addrs = self._pool(nbytes).take(n)
        extra: torch.Tensor | None = None
        if len(bufs) < n:  # pool at its cap: fresh memory for the rest
            extra = torch.empty((n - len(bufs), nbytes), dtype=torch.uint8)
            base = extra.data_ptr()
            addrs = addrs + [base + i * nbytes for i in range(n - len(bufs))]
            if not self.direct_unregistered and not self._register(base, extra.numel()):
                extra = None
                addrs = addrs[:len(bufs)]
        todo = len(addrs)
        client = self.client
        held = (bufs, extra)
        unregister = extra is not None and not self.direct_unregistered

        def get() -> Any:
            try:
                return client.batch_get_into(mkeys[:todo], addrs, [nbytes] * todo)
            finally:
                if unregister:
                    client.unregister_buffer(held[1].data_ptr())
                    with self._lock:
                        self._regions = [r for r in self._regions if r[0] != held[1].data_ptr()]

        codes: list[int | str] = [INVALID_PARAMS] * n
        if todo:
            status, rcs = self._call(get)
            if status == "ok" and isinstance(rcs, (list, tuple)) and len(rcs) == todo:
                codes[:todo] = [int(rc) for rc in rcs]
            else:
                codes[:todo] = [status] * todo
        out: list[torch.Tensor | None] = []
        bad: list[int | str] = []
        ok = missing = corrupt = 0
        for i, c in enumerate(codes):
            if c == nbytes:
                ok += 1
                out.append(torch.frombuffer(bufs[i], dtype=torch.uint8) if i < len(bufs) else extra[i - len(bufs)])
                continue
            out.append(None)
            if c == OBJECT_NOT_FOUND:
                missing += 1
            elif isinstance(c, int) and (c >= 0 or c == INVALID_PARAMS):
                corrupt += 1  # stored object of another size than this deployment's pages
                bad.append(f"size {c} != {nbytes}" if c >= 0 else error_name(c))
            else:
                missing += 1
                bad.append(c)
        with self._lock:
            self.stats.reads_ok += ok
            self.stats.reads_missing += missing
            self.stats.reads_corrupt += corrupt
        self._note("get", bad, n)
        return out

    def batch_exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        mkeys = [self.key_of(k) for k in keys]
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
        mkeys = [self.key_of(k) for k in keys]
        client = self.client
        status, rcs = self._call(lambda: client.batch_remove(mkeys, True))
        return list(rcs) if status == "ok" else [RPC_FAIL] * len(mkeys)

    def close(self) -> None:
        """Close the client (waits at most close_timeout_s: a client whose master died takes long to close)."""
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
    import os
    spec = importlib.util.find_spec("mooncake")
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
