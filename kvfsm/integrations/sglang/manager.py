"""`DecodeKVCacheOffloadManager`: SGLang 0.5.23's decode KV offload manager, driven by kvfsm's runtime.

A drop-in for `sglang.srt.disaggregation.decode_kvcache_offload_manager.DecodeKVCacheOffloadManager`:
the same constructor and methods, called by SGLang's scheduler at the same sites (docs/sglang-upstream.md),
over SGLang's own Req, ReqToTokenPool, allocator, KV pool and tree cache. Every lifecycle step is a
transition of kvfsm's spec-generated machine (`kvfsm.runtime.DecodeOffloadManager`); this class only
translates SGLang's objects (`objects.py`, `pool.py`) and configuration (`settings.py`) into kvfsm's.

What differs from upstream on purpose (docs/sglang-upstream.md has upstream's side):
- TP ranks whose sizes (page, stride, host pool) differ are refused at construction (`TPMismatch` on
  every rank) instead of stranding a rank's copies as upstream's MIN agreement does.
- A page that fails to store does not drop the pages after it in its chunk (kvfsm's FileStorage writes
  each page on its own; HiCacheFile's batch stops at the first failure).
- A chunk is never larger than the host pool (a longer backlog goes in several chunks); upstream would
  retry an oversized chunk forever.
- SGLang releases a retracted request itself; the adapter then ends its kvfsm lifecycle with the spec's
  `released_by_engine`, which frees nothing (see `_end_released_by_engine`). Re-admitted, the request
  starts a new lifecycle and copies its decoded KV again from its first decode chunk (same keys: the store
  keeps the pages it has); upstream keeps its offload state across the retraction and carries on after its
  last chunk.
- On a GPU server nothing of the manager's waits for the GPU: slots are read from SGLang's `req_to_token`
  on the device (kvfsm.runtime.device_table) and copied by kvfsm's CudaCopyEngine on its own stream
  (upstream reads the same table on the device), and frees go through SGLang's `free_segment`, which
  needs no `torch.unique`, or on its paged allocator the page ids straight to the `free_page_ids` that
  `free_segment` calls (objects.AllocatorView).
- `offload_kv_cache(req)` answers at once, as upstream's does (True: a chunk was due and host pages hold it,
  taken in call order), but its copy and its lifecycle's `offload` transition wait: the chunks of an
  iteration go to kvfsm's batch path as one batch (`DecodeOffloadManager.submit_reserved`: one slot
  gather, one copy, one batch event) at the next progress check, or sooner when a call needs them
  submitted (see `_flush`). A call for a request with no chunk due costs a dict lookup and three compares.
  Upstream submits one copy per call.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Mapping
from typing import Any, cast

from kvfsm.dataplane import CpuCopyEngine, CudaCopyEngine, FileStorage, HostKVPool
from kvfsm.dataplane.storage.process import CHILD_FILE_WRITERS, in_processes
from kvfsm.errors import ConfigError, EventRejected, RetractionRefused
from kvfsm.runtime import DecodeOffloadManager, OffloadConfig, TPMismatch
from kvfsm.runtime.lifecycles import ROW_HOLDERS
from kvfsm.runtime.offloading import Reservation
from kvfsm.runtime.protocols import offloadable_tokens, raise_if_field_missing, raise_if_length_invalid
from kvfsm.runtime.tp import ProgressConsensus

from .objects import AllocatorView, PrefixCacheView, RequestView, RequestViews, TableView
from .pool import SGLangDeviceKVPool
from .settings import SOURCE, read_settings

logger = logging.getLogger(__name__)

UPSTREAM_REFUSAL = "Decode KV offload copies are still pending on some rank; refusing to retract"


class RetractionRefusedError(RetractionRefused, RuntimeError):
    """kvfsm's RetractionRefused that is also the RuntimeError upstream raises (with upstream's message
    first), so SGLang code that expects upstream's exception sees the same type and text."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.args = (f"{UPSTREAM_REFUSAL} ({reason}).",)

    def __str__(self) -> str:
        return self.args[0]


class _CopiesInFlight(Mapping[int, int]):
    """`ongoing_offload` as the scheduler uses it: its length is the number of device-to-host copies
    accepted and not yet acknowledged by a progress check (upstream: one entry per chunk), the reserved
    ones waiting for their batch included. Iterating submits those first (serials name submitted chunks).
    Read-only."""

    def __init__(self, adapter: DecodeKVCacheOffloadManager) -> None:
        self._adapter = adapter

    def __len__(self) -> int:
        return len(self._adapter.manager.fx.copy_fifo) + len(self._adapter._pending)

    def __iter__(self) -> Iterator[int]:
        self._adapter._flush()
        return iter([chunk.serial for chunk in self._adapter.manager.fx.copy_fifo])

    def __getitem__(self, key: int) -> int:
        self._adapter._flush()
        for chunk in self._adapter.manager.fx.copy_fifo:
            if chunk.serial == key:
                return chunk.end - chunk.start
        raise KeyError(key)


class DecodeKVCacheOffloadManager:
    """SGLang's decode-side KV offload manager over kvfsm's DecodeOffloadManager (see the module docstring).

    Retraction: SGLang never asks the manager to retract; it releases retracted requests itself right after
    `drain_before_retraction`. `retraction="refuse"` (the default) is upstream's rule, kvfsm's
    `retraction="fail_closed"` policy: the drain raises on every TP rank while any device-to-host copy is
    tracked. `retraction="fenced"` never refuses: the drain makes the scheduler's stream wait on every copy in
    flight (no host wait), so SGLang may free and rewrite those slots at once (the spec's fences param and
    `released_by_engine_fenced`), and kvfsm's own releases under a copy are fenced the same way.
    `checked=True` runs kvfsm's slot ledger and spec invariants on every transition (tests)."""

    def __init__(
        self,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        tp_group: Any,
        tree_cache: Any,
        *,
        checked: bool = False,
        retraction: str = "refuse",
    ) -> None:
        if retraction not in ("refuse", "fenced"):
            raise ConfigError(
                "retraction",
                f"must be 'refuse' (upstream's rule) or 'fenced' (never refused), got {retraction!r}",
                SOURCE,
            )
        kv_cache = token_to_kv_pool_allocator.get_kvcache()
        device_pool = SGLangDeviceKVPool(kv_cache)  # ConfigError: SWA, other pool types, fp8
        table = req_to_token_pool.req_to_token
        if table.device != device_pool.device:
            raise ConfigError(
                "req_to_token_pool",
                f"req_to_token is on {table.device} but the KV pool on "
                f"{device_pool.device}: both must be on one device",
                SOURCE,
            )
        on_gpu = device_pool.device.type == "cuda"
        kv = device_pool.config
        settings = read_settings(int(kv_cache.size), kv.bytes_per_token, tp_group)
        if int(token_to_kv_pool_allocator.page_size) != settings.page_size:
            raise ConfigError(
                "page_size",
                f"the allocator's page size {token_to_kv_pool_allocator.page_size} differs "
                f"from the server's {settings.page_size}",
                SOURCE,
            )
        consensus = ProgressConsensus(tp_group)
        sizes = (settings.page_size, settings.stride, settings.host_slots)
        if not consensus.check_same(*sizes):
            # upstream would run, and a rank whose host pool refuses a chunk its peer took strands the peer's
            # copies (docs/sglang-upstream.md, "TP: the MIN agreement strands a rank")
            raise TPMismatch(
                f"TP ranks disagree on (page size, stride, host pool tokens) = {sizes} on rank "
                f"{settings.tp_rank}: every rank needs the same sizes"
            )
        self.page_size = settings.page_size
        self.offload_stride = settings.stride
        self.tp_group = tp_group
        self.tp_world_size = consensus.world
        self.kv_cache = kv_cache
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.tree_cache = tree_cache
        self.settings = settings
        self._views = RequestViews()
        self._quiet = self._views.quiet  # the early exit's one lookup
        self._checks = 0  # progress checks so far: the clock a quiet entry expires by (`_note_quiet`)
        self.retraction = retraction
        self._retraction_allowed = False  # drain_before_retraction passed: SGLang may release requests itself
        self._released = False  # release_host_resources ran
        # Chunks accepted by offload_kv_cache and not yet submitted (their host pages taken), in call order;
        # the requests among them that finished with their chunk (released once it is acknowledged); the ids
        # of their Reqs. See _flush.
        self._pending: list[Reservation] = []
        self._finishing: list[RequestView] = []
        self._pending_ids: set[int] = set()
        # with kvfsm_store_process the store runs in a child process, which maps the (shared) host pool
        host_pool = HostKVPool(
            kv,
            settings.host_slots,
            settings.page_size,
            settings.host_layout,
            pin_memory=on_gpu,
            shared=settings.store_process,
        )
        # in the child the store's writers take none of the scheduler's interpreter time (CHILD_FILE_WRITERS)
        writers = CHILD_FILE_WRITERS if settings.store_process else 1
        make_store = functools.partial(
            FileStorage,
            settings.file_dir,
            model_name=settings.model_name,
            tp_rank=settings.tp_rank,
            tp_size=settings.tp_size,
            is_mla=kv.is_mla,
            layout=settings.file_layout,
            writers=writers,
            page_dims=(kv.num_planes, kv.num_layers, settings.page_size),
            dtype=kv.dtype,
        )
        # built here, closed here (release_host_resources)
        self._storage = in_processes(make_store, settings.store_processes) if settings.store_process else make_store()
        # The backup queue is left at kvfsm's default, which holds every chunk the host pool can: every acknowledged
        # copy's backup is queued at that progress check, as upstream's queues each one (`write_storage`).
        options: dict[str, Any] = dict(
            page_size=settings.page_size,
            offload_stride=settings.stride,
            host_layout=settings.host_layout,
            copy_backend="cuda" if on_gpu else "cpu",
            storage_backend="file",
            storage_dir=settings.file_dir,
            model_name=settings.model_name or "model",
            retraction="fail_closed" if retraction == "refuse" else "deferred",
            fenced_release=retraction == "fenced",
            checked=checked,
        )
        self.manager = DecodeOffloadManager(
            OffloadConfig(**options),
            device_pool=device_pool,
            allocator=AllocatorView(token_to_kv_pool_allocator, device_pool.size),  # type: ignore[arg-type]
            req_to_token=TableView(req_to_token_pool, self._views),  # type: ignore[arg-type]
            prefix_cache=PrefixCacheView(tree_cache),
            host_pool=host_pool,
            storage=self._storage,
            # one copy per scheduler iteration: offload_kv_cache's chunks are submitted as one batch (_flush)
            copy_engine=CudaCopyEngine(device_pool.device) if on_gpu else CpuCopyEngine(),
            tp_group=tp_group if consensus.world > 1 else None,
            tp_rank=settings.tp_rank,
            tp_size=settings.tp_size,
        )
        self.decode_host_mem_pool = host_pool
        self.ongoing_offload: Mapping[int, int] = _CopiesInFlight(self)
        logger.info(
            "kvfsm decode KV offload for SGLang: page %d, stride %d, host pool %d tokens (%s), store %s",
            self.page_size,
            self.offload_stride,
            settings.host_slots,
            settings.host_layout,
            settings.file_dir,
        )

    # --- the scheduler's calls (docs/sglang-upstream.md, "Where the scheduler calls it") --------------
    def offload_kv_cache(self, req: Any) -> bool:
        """Accept the request's next stride-aligned decode chunk for a device-to-host copy, taking its host
        pages now; False when none is due or the host pool is full (retried from the same position later).
        The copy is submitted with the iteration's other chunks as one batch (`_flush`). A request that
        finished with this chunk is released once its copies are acknowledged, as upstream's progress check
        does.

        The early exit is the scheduler's usual case (no whole stride since the last chunk): one dict lookup
        and three compares, no torch call, no lifecycle lookup. It answers what the full path would: the view
        is in `quiet` only while its Req is pinned on its live lifecycle's row and has not been seen by any
        other call since (`_note_quiet`). It reads the `ReqKvInfo` the Req held then instead of `req.kv`, which
        costs a lookup in the Req's instance dict (SGLang's Req sets 151 attributes, past CPython's shared-key
        limit), and keys `quiet` by the Req instead of `id(req)`, with no weak reference to call: 1,391 -> 203 ns a
        call over the serving loop's Reqs at 4096 live on the H100 host, 270 -> 138 ns on the 2-core development
        machine (bench/probes/door_phases.py, `quiet_call_ns_drained`; bench/results/door_phases*-h100.json).
        SGLang 0.5.23 replaces a Req's `kv` only at admission, at a retraction (which empties `quiet`) and at a
        streaming session's end; were it replaced while the Req decodes, the entry still expires by `view.until`,
        and past the early exit everything is read afresh from the Req."""
        view = self._quiet.get(req)
        if view is not None:
            kv = view.kv
            try:
                if kv.kv_committed_len < view.due and kv.req_pool_idx == view.row and self._checks < view.until:
                    return False
            except TypeError as exc:  # costs nothing until raised
                raise_if_length_invalid(view, exc)
                raise
            del self._quiet[req]  # re-entered once its chunk is submitted, or by the full path
            kv, row = req.kv, view.row
            if kv.req_pool_idx == row:  # due (read afresh from the Req), on the row it was noted on
                try:  # read from the Req itself rather than through its view
                    available = offloadable_tokens(req.origin_input_ids, req.output_ids, kv.kv_committed_len)
                except AttributeError as exc:
                    raise_if_field_missing(view, exc)
                    raise
                except TypeError as exc:
                    raise_if_length_invalid(view, exc)
                    raise
                return self._accept(req, view, self.manager.reserve_due(view, row, available))
        if id(req) in self._pending_ids:  # called again before its chunk was submitted
            self._flush()
        return self._reserve(req, self._enter(req))

    def check_offload_progress(self) -> None:
        """Submit the chunks accepted since the last call as one batch, then acknowledge finished copies and
        backups (MIN-agreed over the TP group), store, free, release."""
        self._checks += 1
        if self._retraction_allowed:
            self._sweep()
        self._flush()
        self.manager.check_progress()

    def finalize_release_on_finish(self, req: Any) -> None:
        """The request finished: release it now, or when its last copy is acknowledged."""
        if id(req) in self._pending_ids:
            self._flush()  # which notes the Req quiet again
        self._quiet.pop(req, None)  # a call after this one takes the full path, which finds the lifecycle ended
        self.manager.finalize(self._enter(req))

    def drain_before_retraction(self) -> None:
        """The accepted chunks are submitted, then a progress check, then `RetractionRefusedError` (a
        RuntimeError, as upstream's) on every TP rank while any rank still tracks a device-to-host copy (on
        the GPU, one not yet acknowledged; on the CPU every copy lands at that progress check, so none is
        tracked unless a TP peer's MIN held its ack back). With `retraction="fenced"` it never refuses: the
        current stream is made to wait on every copy in flight instead. Once it passes, SGLang releases the
        retracted requests itself; their kvfsm lifecycles are ended at the next call (`_sweep`)."""
        self._flush()
        try:
            self.manager.drain_before_retraction()
        except RetractionRefused as exc:
            raise RetractionRefusedError(exc.reason) from exc
        self._retraction_allowed = True
        self._quiet.clear()  # SGLang may now release any request itself: every Req takes the full path

    def has_inflight_device_transfer(self) -> bool:
        """Whether a device-to-host copy may still read device KV (accepted, not yet acknowledged)."""
        return bool(self._pending) or self.manager.has_inflight_device_transfer()

    def release_host_resources(self) -> None:
        """Shutdown: wait for the copies and backups in flight, give the host pool back and stop kvfsm's backup
        worker. Idempotent (upstream's is too); the manager cannot offload afterwards."""
        if self._released:
            return
        self._released = True
        self._flush()
        self._quiet.clear()
        self.manager.drain()
        self.manager.release_host_resources()
        self.manager.close()
        self._storage.close()  # FileStorage's writer threads; ProcessStorage's child (ShardedStorage: each one's)

    # --- internals -------------------------------------------------------------------------------
    def _reserve(self, req: Any, view: RequestView) -> bool:
        """kvfsm's `reserve_offload` for the request: its chunk joins the pending batch, or it has none due."""
        return self._accept(req, view, self.manager.reserve_offload(view))

    def _accept(self, req: Any, view: RequestView, reservation: Reservation | None) -> bool:
        """A reservation joins the pending batch; with none, the request exits early until its next due point."""
        if reservation is None:
            if not req.finished():
                self._note_quiet(req, view)
            return False
        self._pending.append(reservation)
        self._pending_ids.add(id(req))
        if req.finished():
            self._finishing.append(view)
        return True

    def _note_quiet(self, req: Any, view: RequestView) -> None:
        """Let `req`'s next offload calls exit early until its committed length reaches the next due point,
        when kvfsm's manager knows one for the lifecycle on its row and that row is pinned to `req`. The entry
        expires two progress checks after the one at which the chunk falls due at a token an iteration: a
        decoding Req reaches its due point first, and one whose `kv` were replaced is read afresh by then."""
        kv = req.kv
        row = kv.req_pool_idx
        if type(row) is int and row >= 0 and self._views.holder(row) is req:
            due = self.manager.due_at(row)
            if due >= 0:
                view.row, view.due, view.kv = row, due, kv
                view.until = self._checks + due - kv.kv_committed_len + 2  # read only while committed < due
                self._quiet[req] = view

    def _flush(self) -> None:
        """Submit the pending chunks as one batch (one slot gather, one copy, one batch `offload` event),
        then release the requests that finished with theirs. Runs before any call that could observe the
        lifecycles or copies of pending requests: the progress check, the drain, shutdown, a repeated call
        for a pending request and its finalize. Between a chunk's acceptance and this, the request's machine
        sees no other event, so each machine's event sequence is that of upstream's call-by-call path.
        If the copy cannot be submitted, every pending page goes back and the chunks are due again; the
        finishing requests are still ended (released once nothing reads their slots)."""
        if not self._pending:
            return
        pending, finishing = self._pending, self._finishing
        self._pending, self._finishing, self._pending_ids = [], [], set()
        try:
            self.manager.submit_reserved(pending)
        finally:
            self.manager.finalize_batch(finishing)  # one batch event: the releases it makes at once, freed together
        finished = set(map(id, finishing))
        for r in pending:
            view = cast(RequestView, r.req)  # what this adapter reserved
            req = view._ref()
            if req is not None and id(view) not in finished:
                self._note_quiet(req, view)

    def _enter(self, req: Any) -> Any:
        """The request's view, with the Req pinned by its row while kvfsm may release it (unless another
        live Req claims that row: kvfsm then refuses this one with RowInUse, and the pin stays). A Req naming
        no row of the table is not pinned: kvfsm refuses it, and a pin would keep it alive for good. First,
        lifecycles SGLang ended itself (see `_end_released_by_engine`) are ended in kvfsm too."""
        if self._retraction_allowed:
            self._sweep()
        view = self._views.view(req)
        self._end_released_by_engine(req, view)
        row = req.kv.req_pool_idx
        if type(row) is int and 0 <= row < self.manager.req_to_token.rows:  # kvfsm admits a Req on no other row
            holder = self._views.holder(row)
            if holder is not None and holder is not req and holder.kv.req_pool_idx != row:
                self._end_released_by_engine(holder)  # unpins it when it ends
                holder = self._views.holder(row)
            # never re-pin a row a live kvfsm lifecycle still holds: its release would free the new request's row
            if holder is None or holder is req or (holder.kv.req_pool_idx != row and not self._holds_row(holder)):
                self._views.pin(req)
        return view

    def _holds_row(self, req: Any) -> bool:
        m = self.manager.machine_of(self._views.view(req))
        return m is not None and m.state in ROW_HOLDERS

    def _sweep(self) -> None:
        """After a retraction was allowed: end the kvfsm lifecycle of every request SGLang released."""
        self._retraction_allowed = False
        for req in list(self._views.pinned()):
            self._end_released_by_engine(req)

    def _end_released_by_engine(self, req: Any, view: Any = None) -> None:
        """SGLang's retraction releases a request through its own `release_kv_cache` (slots, row, lock),
        never telling the manager (upstream's keeps its offload state and ignores it). kvfsm's lifecycle of
        such a request still holds the row it was admitted on: it ends with the spec's `released_by_engine`,
        which frees nothing. One whose copy still reads the freed slots is refused by the spec (the engine
        skipped the drain): logged, and kvfsm keeps it (a request admitted on its row is then refused with
        RowInUse) until its copy is acknowledged and a later call ends it. `view`: req's, when the caller
        has it (every offload call does: one lookup fewer)."""
        view = self._views.view(req) if view is None else view
        m = self.manager.machine_of(view)
        if m is None or m.state not in ROW_HOLDERS or req.kv.req_pool_idx == m.ctx.row:
            return
        row = m.ctx.row
        self._quiet.pop(req, None)
        try:
            self.manager.released_by_engine(view)
        except EventRejected:
            logger.error(
                "request %r lost table row %d to the engine while a copy of its KV is in flight; "
                "kvfsm keeps the row until the copy is acknowledged",
                req.rid,
                row,
            )
            return
        if self._views.holder(row) is req:
            self._views.unpin(row)
