"""Differential test: every scenario on upstream SGLang 0.5.23's manager and on kvfsm's
drop-in (`kvfsm.integrations.sglang.DecodeKVCacheOffloadManager`), compared per scheduler step.

Both run the same script (`harness.run_scenario`) over the same SGLang objects; `harness.diff_runs` compares
per rank and step the accepted offloads, the releases, the device frees by (owner, row position), the host
slots taken and returned (counts: the two host pools are different implementations, so slot ids may differ
and are not compared), the storage keys that appeared and, at the end, every stored page's bytes. No other
normalisation is applied.

kvfsm's side is seen through a probe (`harness.Probe`) that the test adds to a subclass: it waits for kvfsm's
backup worker, meters the host pool at kvfsm's page calls (`alloc_pages` / `free_pages`, counted in slots
as the harness counts upstream's `alloc` / `free`), and exposes a per-page `set` for the harness's storage
fault injection (kvfsm's FileStorage is made to write page by page through it, as it writes anyway).

Where kvfsm differs on purpose, `INTENDED` names the difference and the test asserts kvfsm's behaviour
instead of equality. Everything else must match exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import harness
from scenarios import BY_NAME, SCENARIOS, Scenario
from timing import backups_settled

import kvfsm.integrations.sglang.manager as adapter_module
from kvfsm.dataplane.storage import ProcessStorage
from kvfsm.integrations.sglang import DecodeKVCacheOffloadManager, TableView


class _HostMeter:
    """What the harness meters (`alloc(n)`, `free(indices)`, `available_size()`), fed by kvfsm's page calls."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._alloc_pages, self._free_pages = pool.alloc_pages, pool.free_pages
        ps = pool.page_size

        def alloc_pages(k: int):
            got = self.alloc(k * ps)  # the harness's wrapper, when it has installed one
            return None if got is None else list(got)

        def free_pages(pages):
            self.free(_Pages(list(pages), ps))

        pool.alloc_pages, pool.free_pages = alloc_pages, free_pages

    def alloc(self, n: int):
        pages = self._alloc_pages(n // self.pool.page_size)
        return None if pages is None else _Pages(pages, self.pool.page_size)

    def free(self, pages) -> int:
        self._free_pages(list(pages))
        return len(pages) * self.pool.page_size

    def available_size(self) -> int:
        return self.pool.free_slots


class _Pages(list):
    """Page ids that count as their slots (`len`), as the harness counts upstream's slot tensors."""

    def __init__(self, pages: list[int], page_size: int) -> None:
        super().__init__(pages)
        self.page_size = page_size

    def __len__(self) -> int:
        return super().__len__() * self.page_size


class _PageWriter:
    """`set(key, page)`: one page through kvfsm's FileStorage; FileStorage's host-pool path is routed here
    page by page, in order, so the harness can fail the n-th page write."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        batch_set = fs.batch_set

        def batch_set_from_host(keys, host_pool, host_indices):
            pages = host_pool.get_pages_bytes(host_indices)
            return [bool(self.set(k, pages[i])) for i, k in enumerate(keys)]

        self._batch_set = batch_set
        fs.batch_set_from_host = batch_set_from_host

    def set(self, key: str, value: Any = None) -> bool:
        return self._batch_set([key], [value])[0]


class _KvfsmProbe(harness.Probe):
    def settle(self, mgr: Any) -> None:
        backups_settled(mgr.manager.fx.worker, "kvfsm's backups to settle", harness.SETTLE_S)

    def before_check(self, mgr: Any) -> None:
        # The check would submit the accepted chunks first (_flush) and then acknowledge the copies that have
        # landed: a CPU engine's has landed when its submit returns, a CUDA one's when the GPU gets to it. So
        # the harness submits them itself (as the check would, under the sync check), waits for every copy in
        # flight, and the check acknowledges the same chunks on a busy GPU as on the CPU.
        with harness.manager_call():
            mgr._flush()
        for chunk in list(mgr.manager.fx.copy_fifo):
            chunk.handle.wait()

    def host_pool(self, mgr: Any) -> Any:
        return _HostMeter(mgr.manager.host_pool)

    def storage(self, mgr: Any) -> Any:
        return _PageWriter(mgr.manager.fx.storage)

    def close(self, mgr: Any) -> None:
        mgr.manager.drain()
        mgr.release_host_resources()


class ProbedAdapter(DecodeKVCacheOffloadManager):
    """The adapter in checked mode (slot ledger and spec invariants on every transition), with the probe."""

    CHECKED = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs, checked=self.CHECKED)

    @staticmethod
    def harness_probe() -> harness.Probe:
        return _KvfsmProbe()


class _MirrorlessTable(TableView):
    """SGLang's table as a CUDA server has it, on a CPU: no host mirror, so kvfsm's manager reads the slots
    on the table's device as tensors it never looks into (kvfsm.runtime.device_table), as on the GPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.host_table = None


class DeviceTableAdapter(ProbedAdapter):
    """ProbedAdapter reading slots the GPU server's way (the CPU twin of the GPU path's slot reads)."""

    def __init__(self, **kwargs: Any) -> None:
        adapter_module.TableView = _MirrorlessTable
        try:
            super().__init__(**kwargs)
        finally:
            adapter_module.TableView = TableView
        assert self.manager.fx.device_table is not None


class ProductionDeviceTableAdapter(DeviceTableAdapter):
    """DeviceTableAdapter unchecked, as a server runs it: checked mode runs every batch event item by item, this
    runs them as batches, so the releases one event makes free their pages in one call
    (OffloadEffects.release_request_each) and a flush's finishing requests end in one `finalize_batch`."""

    CHECKED = False


class ProcessStoreAdapter(ProbedAdapter):
    """ProbedAdapter with `kvfsm_store_process` set: its file store runs in a child process that maps the
    (shared) host pool, and the backup worker sends it page ids."""

    def __init__(self, **kwargs: Any) -> None:
        real = adapter_module.read_settings
        adapter_module.read_settings = lambda *a: dataclasses.replace(real(*a), store_process=True)  # type: ignore[assignment]
        try:
            super().__init__(**kwargs)
        finally:
            adapter_module.read_settings = real  # type: ignore[assignment]
        assert isinstance(self._storage, ProcessStorage) and self.manager.host_pool.share_fd is not None


# The store in a child process: a sample of the scenarios (each starts a store process per rank), MLA and
# TP among them
PROCESS_STORE = ("namespaced", "prefix-matched", "mla", "abort-while-copies-pile-up", "host-pool-full", "tp2")


# Where kvfsm differs from upstream on purpose: scenario -> (the difference, a check of kvfsm's behaviour).
INTENDED: dict[str, str] = {
    "tp2-host-full-on-one-rank": "TP ranks with different host pools are refused at construction (TPMismatch on "
    "every rank); upstream runs and strands rank 0's copy, row and device slots",
    "backup-failure": "a page that fails to store does not drop the pages after it in its chunk: kvfsm stores "
    "them (HiCacheFile's batch stops at the first failure)",
}


def _run(sc: Scenario, cls: type, free_group: bool = True, _cache: dict = {}) -> list[harness.RunResult]:  # noqa: B006 (one run each)
    key = (sc.name, cls, free_group)
    if key not in _cache:
        _cache[key] = harness.run_scenario(sc, cls, free_group=free_group)
    return _cache[key]


@pytest.mark.parametrize("sc", [s for s in SCENARIOS if s.name not in INTENDED], ids=lambda s: s.name)
def test_adapter_matches_upstream(sc: Scenario) -> None:
    diffs = harness.diff_runs(_run(sc, harness.UpstreamManager), _run(sc, ProbedAdapter))
    assert diffs == [], "\n".join(diffs)


@pytest.mark.parametrize("sc", [s for s in SCENARIOS if s.name not in INTENDED], ids=lambda s: s.name)
def test_adapter_reading_slots_on_the_device_matches_upstream(sc: Scenario) -> None:
    diffs = harness.diff_runs(_run(sc, harness.UpstreamManager), _run(sc, DeviceTableAdapter))
    assert diffs == [], "\n".join(diffs)


# Frees that take effect at once (no free group open, as outside SGLang's result processing): a sample with
# releases on both of kvfsm's free paths (page ids on the device table at page sizes above 1; slots on the host
# mirror and at page size 1), prefixes, an abort, a full host pool, speculative over-allocation and TP
AT_ONCE = (
    "plain-p4-s8",
    "plain-p1-s3",
    "prefix-matched",
    "prefix-matched-p1",
    "abort-mid-offload",
    "host-pool-full",
    "spec-decode-overalloc-p1",
    "tp2",
)


@pytest.mark.parametrize("name", AT_ONCE)
@pytest.mark.parametrize("cls", [ProbedAdapter, DeviceTableAdapter], ids=["host-mirror", "device-table"])
def test_adapter_freeing_outside_a_free_group_matches_upstream(name: str, cls: type) -> None:
    sc = BY_NAME[name]
    diffs = harness.diff_runs(_run(sc, harness.UpstreamManager, False), _run(sc, cls, False))
    assert diffs == [], "\n".join(diffs)


@pytest.mark.parametrize("free_group", [True, False], ids=["free-group", "at-once"])
@pytest.mark.parametrize("sc", [s for s in SCENARIOS if s.name not in INTENDED], ids=lambda s: s.name)
def test_the_unchecked_adapter_on_the_device_table_matches_upstream(sc: Scenario, free_group: bool) -> None:
    """The production path (no checked mode), its releases' pages freed a batch at a time: the same frees, in the
    same order, inside SGLang's free group and outside it, as upstream's one free a request."""
    diffs = harness.diff_runs(
        _run(sc, harness.UpstreamManager, free_group), _run(sc, ProductionDeviceTableAdapter, free_group)
    )
    assert diffs == [], "\n".join(diffs)


@pytest.mark.parametrize("name", PROCESS_STORE)
def test_adapter_with_its_store_in_a_child_process_matches_upstream(name: str) -> None:
    """Same keys, frees, releases and stored bytes as upstream, with the pages written by another process."""
    sc = BY_NAME[name]
    diffs = harness.diff_runs(_run(sc, harness.UpstreamManager), _run(sc, ProcessStoreAdapter))
    assert diffs == [], "\n".join(diffs)


def test_backup_failure_keeps_the_rest_of_the_chunk() -> None:
    sc = BY_NAME["backup-failure"]
    (up,), (kv,) = _run(sc, harness.UpstreamManager), _run(sc, ProbedAdapter)
    diffs = harness.diff_runs([up], [kv])
    # only the keys differ, and only by pages kvfsm stored that upstream dropped after a failing page
    assert all(": keys " in d or "stored bytes" in d for d in diffs), diffs
    assert set(up.stored) < set(kv.stored)
    extra = set(kv.stored) - set(up.stored)
    assert all(kv.stored[k] == kv.expected[k][2] for k in kv.stored)  # every page holds the KV written
    # upstream's op for fault ordinal 6 stopped there: the page after it (same chunk) is the one kvfsm keeps
    assert len(extra) == 1, extra
    for a, b in zip(up.steps, kv.steps):
        assert (a.offloads, a.released, a.host_alloc, a.host_freed, sorted(a.freed_at)) == (
            b.offloads,
            b.released,
            b.host_alloc,
            b.host_freed,
            sorted(b.freed_at),
        )


def test_tp_ranks_with_different_host_pools_are_refused() -> None:
    sc = BY_NAME["tp2-host-full-on-one-rank"]
    with pytest.raises(Exception, match="TPMismatch|disagree"):
        harness.run_scenario(sc, ProbedAdapter)


def test_summary() -> None:
    """`N of M scenarios match` (printed; run with -s), the intended differences named."""
    same = [
        sc.name
        for sc in SCENARIOS
        if sc.name not in INTENDED and not harness.diff_runs(_run(sc, harness.UpstreamManager), _run(sc, ProbedAdapter))
    ]
    print(
        f"\n{len(same)} of {len(SCENARIOS)} scenarios match; intended differences in "
        f"{len(INTENDED)}: " + "; ".join(f"{k}: {v}" for k, v in INTENDED.items())
    )
    assert len(same) == len(SCENARIOS) - len(INTENDED)
