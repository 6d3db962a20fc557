"""The bounded exhaustive explorer of the implementation.

- every way of branching (copy: one snapshot per state, clone: one per child, replay) reaches exactly the
  same states;
- a clone is independent of its original (pools, allocator masks that share a bytearray, closures);
- small bounds are explored completely without a violation, and ExplorerConfig() (3 requests x 16 slots, the
  named bounds' `three-requests` sub-bound) to a depth in CI, completely under KVFSM_FUZZ=deep;
- catalog mutants (docs/bug-catalog.md; the faults are tests/catalog_faults.py) are found with a shortest
  event trace, and the pytest file the explorer writes for it fails while the mutant is in place and
  passes once it is gone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from catalog_faults import (
    b1,
    b2,
    b3_engine as b3_faults,
    b5,
    b6_readmit,
    b7,
    b8,
    b9,
    b10,
    b13,
    b15,
    b16,
    b17,
    b17_carried,
    b20_in_flight,
)
from timing import run_watched

from kvfsm.dataplane.pools.allocator import PageSlots
from kvfsm.runtime.manager import DecodeOffloadManager
from kvfsm.verify.commands import check
from kvfsm.verify.explorer import (
    ExplorerConfig,
    World,
    apply,
    build,
    canonical_key,
    check_world,
    clone,
    counterexample_test,
    enabled,
    explore,
    replay_events,
)

DEEP = os.environ.get("KVFSM_FUZZ", "ci") == "deep"


# --- the search itself -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cfg", [ExplorerConfig(requests=1, readmits=1), ExplorerConfig(requests=2)], ids=["1req-readmit", "2req"]
)
def test_copy_and_replay_reach_the_same_states(cfg: ExplorerConfig) -> None:
    by_copy = explore(cfg, keep_keys=True)
    assert by_copy.violation is None and by_copy.complete and by_copy.snapshots > 0
    for mode in ("clone", "replay"):
        other = explore(cfg, mode=mode, keep_keys=True)
        assert other.violation is None and other.complete and other.mode == mode
        assert by_copy.keys == other.keys
        assert by_copy.coverage == other.coverage
        assert by_copy.depth == other.depth and by_copy.edges == other.edges


def test_symmetry_reduction_loses_nothing() -> None:
    cfg = ExplorerConfig(requests=2, host_slots=2, end_kinds=("finish", "retract"), backup_failures=False)
    sym, plain = explore(cfg), explore(cfg, symmetry=False)
    assert sym.violation is None and plain.violation is None and sym.complete and plain.complete
    assert sym.coverage == plain.coverage and sym.depth == plain.depth
    assert sym.states < plain.states <= 2 * sym.states


def test_clone_is_independent() -> None:
    cfg = ExplorerConfig(requests=2, decodes=3)
    w = build(cfg, [("admit", 0), ("admit", 1), ("decode", 0), ("offload", 0), ("copy", 0), ("progress",)])
    before = canonical_key(w)
    c = clone(w)
    assert canonical_key(c) == before
    for ev in [
        ("decode", 1),
        ("offload", 1),
        ("backup", 0),
        ("progress",),
        ("finish", 0),
        ("copy", 0),
        ("progress",),
        ("abort", 1),
        ("progress",),
    ]:
        apply(c, ev)
        check_world(c)
    assert canonical_key(w) == before  # the original did not move
    check_world(w)
    # the copy's pools are its own and stay self-consistent (the allocator's mask views a bytearray)
    assert c.engine.allocator.free_slots != w.engine.allocator.free_slots
    c.engine.allocator.check_conservation()
    mask = c.engine.allocator.snapshot()[1]
    assert int(mask.sum()) * cfg.page_size == c.engine.allocator.capacity - c.engine.allocator.free_slots
    # the FaultyStorage predicate and the backup jobs' closures point at the copy, not the original
    w2 = clone(w)
    apply(w2, ("backup_fail", 0))
    assert w2.engine.worker.completed() == 1 and not w2.engine.worker._done[0].ok
    assert w.engine.worker.completed() == 0 and not w.engine.fail_writes


def test_step_by_step_equals_replay() -> None:
    """A random walk through clones ends in the state that replaying its events from scratch reaches."""
    import random

    cfg = ExplorerConfig(requests=3, decodes=3, readmits=1, host_slots=4)
    rng = random.Random(7)
    w, events = World(cfg), []
    for _ in range(120):
        ev = rng.choice(enabled(w))
        w = clone(w)
        apply(w, ev)
        check_world(w)
        events.append(ev)
    assert canonical_key(replay_events(cfg, events)) == canonical_key(w)


@pytest.mark.parametrize(
    "cfg",
    [  # (the coverage test explores three more bounds completely)
        ExplorerConfig(requests=1, decodes=2, speculative=1, host_slots=2),
        ExplorerConfig(requests=2, host_slots=2, backup_queue=2),
    ],
    ids=["1req-speculative", "2req-host2-queue2"],
)
def test_small_bounds_are_clean(cfg: ExplorerConfig) -> None:
    res = explore(cfg)
    assert res.violation is None, res.violation
    assert res.complete and res.states > 50


@pytest.mark.parametrize("fenced", [False, True])
def test_default_bound_3_requests_16_slots(fenced: bool) -> None:
    """ExplorerConfig(): 3 requests x 16 device slots, with and without fences (complete under
    KVFSM_FUZZ=deep; ~10 s each)."""
    cfg = ExplorerConfig(fenced=fenced)
    assert (cfg.requests, cfg.slots) == (3, 16)
    # In a process of its own: the peak RSS it reports is the whole process's, and this session's earlier
    # tests would count against the explorer's memory.
    code = (
        "import json; from kvfsm.verify.explorer import ExplorerConfig, explore; "
        f"r = explore(ExplorerConfig(fenced={fenced}), max_depth={None if DEEP else 9}); "
        "print(json.dumps({'violation': repr(r.violation) if r.violation else None, "
        "'complete': r.complete, 'peak_rss_mib': r.peak_rss_mib}))"
    )
    proc = run_watched(
        [sys.executable, "-c", code],
        f"the default bound's exploration (fenced={fenced})",
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["violation"] is None, res["violation"]
    assert res["complete"] or not DEEP
    assert res["peak_rss_mib"] < 2048


def test_the_peak_memory_reported_is_the_process_own_not_its_parents() -> None:
    """The bound test above runs the search in a child of pytest: a child must not report its parent's
    high-water mark as its own (Linux's ru_maxrss carries it across fork and exec). A child's own peak depends
    on its torch build (a CUDA build peaks above 600 MiB importing), so it is measured first, without ballast;
    512 MiB more in the parent must then not show in the child's figure."""
    code = "from kvfsm.verify.explorer.search import peak_rss_mib; print(peak_rss_mib())"

    def child_peak() -> float:
        proc = run_watched(
            [sys.executable, "-c", code], "a child's peak_rss_mib()", cwd=Path(__file__).resolve().parents[2]
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return float(proc.stdout.strip().splitlines()[-1])

    own = child_peak()
    ballast = bytearray(512 * 2**20)
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # resident, not just reserved
    assert child_peak() < own + 256, f"the child reported its parent's 512 MiB ballast (own peak {own:.0f} MiB)"
    del ballast


def test_check_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert check(requests=1, quiet=True, out_test=tmp_path / "test_cx.py") == 0
    text = capsys.readouterr().out
    assert "no invariant violated" in text and "states" in text
    assert not (tmp_path / "test_cx.py").exists()


def test_check_command_writes_the_counterexample(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    b2(monkeypatch)
    out = tmp_path / "test_b2_counterexample.py"
    assert check(requests=2, quiet=True, out_test=out) == 1
    text = capsys.readouterr().out
    assert "violation" in text and "shortest trace (4 events)" in text and "finish r0" in text
    mod = _load(out)
    with pytest.raises(Exception, match="in-flight copy"):
        mod.test_b2_counterexample()
    monkeypatch.undo()
    mod.test_b2_counterexample()


# --- catalog mutants --------------------------------------------------------------------------------------
ONE = ExplorerConfig(requests=1)
# id -> (monkeypatch mutant or None, faults hook or None, bound, length of the shortest trace, violation names)
MUTANTS = {
    "B1": (b1, None, ONE, 3, {"live_slot_not_free", "device_accounting"}),
    "B2": (b2, None, ONE, 4, {"CheckedModeError"}),
    "B3": (None, b3_faults, ONE, 2, {"protected_accounting", "device_accounting"}),
    "B5": (b5, None, ExplorerConfig(requests=1, speculative=1), 3, {"device_accounting"}),
    "B6-readmit": (b6_readmit, None, ExplorerConfig(requests=1, readmits=1), 4, None),
    "B7": (b7, None, ExplorerConfig(requests=1, decodes=3, host_slots=2), 6, {"offload_nothing_changes_nothing"}),
    "B8": (b8, None, ONE, 6, {"device_accounting", "row_accounting"}),
    "B9": (b9, None, ONE, 3, None),
    "B10": (b10, None, ONE, 7, None),
    "B13": (b13, None, ONE, 7, {"stored_means_in_storage"}),
    "B15": (b15, None, ONE, 4, {"host_kv_content"}),
    "B16": (b16, None, ONE, 2, {"CheckedModeError"}),
    "B17": (b17, None, ExplorerConfig(requests=1, fenced=True), 5, {"CheckedModeError"}),
    "B17-carried": (
        b17_carried,
        None,
        ExplorerConfig(requests=2, decodes=2, host_slots=4, fenced=True, stream_ordered=True),
        9,
        {"CheckedModeError"},
    ),
    "B20-in-flight": (
        b20_in_flight,
        None,
        ExplorerConfig(requests=2, fenced=True, stream_ordered=True, end_kinds=("finish", "engine_release")),
        10,
        {"host_kv_content"},
    ),
}
FOUND: dict[str, tuple[int, str, int]] = {}


def _load(path: Path):
    name = f"_explorer_cx_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("mid", list(MUTANTS))
def test_explorer_finds_mutant(mid: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    inject, faults, cfg, length, names = MUTANTS[mid]
    if inject is not None:
        inject(monkeypatch)
    res = explore(cfg, faults=faults)
    cx = res.violation
    assert cx is not None, f"mutant {mid} survived {res.states} states"
    FOUND[mid] = (len(cx.events), cx.name, res.states)
    assert len(cx.events) == length, f"{mid}: trace {cx.lines()} ({cx.name}: {cx.detail})"
    if names is not None:
        assert cx.name in names, f"{mid}: {cx.name}: {cx.detail}"
    # the trace is really a shortest one: no violation at any shorter depth
    assert explore(cfg, faults=faults, max_depth=length - 1).violation is None
    # the pytest file written for it fails while the mutant is in place ...
    path = tmp_path / f"test_cx_{mid.replace('-', '_').lower()}.py"
    path.write_text(counterexample_test(cfg, cx, f"cx_{mid.replace('-', '_').lower()}"))
    mod = _load(path)
    test = getattr(mod, f"test_cx_{mid.replace('-', '_').lower()}")
    if faults is not None:  # the generated test replays without hooks: re-apply this one through replay_events
        with pytest.raises(BaseException):  # noqa: B017 - the mutant's own failure, whatever its type
            replay_events(mod.CONFIG, mod.EVENTS, faults=faults)
    else:
        with pytest.raises(BaseException):  # noqa: B017 - the mutant's own failure, whatever its type
            test()
    # ... and passes once it is gone
    monkeypatch.undo()
    test()


def test_mutant_report() -> None:
    """Printed with -s: mutant -> shortest trace length, violation, states explored."""
    if not FOUND:
        pytest.skip("the mutant tests did not run")
    for mid, (n, name, states) in sorted(FOUND.items()):
        print(f"{mid:11s} shortest trace {n} events  {name:32s} ({states} states explored)")


def test_copy_failure_or_divergence_falls_back_to_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ExplorerConfig(requests=1, readmits=1)
    plain = explore(cfg, keep_keys=True)
    assert plain.mode == "copy" and plain.fallback is None and plain.validated > 0

    def uncopyable(engine) -> None:
        engine.pending_work = (x for x in range(3))  # a generator: no copy can be faithful

    res = explore(cfg, faults=uncopyable, keep_keys=True)
    assert res.mode == "replay" and "could not be copied" in res.fallback
    assert res.keys == plain.keys

    import kvfsm.verify.explorer.expand as expand  # the module whose Snapshot and clone the search branches with

    monkeypatch.setattr(expand.Snapshot, "thaw", lambda self: World(cfg))  # a "copy" that forgets everything
    monkeypatch.setattr(expand, "clone", lambda w: World(w.config))
    for mode in ("copy", "clone"):
        res = explore(cfg, keep_keys=True, validate_every=1, mode=mode)
        assert res.mode == "replay" and ("diverged" in res.fallback or "does not happen" in res.fallback)
        assert res.keys == plain.keys


def test_offload_batch_event_catches_a_batch_only_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    """The explorer's offload_batch event reaches code a loop of offload() never runs: a device-slot
    gather that is wrong only for multi-chunk batches is caught there and only there."""
    right = DecodeOffloadManager._copy_slots

    def wrong(self, due, host_pages):  # type: ignore[no-untyped-def]
        device, host = right(self, due, host_pages)
        if len(due) > 1:
            device = (device.slots if isinstance(device, PageSlots) else device).clone()
            device[due[0][2] :] += 2  # the second chunk reads slots two past its own
        return device, host

    monkeypatch.setattr(DecodeOffloadManager, "_copy_slots", wrong)
    res = explore(ExplorerConfig(requests=2, decodes=2), max_depth=12)
    assert res.violation is not None and res.violation.name == "offload_own_slots"
    assert res.violation.events[-1] == ("offload_batch",)
    assert explore(ExplorerConfig(requests=2, decodes=2, batch_offload=False), max_depth=12).violation is None
