"""Tests written to kill survivors of `make mutate` in the runtime modules (docs/mutation.md)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvfsm.dataplane import page_hashes
from kvfsm.dataplane.hashing import storage_namespace_seed
from kvfsm.errors import InvalidRequest, RetractionRefused
from kvfsm.runtime import DecodeOffloadManager, SimplePrefixCache
from kvfsm.runtime.device_table import DeviceTableSlots
from kvfsm.runtime.ledger import PREFIX_CACHE, CheckedModeError, SlotLedger
from kvfsm.runtime.protocols import request_namespace_seed
from kvfsm.runtime.tp import ProgressConsensus
from kvfsm.verify.engine import SimEngine, SimRequest


def _decode(e: SimEngine, req: SimRequest, steps: int) -> None:
    for _ in range(steps):
        assert e.decode(req)


# --- the slot ledger (checked mode) ---------------------------------------------------------------------


def test_a_matched_prefix_on_a_live_requests_page_is_premature_reuse() -> None:
    """Checked mode must catch a prefix match onto pages a live request still owns (B1)."""
    ledger = SlotLedger(page_size=2)
    ledger.claim_device("a", "offload", [4, 5])
    with pytest.raises(CheckedModeError, match="B1"):
        ledger.prefix_locked("b", [4, 5])


def test_a_shared_prefix_is_the_caches_and_no_request_may_free_or_claim_it() -> None:
    """Two requests may lock one prefix; its pages are then the cache's: freeing (B16) or claiming (B1) them fails."""
    ledger = SlotLedger(page_size=2)
    ledger.prefix_locked("a", [0, 1])
    ledger.prefix_locked("b", [0, 1])  # a second holder of the same prefix is no reuse
    assert ledger.device_owner == {0: PREFIX_CACHE} and ledger.prefix_holders[0] == {"a", "b"}
    with pytest.raises(CheckedModeError, match="B16"):
        ledger.release_device("b", "release", [0, 1])
    with pytest.raises(CheckedModeError, match="B1"):
        ledger.claim_device("c", "offload", [0, 1])


def test_a_claimed_or_prefix_locked_page_is_no_longer_marked_released() -> None:
    """A page's 'released by' mark lasts only until it is claimed again, or a later release is a false B9."""
    ledger = SlotLedger(page_size=2)
    ledger.claim_device("a", "offload", [2, 3])
    ledger.release_device("a", "release", [2, 3])
    assert ledger.device_released == {1: "a"}
    ledger.claim_device("b", "offload", [2, 3])
    assert ledger.device_released == {}
    ledger.release_device("b", "release", [2, 3])
    ledger.prefix_locked("c", [2, 3])
    assert ledger.device_released == {}


def test_release_owned_frees_exactly_the_owners_pages_and_names_the_event() -> None:
    """The engine's own release leaves the ledger holding none of the owner's pages and nobody else's freed."""
    ledger = SlotLedger(page_size=2)
    ledger.claim_device("a", "offload", [6, 7])
    ledger.claim_device("b", "offload", [8, 9])
    ledger.release_owned("a", "released_by_engine")
    assert ledger.device_owner == {4: "b"} and ledger.device_released == {3: "a"}
    ledger.copy_started("c", 1, [10, 11], [0, 1])
    with pytest.raises(CheckedModeError, match="B2") as err:
        ledger.release_owned("c", "released_by_engine")
    assert err.value.event == "released_by_engine" and ledger.device_owner[5] == "c"


# --- slots read on the device (no host mirror) -----------------------------------------------------------


def test_device_table_reads_are_int64_copies_of_the_right_slots() -> None:
    """Device-table reads must be int64 copies (the row may be rewritten) of exactly the spans asked for."""
    table = torch.arange(2 * 16, dtype=torch.int64).reshape(2, 16) * 3
    slots = DeviceTableSlots(table, page_size=4)
    got = slots.span(1, 0, 4)
    table[1, 0:4] = -1
    assert got.tolist() == [48, 51, 54, 57]
    assert slots.spans([2, 16 + 8], [2, 3]).tolist() == [6, 9, 72, 75, 78]  # two spans, concatenated
    narrow = DeviceTableSlots(torch.arange(32, dtype=torch.int32).reshape(2, 16), page_size=4)
    two = narrow.spans([1, 16 + 4], [2, 2])
    assert two.tolist() == [1, 2, 20, 21] and two.dtype == torch.int64


def test_whole_pages_round_each_first_slot_down_to_its_page() -> None:
    """Release through the device table frees whole pages: a first slot inside a page names that page."""
    paged = torch.zeros(1, 8, dtype=torch.int32)
    paged[0, :8] = torch.tensor([41, 42, 43, 44, 13, 14, 15, 16])
    assert DeviceTableSlots(paged, 4).whole_pages(0, 0, 8).tolist() == [40, 41, 42, 43, 12, 13, 14, 15]


class _Mirrorless:
    """A request table with no host mirror (as an engine with a GPU-only table presents it)."""

    host_table = None

    def __init__(self, pool: Any) -> None:
        self.pool, self.rows, self.req_to_token = pool, pool.rows, pool.req_to_token

    def is_allocated(self, row: int) -> bool:
        return self.pool.is_allocated(row)

    def free(self, row: int) -> None:
        self.pool.free(row)


def test_checked_mode_registers_every_prefix_page_through_the_device_table() -> None:
    """Without a mirror, checked mode must still give the prefix cache every page of a matched prefix (B16)."""
    e = SimEngine(page_size=1, stride=2, checked=True)
    e.manager.close()
    e.manager = DecodeOffloadManager(
        e.config,
        device_pool=e.device_pool,
        allocator=e.allocator,
        req_to_token=_Mirrorless(e.req_to_token),
        prefix_cache=e.protected,
        host_pool=e.host_pool,
        copy_engine=e.copies,
        storage=e.storage,
        backup_worker=e.worker,
    )
    req = e.admit("a", 6, prefix_len=3)
    e.manager.offload(req)
    prefix = e.req_to_token.read_host(req.req_pool_idx, 0, 3).tolist()
    assert [e.manager.ledger.device_owner.get(s) for s in prefix] == [PREFIX_CACHE] * 3
    e.end(req)
    e.settle()
    e.check_teardown()


def test_a_table_nobody_can_read_is_used_through_its_host_mirror() -> None:
    """A table with a host mirror is read there only (a GPU table is never read by the manager)."""
    e = SimEngine(page_size=2, stride=2, table_device="meta", checked=True)
    req = e.admit("a", 6, prefix_len=2)
    _decode(e, req, 3)
    assert e.manager.offload(req)
    e.settle()
    e.end(req)
    e.settle()
    e.check_teardown()
    assert e.manager.metrics.stored_pages > 0


# --- namespaces ----------------------------------------------------------------------------------------


def test_a_namespaced_requests_pages_are_stored_under_its_namespaced_chain() -> None:
    """Tenants' pages must never share keys: every stored page of a namespaced request chains on its seed."""
    e = SimEngine(page_size=2, stride=2, checked=True)
    reqs = []
    for rid, prompt_len in (("short", 1), ("long", 6)):  # no prompt page (the first chunk starts the chain), and some
        req = SimRequest(rid, [1000 + i for i in range(prompt_len)])
        req.extra_key, req.cache_salt = "tenant", None
        reqs.append(e.admit(rid, prompt_len, req=req))
    for req in reqs:
        _decode(e, req, 4)
        assert e.manager.offload(req)
    e.settle()
    want: set[str] = set()
    for req in reqs:
        tokens = list(req.origin_input_ids) + list(req.output_ids)
        n = req.kv_committed_len // 2 * 2
        want |= set(page_hashes(tokens[:n], 2, extra_key="tenant"))
    assert e.store.pages and set(e.store.pages) <= want
    for req in reqs:
        e.end(req)
    e.settle()
    e.check_teardown()


def test_request_namespace_seed_reads_the_requests_fields() -> None:
    """A request's seed is storage_namespace_seed of its own extra_key and cache_salt."""

    class Req:
        extra_key, cache_salt = "k", "salt"

    assert request_namespace_seed(Req()) == storage_namespace_seed("k", "salt") is not None


# --- release ---------------------------------------------------------------------------------------------


def test_release_clears_the_requests_lock_only_when_it_is_the_released_one() -> None:
    """Release drops req.lock it unlocked (as SGLang does) but never a newer lifecycle's lock on the same object."""
    e = SimEngine(page_size=2, stride=2, checked=True)
    req = e.admit("a", 6, prefix_len=2)
    assert req.lock is not None
    e.end(req)
    assert req.lock is None
    req = e.admit("b", 6, prefix_len=2)
    _decode(e, req, 2)
    assert e.manager.offload(req)
    e.end(req, "retract")  # a copy in flight: release deferred
    e.admit("b", 6, prefix_len=2, req=req)  # re-admitted before the old lifecycle released
    new_lock = req.lock
    assert new_lock is not None
    e.settle()  # the old lifecycle's release unlocks its own lock only
    assert req.lock is new_lock and not new_lock.released
    e.end(req)
    e.settle()
    assert req.lock is None
    e.check_teardown()


def test_the_optional_lock_field_may_be_absent() -> None:
    """`lock` is optional: a request without one is admitted, and one that dropped it by release is released."""
    e = SimEngine(page_size=2, stride=2, checked=True)
    plain = e.admit("plain", 6)
    del plain.lock
    _decode(e, plain, 2)
    assert e.manager.offload(plain)
    locked = e.admit("locked", 6, prefix_len=2)
    e.manager.offload(locked)  # admitted (nothing to offload yet)
    assert e.manager.machine_of(locked) is not None
    del locked.lock  # the manager still holds the lock it read at admission
    for req in (plain, locked):
        e.end(req)
    e.settle()
    e.check_teardown()


def test_the_engines_own_release_leaves_nothing_in_the_ledger_and_is_counted() -> None:
    """After released_by_engine the ledger holds none of the request's pages or prefix, so reuse is not B1."""
    e = SimEngine(page_size=2, stride=2, checked=True)
    for i in range(2):
        req = e.admit(f"r{i}", 6, prefix_len=2)
        _decode(e, req, 2)
        assert e.manager.offload(req)
        e.settle()
        e.release_itself(req)
        assert e.manager.ledger.device_owner == {} and not e.manager.ledger.prefix_holders
        assert e.manager.metrics.engine_releases == i + 1
    again = e.admit("again", 20, prefix_len=4)  # the same slots again
    _decode(e, again, 2)
    assert e.manager.offload(again)
    e.end(again)
    e.settle()
    e.check_teardown()


# --- admission and ending ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [1, -2, 1.5])
def test_a_prefix_that_is_not_whole_pages_of_the_prompt_is_refused(prefix: Any) -> None:
    """The spec's create: a matched prefix is whole pages of the prompt, else InvalidRequest and nothing changes."""
    e = SimEngine(page_size=2, stride=2, checked=True)
    req = e.admit("a", 6)
    req.prefix_len = prefix
    with pytest.raises(InvalidRequest, match="prefix_len"):
        e.manager.offload(req)
    assert e.manager.machine_of(req) is None
    req.prefix_len = 0
    e.manager.offload(req)  # admitted now
    assert e.manager.machine_of(req) is not None


def test_ending_a_request_that_never_had_a_row_does_nothing() -> None:
    """finalize of a request with row -1 (never admitted) holds nothing and must not try to admit it."""
    e = SimEngine(page_size=2, stride=2, checked=True)
    req = SimRequest("never", [1, 2, 3])
    req.req_pool_idx = -1
    e.manager.finalize(req)
    assert e.manager.machine_of(req) is None


def test_fail_closed_refuses_retraction_exactly_while_a_copy_is_in_flight() -> None:
    """Under retraction: fail_closed, retract and drain_before_retraction refuse while (and only while) a copy runs."""
    e = SimEngine(page_size=2, stride=2, checked=True, retraction="fail_closed")
    idle = SimRequest("never", [1, 2, 3])
    e.manager.retract(idle)  # never admitted: nothing to refuse
    e.manager.drain_before_retraction()
    assert not e.manager.has_inflight_device_transfer()
    req = e.admit("a", 6)
    _decode(e, req, 2)
    assert e.manager.offload(req)  # one copy in flight
    assert e.manager.has_inflight_device_transfer()
    with pytest.raises(RetractionRefused):
        e.manager.drain_before_retraction()
    with pytest.raises(RetractionRefused):
        e.end(req, "retract")
    e.live.append(req)
    e.settle()
    assert not e.manager.has_inflight_device_transfer()
    e.manager.drain_before_retraction()
    e.end(req, "retract")  # nothing in flight: retracted
    e.settle()
    e.check_teardown()


def test_release_host_resources_works_with_a_store_that_registers_nothing() -> None:
    """A store without unregister_host_pool (most) must not stop the host pool's release at shutdown."""
    e = SimEngine(page_size=2, stride=2, checked=False)
    e.manager.release_host_resources()
    assert e.host_pool.released


def test_a_closed_manager_holds_no_tp_group_and_agrees_locally() -> None:
    """close() lets go of the TP group; the manager then agrees on its own rank's counts."""
    e = SimEngine(page_size=2, stride=2, checked=False)
    e.manager.close()
    assert e.manager.consensus.group is None and e.manager.consensus.agree(3, 4) == (3, 4)


# --- the prefix cache -------------------------------------------------------------------------------


class _Allocator:
    """Records what is freed; `page_size` only when given (a cache must not need one)."""

    def __init__(self, page_size: int | None = None) -> None:
        self.freed: list[list[int]] = []
        if page_size is not None:
            self.page_size = page_size

    def free(self, slots: torch.Tensor) -> None:
        self.freed.append(slots.tolist())


def test_a_prefix_page_is_evicted_once_at_its_last_unlock() -> None:
    """Shared prefix pages stay locked until the last holder unlocks; an unlock is refused twice (B4)."""
    alloc = _Allocator(page_size=2)
    cache = SimplePrefixCache(alloc)
    first, second = cache.lock([4, 5]), cache.lock([4, 5])
    cache.unlock(first)
    assert alloc.freed == [] and cache.locked_pages() == {2} and cache.size == 2
    cache.unlock(second)
    assert alloc.freed == [[4, 5]] and cache.locked_pages() == set() and cache.size == 0
    with pytest.raises(ValueError, match="B4"):
        cache.unlock(first)
    with pytest.raises(ValueError, match="B4"):
        cache.unlock(object())


def test_a_prefix_cache_over_an_allocator_without_page_size_uses_pages_of_one_slot() -> None:
    """An allocator that has no page_size is one of single-slot pages."""
    alloc = _Allocator()
    cache = SimplePrefixCache(alloc)
    lock = cache.lock([5, 6, 7])
    assert cache.locked_pages() == {5, 6, 7}
    cache.unlock(lock)
    assert alloc.freed == [[5, 6, 7]]


# --- TP consensus -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mine, theirs", [(False, False), (True, False), (False, True), (True, True)])
def test_any_is_true_when_some_rank_says_so(mine: bool, theirs: bool) -> None:
    """any() is a MAX over ranks (through agree's MIN of negated flags); identity on one rank."""
    one = ProgressConsensus(None)
    assert one.any(mine) is mine
    two = ProgressConsensus(None)
    two.world = 2
    two.agree = lambda *counts: tuple(min(c, -int(theirs)) for c in counts)  # type: ignore[method-assign]
    assert two.any(mine) is (mine or theirs)


def test_an_nccl_group_reduces_on_the_ranks_current_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL's collectives take only tensors on the rank's own GPU; gloo's take CPU tensors. The consensus
    picks its device from the group's backend (no GPU is touched to pick it)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for backend, device in (("nccl", torch.device("cuda", 1)), ("gloo", torch.device("cpu"))):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        c = ProgressConsensus(group=object())
        assert (c.world, c.device) == (2, device)


def test_the_counts_are_reduced_on_the_consensus_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """agree() builds its counts tensor on the consensus device, so an NCCL group gets it on the rank's GPU
    (on the CPU, NCCL refuses it). `meta` stands for that GPU here: a device that is not the CPU's default."""
    import torch.distributed as dist

    class Reduced(Exception):
        """What the stand-in collective raises once it has seen its tensor (a meta tensor holds no values)."""

    seen: list[tuple[Any, ...]] = []

    def all_reduce(t: torch.Tensor, op: Any = None, group: Any = None) -> None:
        seen.append((t.device, t.dtype, tuple(t.shape), op, group))
        raise Reduced

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    c = ProgressConsensus(group=object())
    c.device = torch.device("meta")
    with pytest.raises(Reduced):
        c.agree(3, 5)
    assert seen == [(torch.device("meta"), torch.int64, (2,), dist.ReduceOp.MIN, c.group)]


# --- fenced release: the engine's own release, the fence, the counters ------------------------------------


def _fenced_offloading(e: SimEngine, rid: str) -> SimRequest:
    req = e.admit(rid, 4)
    assert req is not None
    for _ in range(40):
        assert e.decode(req)
        if e.manager.offload(req):
            return req
    raise AssertionError("no chunk was offloaded")


def _fenced_engine(**kw: Any) -> SimEngine:
    opts: dict[str, Any] = dict(page_size=2, stride=4, device_slots=24, host_slots=16, rows=4, fenced=True)
    opts.update(kw)
    return SimEngine(**opts)


def test_an_engine_release_under_fenced_unlanded_copies_is_recorded_with_a_waited_fence() -> None:
    """The engine may free slots whose copies still run once its stream waits on them: the ledger keeps a waited fence."""
    import kvfsm.generated.decode_offload as spec_gen

    e = _fenced_engine(checked=True)
    a = _fenced_offloading(e, "a")
    fx = e.manager.fx
    handles = [c.handle for c in fx.copy_fifo]
    assert handles and not any(h.done() for h in handles)
    fx.fenced_handles = {id(h) for h in handles}  # as fence_copies_in_flight records, without the CPU twin's wait
    rec = e.manager._records[id(a)]
    e.manager.released_by_engine(a)
    assert spec_gen.STATES[rec.machine.state] == "fenced"
    assert e.manager.metrics.engine_releases == 1 and e.manager.metrics.releases == 0
    assert rec.lock is None and rec.req is None
    ledger = fx.ledger
    assert "a" not in ledger.device_owner.values()
    assert not any("a" in holders for holders in ledger.prefix_holders.values())
    fences = [f for entries in ledger.device_fence.values() for f, _ in entries]
    # waited before the engine freed them: no later writer needs another wait (the engine's stream is ordered)
    assert fences and all(f.waited and need == 0 for entries in ledger.device_fence.values() for f, need in entries)
    assert all(f.covers(h) for f in fences for h in handles)


def test_an_engine_release_after_its_copies_landed_needs_no_fence() -> None:
    """A copy that landed (not yet acknowledged) reads nothing: the engine's release is accepted without a wait."""
    import kvfsm.generated.decode_offload as spec_gen

    e = _fenced_engine(checked=True)
    a = _fenced_offloading(e, "a")
    e.copies.complete_all()
    assert e.manager.fx.fenced_handles == set()
    rec = e.manager._records[id(a)]
    e.manager.released_by_engine(a)
    assert spec_gen.STATES[rec.machine.state] == "fenced"
    assert e.manager.metrics.engine_releases == 1


def test_an_engine_release_with_every_copy_acknowledged_is_the_plain_one() -> None:
    """A request with no copy in flight (all acknowledged) is released_by_engine, never the fenced event."""
    import kvfsm.generated.decode_offload as spec_gen

    e = _fenced_engine(checked=True)
    a = _fenced_offloading(e, "a")
    e.copies.complete_all()
    e.manager.check_progress()
    m = e.manager.machine_of(a)
    assert m is not None and m.copies == 0
    e.release_itself(a)
    assert spec_gen.STATES[m.state] == "draining"


def test_fence_copies_in_flight_waits_on_each_distinct_handle_once() -> None:
    """Every copy in flight is waited on (once per handle), and the set of fenced handles is what the release checks."""
    e = _fenced_engine(checked=False)
    _fenced_offloading(e, "a")
    _fenced_offloading(e, "b")
    fx = e.manager.fx
    handles = {id(c.handle): c.handle for c in fx.copy_fifo}
    assert len(handles) >= 2 and not any(h.done() for h in handles.values())
    assert e.manager.fence_copies_in_flight() == len(handles)
    assert fx.fenced_handles == set(handles)
    assert all(h.done() for h in handles.values())


def test_each_release_under_a_copy_is_counted_fenced_or_deferred() -> None:
    """fenced_releases counts each fenced release; deferred_releases only releases deferred (no fences)."""
    e = _fenced_engine(checked=False)
    a, b = _fenced_offloading(e, "a"), _fenced_offloading(e, "b")
    e.end(a, "finish")
    e.end(b, "finish")
    assert e.manager.metrics.fenced_releases == 2 and e.manager.metrics.deferred_releases == 0
    e.settle()
    d = _fenced_engine(checked=False, fenced=False)
    a, b = _fenced_offloading(d, "a"), _fenced_offloading(d, "b")
    d.end(a, "finish")
    d.end(b, "finish")
    assert d.manager.metrics.deferred_releases == 2 and d.manager.metrics.fenced_releases == 0
    d.settle()


# --- survivors of the full run at 6ea51a2 -----------------------------------------------------------------


def test_a_machine_built_without_the_fences_param_releases_deferred() -> None:
    """`fences` defaults to 0: a machine an engine builds without it must never take the fenced release."""
    from tests.reference.test_differential import RecordingEffects, put_into

    from kvfsm.generated import decode_offload as gen

    m = put_into(gen.DecodeOffloadMachine(RecordingEffects()), gen.OFFLOADING, (1, 0, 0))
    assert m.fences == 0
    m.finish()
    assert m.state == gen.FINISHED


def test_checked_modes_ledger_forgets_every_copy_once_acknowledged() -> None:
    """The ledger's per-copy records (readers of device pages, handles) must empty as copies are acknowledged,
    or a long checked run grows without bound and mistakes a slot's next copy for the old one."""
    from tests.runtime.test_fenced_release import _engine, _offloading

    e = _engine(checked=True)
    req = _offloading(e, "a")
    ledger = e.manager.ledger
    assert ledger is not None and ledger.device_readers and ledger.copy_handle
    e.copies.complete_all()
    e.manager.check_progress()
    assert ledger.device_readers == {} and ledger.copy_handle == {}
    del req


def test_without_fences_an_engine_release_under_a_copy_is_refused_as_the_event_it_called() -> None:
    """With fences off the engine's release of a request whose copy is in flight is refused as
    `released_by_engine`, the call it made, and changes nothing (never as the fenced event it did not make)."""
    from tests.runtime.test_fenced_release import _engine, _offloading, _state

    from kvfsm.errors import EventRejected

    e = _engine(fenced=False)
    req = _offloading(e, "a")
    with pytest.raises(EventRejected) as info:
        e.manager.released_by_engine(req)
    assert info.value.event == "released_by_engine" and _state(e, req) == "offloading"


# --- the config file's error location ---------------------------------------------------------------------


def test_a_malformed_config_file_is_located_at_its_line_or_else_named_alone(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A YAML error names the file and the line of its mark; one that carries no mark (PyYAML's marks are
    optional) names the file alone instead of failing on the missing mark."""
    import yaml

    import kvfsm.runtime.config as config_mod
    from kvfsm.errors import ConfigError
    from kvfsm.runtime import OffloadConfig

    cfg = tmp_path / "offload.yaml"
    cfg.write_text("page_size: 4\noffload_stride: [8\n")
    with pytest.raises(ConfigError) as marked:
        OffloadConfig.from_file(cfg)
    assert marked.value.source == f"{cfg}:3" and "malformed YAML" in marked.value.reason  # the mark: end of input

    def unmarked(*_: Any, **__: Any) -> Any:
        raise yaml.MarkedYAMLError(problem="no mark on this one")

    monkeypatch.setattr(config_mod, "load_yaml_data", unmarked)
    with pytest.raises(ConfigError, match="no mark on this one") as bare:
        OffloadConfig.from_file(cfg)
    assert bare.value.source == str(cfg)
