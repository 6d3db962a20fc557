"""Slots read on the device (`kvfsm.runtime.device_table`), for a request table with no host mirror (SGLang's
`req_to_token` on the GPU): the reads themselves, and whole lifecycles run through them in checked mode,
with the same copies, frees and stored pages as through the mirror. The GPU run of the same path is
tests/upstream/test_adapter_gpu.py."""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest
import torch

import kvfsm.verify.engine as engine_mod
from kvfsm.runtime import DecodeOffloadManager
from kvfsm.runtime.device_table import DeviceTableSlots
from kvfsm.verify.engine import SimEngine


def test_spans_and_whole_pages_read_the_table() -> None:
    table = torch.arange(6 * 16, dtype=torch.int32).reshape(6, 16) * 3
    slots = DeviceTableSlots(table, page_size=4)
    assert slots.span(2, 4, 8).tolist() == table[2, 4:8].tolist() and slots.span(2, 4, 8).dtype == torch.int64
    before = slots.span(1, 0, 4)
    table[1, 0:4] = -1  # a span is a copy: later writes of the row do not reach it
    assert before.tolist() == [48, 51, 54, 57]
    got = slots.spans([3 * 16 + 2, 5 * 16 + 8, 0], [3, 4, 2])
    assert got.tolist() == table[3, 2:5].tolist() + table[5, 8:12].tolist() + table[0, 0:2].tolist()
    assert slots.spans([4 * 16 + 1], [5]).tolist() == table[4, 1:6].tolist()
    paged = torch.zeros(2, 16, dtype=torch.int32)
    paged[1, :8] = torch.tensor([40, 41, 42, 43, 12, 13, 14, 15])
    assert DeviceTableSlots(paged, 4).whole_pages(1, 0, 8).tolist() == [40, 41, 42, 43, 12, 13, 14, 15]
    assert DeviceTableSlots(paged, 4).whole_pages(1, 4, 8).tolist() == [12, 13, 14, 15]
    with pytest.raises(ValueError, match="rows, max_context"):
        DeviceTableSlots(torch.zeros(4), 4)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_whole_pages_and_page_ids_are_the_pages_a_span_starts_on(dtype: torch.dtype, page_size: int) -> None:
    """Each page named by a first slot (rounded down to its page, as an unaligned slot is) gives its page_size
    slots, in order, as int64, and its id, for spans that end mid-page, on a page, or past the row (clamped)."""
    width = 5 * page_size + 3
    table = torch.randint(0, 1 << 20, (3, width), generator=torch.Generator().manual_seed(page_size), dtype=dtype)
    slots = DeviceTableSlots(table, page_size)
    for row, start in itertools.product(range(3), range(0, width, page_size)):
        for end in (start, start + 1, start + page_size, start + 2 * page_size + 1, width + page_size):
            want = [
                first // page_size * page_size + k
                for first in table[row, start:end:page_size].tolist()
                for k in range(page_size)
            ]
            got = slots.whole_pages(row, start, end)
            assert got.dtype == torch.int64 and got.tolist() == want, (row, start, end)
            ids = slots.page_ids(row, start, end)  # the same pages by id
            assert ids.dtype == torch.int64 and ids.tolist() == [w // page_size for w in want[::page_size]], (
                row,
                start,
                end,
            )


class _Mirrorless:
    """A request table as an engine with a GPU-only table presents it: no host mirror."""

    host_table = None

    def __init__(self, pool: Any) -> None:
        self.pool, self.rows, self.req_to_token = pool, pool.rows, pool.req_to_token

    def is_allocated(self, row: int) -> bool:
        return self.pool.is_allocated(row)

    def free(self, row: int) -> None:
        self.pool.free(row)


class MirrorlessEngine(SimEngine):
    def manager_allocator(self) -> Any:
        """The device allocator the manager is given (the engine's own)."""
        return self.allocator

    def manager_prefix_cache(self) -> Any:
        """The prefix cache the manager is given (the engine's own)."""
        return self.protected

    def __post_init__(self) -> None:
        super().__post_init__()
        self.manager.close()
        self.manager = DecodeOffloadManager(
            self.config,
            device_pool=self.device_pool,
            allocator=self.manager_allocator(),
            req_to_token=_Mirrorless(self.req_to_token),
            prefix_cache=self.manager_prefix_cache(),
            host_pool=self.host_pool,
            copy_engine=self.copies,
            storage=self.storage,
            backup_worker=self.worker,
        )


class _ByPageId:
    """A device allocator that frees a request's pages by page id, as SGLang's paged allocator does through the
    adapter (`frees_page_ids`): the manager hands it the ids it reads from the table, never the slots. Each
    free is recorded, then made on the engine's allocator as the slots of those pages."""

    frees_page_ids = True

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.page_frees: list[tuple[list[int], Any]] = []  # (page ids, fence) of each free_page_ids
        self.slot_frees = 0  # frees by slot

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def free(self, slots: Any, **kw: Any) -> None:
        self.slot_frees += 1
        self._inner.free(slots, **kw)

    def free_page_ids(self, pages: torch.Tensor, fence: Any) -> None:
        ids = pages.tolist()
        self.page_frees.append((ids, fence))
        slots = torch.from_numpy(self._inner.slots_of(ids))
        if fence is None:
            self._inner.free(slots)
        else:
            self._inner.free(slots, fence=fence)


class PageIdEngine(MirrorlessEngine):
    def manager_allocator(self) -> Any:
        self.by_id = _ByPageId(self.allocator)
        return self.by_id


class _UnsaidOrder(_ByPageId):
    """An allocator that hands out its newest frees first (each free's pages go to the front of the free list, as
    SGLang's paged allocator outside a free group) and does not say so (no `frees_newest_first`, nor the engine
    allocator's), as an engine's own allocator the manager knows nothing of: its releases go one at a time."""

    def __getattr__(self, name: str) -> Any:
        if name == "frees_newest_first":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def free_page_ids(self, pages: torch.Tensor, fence: Any) -> None:
        super().free_page_ids(pages, fence)
        ids, free = pages.tolist(), self._inner._free_pages
        assert list(free)[len(free) - len(ids) :] == ids  # unfenced: appended at the end
        for _ in ids:
            free.pop()
        free.extendleft(reversed(ids))


class _NewestFirst(_UnsaidOrder):
    """As _UnsaidOrder, saying so."""

    def frees_newest_first(self) -> bool:
        return True


class _TreeCache:
    """A prefix cache that, like SGLang's tree, frees nothing at unlock: an unlocked prefix stays cached until
    `evict()` (frees_at_unlock False)."""

    frees_at_unlock = False

    def __init__(self, inner: Any) -> None:
        self.inner, self.unlocked = inner, []

    def unlock(self, lock: Any) -> None:
        self.unlocked.append(lock)

    def evict(self) -> None:
        for lock in self.unlocked:
            self.inner.unlock(lock)
        self.unlocked.clear()


class _SaysNothing:
    """A prefix cache that evicts at unlock (kvfsm's SimplePrefixCache) and says nothing about it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def unlock(self, lock: Any) -> None:
        self.inner.unlock(lock)


class TreePageIdEngine(PageIdEngine):
    """Page-id frees, with a prefix cache that frees nothing at unlock: a batch's releases with prefixes are one free."""

    def manager_prefix_cache(self) -> Any:
        self.tree = _TreeCache(self.protected)
        return self.tree


class NewestFirstTreeEngine(TreePageIdEngine):
    def manager_allocator(self) -> Any:
        self.by_id = _NewestFirst(self.allocator)
        return self.by_id


class UnsaidOrderEngine(TreePageIdEngine):
    def manager_allocator(self) -> Any:
        self.by_id = _UnsaidOrder(self.allocator)
        return self.by_id


class SaysNothingPageIdEngine(PageIdEngine):
    def manager_prefix_cache(self) -> Any:
        return _SaysNothing(self.protected)


def _run(cls: type, prefix: int, fenced: bool = False) -> tuple[tuple[dict[str, bytes], list[int], int], Any]:
    """Three requests decoding, offloading one by one and in batches, one aborted under a copy; ((stored
    pages, the device allocator's free list, pages stored), the engine)."""
    e = cls(page_size=2, stride=4, device_slots=64, host_slots=32, rows=3, checked=True, fenced=fenced)
    reqs = [e.admit(f"r{i}", 6, prefix) for i in range(3)]
    for step in range(9):
        for req in reqs:
            e.decode(req, speculative=1 if step % 3 == 0 else 0)
        if step % 2:
            e.manager.offload_batch(
                reqs, np.array([r.req_pool_idx for r in reqs]), np.array([r.kv_committed_len for r in reqs])
            )
        else:
            for req in reqs:
                e.manager.offload(req)
        if step == 4:
            e.copies.complete_next()
            e.manager.check_progress()
    e.end(reqs[0], "abort")  # a copy still in flight: release deferred
    for req in reqs[1:]:
        e.end(req)
    e.settle()
    e.check_teardown()
    stored = {k: v.numpy().tobytes() for k, v in e.store.pages.items()}
    return (stored, list(e.allocator._free_pages), e.manager.metrics.stored_pages), e  # free-list order: same frees


@pytest.mark.parametrize("prefix", [0, 2])
def test_lifecycles_through_the_device_table_match_the_mirror(prefix: int, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = []
    for cls in (SimEngine, MirrorlessEngine):
        monkeypatch.setattr(engine_mod, "_serials", itertools.count(1))  # the same writers' KV in both runs
        runs.append(_run(cls, prefix)[0])
    mirror, mirrorless = runs
    assert mirrorless == mirror and mirror[2] > 0


@pytest.mark.parametrize("fenced", [False, True])
@pytest.mark.parametrize("prefix", [0, 2])
def test_an_allocator_that_frees_by_page_id_gets_each_requests_own_pages_with_its_fence(
    prefix: int, fenced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a mirror, an allocator that frees by page id (SGLang's, through the adapter) is given the ids of
    the pages the request owns past its matched prefix, once each, with the fence of the copies that still read
    them: the same frees, in the same order, as the mirror's slots, and nothing freed by slot."""
    runs = []
    for cls in (SimEngine, PageIdEngine):
        monkeypatch.setattr(engine_mod, "_serials", itertools.count(1))
        runs.append(_run(cls, prefix, fenced))
    (mirror, _), (by_id, engine) = runs
    assert by_id == mirror and mirror[2] > 0
    alloc = engine.by_id
    assert alloc.slot_frees == 0 and len(alloc.page_frees) == 3  # one free a request
    freed = [p for ids, _ in alloc.page_frees for p in ids]
    assert freed and len(freed) == len(set(freed))
    fences = [fence for _, fence in alloc.page_frees]
    assert any(fences) if fenced else not any(fences)  # fenced: released under copies still in flight


def _finishes(batched: bool, seed: int, cls: type) -> tuple[list[Any], Any]:
    """A random workload whose requests end several at a step, by one `finalize_batch` or a loop of `finalize`
    (a request repeated, one already ended, one the manager never saw among them), unchecked so that batch events
    run as batches; what each step leaves (lifecycles, metrics, rows, the device free list in order, the host
    pool) and the engine."""
    rng = random.Random(seed)
    e = cls(page_size=2, stride=4, device_slots=160, host_slots=48, rows=8, max_context=40, checked=False)
    free, frees = e.allocator.free, []

    def counted(*args: Any, **kw: Any) -> None:  # every free the engine's allocator is handed, by slot or page id
        frees.append(1)
        free(*args, **kw)

    e.allocator.free = counted
    e.frees = frees
    log: list[Any] = []
    serial, ended = 0, []
    for step in range(40):
        while len(e.live) < e.rows and rng.random() < 0.5:
            serial += 1
            e.admit(f"r{serial}", rng.randint(2, 9), prefix_len=2 * (rng.random() < 0.2))
        for req in list(e.live):
            if not e.decode(req):
                e.end(req, "retract")
        seen = [r for r in e.live if rng.random() < 0.85]  # the rest are new to the manager when they end
        e.manager.offload_batch(
            seen, np.array([r.req_pool_idx for r in seen]), np.array([r.kv_committed_len for r in seen])
        )
        if rng.random() < 0.7:
            e.copies.complete_all()
        if rng.random() < 0.6 and e.worker.pending:
            e.worker.run_all()
        e.manager.check_progress()
        ending = rng.sample(e.live, min(len(e.live), rng.randint(0, 4)))
        for req in ending:
            req.done = True
            e.live.remove(req)
        calls = ending + ending[:1] * (step % 3 == 0) + ended[-1:] * (step % 5 == 0)
        if batched:
            e.manager.finalize_batch(calls)
        else:
            for req in calls:
                e.manager.finalize(req)
        ended += ending
        states = sorted(
            (rec.rid, rec.machine.state, rec.inc_len) for rec in e.manager._records.values() if rec.machine is not None
        )
        log.append(
            (
                states,
                e.manager.metrics.as_dict(),
                e.req_to_token.free_rows,
                list(e.allocator._free_pages),
                e.host_pool.free_slots,
            )
        )
        del ending, calls
    return log, e


ENGINES = {
    "mirror": SimEngine,
    "device-table": MirrorlessEngine,
    "page-ids": PageIdEngine,
    "page-ids-tree": TreePageIdEngine,
    "page-ids-newest-first": NewestFirstTreeEngine,
    "page-ids-silent-cache": SaysNothingPageIdEngine,
    "page-ids-unsaid-order": UnsaidOrderEngine,
}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", list(ENGINES))
def test_finalize_batch_makes_the_transitions_and_frees_of_a_loop_of_finalize(seed: int, name: str) -> None:
    """One batch `finish` event for a step's finishes: the same lifecycles, metrics (a repeated request's second
    finish is an ignored duplicate), rows and device free list, in order, as `finalize` one request at a time,
    whatever the allocator and the prefix cache. Through an allocator that frees by page id, the releases one
    event makes are one free, when no prefix lock goes with them or the cache frees nothing at unlock (laid out
    newest first where the allocator hands those out first); a cache that does not say so is taken to free."""
    cls = ENGINES[name]
    loop, _ = _finishes(False, seed, cls)
    batch, engine = _finishes(True, seed, cls)
    for step, (a, b) in enumerate(zip(loop, batch)):
        assert a == b, f"step {step}: loop and batch diverge"
    assert batch[-1][1]["releases"] > 5 and batch[-1][1]["ignored_duplicate_releases"] > 0
    if cls is UnsaidOrderEngine:  # an order not said: a free a release, as the loop
        assert not hasattr(engine.by_id, "frees_newest_first")
        assert len(engine.frees) == len(_finishes(False, seed, cls)[1].frees)
        return
    assert len(engine.frees) < len(_finishes(False, seed, cls)[1].frees)  # some frees held several releases
    if issubclass(cls, PageIdEngine):
        sizes = [len(ids) for ids, _ in engine.by_id.page_frees]
        assert engine.by_id.slot_frees == 0 and len(sizes) < batch[-1][1]["releases"]  # some frees held several
    if issubclass(cls, TreePageIdEngine):  # releases with prefixes among those batched: fewer frees still
        assert len(sizes) < len(_finishes(True, seed, PageIdEngine)[1].by_id.page_frees)
        engine.tree.evict()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_page_ids_many_reads_each_spans_page_ids_in_order_in_one_gather(dtype: torch.dtype, page_size: int) -> None:
    """`page_ids_many` is `page_ids` of each span, concatenated in the order given, int64 on the table's device:
    spans past the table's width stop at it, an empty or reversed span gives none, any page-aligned start."""
    table = torch.randint(0, 1 << 20, (6, 24), dtype=dtype)
    slots = DeviceTableSlots(table, page_size)
    rng = random.Random(page_size)
    for _ in range(20):
        n = rng.randint(0, 5)
        rows = [rng.randrange(6) for _ in range(n)]
        starts = [page_size * rng.randint(0, 24 // page_size) for _ in range(n)]
        ends = [rng.randint(0, 30) for _ in range(n)]
        got = slots.page_ids_many(rows, starts, ends)
        want = [slots.page_ids(r, a, b) for r, a, b in zip(rows, starts, ends)]
        assert got.dtype == torch.int64 and got.device == table.device
        assert got.tolist() == [p for w in want for p in w.tolist()]
