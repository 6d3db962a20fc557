"""Trace conformance: recorded traces replay clean; illegal steps are flagged at their line."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvfsm.spec import load_spec
from kvfsm.verify.commands import replay
from kvfsm.verify.explorer import LIVE, NEW, ExplorerConfig, World, apply, check_world, enabled
from kvfsm.verify.replay import check_trace, default_spec_path

SPEC = load_spec(default_spec_path())
Z = {"copies": 0, "parked": 0, "backups": 0}
RELEASE = ["device_slots", "table_row", "prefix_lock"]


def _line(
    req: str, event: str, src: str, dst: str, tid: int, counters: dict[str, int], acquired=(), released=()
) -> dict:
    return {
        "t": 0.0,
        "req": req,
        "event": event,
        "from": src,
        "to": dst,
        "transition": tid,
        "counters": counters,
        "acquired": list(acquired),
        "released": list(released),
    }


def _tid(src: str, event: str, guard: Any = "any") -> int:
    return next(
        t.id for t in SPEC.transitions if t.src == src and t.event == event and (guard == "any" or t.guard == guard)
    )


def _write(path: Path, lines: list[dict], sha: str = SPEC.sha256) -> Path:
    path.write_text("\n".join(json.dumps(x) for x in [{"kind": "header", "spec_sha256": sha}] + lines) + "\n")
    return path


def _good() -> list[dict]:
    """One request through offload, copy ack, backup, finish; another finished at once, then finished again."""
    c1 = {"copies": 1, "parked": 0, "backups": 0}
    b1 = {"copies": 0, "parked": 0, "backups": 1}
    return [
        _line("a#1", "offload", "allocated", "offloading", _tid("allocated", "offload"), c1, ["host_slots"]),
        _line("b#2", "finish", "allocated", "released", _tid("allocated", "finish"), Z, released=RELEASE),
        _line("a#1", "copy_done", "offloading", "inflight", _tid("offloading", "copy_done", "last_copy"), b1),
        _line("b#2", "finish", "released", "released", -1, Z),
        _line(
            "a#1",
            "backup_done",
            "inflight",
            "allocated",
            _tid("inflight", "backup_done", "last_host_chunk"),
            Z,
            released=["host_slots"],
        ),
        _line("a#1", "finish", "allocated", "released", _tid("allocated", "finish"), Z, released=RELEASE),
    ]


@pytest.mark.parametrize(
    "cfg",
    [
        ExplorerConfig(requests=3, decodes=3, readmits=1, host_slots=4),
        ExplorerConfig(requests=2, decodes=3, readmits=1, host_slots=2, backup_queue=2),
    ],
    ids=["3req", "2req-host2"],
)
def test_real_sim_engine_trace_replays_clean(cfg: ExplorerConfig, tmp_path: Path) -> None:
    """Random runs of the real manager over SimEngine (every invariant checked) write clean traces."""
    rng = random.Random(3)
    weights = {"finish": 0.05, "abort": 0.05, "retract": 0.05, "end_again": 0.2}
    used: set[int] = set()
    steps = 0
    for episode in range(6):
        path = tmp_path / f"trace{episode}.jsonl"
        w = World(cfg, trace_path=str(path))
        for _ in range(400):
            events = enabled(w)
            ev = rng.choices(events, weights=[weights.get(e[0], 1.0) for e in events])[0]
            apply(w, ev)
            check_world(w)
            if all(c[0] not in (NEW, LIVE) for c in w.ctl) and w.engine.manager.idle():
                break
        w.engine.manager.close()
        res = check_trace(path)
        assert res.ok, res.error
        assert res.requests >= cfg.requests
        steps += res.steps
        used |= {t for t in res.transitions if t >= 0}
    assert steps > 60 and len(used) >= 15, (steps, sorted(used))
    assert replay(path) == 0


def test_hand_written_good_trace(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _write(tmp_path / "good.jsonl", _good())
    res = check_trace(path)
    assert res.ok, res.error
    assert (res.steps, res.ignored, res.requests) == (6, 1, 2)
    assert res.final_states == {"released": 2}
    assert replay(path) == 0
    assert "ok: 6 steps" in capsys.readouterr().out


def _flag(tmp_path: Path, lines: list[dict], line: int, words: str, sha: str = SPEC.sha256) -> None:
    path = _write(tmp_path / "bad.jsonl", lines, sha)
    res = check_trace(path)
    assert res.error is not None, "illegal trace accepted"
    assert res.error.line == line, res.error
    assert words in res.error.message, res.error.message
    assert replay(path) == 1


def test_wrong_target_state(tmp_path: Path) -> None:
    lines = _good()
    lines[2]["to"] = "allocated"  # copy_done [last_copy] leads to inflight
    _flag(tmp_path, lines, 4, "leads to 'inflight'")


def test_undeclared_event_in_state(tmp_path: Path) -> None:
    lines = _good()
    bogus = _tid("offloading", "copy_done", "last_copy")
    lines.insert(1, _line("b#2", "copy_done", "allocated", "allocated", bogus, Z))
    _flag(tmp_path, lines, 3, "not handled in state 'allocated'")


def test_unknown_event(tmp_path: Path) -> None:
    lines = _good()
    lines[0]["event"] = "teleport"
    _flag(tmp_path, lines, 2, "undeclared event")


def test_counters_that_jump(tmp_path: Path) -> None:
    lines = _good()
    lines[0]["counters"] = {"copies": 2, "parked": 0, "backups": 0}
    _flag(tmp_path, lines, 2, "the spec's update gives")


def test_second_release(tmp_path: Path) -> None:
    lines = _good()
    # b#2 was released at line 3; a second release logged as a fresh finish from allocated
    lines.insert(2, _line("b#2", "finish", "allocated", "released", _tid("allocated", "finish"), Z, released=RELEASE))
    _flag(tmp_path, lines, 4, "is in state 'released'")


def test_ignored_step_that_releases(tmp_path: Path) -> None:
    lines = _good()
    lines[3]["released"] = RELEASE  # the duplicate finish is a declared no-op: it must free nothing
    _flag(tmp_path, lines, 5, "declared no-op")


def test_transition_id_that_does_not_match(tmp_path: Path) -> None:
    lines = _good()
    lines[1]["transition"] = _tid("allocated", "abort")  # the step is a finish
    _flag(tmp_path, lines, 3, "not 'finish' from 'allocated'")


def test_transition_id_out_of_range(tmp_path: Path) -> None:
    lines = _good()
    lines[1]["transition"] = 999
    _flag(tmp_path, lines, 3, "no transition has id 999")


def test_guard_that_does_not_hold(tmp_path: Path) -> None:
    lines = _good()
    # two copies in flight, then an ack logged as the last copy (guard last_copy: copies == 1)
    c2 = {"copies": 2, "parked": 0, "backups": 0}
    lines.insert(
        1, _line("a#1", "offload", "offloading", "offloading", _tid("offloading", "offload"), c2, ["host_slots"])
    )
    lines[3] = _line(
        "a#1",
        "copy_done",
        "offloading",
        "inflight",
        _tid("offloading", "copy_done", "last_copy"),
        {"copies": 1, "parked": 0, "backups": 1},
    )
    _flag(tmp_path, lines, 5, "guard 'last_copy' does not hold")


def test_ignored_where_not_declared(tmp_path: Path) -> None:
    lines = _good()
    lines[0] = _line("a#1", "offload", "allocated", "allocated", -1, Z)
    _flag(tmp_path, lines, 2, "logged as a declared no-op")


def test_spec_hash_mismatch(tmp_path: Path) -> None:
    _flag(tmp_path, _good(), 1, "recorded against spec sha256", sha="0" * 64)


def test_missing_header_and_garbage(tmp_path: Path) -> None:
    path = tmp_path / "nohdr.jsonl"
    path.write_text(json.dumps(_good()[0]) + "\n")
    res = check_trace(path)
    assert res.error is not None and res.error.line == 1 and "header" in res.error.message
    lines = _good()
    path = _write(tmp_path / "garbage.jsonl", lines)
    path.write_text(path.read_text() + "{not json\n")
    res = check_trace(path)
    assert res.error is not None and res.error.line == len(lines) + 2
    assert replay(tmp_path / "missing.jsonl") == 2
