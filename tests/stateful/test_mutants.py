"""Catalog mutants: for each bug class of docs/bug-catalog.md, a fault injected into the
runtime with `monkeypatch` (tests/catalog_faults.py, shared with the explorer's tests), and proof that the
stateful suite catches it.

Each mutant test runs the stateful machine of test_manager_machine.py (its own step counter, derandomized,
no example database) with the fault in place and asserts that the run FAILS; it records the first failing
check (an invariant name, or the exception a guard raised), the rule steps it took to get there and the
steps of the shrunk example. B14 (TP ranks diverge; its fault is `b14` of the catalog too) runs two ranks in
one process: two SimEngines whose `check_progress` calls meet in a thread barrier standing in for the MIN
all-reduce (the real ProgressConsensus code runs; only torch.distributed.all_reduce is replaced by the
in-process exchange).

The classes the stateful machine takes as given (an allocator's refusal, the order of resubmitted backups, a
store's exception type, an integration's fenced free, the explorer's own checks) are caught by component
tests instead: COMPONENT_MUTANTS runs each such test in a pytest of its own with the fault in place from the
start, and records the first test that failed.

`python tests/stateful/report_mutants.py` (or KVFSM_MUTANT_REPORT=docs/mutants.md pytest this file) writes
the Markdown report docs/mutants.md.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import test_manager_machine as tm
from catalog_faults import (
    b1,
    b2,
    b3,
    b3_host,
    b4,
    b5,
    b6,
    b6_readmit,
    b7,
    b8,
    b9,
    b10,
    b11,
    b12,
    b13,
    b14,
    b15,
    b16,
    b17,
    b17_carried,
    b18,
    b18_fenced,
    b18_parked,
    b19,
    b19_batch,
    b19_partial,
    b20,
    b20_in_flight,
    b20_swap_out,
    b21,
    b21_first,
    missing,
    skip_if_missing,
)
from timing import join_all, run_watched
from tp_threads import ThreadGroup, route_all_reduce

from kvfsm.runtime.tp import ProgressConsensus
from kvfsm.verify.engine import SimEngine

DEEP = tm.DEEP
REPORT: dict[str, dict[str, Any]] = {}

# id -> (bug class, fault, checked mode)
MUTANTS: dict[str, tuple[str, Callable[[pytest.MonkeyPatch], None], bool]] = {
    "B1": ("premature free of attended slots", b1, True),
    "B2": ("free while a copy still reads the slot", b2, True),
    "B2-unchecked": ("free while a copy still reads the slot (ledger off)", b2, False),
    "B3": ("accounting leak (protected size)", b3, True),
    "B3-host": ("accounting leak (host slots of failed backups)", b3_host, True),
    "B4": ("accounting underflow / double decrement", b4, True),
    "B5": ("over-allocation leak", b5, True),
    "B6": ("stale per-request state on rid reuse", b6, True),
    "B6-readmit": ("stale per-request state on re-admission of a retracted request", b6_readmit, True),
    "B7": ("stale state on host allocation failure", b7, True),
    "B8": ("leak on abort mid-offload", b8, True),
    "B9": ("double release", b9, True),
    "B10": ("host-pool double free", b10, True),
    "B11": ("page split double free", b11, True),
    "B12": ("duplicate id in one free batch", b12, True),
    "B13": ("failed transfer treated as success", b13, True),
    "B15": ("copy that silently moves nothing", b15, True),
    "B16": ("release frees the prefix cache's pages", b16, True),
    "B17": ("reuse of a fenced slot before its copy landed", b17, True),
    "B17-unchecked": ("reuse of a fenced slot before its copy landed (ledger off)", b17, False),
    "B17-carried": ("reuse of a fenced slot before its copy landed (a reused slot freed again)", b17_carried, True),
    "B20-in-flight": ("fence marked waited, no wait enqueued (fence_copies_in_flight)", b20_in_flight, True),
}

ROOT = Path(__file__).resolve().parents[2]
WAITS = "fence marked waited, no wait enqueued"
ROOM = "refusal or starvation while there is room"
UNPLANNED = "unplanned fault: a foreign exception or a partial refusal"
# id -> (bug class, fault, the component tests (paths or node ids, from the repository root) that must fail)
COMPONENT_MUTANTS: dict[str, tuple[str, Callable[[pytest.MonkeyPatch], None], tuple[str, ...]]] = {
    "B18": (ROOM, b18, ("tests/dataplane/test_allocator_liveness.py",)),
    "B18-fenced": (f"{ROOM} (pages whose fence passed)", b18_fenced, ("tests/dataplane/test_allocator_liveness.py",)),
    "B18-parked": (f"{ROOM} (parked chunks)", b18_parked, ("tests/runtime/test_parked_fairness.py",)),
    "B19": (
        UNPLANNED,
        b19,
        ("tests/runtime/test_fault_breadth.py::test_a_store_that_raises_anything_fails_that_backup_and_nothing_else",),
    ),
    "B19-partial": (f"{UNPLANNED} (coalescing flush)", b19_partial, ("tests/dataplane/test_copy_engine.py",)),
    "B19-batch": (f"{UNPLANNED} (an offload batch's shared copy)", b19_batch, ("tests/runtime/test_offload_batch.py",)),
    "B20": (WAITS, b20, ("tests/dataplane/test_fence_waits.py",)),
    "B20-swap-out": (
        f"{WAITS} (transformers' fenced swap-out)",
        b20_swap_out,
        (
            "tests/integrations/test_transformers_swap.py::"
            "test_a_fenced_swap_out_enqueues_the_compute_streams_wait_before_the_blocks_go_back",
        ),
    ),
    "B21": ("weakened explorer check", b21, ("tests/verify/test_checks_fire.py",)),
    "B21-first": (
        "weakened explorer check (only the first landed copy)",
        b21_first,
        ("tests/verify/test_checks_fire.py",),
    ),
}

# Shrinking a failing run costs minutes per mutant; CI only needs the catch. The report script turns it on,
# bounded to SHRINK_SECONDS per mutant, to give the length of a minimal failing example.
SHRINK_SECONDS = float(os.environ.get("KVFSM_MUTANT_SHRINK", "0"))
MUTANT_SETTINGS = dict(
    max_examples=1000 if DEEP else 300,
    stateful_step_count=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=(Phase.explicit, Phase.generate) + ((Phase.shrink,) if SHRINK_SECONDS > 0 else ()),
)


@pytest.mark.parametrize("mid", list(MUTANTS))
def test_mutant_is_caught(mid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    bug, inject, checked = MUTANTS[mid]
    machine = type(
        f"Mutant_{mid.replace('-', '_')}", (tm.ManagerMachine,), {"bucket": f"mutant:{mid}", "checked": checked}
    )
    if SHRINK_SECONDS > 0:
        import hypothesis.internal.conjecture.engine as conjecture_engine

        monkeypatch.setattr(conjecture_engine, "MAX_SHRINKING_SECONDS", SHRINK_SECONDS)
    inject(monkeypatch)
    t0 = time.perf_counter()
    error: Optional[BaseException] = None
    try:
        run_state_machine_as_test(machine, settings=settings(**MUTANT_SETTINGS))
    except BaseException as exc:  # noqa: BLE001 - any failure is the catch
        error = exc
    finally:
        monkeypatch.undo()
    elapsed = time.perf_counter() - t0
    first = tm.FIRST_FAILURE.get(machine.bucket)
    last = tm.LAST_FAILURE.get(machine.bucket)
    REPORT[mid] = {
        "bug": bug,
        "fault": (inject.__doc__ or "").strip(),
        "checked": checked,
        "caught": error is not None,
        "first": first,
        "last": last,
        "steps_run": tm.STEPS.get(machine.bucket, 0),
        "seconds": elapsed,
    }
    assert error is not None, f"mutant {mid} survived {tm.STEPS.get(machine.bucket, 0)} steps"
    assert first is not None, f"mutant {mid}: failure outside the machine's steps: {error!r}"


@pytest.mark.parametrize("mid", list(COMPONENT_MUTANTS))
def test_component_mutant_is_caught(mid: str, tmp_path: Path) -> None:
    """The fault in place from before collection (a test module's `from x import f` sees it too), the tests
    run until the first failure, which must be a test's own (its call, not its set-up or a collection)."""
    bug, inject, tests = COMPONENT_MUTANTS[mid]
    skip_if_missing(inject)
    first_file = tmp_path / "first_failure.json"
    env = dict(
        os.environ,
        KVFSM_CATALOG_FAULT=inject.__name__,
        KVFSM_CATALOG_FAULT_REPORT=str(first_file),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p),
    )
    t0 = time.perf_counter()
    proc = run_watched(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "catalog_faults", *tests],
        f"the component tests of mutant {mid}",
        cwd=ROOT,
        env=env,
    )
    first = json.loads(first_file.read_text()) if first_file.exists() else None
    caught = proc.returncode == 1 and first is not None and first["when"] == "call"
    REPORT[mid] = {
        "bug": bug,
        "fault": (inject.__doc__ or "").strip(),
        "checked": True,
        "caught": caught,
        "component": True,
        "last": None,
        "steps_run": None,
        "seconds": time.perf_counter() - t0,
        "first": first and {"check": first["nodeid"], "exc": first["message"].strip().splitlines()[0]},
    }
    assert caught, (
        f"mutant {mid} survived {' '.join(tests)} (exit {proc.returncode}, first failure {first}):\n"
        f"{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
    )


# --- B14: TP ranks diverge -----------------------------------------------------------------------------


def _tp_engine(group: ThreadGroup, log: list) -> SimEngine:
    e = SimEngine(page_size=2, stride=4, device_slots=96, host_slots=16, rows=4, max_context=48, backup_queue=2)
    consensus = ProgressConsensus(None)
    consensus.group, consensus.world = group, group.world  # the real agree(), over the in-process group
    e.manager.consensus = consensus
    alloc_free, host_free = e.allocator.free, e.host_pool.free_pages
    e.allocator.free = lambda idx: (log.append(("device_free", torch.as_tensor(idx).tolist())), alloc_free(idx))[1]
    e.host_pool.free_pages = lambda pages: (
        log.append(("host_free", e.host_pool.slots_of(pages).tolist())),
        host_free(pages),
    )[1]
    return e


def run_tp_ranks(seed: int, iterations: int = 80, group: Optional[ThreadGroup] = None) -> Optional[str]:
    """Two ranks, identical scheduler decisions, rank-specific completion timing; the first divergence of
    their free logs (device and host frees, in order) or stored keys, or None."""
    group = group or ThreadGroup(2)
    logs: list[list] = [[], []]
    engines = [_tp_engine(group, logs[r]) for r in range(2)]
    timing = [random.Random(seed * 7 + r + 1) for r in range(2)]
    errors: list[BaseException] = []

    def progress(rank: int) -> None:
        group.bind(rank)
        try:
            e, rng = engines[rank], timing[rank]
            pending = [h for h in e.copies.pending if rng.random() < 0.5]
            rng.shuffle(pending)
            for h in pending:
                e.copies.complete(h)
            while e.worker.pending and rng.random() < 0.5:  # one backup thread per rank: FIFO
                e.worker.run(0)
            e.manager.check_progress()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            group.abort()

    work = random.Random(seed)
    retracted: list[list] = [[], []]
    for it in range(iterations):
        # The scheduler: the same decisions on both ranks (requests correspond by position).
        plan: list[tuple] = []
        if work.random() < 0.4:
            plan.append(("admit", work.randrange(1, 10), work.randrange(0, 3), work.random() < 0.5))
        for k in range(4):
            plan.append(("step", k, work.choice((0, 0, 1, 3)), work.random()))
        for rank, e in enumerate(engines):
            for act in plan:
                if act[0] == "admit":
                    if act[3] and retracted[rank]:
                        e.admit("", 0, req=retracted[rank].pop(0))
                    else:
                        e.admit(f"r{it}", act[1], act[2])
                elif act[1] < len(e.live):
                    req = e.live[act[1]]
                    if act[3] < 0.05:
                        e.end(req, "finish")
                    elif act[3] < 0.08:
                        e.end(req, "retract")
                        retracted[rank].append(req)
                    elif not e.decode(req, act[2]):
                        e.end(req, "abort")
                    else:
                        e.manager.offload(req)
        threads = [threading.Thread(target=progress, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        join_all(threads, f"iteration {it}: both ranks' progress checks", 60)
        if errors:
            raise errors[0]
        if logs[0] != logs[1]:
            i = next((i for i, (a, b) in enumerate(zip(*logs)) if a != b), min(map(len, logs)))
            return f"iteration {it}: free #{i} differs: {logs[0][i : i + 1]} vs {logs[1][i : i + 1]}"
        stored = [sorted(e.manager.fx.stored) for e in engines]
        if stored[0] != stored[1]:
            return f"iteration {it}: stored keys differ ({len(stored[0])} vs {len(stored[1])})"
    return None


TP_SEEDS = range(40 if DEEP else 8)


def test_tp_ranks_agree_with_consensus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness itself: with the real MIN consensus both ranks free and store identically."""
    route_all_reduce(monkeypatch)  # the consensus's own reduction op reaches the in-process group
    for seed in TP_SEEDS:
        group = ThreadGroup(2)
        assert run_tp_ranks(seed, group=group) is None, f"seed {seed}: ranks diverged with consensus"
        assert group.calls, "the consensus never reduced across the ranks"


def test_mutant_b14_tp_divergence_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    route_all_reduce(monkeypatch)
    b14(monkeypatch)  # the fault: no MIN
    t0 = time.perf_counter()
    found = None
    for seed in TP_SEEDS:
        found = run_tp_ranks(seed)
        if found:
            break
    REPORT["B14"] = {
        "bug": "TP ranks diverge",
        "checked": True,
        "caught": found is not None,
        "fault": (b14.__doc__ or "").strip(),
        "first": {
            "check": "tp_identical_frees",
            "exc": found or "",
            "steps_total": None,
            "steps_example": None,
            "seed": seed,
        },
        "last": None,
        "steps_run": None,
        "seconds": time.perf_counter() - t0,
    }
    assert found, "ranks never diverged without consensus: the harness could not fail"


# --- the report ------------------------------------------------------------------------------------------


def _md(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def write_report(path: Path) -> None:
    lines = [
        "# Catalog mutants",
        "",
        "Generated by `tests/stateful/report_mutants.py` from `tests/stateful/test_mutants.py`: each bug class of",
        "[`docs/bug-catalog.md`](bug-catalog.md) injected into the runtime with `monkeypatch`, then the stateful machine of",
        "`tests/stateful/test_manager_machine.py` run (derandomized) until it fails. *First check* is what",
        "failed first: an invariant of the stateful suite, or the exception a guard raised (the checked-mode",
        "ledger's `CheckedModeError`, an allocator's typed error, a spec `EventRejected`). *Steps to failure*",
        "counts rule steps from the start of the run to the first failure; *shrunk* is the length of the",
        "minimal failing example hypothesis reduced it to.",
        "",
        "| mutant | bug class | fault injected | caught | first check | steps to failure | shrunk | first failure |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(REPORT, key=lambda k: (int("".join(c for c in k.split("-")[0] if c.isdigit())), k))
    for mid in (m for m in order if not REPORT[m].get("component")):
        r = REPORT[mid]
        first, last = r["first"] or {}, r["last"] or {}
        steps = first.get("steps_total")
        if mid == "B14":
            steps_s, shrunk = f"seed {first.get('seed')}", "-"
        else:
            steps_s = f"{steps} (example step {first.get('steps_example')})" if steps is not None else "-"
            shrunk = str(last.get("steps_example", "-"))
        lines.append(
            f"| {mid} | {_md(r['bug'])}{'' if r['checked'] else ' (checked mode off)'} | {_md(r['fault'])} | "
            f"{'yes' if r['caught'] else '**NO**'} | `{_md(first.get('check', '-'))}` | {steps_s} | {shrunk} | "
            f"{_md(first.get('exc', '-'))[:240]} |"
        )
    if "B14" in REPORT:
        lines += [
            "",
            "B14 needs several ranks: it runs two SimEngines in one process whose progress checks meet in a thread",
            "barrier that stands in for the MIN all-reduce (the real `ProgressConsensus.agree` runs over it); the",
            "check compares the two ranks' ordered device/host free logs and stored keys after every iteration.",
            "The multi-process version is `tests/runtime/test_tp_gloo.py` (gloo, spawned ranks).",
        ]
    component = [m for m in order if REPORT[m].get("component")]
    if component:
        lines += [
            "",
            "## Caught by component tests",
            "",
            "The stateful machine takes some bugs as given: an allocator's refusal is the pool's answer, the",
            "order of resubmitted backups is not a safety property, its stores fail by refusing pages, never by",
            "raising, it runs neither the coalescing engine nor an integration, and it checks the runtime with",
            "invariants of its own, not the explorer's. These mutants run the component tests that guard each",
            "(`COMPONENT_MUTANTS`) in a pytest of their own, with the fault in place from before collection",
            "(`-p catalog_faults`) and hypothesis derandomized; *first check* is the first test that failed.",
            "",
            "| mutant | bug class | fault injected | caught | first check | first failure |",
            "|---|---|---|---|---|---|",
        ]
        for mid in component:
            r = REPORT[mid]
            first = r["first"] or {}
            lines.append(
                f"| {mid} | {_md(r['bug'])} | {_md(r['fault'])} | {'yes' if r['caught'] else '**NO**'} | "
                f"`{_md(first.get('check', '-'))}` | {_md(first.get('exc', '-'))[:240]} |"
            )
    caught = sum(r["caught"] for r in REPORT.values())
    lines += ["", f"{caught} of {len(REPORT)} mutants caught.", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


CATALOG = Path(__file__).resolve().parents[2] / "docs" / "bug-catalog.md"


def _catalog_ids() -> list[str]:
    """The bug classes of docs/bug-catalog.md's table (B1, B2, ...)."""
    import re

    return sorted(set(re.findall(r"^\| \[(B\d+)\]\(#b\d+\) \|", CATALOG.read_text(), re.M)), key=lambda b: int(b[1:]))


def _selected(session: pytest.Session) -> set[str]:
    """The mutants whose tests this session selected (B14 is its own test), less those that skip because the
    integration they patch is not installed."""
    out = set()
    for item in session.items:
        if getattr(item, "originalname", None) in ("test_mutant_is_caught", "test_component_mutant_is_caught"):
            mid = item.callspec.params["mid"]  # type: ignore[attr-defined]
            if mid not in COMPONENT_MUTANTS or missing(COMPONENT_MUTANTS[mid][1]) is None:
                out.add(mid)
        elif item.name == "test_mutant_b14_tp_divergence_is_caught":
            out.add("B14")
    return out


def test_zz_report(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The mutant report: every catalog class has a mutant, every mutant this session selected ran and was
    caught inside the machine's steps with a named first check, and the Markdown report (written to
    KVFSM_MUTANT_REPORT when set, docs/mutants.md by report_mutants.py) says so row by row."""
    ids = _catalog_ids()
    assert ids == [f"B{i}" for i in range(1, 22)], ids
    covered = {mid.split("-")[0] for mid in (*MUTANTS, *COMPONENT_MUTANTS)} | {"B14"}
    assert set(ids) <= covered, f"catalog classes without a mutant: {sorted(set(ids) - covered)}"
    if not REPORT:
        pytest.skip("no mutant ran in this session")
    selected = _selected(request.session)
    assert set(REPORT) == selected, f"selected but not reported: {sorted(selected - set(REPORT))}"
    for mid, r in REPORT.items():
        assert r["caught"], f"mutant {mid} survived"
        first = r["first"] or {}
        assert first.get("check"), f"mutant {mid}: no first check recorded"
        assert first.get("exc"), f"mutant {mid}: no failure message recorded"
        if mid == "B14":
            assert first["check"] == "tp_identical_frees" and "differ" in first["exc"], first
        elif r.get("component"):
            test_path = first["check"].split("::")[0]
            assert "::" in first["check"] and any(t.split("::")[0] == test_path for t in COMPONENT_MUTANTS[mid][2]), (
                first
            )
        else:
            assert r["steps_run"] > 0 and first["steps_total"] > 0 and first["where"], (mid, first)
    target = Path(os.environ.get("KVFSM_MUTANT_REPORT") or tmp_path / "mutants.md")
    write_report(target)
    text = target.read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| B")}
    assert set(rows) == set(REPORT), sorted(set(REPORT) ^ set(rows))
    for mid, line in rows.items():
        assert "| yes |" in line and f"`{REPORT[mid]['first']['check']}`" in line, line
    assert "**NO**" not in text
    assert f"{len(REPORT)} of {len(REPORT)} mutants caught." in text
    if selected >= set(MUTANTS) | set(COMPONENT_MUTANTS) | {
        "B14"
    }:  # the whole table ran: every catalog class was caught
        caught = {mid.split("-")[0] for mid, r in REPORT.items() if r["caught"]}
        assert set(ids) <= caught, f"catalog classes not caught: {sorted(set(ids) - caught)}"
