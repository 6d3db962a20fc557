"""The catalog's faults (docs/bug-catalog.md), one per bug class: each injects its bug into the runtime
with `monkeypatch`. Shared by the stateful suite (tests/stateful/test_mutants.py), which must fail with
each fault in place, and the bounded explorer (tests/verify/test_explorer.py), which must find a shortest
trace to it. A fault whose bug neither can see (most of B18 to B21: an allocator's refusal, the order of
resubmitted backups, an integration's fenced free, the explorer's own checks) must instead fail the
component test that guards it, which test_mutants.py runs in a pytest of its own that loads this module as
a plugin (`-p catalog_faults`). Each fault's docstring is what docs/mutants.md says it injects.

Every mutant these suites run is defined here and nowhere else, and each bites in checked and unchecked
mode alike (`_wrap_action` patches an action's single and batch forms): `b<n>(mp)` patches the runtime's classes
(the form both suites use), `b3_engine(engine)` is the explorer's per-engine `faults` hook for the same B3
fault (the explorer copies worlds, so it injects into each engine it builds), and `b14` is the TP fault the
stateful suite's two-rank harness runs.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import sys
from collections.abc import Callable

import pytest
import torch

import kvfsm.dataplane.copy.base as copy_engine
import kvfsm.generated.decode_offload as gen
from kvfsm.dataplane import HostKVPool, TokenSlotAllocator
from kvfsm.dataplane.fences import SlotFence
from kvfsm.generated.decode_offload import DecodeOffloadMachine
from kvfsm.runtime import SimplePrefixCache
from kvfsm.runtime.backup import Job
from kvfsm.runtime.effects import OffloadEffects
from kvfsm.runtime.manager import DecodeOffloadManager
from kvfsm.runtime.tp import ProgressConsensus
from kvfsm.verify.engine import SimEngine

# --- helpers ---------------------------------------------------------------------------------------------


def _wrap(mp: pytest.MonkeyPatch, cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    mp.setattr(cls, name, make(getattr(cls, name)))


def _wrap_action(mp: pytest.MonkeyPatch, name: str, make: Callable[[Callable], Callable]) -> None:
    """Inject a fault into a spec action in both forms the generated machine calls: the single form (checked
    mode's item-by-item events) and the batch form `<name>_each` (unchecked mode's batch events, what
    production runs). `make(orig)` returns the faulty single form; the batch form runs it item by item, its
    `orig` being the real batch form on one item (so the fault never recurses through the patched pair)."""
    real_each = getattr(OffloadEffects, f"{name}_each")
    faulty = make(lambda self, m, arg: real_each(self, [(m, arg)]))
    mp.setattr(OffloadEffects, name, faulty)
    mp.setattr(OffloadEffects, f"{name}_each", lambda self, items: [faulty(self, m, arg) for m, arg in items] and None)


def _wrap_end_events(mp: pytest.MonkeyPatch, fn: Callable) -> None:
    """fn(orig, machine, event, arg) replaces finish/abort/retract of the generated machine."""
    for event in ("finish", "abort", "retract"):
        orig = getattr(DecodeOffloadMachine, event)
        mp.setattr(DecodeOffloadMachine, event, lambda self, arg=None, _o=orig, _e=event: fn(_o, self, _e, arg))


def b1(mp: pytest.MonkeyPatch) -> None:
    """The first offload of a request frees its prefill-aligned device slots (skipping the ledger)."""

    def make(orig):
        def start_copy(self, m, chunk):
            orig(self, m, chunk)
            rec = chunk.record
            if chunk.start == rec.prefill_len and rec.prefill_len:
                self.allocator.free(self.req_to_token.req_to_token[rec.row, : rec.prefill_len].clone())

        return start_copy

    _wrap_action(mp, "start_copy", make)


def b2(mp: pytest.MonkeyPatch) -> None:
    """finish/abort/retract free the device slots at once, although a copy still reads them."""

    def end(orig, m, event, arg):
        was = m.state
        orig(m, arg)
        if was == gen.OFFLOADING:
            m.fx.release_request(m, arg)
            m.ctx.released_early = True

    def make(orig):
        def release_request(self, m, arg):
            if getattr(m.ctx, "released_early", False) and m.ctx.req is None:
                return  # the deferred release at the last copy ack: already done
            orig(self, m, arg)

        return release_request

    _wrap_end_events(mp, end)
    _wrap(mp, OffloadEffects, "release_request", make)


def b3(mp: pytest.MonkeyPatch) -> None:
    """Release never unlocks the matched prefix: the prefix cache's protected size never comes down (S #12774)."""
    mp.setattr(SimplePrefixCache, "unlock", lambda self, lock: None)


def b3_engine(engine) -> None:
    """The `faults` hook: release never unlocks the matched prefix (S #12774)."""
    engine.protected.unlock = lambda lock: None


def b3_host(mp: pytest.MonkeyPatch) -> None:
    """A failed backup never returns its chunk's host slots."""

    def make(orig):
        def free_host_chunk(self, m, chunk):
            if getattr(chunk, "write", None) is not None and not chunk.ok:  # its backup was submitted, and failed
                return
            orig(self, m, chunk)

        return free_host_chunk

    _wrap_action(mp, "free_host_chunk", make)


def b4(mp: pytest.MonkeyPatch) -> None:
    """Release unlocks the matched prefix twice: the protected size is decremented twice (S #27666)."""

    def make(orig):
        def release_request(self, m, arg):
            lock = m.ctx.lock
            orig(self, m, arg)
            self.prefix_cache.unlock(lock)

        return release_request

    _wrap(mp, OffloadEffects, "release_request", make)


def b5(mp: pytest.MonkeyPatch) -> None:
    """Release frees [prefix_len, ceil_page(committed)) only: the speculative over-allocation leaks (S #19518)."""

    def make(orig):
        def request_slots(self, rec):
            committed, _ = rec.end_lengths or (rec.req.kv_committed_len, rec.req.kv_allocated_len)
            pages = -(-committed // self.page_size)
            starts = self.req_to_token.req_to_token[rec.row, rec.prefix_len : pages * self.page_size : self.page_size]
            starts = starts - starts % self.page_size
            return (starts[:, None] + self._offsets).reshape(-1)

        return request_slots

    _wrap(mp, OffloadEffects, "request_slots", make)


def b6(mp: pytest.MonkeyPatch) -> None:
    """Records keyed by rid: a new request with a reused rid inherits the old one's lifecycle (S #37026)."""

    def make_admit(orig):
        def _admit(self, req):
            rec = self._records.get(req.rid)
            if rec is not None:  # the bug: a request with a reused rid finds the old lifecycle
                return rec
            rec = orig(self, req)
            self._records.pop(id(req), None)
            self._records[req.rid] = rec
            return rec

        return _admit

    def _end(self, req, event):
        rec = self._records.get(req.rid)
        if rec is None:
            if req.req_pool_idx in (None, -1):
                return
            rec = self._admit(req)
        getattr(rec.machine, event)(None)

    _wrap(mp, DecodeOffloadManager, "_admit", make_admit)
    mp.setattr(DecodeOffloadManager, "_end", _end)


def b6_readmit(mp: pytest.MonkeyPatch) -> None:
    """A re-admitted request object (retract, then admit) keeps driving its ended lifecycle."""
    mp.setattr(DecodeOffloadManager, "_readmitted", lambda self, rec, req: False)


def b7(mp: pytest.MonkeyPatch) -> None:
    """Offload progress is recorded before the host allocation, which then fails (S #30031)."""

    def make(orig):
        def count_host_full(self, m, arg):
            orig(self, m, arg)
            m.ctx.inc_len += self.page_size

        return count_host_full

    _wrap(mp, OffloadEffects, "count_host_full", make)


def b8(mp: pytest.MonkeyPatch) -> None:
    """Abort while a copy is in flight: the deferred release forgets the device slots and the row (S #21652)."""

    def end(orig, m, event, arg):
        if event == "abort" and m.state == gen.OFFLOADING:
            m.ctx.aborted_in_flight = True
        orig(m, arg)

    def make(orig):
        def release_request(self, m, arg):
            rec = m.ctx
            if not getattr(rec, "aborted_in_flight", False):
                return orig(self, m, arg)
            self.prefix_cache.unlock(rec.lock)
            rec.lock = None
            if rec.req.req_pool_idx == rec.row:
                rec.req.req_pool_idx = None
            rec.req = None

        return release_request

    _wrap_end_events(mp, end)
    _wrap(mp, OffloadEffects, "release_request", make)


def b9(mp: pytest.MonkeyPatch) -> None:
    """A second finish/abort/retract after release is not ignored: it releases again."""

    def end(orig, m, event, arg):
        if m.state in (gen.DRAINING, gen.RELEASED) and m.ctx.req is not None:
            m.fx.release_request(m, arg)
        orig(m, arg)

    def make(orig):
        def release_request(self, m, arg):
            req = m.ctx.req
            orig(self, m, arg)
            m.ctx.req = req  # keep it, as a release path that does not know it already ran would

        return release_request

    _wrap_end_events(mp, end)
    _wrap(mp, OffloadEffects, "release_request", make)


def b10(mp: pytest.MonkeyPatch) -> None:
    """A failed backup frees its chunk's host slots in the failure path, and the collection frees them again."""

    def make(orig):
        def count_backup_failure(self, m, chunk):
            orig(self, m, chunk)
            self.host_pool.free(chunk.host_indices)

        return count_backup_failure

    _wrap_action(mp, "count_backup_failure", make)


def b11(mp: pytest.MonkeyPatch) -> None:
    """Release frees [prefix_len, committed) and [committed, allocated) as two ranges not split at a page boundary (S #38941)."""

    def make(orig):
        def request_slots(self, rec):
            ps = self.page_size
            committed, allocated = rec.end_lengths or (rec.req.kv_committed_len, rec.req.kv_allocated_len)
            positions = list(range(rec.prefix_len, committed, ps)) + list(
                range(max(committed, rec.prefix_len), max(allocated, committed), ps)
            )
            if not positions:
                return torch.empty(0, dtype=torch.int64)
            starts = self.req_to_token.req_to_token[rec.row, torch.tensor(positions)]
            starts = starts - starts % ps
            return (starts[:, None] + self._offsets).reshape(-1)

        return request_slots

    _wrap(mp, OffloadEffects, "request_slots", make)


def b12(mp: pytest.MonkeyPatch) -> None:
    """One free batch names a page twice (V #42571): the release batch repeats its last page."""

    def make(orig):
        def request_slots(self, rec):
            slots = orig(self, rec)
            return torch.cat([slots, slots[-self.page_size :]]) if slots.numel() else slots

        return request_slots

    _wrap(mp, OffloadEffects, "request_slots", make)


def b13(mp: pytest.MonkeyPatch) -> None:
    """A failed backup is treated as a success: its pages are reported as stored (D #15079)."""

    def make(orig):
        def count_backup_failure(self, m, chunk):
            orig(self, m, chunk)
            self.mark_stored(m, chunk)

        return count_backup_failure

    _wrap_action(mp, "count_backup_failure", make)


def b14(mp: pytest.MonkeyPatch) -> None:
    """ProgressConsensus.agree returns this rank's own counts (no MIN all-reduce)."""
    mp.setattr(ProgressConsensus, "agree", lambda self, *counts: counts)


def b15(mp: pytest.MonkeyPatch) -> None:
    """Copies written `dst[idx].copy_(src[idx])`: they write a temporary and move nothing (HF PR #45184)."""

    def torch_copy_rows(src5, src_idx, dst5, dst_idx):
        dst5[:, :, dst_idx.to(dst5.device)].copy_(src5[:, :, src_idx.to(src5.device)].to(dst5.device))

    mp.setattr(copy_engine, "torch_copy_rows", torch_copy_rows)


def b16(mp: pytest.MonkeyPatch) -> None:
    """Release frees [0, allocated), the matched prefix's pages included (SGLang 0.5.23 frees from cache_protected_len)."""

    def make(orig):
        def request_slots(self, rec):
            prefix, rec.prefix_len = rec.prefix_len, 0
            try:
                return orig(self, rec)
            finally:
                rec.prefix_len = prefix

        return request_slots

    _wrap(mp, OffloadEffects, "request_slots", make)


def b17(mp: pytest.MonkeyPatch) -> None:
    """The writer of a reused device slot skips the wait on its fence, writing under a copy still reading it (S #17216)."""
    mp.setattr(SimEngine, "_wait", lambda self, fences: None)


def b17_carried(mp: pytest.MonkeyPatch) -> None:
    """A reused device slot freed again before its old copy landed goes back without that copy's fence, though a wait orders only the stream that made it."""
    orig = TokenSlotAllocator._put_free

    def put_free(self: TokenSlotAllocator, pages: list[int], fence: object) -> None:
        for p in pages:
            self._held_fence.pop(p, None)
        orig(self, pages, fence)

    mp.setattr(TokenSlotAllocator, "_put_free", put_free)


# --- B18 to B21: what the stateful machine mostly takes as given (an allocator's refusal, the order of
# resubmitted backups, a store's exception type, an integration's fenced free, the explorer's own checks).
# A component test catches each of these faults but b20_in_flight: test_mutants.py's COMPONENT_MUTANTS runs
# that test in a pytest of its own with the fault in place from the start (`-p catalog_faults`, below).


def b18(mp: pytest.MonkeyPatch) -> None:
    """The allocator refuses k pages unless k + 1 are free to it (`>=` for `>`; device and host pool alike): a spurious out-of-slots or host-full."""
    plain, fenced = TokenSlotAllocator.alloc_pages, TokenSlotAllocator.alloc_pages_fenced
    inner = [False]  # alloc_pages_fenced takes its plain pages through alloc_pages: one comparison per call

    def alloc_pages(self: TokenSlotAllocator, k: int) -> list[int] | None:
        if not inner[0] and k and k >= len(self._free_pages):
            self.reclaim_fenced()
            if k >= len(self._free_pages):
                return None
        return plain(self, k)

    def alloc_pages_fenced(self: TokenSlotAllocator, k: int):  # type: ignore[no-untyped-def]
        if k and k >= len(self._free_pages) + len(self._fenced_pages):
            return None
        inner[0] = True
        try:
            return fenced(self, k)
        finally:
            inner[0] = False

    mp.setattr(TokenSlotAllocator, "alloc_pages", alloc_pages)
    mp.setattr(TokenSlotAllocator, "alloc_pages_fenced", alloc_pages_fenced)


def b18_fenced(mp: pytest.MonkeyPatch) -> None:
    """A plain allocation never looks at the fenced free pages: pages whose fence has passed stay unusable until a fenced allocation takes them."""
    mp.setattr(TokenSlotAllocator, "reclaim_fenced", lambda self: 0)


class _NewestFirst(collections.deque):
    """The parked chunks, resubmitted newest first."""

    def popleft(self):  # type: ignore[no-untyped-def]
        return self.pop()


def b18_parked(mp: pytest.MonkeyPatch) -> None:
    """Chunks parked by a full backup queue are resubmitted newest first: the oldest starves behind newer copies, holding its host pages."""
    orig = OffloadEffects.__init__

    def __init__(self: OffloadEffects, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        orig(self, *args, **kwargs)
        self.parked = _NewestFirst(self.parked)

    mp.setattr(OffloadEffects, "__init__", __init__)


def b19(mp: pytest.MonkeyPatch) -> None:
    """A backup job catches only the errors a store is expected to raise (OSError, ValueError): a client library's own exception escapes the backup worker."""

    def run(self: Job) -> None:
        try:
            self.results = tuple(self.write(self.payload))
        except (OSError, ValueError) as exc:
            self.error = exc
            self.results = ()

    mp.setattr(Job, "run", run)


def b19_partial(mp: pytest.MonkeyPatch) -> None:
    """The coalescing engine's flush is undone whole when the inner engine refuses a later group: the groups it already submitted are queued again and copied twice."""
    from kvfsm.dataplane.copy.coalescing import CoalescingCopyEngine

    orig = CoalescingCopyEngine.flush

    def flush(self: CoalescingCopyEngine) -> None:
        queued = [(h, h.plan) for h in self._queue]
        try:
            orig(self)
        except BaseException:
            for h, plan in queued:
                h.plan = plan
            self._queue = [h for h, _ in queued]
            raise

    mp.setattr(CoalescingCopyEngine, "flush", flush)


def b19_batch(mp: pytest.MonkeyPatch) -> None:
    """An offload batch whose shared copy is refused keeps the host pages it took for every chunk of the batch."""
    orig = HostKVPool.undo_alloc

    def undo_alloc(self: HostKVPool, indices: object) -> None:
        if sys.exc_info()[1] is None:  # a stale reservation's pages still go back; a refusal's do not
            orig(self, indices)

    mp.setattr(HostKVPool, "undo_alloc", undo_alloc)


def b20(mp: pytest.MonkeyPatch) -> None:
    """The SGLang adapter's fenced free marks the fence waited without enqueueing the stream wait: the next writer is ordered after nothing."""
    from kvfsm.integrations.sglang.objects import AllocatorView

    orig = AllocatorView.free

    def free(self: AllocatorView, slots: torch.Tensor, fence: SlotFence | None = None) -> None:
        if fence is not None and not fence.passed():
            fence.mark_waited()
        orig(self, slots)

    mp.setattr(AllocatorView, "free", free)


# Faults inside an optional integration, with the package each patches: where it is not installed (the oldest row
# of tests/compat/matrix.py), a test that injects one skips, as the integration's own tests do, unless
# KVFSM_REQUIRE_<PACKAGE>=1 asks that it be there.
NEEDS = {"b20_swap_out": "transformers"}


def missing(fault: Callable[..., object]) -> str | None:
    """The package `fault` patches when it is not installed, else None."""
    pkg = NEEDS.get(fault.__name__)
    return pkg if pkg is not None and importlib.util.find_spec(pkg) is None else None


def skip_if_missing(fault: Callable[..., object]) -> None:
    pkg = missing(fault)
    if pkg is not None:
        reason = f"{fault.__name__} patches the {pkg} integration and {pkg} is not installed"
        if os.environ.get(f"KVFSM_REQUIRE_{pkg.upper()}") == "1":
            pytest.fail(f"{reason} (KVFSM_REQUIRE_{pkg.upper()}=1)", pytrace=False)
        pytest.skip(reason)


def b20_swap_out(mp: pytest.MonkeyPatch) -> None:
    """Transformers' fenced swap-out marks the copy's fence waited without enqueueing the compute stream's wait."""
    import kvfsm.integrations.transformers.effects as swap_effects

    class MarkedOnly(SlotFence):
        __slots__ = ()

        def wait(self, stream: object | None = None) -> None:
            self.mark_waited()

    mp.setattr(swap_effects, "SlotFence", MarkedOnly)


def b20_in_flight(mp: pytest.MonkeyPatch) -> None:
    """fence_copies_in_flight records the copies in flight as fenced without enqueueing a wait on any of them."""

    def fence_copies_in_flight(self: DecodeOffloadManager, stream: object = None) -> int:
        self.fx.fenced_handles = {id(c.handle) for c in self.fx.copy_fifo}
        return len(self.fx.fenced_handles)

    mp.setattr(DecodeOffloadManager, "fence_copies_in_flight", fence_copies_in_flight)


def _weaken(mp: pytest.MonkeyPatch, module: object, name: str, old: str, new: str) -> None:
    """Replace function `name` of `module` with its source edited `old` -> `new` (exactly one occurrence),
    under every name a loaded kvfsm module imported it as."""
    import inspect
    import textwrap

    fn = getattr(module, name)
    src = textwrap.dedent(inspect.getsource(fn))
    if src.count(old) != 1:
        raise AssertionError(f"{module.__name__}.{name} no longer has exactly one {old!r}: the fault needs updating")
    ns: dict = {}
    exec(compile(src.replace(old, new), inspect.getsourcefile(fn) or "<fault>", "exec"), vars(module), ns)
    for mod in [m for k, m in sys.modules.items() if k.split(".")[0] == "kvfsm"]:
        if getattr(mod, name, None) is fn:
            mp.setattr(mod, name, ns[name])


def b21(mp: pytest.MonkeyPatch) -> None:
    """The explorer's host-content check skips the last completed copy (`for c in done[:-1]`)."""
    import kvfsm.verify.explorer.checks as checks

    _weaken(mp, checks, "check_world", "for c in done:", "for c in done[:-1]:")


def b21_first(mp: pytest.MonkeyPatch) -> None:
    """The explorer's host-content check looks only at the first completed copy (`for c in done[:1]`)."""
    import kvfsm.verify.explorer.checks as checks

    _weaken(mp, checks, "check_world", "for c in done:", "for c in done[:1]:")


def pytest_configure(config: pytest.Config) -> None:
    """Loaded as a plugin (`-p catalog_faults`, tests/ on the path) with KVFSM_CATALOG_FAULT naming a fault:
    the session runs with it in place from before collection, so a test module's `from x import f` sees it
    too; hypothesis derandomized and without shrinking, so which test fails first is the same every run."""
    name = os.environ.get("KVFSM_CATALOG_FAULT")
    if not name:
        return
    fault = globals().get(name)
    if not callable(fault) or not name.startswith("b"):
        raise pytest.UsageError(f"KVFSM_CATALOG_FAULT={name!r} names no fault of tests/catalog_faults.py")
    from hypothesis import HealthCheck, Phase, settings

    settings.register_profile(
        "catalog-fault",
        parent=settings.default,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
    )
    settings.load_profile("catalog-fault")
    mp = pytest.MonkeyPatch()
    fault(mp)
    config.add_cleanup(mp.undo)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Loaded as that plugin: the first test that fails (node id, phase, error) is written, as JSON, to
    KVFSM_CATALOG_FAULT_REPORT, which the mutant report quotes."""
    path = os.environ.get("KVFSM_CATALOG_FAULT_REPORT")
    if not path or not os.environ.get("KVFSM_CATALOG_FAULT") or not report.failed or os.path.exists(path):
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    with open(path, "w") as f:
        json.dump(
            {
                "nodeid": report.nodeid,
                "when": report.when,
                "message": crash.message if crash is not None else str(report.longrepr),
            },
            f,
        )
