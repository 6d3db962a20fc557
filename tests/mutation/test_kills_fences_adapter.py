"""Tests written to kill survivors of the `fences-adapter` mutation scope (docs/mutation.md): the fences, the
ledger's fence and wait checks, the coalescing copy engine and the parts of the SGLang adapter that run
without SGLang (the adapter's tests over SGLang's own objects are in tests/upstream/test_kills_adapter.py)."""

from __future__ import annotations

import pytest
import torch

from tests.dataplane.helpers import bits, make_device_pool, make_host_pool
from tests.dataplane.test_fences import FakeCopy

from kvfsm.dataplane import CpuCopyEngine, DeferredCpuCopyEngine, KVCacheConfig, SlotFence
from kvfsm.dataplane.copy.coalescing import CoalescingCopyEngine
from kvfsm.runtime import CheckedModeError
from kvfsm.runtime.ledger import SlotLedger

# --- SlotFence --------------------------------------------------------------------------------------------


def test_a_new_fence_is_not_waited_and_mark_waited_counts_each_wait_without_touching_the_copies() -> None:
    copy = FakeCopy()
    fence = SlotFence([copy])
    assert fence.waited is False and fence.waits == 0
    fence.mark_waited()
    assert fence.waited is True and fence.waits == 1
    fence.mark_waited()
    assert fence.waits == 2 and copy.waited_on == []  # recorded only: the caller made the waits itself


def test_a_passed_fence_holds_no_copies_and_covers_a_landed_one() -> None:
    copy, other = FakeCopy(), FakeCopy()
    fence = SlotFence([copy])
    assert len(fence) == 1
    copy.landed = other.landed = True
    assert fence.passed() and len(fence) == 0
    assert fence.covers(other) and not fence.covers(None)


# --- the ledger's fences and waits ----------------------------------------------------------------------


def _ledger_with_copy(handle: object = None) -> SlotLedger:
    """Page 0 (slots 0, 1) owned by request a, read by chunk 1's copy."""
    ledger = SlotLedger(page_size=2)
    ledger.copy_started("a", 1, [0, 1], [0, 1], handle)
    return ledger


def test_a_fence_waited_before_the_engine_released_the_page_is_never_carried_as_a_wait() -> None:
    """The engine waited on the fence on its own stream, then freed the page itself (released_by_engine_fenced):
    every later write is ordered after the copy, so neither the next owner's write nor, after each later owner
    releases the page while the copy still reads it, the writes after need a new wait."""
    copy = FakeCopy()
    ledger = _ledger_with_copy(copy)
    fence = SlotFence([copy])
    fence.mark_waited()
    ledger.release_device("a", "released_by_engine_fenced", [0, 1], fence)
    ledger.device_write("b", [0, 1])
    ledger.claim_device("b", "admit", [0, 1])
    ledger.release_device("b", "finish", [0, 1])  # plainly: covered by the carried fence
    ledger.device_write("c", [0, 1])  # no new wait needed
    ledger.claim_device("c", "admit", [0, 1])
    ledger.release_device("c", "finish", [0, 1])  # carried once more
    ledger.device_write("d", [0, 1])  # still none
    assert fence.waits == 1


def test_a_fence_not_waited_before_its_release_needs_a_wait_for_each_release() -> None:
    copy = FakeCopy()
    ledger = _ledger_with_copy(copy)
    fence = SlotFence([copy])
    ledger.release_device("a", "finish", [0, 1], fence)
    with pytest.raises(CheckedModeError):
        ledger.device_write("b", [0, 1])
    fence.mark_waited()
    ledger.device_write("b", [0, 1])
    ledger.claim_device("b", "admit", [0, 1])
    ledger.release_device("b", "finish", [0, 1])
    with pytest.raises(CheckedModeError):
        ledger.device_write("c", [0, 1])  # the first wait ordered b's stream only


def test_a_copy_tracked_without_a_handle_completes() -> None:
    ledger = _ledger_with_copy()
    ledger.copy_completed(1, [0, 1])
    assert not ledger.device_readers and not ledger.copy_handle
    ledger.release_device("a", "finish", [0, 1])


def test_a_second_release_of_the_same_page_by_its_owner_is_a_double_release() -> None:
    ledger = SlotLedger(page_size=2)
    ledger.claim_device("a", "admit", [0, 1, 2, 3])
    ledger.release_device("a", "finish", [2, 3])
    with pytest.raises(CheckedModeError, match="double release") as err:
        ledger.release_device("a", "abort", [2, 3])
    assert (err.value.request, err.value.event, err.value.slot) == ("a", "abort", 2)
    assert ledger.device_owner == {0: "a"}


def test_release_owned_names_its_event_in_the_error() -> None:
    ledger = _ledger_with_copy(FakeCopy())
    with pytest.raises(CheckedModeError, match="B2") as err:
        ledger.release_owned("a", "released_by_engine")
    assert (err.value.request, err.value.event, err.value.slot) == ("a", "released_by_engine", 0)
    assert ledger.device_owner == {0: "a"}  # refused: nothing released


# --- the coalescing copy engine -------------------------------------------------------------------------


def test_a_coalesced_handles_stream_wait_is_made_on_the_stream_given() -> None:
    cfg = KVCacheConfig.tiny()
    dev, host = make_device_pool(cfg, 64), make_host_pool(cfg, 32, 4)
    inner = DeferredCpuCopyEngine(stream_ordered=True)
    handle = CoalescingCopyEngine(inner).submit_d2h(dev, torch.arange(8, 12), host, host.alloc(4))
    stream = object()
    handle.wait_stream(stream)
    assert [(s, h.num_tokens) for s, h in inner.waits] == [(stream, 4)]
    assert not handle.done()  # ordered, not landed


def test_offloads_from_one_device_pool_to_two_host_pools_land_each_in_its_own() -> None:
    cfg = KVCacheConfig.tiny()
    dev = make_device_pool(cfg, 64, seed=9)
    hosts = [make_host_pool(cfg, 32, 4), make_host_pool(cfg, 32, 4)]
    eng = CoalescingCopyEngine(CpuCopyEngine())
    parts = [(torch.arange(8 + 8 * k, 12 + 8 * k), host, host.alloc(4)) for k, host in enumerate(hosts)]
    handles = [eng.submit_d2h(dev, d, host, h) for d, host, h in parts]
    eng.flush()
    assert all(h.done() for h in handles)
    for d, host, h in parts:
        assert torch.equal(bits(host.token_view()[:, :, h]), bits(dev.storage[:, :, d]))


def test_close_submits_the_queue_then_closes_the_inner_engine() -> None:
    cfg = KVCacheConfig.tiny()
    dev, host = make_device_pool(cfg, 64, seed=10), make_host_pool(cfg, 32, 4)

    class Closing(CpuCopyEngine):
        closed = 0

        def close(self) -> None:
            self.closed += 1

    inner = Closing()
    eng = CoalescingCopyEngine(inner)
    h = host.alloc(4)
    eng.submit_d2h(dev, torch.arange(8, 12), host, h)
    eng.close()
    assert inner.closed == 1 and eng.queued == 0
    assert torch.equal(bits(host.token_view()[:, :, h]), bits(dev.storage[:, :, 8:12]))
    CoalescingCopyEngine(DeferredCpuCopyEngine()).close()  # an inner engine without close() is fine


# --- the SGLang adapter's views of SGLang's objects, over stand-ins (no SGLang needed) ----------------------


class FakeKv:
    def __init__(self, row: int | None) -> None:
        self.req_pool_idx, self.kv_committed_len, self.kv_allocated_len, self.cache_protected_len = row, 0, 0, 0
        self.released = 0

    def mark_kv_released(self) -> None:
        self.released += 1


class FakeReq:
    """What the adapter reads of SGLang 0.5.23's Req."""

    def __init__(self, rid: str, row: int | None = None, done: bool = False) -> None:
        self.rid, self.kv, self._done = rid, FakeKv(row), done

    def finished(self) -> bool:
        return self._done


class FakeTablePool:
    """What TableView calls of SGLang's ReqToTokenPool."""

    def __init__(self, rows: int = 4, free: tuple[int, ...] = (3,), table: object = None) -> None:
        self.req_to_token = torch.zeros(rows, 8, dtype=torch.int32) if table is None else table
        self.free_slots = list(free)
        self.freed: list[str] = []

    def free(self, req: FakeReq) -> None:
        self.freed.append(req.rid)
        req.kv.req_pool_idx = None


def test_a_collected_req_takes_its_view_along_and_raises_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc
    import sys

    from kvfsm.integrations.sglang import RequestViews

    unraisable: list[object] = []  # an exception in a weakref callback is only reported here
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    views = RequestViews()
    a, b, c = FakeReq("a", 1), FakeReq("b", 2), FakeReq("c", 3)
    views.view(a), views.view(b), views.view(c)
    del a
    gc.collect()
    assert list(views._views) == [id(b), id(c)]  # a's view went with it
    del c
    gc.collect()
    assert list(views._views) == [id(b)] and unraisable == []


def test_quiet_holds_pinned_reqs_only() -> None:
    """A quiet entry keeps its Req alive no longer than its pin does: unpinning the row, or pinning another Req
    on it, drops the entry (the early exit then takes the full path)."""
    from kvfsm.integrations.sglang import RequestViews

    views = RequestViews()
    a, b, c = FakeReq("a", 1), FakeReq("b", 2), FakeReq("c", 3)
    for req in (a, b):
        views.pin(req)
        views.quiet[req] = views.view(req)
    views.pin(a)  # pinned again on its own row: its entry stays
    assert list(views.quiet) == [a, b]
    c.kv.req_pool_idx = 1
    views.pin(c)  # c takes a's row
    assert list(views.quiet) == [b] and views.holder(1) is c
    assert views.unpin(2) is b and not views.quiet
    assert views.unpin(2) is None


def test_pin_keeps_only_reqs_on_a_real_row() -> None:
    from kvfsm.integrations.sglang import RequestViews

    views = RequestViews()
    for row in (None, -1):
        views.pin(FakeReq("none", row))
    assert views.pinned() == []
    one, two = FakeReq("one", 1), FakeReq("two", 2)
    views.pin(one)
    views.pin(two)
    assert views.holder(1) is one and views.holder(2) is two and views.holder(-1) is None
    assert views.unpin(1) is one and views.unpin(1) is None and views.unpin(7) is None
    assert views.pinned() == [two]


def test_a_request_view_reads_finished_from_its_req() -> None:
    from kvfsm.integrations.sglang import RequestViews

    views = RequestViews()
    done, running = FakeReq("done", 1, done=True), FakeReq("running", 2)
    assert views.view(done).finished() is True and views.view(running).finished() is False


def test_the_table_view_refuses_anything_but_a_2d_tensor() -> None:
    from kvfsm.errors import InvalidRequest
    from kvfsm.integrations.sglang import RequestViews, TableView

    for table in ([[0, 1], [2, 3]], torch.zeros(8, dtype=torch.int32), torch.zeros(2, 2, 2, dtype=torch.int32)):
        with pytest.raises(InvalidRequest, match="2-D tensor"):
            TableView(FakeTablePool(table=table), RequestViews())
    view = TableView(FakeTablePool(rows=5), RequestViews())
    assert (view.rows, view.max_context) == (5, 8) and view.host_table is view.req_to_token
    # a table off the CPU (a CUDA server's) has no host mirror: kvfsm reads its slots on its device
    off_cpu = TableView(FakeTablePool(table=torch.zeros(5, 8, dtype=torch.int32, device="meta")), RequestViews())
    assert off_cpu.host_table is None and off_cpu.req_to_token.device.type == "meta"


def test_a_table_row_is_allocated_when_it_is_a_request_row_not_free() -> None:
    from kvfsm.integrations.sglang import RequestViews, TableView

    view = TableView(FakeTablePool(rows=4, free=(2,)), RequestViews())
    assert [view.is_allocated(r) for r in (-1, 0, 1, 2, 3, 4, 5)] == [False, False, True, False, True, False, False]
    assert not view.is_allocated(1.0)  # type: ignore[arg-type]


def test_the_table_view_frees_only_a_row_its_pinned_req_still_holds() -> None:
    from kvfsm.errors import InvalidRequest
    from kvfsm.integrations.sglang import RequestViews, TableView

    views = RequestViews()
    pool = FakeTablePool(rows=4, free=())
    table = TableView(pool, views)
    with pytest.raises(InvalidRequest, match="row 1"):
        table.free(1)  # nothing pinned there
    moved = FakeReq("moved", 2)
    views.pin(moved)
    moved.kv.req_pool_idx = 3  # the engine gave it another row
    with pytest.raises(InvalidRequest, match="row 2"):
        table.free(2)
    held = FakeReq("held", 1)
    views.pin(held)
    table.free(1)
    assert pool.freed == ["held"] and held.kv.req_pool_idx is None and held.kv.released == 1
    assert views.holder(1) is None


class _SegmentLog:
    page_size = 4
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list[tuple[torch.dtype, list[int]]] = []

    def free_segment(self, slots: torch.Tensor, start_pos: int = 0) -> None:
        self.calls.append((slots.dtype, slots.tolist()))


def test_the_allocator_view_frees_int64_slots_and_never_takes_a_page_list_on_trust() -> None:
    from kvfsm.integrations.sglang import AllocatorView

    alloc = _SegmentLog()
    view = AllocatorView(alloc, 64)
    view.free(torch.arange(8, 12, dtype=torch.int32))
    view.free(torch.zeros(0, dtype=torch.int32))  # nothing to free: no call
    assert alloc.calls == [(torch.int64, [8, 9, 10, 11])]
    # SGLang's allocator keeps no per-page mask kvfsm could ask: a copy's pages are range-checked slot by slot
    assert view.owns_page_list([2]) is False and view.fences is True


# --- the adapter's settings -------------------------------------------------------------------------------


def test_a_bad_stride_is_a_config_error_from_the_adapter() -> None:
    from kvfsm.errors import ConfigError
    from kvfsm.integrations.sglang.settings import STRIDE_ENV, offload_stride

    with pytest.raises(ConfigError) as err:
        offload_stride(4, "four")
    assert (err.value.field, err.value.source) == (STRIDE_ENV, "kvfsm.integrations.sglang")


def test_host_slots_sizes_the_host_pool_as_upstream() -> None:
    from types import SimpleNamespace

    from kvfsm.errors import ConfigError
    from kvfsm.integrations.sglang.settings import host_slots

    # hicache_size in GB: whole tokens of bytes_per_token, then whole pages plus one page
    assert host_slots(SimpleNamespace(hicache_size=1), 100, 1000, 4) == (1_000_000 // 4 + 1) * 4
    assert host_slots(SimpleNamespace(hicache_size=1, hicache_ratio=9), 100, 3, 4) == (333_333_333 // 4 + 1) * 4
    assert host_slots(SimpleNamespace(hicache_size=1), 100, 1, 1) == 1_000_000_001  # 10**9 tokens, one more page
    # no hicache_size (or 0): the ratio of the device pool's tokens
    for memory in (SimpleNamespace(hicache_ratio=2.5), SimpleNamespace(hicache_size=0, hicache_ratio=2.5)):
        got = host_slots(memory, 10, 1000, 4)
        assert got == 28 and type(got) is int  # 25 tokens: 6 pages, plus one
    for memory in (
        SimpleNamespace(),
        SimpleNamespace(hicache_ratio=None),
        SimpleNamespace(hicache_ratio=0),
        SimpleNamespace(hicache_size=0, hicache_ratio=-1),
    ):
        with pytest.raises(ConfigError) as err:
            host_slots(memory, 10, 1000, 4)
        assert err.value.field == "hicache_ratio"


# --- reading SGLang's published server config, over a stand-in of sglang.srt.runtime_context ----------------


def _published(
    monkeypatch: pytest.MonkeyPatch,
    *,
    dp_attention: object = False,
    parallel: object = None,
    served_model_name: str | None = "m",
    **memory: object,
) -> None:
    """Install stand-ins for the SGLang modules read_settings and _tp_rank_size import (in place of SGLang's
    own where it is installed): page size 4, plain TP of one rank, a file store, `memory`'s fields."""
    import sys
    import types

    fields = dict(hicache_storage_backend="file", hicache_ratio=2)
    fields.update(memory)
    fields = {k: v for k, v in fields.items() if v is not _MISSING}
    parallel = types.SimpleNamespace(tp_rank=0, tp_size=1) if parallel is None else parallel

    def is_dp_attention_enabled() -> bool:
        if isinstance(dp_attention, Exception):
            raise dp_attention
        return bool(dp_attention)

    ctx = types.ModuleType("sglang.srt.runtime_context")
    ctx.get_schedule = lambda: types.SimpleNamespace(page_size=4)  # type: ignore[attr-defined]
    ctx.get_memory = lambda: types.SimpleNamespace(**fields)  # type: ignore[attr-defined]
    ctx.get_serving = lambda: types.SimpleNamespace(served_model_name=served_model_name)  # type: ignore[attr-defined]
    ctx.get_parallel = lambda: parallel  # type: ignore[attr-defined]
    dp = types.ModuleType("sglang.srt.layers.dp_attention")
    dp.is_dp_attention_enabled = is_dp_attention_enabled  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.layers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", ctx)
    monkeypatch.setitem(sys.modules, "sglang.srt.layers.dp_attention", dp)
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", raising=False)


_MISSING = object()


def test_read_settings_takes_sglangs_defaults_for_what_the_server_left_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfsm.integrations.sglang import read_settings

    _published(monkeypatch, served_model_name=None)
    s = read_settings(10, 1000, None)
    assert (s.page_size, s.stride, s.host_slots) == (4, 4, 24)
    assert (s.host_layout, s.file_layout, s.storage_backend, s.storage_extra) == (
        "layer_first",
        "layer_first",
        "file",
        {},
    )
    assert (s.file_dir, s.model_name, s.tp_rank, s.tp_size) == ("/tmp/hicache", "", 0, 1)


def test_read_settings_takes_what_the_server_published(monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import types

    from kvfsm.integrations.sglang import read_settings

    _published(
        monkeypatch,
        hicache_mem_layout="page_first_direct",
        hicache_storage_backend_extra_config=json.dumps({"file_storage_path": "/x"}),
    )
    s = read_settings(10, 1000, None)
    assert (s.host_layout, s.file_layout, s.storage_extra, s.file_dir, s.model_name) == (
        "layer_first",
        "layer_first",
        {"file_storage_path": "/x"},
        "/x",
        "m",
    )
    _published(monkeypatch, hicache_mem_layout="page_first", parallel=types.SimpleNamespace(tp_rank=None, tp_size=None))
    s = read_settings(10, 1000, None)
    assert (s.host_layout, s.file_layout, s.tp_rank, s.tp_size) == ("page_first", "page_first", 0, 1)


def test_read_settings_refuses_what_kvfsm_cannot_do_as_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfsm.errors import ConfigError
    from kvfsm.integrations.sglang import read_settings

    for memory, field in (
        (dict(hicache_storage_backend=_MISSING), "hicache_storage_backend"),
        (dict(hicache_storage_backend="mooncake"), "hicache_storage_backend"),
        (dict(hicache_mem_layout="head_first"), "hicache_mem_layout"),
        (dict(hicache_storage_backend_extra_config="[1]"), "hicache_storage_backend_extra_config"),
        (dict(hicache_storage_backend_extra_config="{"), "hicache_storage_backend_extra_config"),
    ):
        _published(monkeypatch, **memory)
        with pytest.raises(ConfigError) as err:
            read_settings(10, 1000, None)
        assert (err.value.field, err.value.source) == (field, "kvfsm.integrations.sglang")


def test_the_tp_rank_and_size_are_the_attention_tp_ones_under_dp_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from kvfsm.integrations.sglang.settings import _tp_rank_size

    parallel = types.SimpleNamespace(tp_rank=3, tp_size=4, attn_tp_rank=1, attn_tp_size=2)
    for dp_attention, want in ((True, (1, 2)), (False, (3, 4)), (RuntimeError("not initialised"), (3, 4))):
        _published(monkeypatch, parallel=parallel, dp_attention=dp_attention)
        assert _tp_rank_size() == want


def test_pipeline_and_context_parallelism_are_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from kvfsm.errors import ConfigError
    from kvfsm.integrations.sglang.settings import _tp_rank_size

    class Raises:
        tp_rank, tp_size = 0, 1

        @property
        def attn_cp_size(self) -> int:
            raise ValueError("not initialised")

        @property
        def attn_dcp_size(self) -> int:
            raise RuntimeError("not initialised")

    for ok in (
        types.SimpleNamespace(tp_rank=0, tp_size=1),  # absent: as 1
        types.SimpleNamespace(tp_rank=0, tp_size=1, pp_size=None, attn_cp_size=1, attn_dcp_size=None),
        Raises(),
    ):
        _published(monkeypatch, parallel=ok)
        assert _tp_rank_size() == (0, 1)
    for name in ("pp_size", "attn_cp_size", "attn_dcp_size"):
        _published(monkeypatch, parallel=types.SimpleNamespace(tp_rank=0, tp_size=1, **{name: 2}))
        with pytest.raises(ConfigError) as err:
            _tp_rank_size()
        assert err.value.field == name


def test_the_published_tp_size_must_be_tp_groups_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from kvfsm.errors import ConfigError
    from kvfsm.integrations.sglang import read_settings

    group = object()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2 if group is not None else 1)
    _published(monkeypatch, parallel=types.SimpleNamespace(tp_rank=1, tp_size=2))
    s = read_settings(10, 1000, group)
    assert (s.tp_rank, s.tp_size) == (1, 2)
    _published(monkeypatch, parallel=types.SimpleNamespace(tp_rank=0, tp_size=1))
    with pytest.raises(ConfigError) as err:
        read_settings(10, 1000, group)
    assert err.value.field == "tp_size"
    assert read_settings(10, 1000, None).tp_size == 1  # no group: one rank, whatever torch.distributed says
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    assert read_settings(10, 1000, group).tp_size == 1  # not initialised: the group is not asked


def test_the_stride_given_is_read_rather_than_the_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfsm.integrations.sglang.settings import STRIDE_ENV, offload_stride

    monkeypatch.setenv(STRIDE_ENV, "64")
    assert offload_stride(4, "8") == 8 and offload_stride(4, "10") == 8 and offload_stride(4, "") == 4
    assert offload_stride(4) == 64
