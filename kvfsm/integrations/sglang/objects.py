"""SGLang 0.5.23's Req, ReqToTokenPool and token-to-KV allocator, seen as kvfsm's runtime protocols.

kvfsm's manager keys lifecycles by object identity and reads `req.req_pool_idx`, `req.prefix_len`, ...;
SGLang keeps those on `req.kv` (`ReqKvInfo`) under other names. `RequestViews` hands out one `RequestView`
per `Req`, the same one every time (a WeakKeyDictionary), so kvfsm sees one stable object per request.
A view holds its Req weakly (the registry's value must not keep its key alive); while kvfsm may still
release a request, `RequestViews.pin` keeps the Req alive by its table row, as upstream's `ongoing_offload`
keeps it alive until its ack.

Frees go to SGLang's own objects, so that everything SGLang (and the differential harness) observes is
what upstream's release does: device slots through the allocator's `free` (the paged allocator frees the
pages of the slots it is given), the row through `ReqToTokenPool.free(req)` (which sets
`req.kv.req_pool_idx = None`), then `req.kv.mark_kv_released()`; kvfsm itself sets `req.lock = None`
after `tree_cache.unlock(req.lock)`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NoReturn, Optional

import numpy as np
import torch

from kvfsm.dataplane.fences import SlotFence
from kvfsm.errors import InvalidRequest


def _collected() -> NoReturn:
    raise InvalidRequest("the SGLang Req of this kvfsm request view was garbage collected")


class RequestView:
    """One SGLang `Req` as kvfsm's `OffloadRequest`: `req_pool_idx`, `kv_committed_len`, `kv_allocated_len`
    and `prefix_len` (= `cache_protected_len`) read through `req.kv`; `lock` read and written on the Req."""

    # While the view is in `RequestViews.quiet` (the adapter's constant-time early exit, set by its `_note_quiet`):
    # the row its live lifecycle holds, the committed length before which it has no chunk due, the Req's
    # `ReqKvInfo` then, and the progress check after which the entry is read afresh from the Req
    __slots__ = ("_ref", "row", "due", "kv", "until", "__weakref__")
    kv: Any
    until: int

    def __init__(self, req: Any, callback: Any = None) -> None:
        self._ref = weakref.KeyedRef(req, callback, id(req))  # the key: RequestViews' entry, for the callback
        self.row = self.due = -1

    @property
    def req(self) -> Any:
        """The SGLang Req (a view outlives its Req only inside kvfsm's bookkeeping, never in a call)."""
        req = self._ref()
        if req is None:
            _collected()
        return req

    # --- OffloadRequest ---
    # The four fields an offload reads for every request it looks at dereference the Req themselves rather
    # than through `req`: one Python call a read instead of two, 277-279 -> 201-204 ns on the 2-core
    # development machine (bench/probes/per_call_trims.py), and `offload_batch` at 4096 live, 16/16, reads them
    # about 2,400 times an iteration (bench/probes/adapter_profile.py's call counts).
    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def origin_input_ids(self) -> Sequence[int]:
        req = self._ref()
        if req is None:
            _collected()
        return req.origin_input_ids

    @property
    def output_ids(self) -> Sequence[int]:
        req = self._ref()
        if req is None:
            _collected()
        return req.output_ids

    @property
    def req_pool_idx(self) -> Optional[int]:
        req = self._ref()
        if req is None:
            _collected()
        row = req.kv.req_pool_idx
        return None if row is None else int(row)

    @req_pool_idx.setter
    def req_pool_idx(self, value: Optional[int]) -> None:
        self.req.kv.req_pool_idx = value

    @property
    def kv_committed_len(self) -> int:
        req = self._ref()
        if req is None:
            _collected()
        return req.kv.kv_committed_len

    @property
    def kv_allocated_len(self) -> int:
        return self.req.kv.kv_allocated_len

    @property
    def prefix_len(self) -> int:
        return self.req.kv.cache_protected_len

    @property
    def extra_key(self) -> Optional[str]:
        return self.req.extra_key

    @property
    def cache_salt(self) -> Optional[str]:
        return self.req.cache_salt

    @property
    def lock(self) -> Any:
        return getattr(self.req, "lock", None)

    @lock.setter
    def lock(self, value: Any) -> None:
        self.req.lock = value

    def finished(self) -> bool:
        return bool(self.req.finished())

    def __repr__(self) -> str:
        req = self._ref()
        return f"RequestView({getattr(req, 'rid', '<collected>')!r})"


class RequestViews:
    """The identity-stable view of each Req, and the Reqs kvfsm may still release, by table row."""

    def __init__(self) -> None:
        # id(Req) -> its view. An entry goes with its Req: the view's weakref carries the key and calls one
        # bound method for all views. (A WeakKeyDictionary kept a second weak reference a Req, 4,090 tracked
        # objects at 4096 live in the heap census of bench/sglang_adapter_gpu.py, and made one per lookup.)
        self._views: dict[int, RequestView] = {}
        self._pinned: dict[int, Any] = {}  # row -> the Req that holds it (strong: kvfsm may release it later)
        # Req -> its view, for Reqs pinned on a live lifecycle with no chunk due before `view.due`: the adapter
        # answers their offload calls with this one lookup. Keyed by the Req itself, whose hash is its identity
        # (SGLang's Req defines no __eq__ or __hash__), so the lookup needs no `id()` call. The reference adds
        # no lifetime: an entry lives only while its Req is pinned (`pin` and `unpin` drop it when the row
        # changes hands), and the adapter drops it on every other call about that Req.
        self.quiet: dict[Any, RequestView] = {}
        self._on_collected = self._collected  # one bound method for every view's weakref

    def view(self, req: Any) -> RequestView:
        """The view of `req` (made on first sight); a Req without `kv` is refused with InvalidRequest."""
        view = self._views.get(id(req))
        if view is not None and view._ref() is req:  # a live Req's id is its own: the check is for safety only
            return view
        if not hasattr(req, "kv") or not hasattr(req.kv, "req_pool_idx"):
            raise InvalidRequest(
                f"{type(req).__name__} object {getattr(req, 'rid', '?')!r} has no `kv` "
                f"(SGLang 0.5.23's ReqKvInfo): not an SGLang Req"
            )
        try:
            view = RequestView(req, self._on_collected)
        except TypeError:
            raise InvalidRequest(f"{type(req).__name__} objects are not weak-referenceable SGLang Reqs") from None
        self._views[id(req)] = view
        return view

    def _collected(self, ref: weakref.KeyedRef[int, Any]) -> None:
        """A Req is gone: its view goes with it (one callback for all views, the key on the weak reference,
        instead of a closure per view). A collected Req has no quiet entry: those are pinned."""
        key = ref.key
        view = self._views.get(key)
        if view is not None and view._ref is ref:
            del self._views[key]

    def pin(self, req: Any) -> None:
        """Keep `req` alive while it holds its row (called whenever it reaches kvfsm with a row)."""
        row = req.kv.req_pool_idx
        if row is not None and row != -1:
            held = self._pinned.get(int(row))
            if held is not req:
                if held is not None:
                    self.quiet.pop(held, None)  # quiet holds pinned Reqs only
                self._pinned[int(row)] = req

    def holder(self, row: int) -> Any:
        """The Req last seen holding `row` (None when none was)."""
        return self._pinned.get(row)

    def pinned(self) -> list[Any]:
        return list(self._pinned.values())

    def unpin(self, row: int) -> Any:
        req = self._pinned.pop(row, None)
        if req is not None:
            self.quiet.pop(req, None)  # quiet holds pinned Reqs only
        return req


class PrefixCacheView:
    """SGLang's tree cache as kvfsm's PrefixCache (`unlock(lock)`)."""

    # An unlock frees no device page: SGLang's `dec_lock_ref` moves the node's pages from protected to evictable, and
    # only `evict()` frees them (read by OffloadEffects.release_request_each: several releases' pages in one free)
    frees_at_unlock = False

    def __init__(self, tree_cache: Any) -> None:
        self.tree_cache = tree_cache

    def unlock(self, lock: Any) -> None:
        self.tree_cache.unlock(lock)


class TableView:
    """SGLang's `ReqToTokenPool` as kvfsm's request table: `rows`, `req_to_token`, `host_table`,
    `is_allocated`, `free`.

    SGLang's `req_to_token` is a plain tensor written in place by SGLang (on the GPU in a CUDA server, by
    its kernels). On the CPU the table is its own host mirror (an int32 view, read in place). On the GPU
    it has none (`host_table` None): kvfsm's manager then reads slots on the device, as device tensors it
    never looks into (kvfsm.runtime.device_table), so no call waits for the decode step."""

    def __init__(self, pool: Any, views: RequestViews) -> None:
        table = pool.req_to_token
        if not isinstance(table, torch.Tensor) or table.dim() != 2:
            raise InvalidRequest(f"req_to_token_pool.req_to_token must be a 2-D tensor, got {type(table).__name__}")
        self.pool = pool
        self.views = views
        self.rows = int(table.shape[0])
        self.max_context = int(table.shape[1])
        self.req_to_token = table
        self.host_table = table if table.device.type == "cpu" else None
        self._freed_last: Any = None

    def is_allocated(self, row: int) -> bool:
        """Row 0 is SGLang's padding row, never a request's; a row is allocated when not in `free_slots`."""
        return isinstance(row, int) and 0 < row < self.rows and row not in self.pool.free_slots

    def free(self, row: int) -> None:
        """Release `row` as upstream's release does: `req_to_token_pool.free(req)` (req.kv.req_pool_idx ->
        None), then `req.kv.mark_kv_released()` (kv_allocated_len -> 0)."""
        req = self.views.unpin(row)
        if req is None or req.kv.req_pool_idx != row:
            # kvfsm releases only rows it admitted a request on, and pins every such request: a miss means
            # the engine freed the row itself (its own release path) while kvfsm still held it
            raise InvalidRequest(f"request table row {row} is no longer held by the request kvfsm admitted on it")
        self.pool.free(req)
        req.kv.mark_kv_released()
        # SGLang drops a finished Req once the manager took it over, and the pin was its last reference: keep
        # it until the next free, so the rest of kvfsm's release (its lock, its row field) still reaches it
        self._freed_last = req


class AllocatorView:
    """SGLang's token-to-KV allocator as kvfsm's device allocator: `page_size`, `num_slots` and `free`.

    `free(slots)` hands the slots to SGLang's `allocator.free_segment` (see there). Inside the allocator's free
    group, which SGLang's decode result processing opens around the manager's calls, both frees go back at the
    group's end, as SGLang's own do.
    `owns_page_list` answers False, so a copy's device slots are range-checked slot by slot (SGLang's
    allocator keeps no per-page mask to ask)."""

    # Frees take a fence: SGLang writes KV only on the scheduler's current (compute) stream, so a fenced free
    # makes that stream wait on the fence before the slots go back (a wait_event: the host never waits).
    fences = True

    def __init__(self, allocator: Any, num_slots: int) -> None:
        self.allocator = allocator
        self.page_size = int(allocator.page_size)
        self.num_slots = int(num_slots)
        # Whether a free by page id is exactly this allocator's `free_segment`: SGLang's paged allocator's own,
        # which is `free_page_ids(slots[::page_size] // page_size)` once its debug checks are off (a subclass that
        # lays pages out otherwise, as page_interleave does, keeps its own `free_segment` and the slot path)
        paged = _paged_free_segment()
        self.frees_page_ids = (
            paged is not None
            and getattr(type(allocator), "free_segment", None) is paged
            and not getattr(allocator, "debug_mode", True)
        )
        # Where a free puts its pages in the free list: the paged allocator at the front, the token allocator (page
        # size 1) at the end; another (page_interleave, SWA, ...) is not known here (frees_newest_first: None)
        self._free_list = (
            _SGLANG_FREE_LISTS.get(type(allocator).__name__)
            if type(allocator).__module__.startswith("sglang.")
            else None
        )

    def free(self, slots: torch.Tensor | np.ndarray, fence: Optional[SlotFence] = None) -> None:
        """kvfsm frees a request's own pages, [cache_protected_len, allocated), whole and in slot order
        (`OffloadEffects.request_slots`): SGLang's `free_segment` contract (a page-aligned segment whose
        every `page_size`-th slot names a page), the call upstream's `free_kv_row` ends in. Unlike `free`
        it needs no `torch.unique`, so on a GPU server it never waits for the GPU. With a `fence` (copies
        still read the slots), the current stream waits on it first."""
        if fence is not None and not fence.passed():
            fence.wait()
        if len(slots):
            if isinstance(slots, np.ndarray):  # SGLang's table on the CPU, read as kvfsm's host mirror
                slots = torch.from_numpy(slots)
            slots = slots.to(device=self.allocator.device, dtype=torch.int64)
            self.allocator.free_segment(slots, start_pos=0)  # start_pos is only checked to be page-aligned

    def free_page_ids(self, pages: torch.Tensor, fence: Optional[SlotFence] = None) -> None:
        """Free whole pages by id (int64, on the pool's device, each once): what `free` of their slots does
        when `frees_page_ids` holds, without the slots. kvfsm computes the ids from each page's first slot
        (`DeviceTableSlots.page_ids`), as SGLang's `free_segment` would from the slots."""
        if fence is not None and not fence.passed():
            fence.wait()
        if len(pages):
            self.allocator.free_page_ids(pages)

    def frees_newest_first(self) -> Optional[bool]:
        """Whether pages freed now are handed out before those freed earlier: SGLang's paged allocator puts each
        free's pages at the front of its free list, unless a free group holds them (they go back at the group's
        end, in the order freed) or it stages them for sorting (`need_sort`: then the order is the sort's); its
        token allocator appends them. kvfsm frees a batch of releases' pages in one call laid out so (effects'
        `release_request_each`), which leaves the free list as one free a request does. None for an allocator
        whose order is not known here: kvfsm then frees one request at a time."""
        allocator = self.allocator
        if self._free_list is None:
            return None
        return self._free_list == "front" and allocator.free_group is None and not allocator.need_sort

    def owns_page_list(self, pages: Sequence[int]) -> bool:
        return False


# SGLang's allocators whose free order kvfsm knows (by class, in sglang.srt.mem_cache.allocator): where a free
# outside a free group puts the freed pages in the free list
_SGLANG_FREE_LISTS = {"PagedTokenToKVPoolAllocator": "front", "TokenToKVPoolAllocator": "end"}


def _paged_free_segment() -> Any:
    """SGLang's `PagedTokenToKVPoolAllocator.free_segment`, or None where SGLang has no such allocator."""
    try:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    except ImportError:
        return None
    return PagedTokenToKVPoolAllocator.free_segment
