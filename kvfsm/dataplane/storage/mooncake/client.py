"""MooncakeStorage, the `StorageBackend` over one Mooncake Store client, and MooncakeStats.

The batch data path described in the package docstring: puts (in place, staged, or gathered from a HostKVPool),
reads into `read_pool` buffers, exists, per-page failure accounting. The client comes from `connect`; every call
on it goes through `runner`. A page's object keys are `keys`', its split into objects and back `objects`', and
the memory registered with the client `regions`'.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base import StorageStats, _check_batch
from .connect import _host_port, connect
from .errors import INVALID_PARAMS, OBJECT_ALREADY_EXISTS, OBJECT_NOT_FOUND, OK, RPC_FAIL, TIMEOUT, error_name
from .keys import ObjectKeys
from .objects import PageObjects
from .read_pool import _ReadPool
from .regions import Regions
from .runner import _Runner

logger = logging.getLogger(__package__)  # the backend's one logger, as before the package split


@dataclass
class MooncakeStats(StorageStats):
    timeouts: int = 0  # client calls abandoned after op_timeout_s
    late_removed: int = 0  # pages an abandoned put wrote after it was reported failed, removed again
    errors: Counter[str] = field(default_factory=Counter)  # per-page failure reasons by name


class MooncakeStorage:
    """`StorageBackend` on a Mooncake Store cluster (master + clients that mount memory segments).

    master_server_addr: "host:port" of mooncake_master's RPC service.
    metadata_server: transfer-engine metadata URL; default `http://{master host}:8080/metadata`, the
        master's own HTTP metadata server (`--enable_http_metadata_server=true`).
    local_hostname: address this client advertises to its peers (loopback only works on one host).
    global_segment_size: bytes of this process's memory given to the store (0: a pure client).
    page_nbytes: page size for reads (learned from the first write or the first stored key otherwise).
    layout: the byte order of each object, as SGLang's `--hicache-mem-layout` of the peers: "layer_first"
        (each plane's (layers, tokens) in kvfsm's canonical order; SGLang's page_first_direct, and its
        layer_first for MLA) or "page_first" (SGLang's default: tokens before layers; needs `page_dims`).
    page_dims: (planes, layers, page_size), to reorder "page_first" objects (planes: 2 MHA, 1 MLA).
    backend_tag: SGLang's `extra_backend_tag`, the first part of the key prefix (default: none).

    Keys are SGLang 0.5.23's (`sglang_mooncake_keys`): an MHA page is two objects, its K half and its V
    half, an MLA page one, so a kvfsm decode and an SGLang prefill of one deployment read each other's
    pages. A page is stored, found or read only when all of its objects are.
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
        layout: str = "layer_first",
        page_dims: tuple[int, int, int] | None = None,
        backend_tag: str | None = None,
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
        self.objects = PageObjects(layout, is_mla, page_dims)
        self.planes = self.objects.planes
        if page_nbytes is not None and (page_nbytes <= 0 or page_nbytes % self.planes):
            raise ValueError(f"page_nbytes must be a positive multiple of {self.planes}, got {page_nbytes}")
        self.layout, self.page_dims = layout, self.objects.page_dims
        self.model_name, self.tp_rank, self.is_mla, self.backend_tag = model_name, tp_rank, is_mla, backend_tag
        self.keys = ObjectKeys(model_name=model_name, tp_rank=tp_rank, is_mla=is_mla, backend_tag=backend_tag)
        self.page_nbytes = page_nbytes
        self.op_timeout_s = float(op_timeout_s)
        self.close_timeout_s = float(close_timeout_s)
        self.read_pool_bytes = int(read_pool_bytes)
        # The TCP transport reads and writes any host address; RDMA and the like need registered memory.
        self.direct_unregistered = protocol == "tcp" if direct_unregistered is None else bool(direct_unregistered)
        self.stats = MooncakeStats()
        self._lock = threading.Lock()
        self._pools: dict[int, _ReadPool] = {}
        self._closed = False
        self._put_config = None
        if client is None:
            client, self._put_config = connect(
                master_server_addr,
                self.metadata_server,
                local_hostname=local_hostname,
                protocol=protocol,
                device_name=device_name,
                global_segment_size=global_segment_size,
                local_buffer_size=local_buffer_size,
                replica_num=replica_num,
                op_timeout_s=op_timeout_s,
                setup_timeout_s=setup_timeout_s,
                connect_timeout_s=connect_timeout_s,
            )
        self.client = client
        self._runner = _Runner(max(1, int(workers)), "kvfsm-mooncake")
        self.regions = Regions(client, self._runner, self.op_timeout_s, self._lock)

    @classmethod
    def from_config(
        cls, config: Any, *, tp_rank: int = 0, tp_size: int = 1, is_mla: bool = False, **overrides: Any
    ) -> MooncakeStorage:
        """Build from an OffloadConfig: `storage_extra` holds the constructor's keyword arguments."""
        extra: dict[str, Any] = dict(getattr(config, "storage_extra", None) or {})
        extra.update(overrides)
        extra.setdefault("model_name", getattr(config, "model_name", ""))
        if "master_server_addr" not in extra:
            raise ValueError("storage_extra needs master_server_addr for the Mooncake backend")
        return cls(extra.pop("master_server_addr"), tp_rank=tp_rank, tp_size=tp_size, is_mla=is_mla, **extra)

    # ---- keys, regions ----------------------------------------------------------------------------------
    def key_of(self, key: str) -> list[str]:
        """The Mooncake object keys of page hash `key`: SGLang's, K then V for MHA, one for MLA."""
        return self.keys.of(key)

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """Register a CPU tensor's memory with the client: pages inside it are sent in place."""
        if tensor.device.type != "cpu":
            raise ValueError("only host memory can be registered with the Mooncake client")
        self.regions.register(tensor.data_ptr(), tensor.numel() * tensor.element_size(), strict=True)

    def register_host_pool(self, host_pool: Any) -> None:
        """Register a HostKVPool's buffer (for batch_set_from_host and in-place puts from it)."""
        if id(host_pool) not in self.regions.pools:
            self.register_buffer(host_pool.kv_buffer)
            self.regions.pools.add(id(host_pool))

    def unregister_buffer(self, tensor: torch.Tensor) -> None:
        """Undo register_buffer (before the tensor's memory is freed)."""
        self.regions.unregister(tensor.data_ptr())

    def unregister_host_pool(self, host_pool: Any) -> None:
        if id(host_pool) in self.regions.pools:
            self.regions.pools.discard(id(host_pool))
            self.unregister_buffer(host_pool.kv_buffer)

    def _pool(self, page_nbytes: int) -> _ReadPool:
        with self._lock:
            pool = self._pools.get(page_nbytes)
            if pool is None:
                register = None if self.direct_unregistered else self.regions.register  # TCP needs no registration
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
            logger.error(
                "mooncake call did not return within %.1fs (master %s); reported failed",
                self.op_timeout_s,
                self.master_server_addr,
            )
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
        mkeys = self.keys.of_pages(keys)
        held: list[Any] = []  # everything the client reads stays referenced until the call returns
        for t in pages:
            if not (t.is_cpu and t.is_contiguous()):
                t = t.detach().to("cpu").contiguous()
            if t.numel() % self.planes:
                raise ValueError(f"a {t.numel()}-byte page does not split into {self.planes} objects (K, V)")
            held.extend(self.objects.split(t))
        ptrs: list[int] = [t.data_ptr() for t in held]
        sizes: list[int] = [t.numel() for t in held]
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
        good_obj = [c == OK or c == OBJECT_ALREADY_EXISTS for c in codes]
        ok = self.objects.pages_ok(codes, lambda c: c == OK or c == OBJECT_ALREADY_EXISTS)
        n_ok = ok.count(True)
        with self._lock:
            self.stats.writes_ok += n_ok
            self.stats.writes_failed += len(ok) - n_ok
        if n_ok and self.page_nbytes is None and len(set(sizes)) == 1:
            self.page_nbytes = sizes[0] * self.planes
        if n_ok < len(ok):
            self._note("put", [c for c, good in zip(codes, good_obj) if not good], n)
        return ok

    def _stage(self, held: list[Any], ptrs: list[int], sizes: list[int]) -> None:
        """Copy pages outside registered memory into registered read-pool buffers (transports that need it);
        a page that finds no registered room gets size 0 (reported failed)."""
        by_size: dict[int, list[int]] = {}
        for i, (ptr, size) in enumerate(zip(ptrs, sizes)):
            if not self.regions.covers(ptr, size):
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

        Each object (a page's K or V plane, or its MLA latent) is gathered from the pool in the store's
        byte order, as few ranges as the pool's layout allows (one when the pool's layout and the store's
        agree: SGLang's zero-copy case), so pages stored here read back with batch_get / set_pages_bytes
        like any other. The pages must stay allocated (and unchanged) until this returns.
        """
        if not keys:
            return []
        idx = host_pool._page_index(host_indices)  # whole, allocated pages, in order (raises otherwise)
        ps = host_pool.page_size
        starts = idx.view(-1, ps)[:, 0]
        if len(keys) != starts.numel():
            raise ValueError(f"{len(keys)} keys but {starts.numel()} pages")
        tv = host_pool.token_view()  # (planes, L, size, H, D)
        planes, layers = tv.shape[0], tv.shape[1]
        if planes != self.planes:
            raise ValueError(f"a host pool of {planes} planes for a store of {self.planes} (is_mla={self.is_mla})")
        if self.page_dims is not None and self.page_dims != (planes, layers, ps):
            raise ValueError(f"host pool pages are {(planes, layers, ps)}, this store's page_dims {self.page_dims}")
        self.register_host_pool(host_pool)
        mkeys = self.keys.of_pages(keys)
        es = tv.element_size()
        row = tv.shape[3] * tv.shape[4] * es  # one token of one (plane, layer): contiguous in both layouts
        st = tv.stride()
        # byte offsets of the (layer, token) rows of one object, in the object's order, merged into runs
        lt = torch.arange(layers).view(-1, 1) * st[1] + torch.arange(ps).view(1, -1) * st[2]
        rows = (lt if self.layout == "layer_first" else lt.t()).reshape(-1) * es
        breaks = torch.nonzero(rows[1:] - rows[:-1] != row).view(-1) + 1
        run_starts = torch.cat([torch.zeros(1, dtype=torch.long), breaks])
        run_bytes = (torch.diff(torch.cat([run_starts, torch.tensor([rows.numel()])])) * row).tolist()
        base = (starts.view(-1, 1) * st[2] + torch.arange(planes).view(1, -1) * st[0]) * es + tv.data_ptr()
        addrs = (base.view(-1, 1) + rows[run_starts].view(1, -1)).tolist()  # one list per object, page by page
        sizes = [run_bytes] * len(addrs)
        client, held = self.client, host_pool.kv_buffer

        def put() -> Any:
            _ = held
            return client.batch_put_from_multi_buffers(mkeys, addrs, sizes)

        status, rcs = self._call(put, self._late_put_cleanup(mkeys))
        codes: list[int | str] = (
            [int(rc) for rc in rcs] if status == "ok" and len(rcs) == len(mkeys) else [status] * len(mkeys)
        )
        good_obj = [c == OK or c == OBJECT_ALREADY_EXISTS for c in codes]
        ok = self.objects.pages_ok(codes, lambda c: c == OK or c == OBJECT_ALREADY_EXISTS)
        with self._lock:
            self.stats.writes_ok += sum(ok)
            self.stats.writes_failed += len(ok) - sum(ok)
        if any(ok) and self.page_nbytes is None:
            self.page_nbytes = host_pool.page_nbytes
        self._note("put", [c for c, good in zip(codes, good_obj) if not good], len(keys))
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
                mine = idx[at : at + k]
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
                if not self.direct_unregistered and not self.regions.register(extra.data_ptr(), extra.numel()):
                    continue
                for j, i in enumerate(rest):
                    addrs[i] = extra.data_ptr() + j * size
                plan.append((extra, len(rest), size, rest))
        filled = sum(k for _, k, _, _ in plan)
        todo: list[int] | None = None
        if filled < n:
            todo = picked = sorted(i for _, _, _, mine in plan for i in mine)
            tk, ta, ts = [mkeys[i] for i in picked], [addrs[i] for i in picked], [sizes[i] for i in picked]
        else:
            tk, ta, ts = mkeys, addrs, sizes
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
                    self.regions.forget(unregister)

        started = self._submit(get)
        for mem, k, size, mine in plan:
            block = (
                torch.frombuffer(mem, dtype=torch.uint8).view(k, size) if isinstance(mem, memoryview) else mem
            ).unbind(0)
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
        """Each page's objects read into recycled buffers and put together as the canonical page bytes (the
        object itself for layer_first MLA; one copy joining K and V, or reordering page_first); None where
        any object of the page is missing or of another size than its sibling."""
        if not keys:
            return []
        mkeys = self.keys.of_pages(keys)
        n, k = len(mkeys), self.planes
        nbytes = self.page_nbytes
        if nbytes:
            osize = nbytes // k
            codes, rows = self._get_into(mkeys, [osize] * n)
            sizes = [osize] * n
            if codes.count(osize) == n:  # the common case: every object there, of the expected size
                with self._lock:
                    self.stats.reads_ok += len(keys)
                return [self.objects.join(rows[i : i + k]) for i in range(0, n, k)]
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
                    self.page_nbytes = fetch[0][1] * k
        out: list[torch.Tensor | None] = []
        bad: list[int | str] = []
        ok = missing = 0
        for i in range(0, n, k):
            cs, rs, szs = codes[i : i + k], rows[i : i + k], sizes[i : i + k]
            # an object read whole: all its bytes, into a buffer of at least its size
            whole = all(isinstance(c, int) and 0 < c <= sz and r is not None for c, r, sz in zip(cs, rs, szs))
            page = None
            if whole and len(set(cs)) == 1:  # K and V of one size
                try:
                    page = self.objects.join([r if c == sz else r[:c] for c, r, sz in zip(cs, rs, szs)])  # type: ignore[index]
                except RuntimeError:  # a size page_dims cannot reorder: not a page of this deployment
                    page = None
            if page is not None:
                ok += 1
                out.append(page)
                continue
            out.append(None)
            missing += 1
            bad.extend(c for c in cs if c != OBJECT_NOT_FOUND and not (isinstance(c, int) and c > 0))
        with self._lock:
            self.stats.reads_ok += ok
            self.stats.reads_missing += missing
        if bad:
            self._note("get", bad, n)
        return out

    def batch_exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        mkeys = self.keys.of_pages(keys)
        client = self.client
        status, rcs = self._call(lambda: client.batch_is_exist(mkeys))
        if status != "ok" or not isinstance(rcs, (list, tuple)):
            self._note("exists", [status], len(keys))
            return 0
        for i, rc in enumerate(rcs):
            if rc != 1:
                if rc != 0:
                    self._note("exists", [int(rc)], len(keys))
                return i // self.planes  # a page counts when all its objects are there
        return len(rcs) // self.planes

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def health(self) -> int:
        """The client's health_check: 0 healthy, 1 not set up or closed, 2 master unreachable (-1: no answer)."""
        status, rc = self._call(self.client.health_check)
        return int(rc) if status == "ok" else -1

    def remove(self, keys: Sequence[str]) -> list[int]:
        """Remove pages by page hash (tests and tools): per page, 0 or the first of its objects' errors."""
        mkeys = self.keys.of_pages(keys)
        client = self.client
        status, rcs = self._call(lambda: client.batch_remove(mkeys, True))
        if status != "ok" or not isinstance(rcs, (list, tuple)) or len(rcs) != len(mkeys):
            return [RPC_FAIL] * len(keys)
        k = self.planes
        return [next((int(c) for c in rcs[i : i + k] if c != 0), 0) for i in range(0, len(rcs), k)]

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
            logger.warning(
                "Mooncake client close did not finish within %.1fs; left to finish in the background",
                self.close_timeout_s,
            )

    def __enter__(self) -> MooncakeStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
