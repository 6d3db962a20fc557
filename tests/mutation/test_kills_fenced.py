"""Tests written to kill survivors of `make mutate` in the fenced release's code (docs/mutation.md)."""

from __future__ import annotations

import weakref
from fractions import Fraction
from typing import Any

import pytest
import torch

from catalog_faults import b2, b16
from tests.dataplane.test_fences import FakeCopy
from tests.runtime.test_fenced_release import _engine, _offloading, _state

from kvfsm.dataplane import CpuCopyEngine, FileStorage, SlotFence, TokenSlotAllocator
from kvfsm.dataplane.copy.cpu import DeferredHandle
from kvfsm.dataplane.pools.config import KVCacheConfig
from kvfsm.dataplane.pools.device_pool import DeviceKVPool
from kvfsm.errors import ConfigError
from kvfsm.runtime import CheckedModeError, DecodeOffloadManager, OffloadConfig, SimplePrefixCache
from kvfsm.runtime.ledger import SlotLedger


def _fenced_free(a: TokenSlotAllocator, pages: int, copy: FakeCopy) -> list[int]:
    """`pages` pages allocated, then freed under the fence of `copy` (still reading them)."""
    got = a.alloc_pages(pages)
    assert got is not None
    a.free_pages(got, fence=SlotFence([copy]))
    return got


# --- the allocator: alloc_fenced and alloc_pages_fenced take exactly what alloc and alloc_pages take ----------


def test_alloc_fenced_refuses_sizes_alloc_refuses() -> None:
    """A size that is not a non-negative int multiple of the page size is a caller's bug: refused, never rounded."""
    a = TokenSlotAllocator(16, page_size=2)
    for bad in (3, -2, True, 2.0, Fraction(4)):
        with pytest.raises(ValueError):
            a.alloc_fenced(bad)  # type: ignore[arg-type]
    one = TokenSlotAllocator(8, page_size=1)
    with pytest.raises(ValueError):
        one.alloc_fenced(True)  # a bool is not a size, even where page_size 1 divides it
    assert a.free_page_count == 7 and one.free_page_count == 7


def test_alloc_fenced_of_nothing_is_an_empty_allocation() -> None:
    """alloc_fenced(0) (a request with nothing to grow this step) gets no slots and no fences, not an error."""
    a = TokenSlotAllocator(16, page_size=2)
    slots, fences = a.alloc_fenced(0)  # type: ignore[misc]
    assert slots.tolist() == [] and fences == ()
    assert a.alloc_pages_fenced(0) == ([], ())
    assert a.free_page_count == 7


def test_alloc_pages_fenced_refuses_counts_alloc_pages_refuses() -> None:
    """A page count must be a non-negative int (no bool, no float), whatever is free: a full pool says so too."""
    a = TokenSlotAllocator(16, page_size=2)
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError):
            a.alloc_pages_fenced(bad)  # type: ignore[arg-type]
    assert a.alloc_pages(7) is not None  # full: nothing free, plain or fenced
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError):
            a.alloc_pages_fenced(bad)  # type: ignore[arg-type]


def test_alloc_fenced_returns_slots_on_the_allocators_device() -> None:
    """The slots index the device pool: they must be on the allocator's device, as alloc's are."""
    a = TokenSlotAllocator(16, page_size=2, device="meta")
    slots, _ = a.alloc_fenced(4)  # type: ignore[misc]
    assert slots.device.type == "meta" and slots.dtype == torch.int64 and slots.shape == (4,)
    cpu = TokenSlotAllocator(16, page_size=2)
    slots, _ = cpu.alloc_fenced(4)  # type: ignore[misc]
    assert slots.device.type == "cpu" and slots.tolist() == [2, 3, 4, 5]


def test_an_allocation_the_plain_free_pages_cover_queries_no_fence() -> None:
    """Fences are queried only when the plain free pages run out (an event query each, on the hot path): taking
    exactly the plain free pages leaves a fenced page fenced, with no query made."""
    a = TokenSlotAllocator(16, page_size=2)
    copy = FakeCopy()
    fenced = _fenced_free(a, 1, copy)
    copy.landed = True  # passed, but nobody has asked
    plain = a.free_page_count - 1
    copy.queries = 0
    got = a.alloc_pages_fenced(plain)
    assert got is not None and fenced[0] not in got[0] and got[1] == ()
    assert copy.queries == 0 and a.fenced_page_count == 1


def test_the_snapshot_lists_fenced_free_pages_after_a_minus_one() -> None:
    """Equal snapshots must mean equal allocator state: the fenced free pages are in it, after the -1 marker."""
    a = TokenSlotAllocator(8, page_size=2)
    before = a.snapshot()[0].tolist()
    assert before == [1, 2, 3]
    _fenced_free(a, 1, FakeCopy())
    assert a.snapshot()[0].tolist() == [2, 3, -1, 1]
    assert a.snapshot()[0].tolist() != before


# --- build: a fenced release needs a copy engine that fences --------------------------------------------


def test_a_config_with_fenced_release_builds_its_own_fencing_engine() -> None:
    """fenced_release with the engine left to the config builds it (every engine kvfsm builds fences)."""
    import kvfsm.runtime.build as build

    pool = DeviceKVPool.create(KVCacheConfig.tiny(), 64)
    config = OffloadConfig(page_size=4, host_pool_ratio=0.5, copy_backend="cpu", fenced_release=True)
    built = build.build_components(config, device_pool=pool)
    assert isinstance(built.copy_engine, CpuCopyEngine) and built.copy_engine.fences


def test_a_built_engine_that_does_not_fence_is_refused_and_the_store_built_for_it_closed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine the config builds is checked too (its fences known only once built); refusing it closes the
    store built before it, or its writer threads (or a Mooncake client) outlive the failed start."""
    import kvfsm.runtime.build as build

    class NoFences(CpuCopyEngine):
        fences = False

    monkeypatch.setattr(build, "CpuCopyEngine", NoFences)
    closed: list[Any] = []
    monkeypatch.setattr(FileStorage, "close", lambda self: closed.append(self))
    pool = DeviceKVPool.create(KVCacheConfig.tiny(), 64)
    config = OffloadConfig(
        page_size=4,
        host_pool_ratio=0.5,
        copy_backend="cpu",
        fenced_release=True,
        storage_backend="file",
        storage_dir=tmp_path,
    )
    with pytest.raises(ConfigError) as info:
        build.build_components(config, device_pool=pool)
    assert info.value.field == "fenced_release" and "NoFences" in info.value.reason
    assert len(closed) == 1 and isinstance(closed[0], FileStorage)


class _DuckEngine:
    """A copy engine by protocol only (no CopyEngine base, so no `fences` attribute)."""

    def submit_d2h(self, *a: Any) -> Any:
        raise AssertionError

    def submit_h2d(self, *a: Any) -> Any:
        raise AssertionError


class _DuckAllocator:
    """An allocator by protocol only (no `fences` attribute: its frees take no fence)."""

    def __init__(self, inner: TokenSlotAllocator) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "fences":
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_fenced_release_refuses_an_engine_or_allocator_that_does_not_say_it_fences() -> None:
    """Saying nothing is not fencing: an engine or allocator with no `fences` attribute is a ConfigError
    naming fenced_release (not an AttributeError, and never accepted)."""
    e = _engine()
    common = dict(
        device_pool=e.device_pool,
        req_to_token=e.req_to_token,
        prefix_cache=SimplePrefixCache(e.allocator),
        host_pool=e.host_pool,
    )
    config = OffloadConfig(
        page_size=2, offload_stride=4, host_pool_ratio=1.0, storage_backend="none", fenced_release=True
    )
    with pytest.raises(ConfigError) as info:
        DecodeOffloadManager(config, allocator=e.allocator, copy_engine=_DuckEngine(), **common)  # type: ignore[arg-type]
    assert info.value.field == "fenced_release"
    with pytest.raises(ConfigError) as info:
        DecodeOffloadManager(config, allocator=_DuckAllocator(e.allocator), copy_engine=e.copies, **common)  # type: ignore[arg-type]
    assert info.value.field == "fenced_release"


# --- the release's checked-mode event names (what a CheckedModeError reports) ---------------------------


def test_checked_mode_names_a_plain_release_under_a_copy_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catalog fault B2 (a release under a copy) is reported as the plain release that did it: event 'release'."""
    b2(monkeypatch)
    e = _engine(checked=True)
    a = _offloading(e, "a")
    with pytest.raises(CheckedModeError, match="B2") as err:
        e.end(a, "finish")
    assert err.value.event == "release" and err.value.request == e.manager._records[id(a)].key


def test_checked_mode_names_a_fenced_release_release_fenced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catalog fault B16 in a fenced release (under a copy) is reported as event 'release_fenced'; the same
    fault in a plain release (no copy in flight) as 'release'."""
    b16(monkeypatch)
    e = _engine(checked=True, fenced=True)
    a = e.admit("a", 6, prefix_len=2)
    assert a is not None
    while not e.manager.offload(a):
        assert e.decode(a)
    with pytest.raises(CheckedModeError, match="B16") as err:
        e.end(a, "finish")
    assert err.value.event == "release_fenced"
    e = _engine(checked=True, fenced=True)
    b = e.admit("b", 6, prefix_len=2)
    assert b is not None
    with pytest.raises(CheckedModeError, match="B16") as err:
        e.end(b, "finish")
    assert err.value.event == "release"


def test_a_released_record_holds_no_request() -> None:
    """After its release the record drops the request (its `req` is None, what the explorer's state reads), so
    the manager keeps no finished request alive while its copy still runs."""
    e = _engine(fenced=True)
    a = _offloading(e, "a")
    rec = e.manager._records[id(a)]
    e.end(a, "finish")
    assert _state(e, a) == "fenced" and rec.req is None
    ref = weakref.ref(a)
    e.live[:] = []
    del a
    assert ref() is None


# --- the engine's own release, fenced, with GPU-like fences (the wait orders a stream, the host goes on) ---


@pytest.fixture
def gpu_like_waits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, object]]:
    """Deferred handles whose wait_stream only records (as a CUDA wait_event): the copy stays in flight."""
    waits: list[tuple[int, object]] = []
    monkeypatch.setattr(DeferredHandle, "wait_stream", lambda self, stream=None: waits.append((id(self), stream)))
    return waits


@pytest.mark.parametrize("checked", [True, False])
def test_an_engine_release_after_fencing_unlanded_copies_is_accepted_and_counted(
    checked: bool, gpu_like_waits: list[tuple[int, object]]
) -> None:
    """With fences the engine may free a request's slots while its copies run, once its stream waits on them:
    accepted (state fenced), counted once per release, the ledger then holding nothing of the request's."""
    e = _engine(fenced=True, checked=checked, device_slots=24)
    a, b = _offloading(e, "a"), _offloading(e, "b")
    e.release_itself(a)
    e.release_itself(b)
    assert gpu_like_waits and not any(c.handle.done() for c in e.manager.fx.copy_fifo)  # still in flight
    assert _state(e, a) == _state(e, b) == "fenced"
    assert e.manager.metrics.engine_releases == 2 and e.manager.metrics.releases == 0
    if checked:
        ledger = e.manager.ledger
        assert ledger.device_owner == {} and dict(ledger.prefix_holders) == {}
    e.settle()
    assert _state(e, a) == _state(e, b) == "released"
    e.check_teardown()


def test_an_engine_release_with_a_prefix_leaves_no_prefix_hold_in_the_ledger() -> None:
    """The engine's fenced release unlocks the request's prefix in the ledger too, or a later reuse of those
    pages (once evicted) would be a false premature reuse (B1)."""
    e = _engine(fenced=True, checked=True, device_slots=24)
    a = e.admit("a", 6, prefix_len=2)
    assert a is not None
    while not e.manager.offload(a):
        assert e.decode(a)
    assert e.manager.ledger.prefix_holders
    e.release_itself(a)
    assert _state(e, a) == "fenced"
    assert dict(e.manager.ledger.prefix_holders) == {}


def test_fence_copies_in_flight_waits_on_each_copy_on_the_stream_given(
    gpu_like_waits: list[tuple[int, object]],
) -> None:
    """Each distinct copy in flight is waited on once (the chunks of one offload_batch share it), on the
    stream the engine names, and counted."""
    e = _engine(fenced=True, device_slots=32)
    a, b = e.admit("a", 4), e.admit("b", 4)
    assert a is not None and b is not None
    for _ in range(5):
        assert e.decode(a) and e.decode(b)
    assert e.manager.offload_batch([a, b]) == 2  # two chunks, one copy
    _offloading(e, "c")
    handles = {id(c.handle) for c in e.manager.fx.copy_fifo}
    assert len(e.manager.fx.copy_fifo) == 3 and len(handles) == 2
    assert e.manager.fence_copies_in_flight("compute-stream") == 2
    assert sorted(gpu_like_waits) == sorted((h, "compute-stream") for h in handles)


# --- the slot ledger (checked mode) ----------------------------------------------------------------------


def test_a_copy_that_landed_unacknowledged_no_longer_blocks_a_plain_release() -> None:
    """A landed copy (its handle says done) reads nothing: releasing its slots before the progress check
    acknowledges it is no B2."""
    led = SlotLedger(page_size=2)
    copy = FakeCopy()
    led.copy_started("A", 1, [2, 3], [0, 1], copy)
    with pytest.raises(CheckedModeError, match="B2"):
        led.release_device("A", "release", [2, 3])
    copy.landed = True
    led.release_device("A", "release", [2, 3])
    assert led.device_owner == {} and led.device_released == {1: "A"}


def test_the_ledger_drops_a_copys_handle_once_the_copy_is_acknowledged() -> None:
    """A long checked run must not keep every copy's handle (and what it holds) alive after its acknowledgement."""
    led = SlotLedger(page_size=2)
    copy = FakeCopy()
    led.copy_started("A", 1, [2, 3], [0, 1], copy)
    ref = weakref.ref(copy)
    copy.landed = True
    led.copy_completed(1, [2, 3])
    del copy
    assert ref() is None and led.copy_handle == {}


def test_a_fenced_pages_fence_ends_with_the_last_copy_reading_that_page() -> None:
    """The fence of a request's release waits for all its copies, but a page is read only by its own: once
    they landed (and for a page no copy read at all) its next writer need not wait."""
    led = SlotLedger(page_size=2)
    first, second = FakeCopy(), FakeCopy()
    led.claim_device("A", "admit", [8, 9])  # a page no copy reads
    led.copy_started("A", 1, [2, 3], [0, 1], first)
    led.copy_started("A", 2, [4, 5], [2, 3], second)
    led.release_device("A", "release_fenced", [2, 3, 4, 5, 8, 9], SlotFence([first, second]))
    led.device_write("B", [8, 9])  # never read by a copy: no fence on it
    with pytest.raises(CheckedModeError, match="B2"):
        led.device_write("B", [2, 3])  # its copy still runs and nobody waited
    first.landed = True
    led.copy_completed(1, [2, 3])
    led.device_write("B", [2, 3])  # its only copy landed: the second copy reads another page
    with pytest.raises(CheckedModeError, match="B2"):
        led.device_write("B", [4, 5])
