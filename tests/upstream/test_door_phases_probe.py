"""`bench/probes/door_phases.py` on CPU pools: each mode's phases are timed, `--detail` times the steps inside
them and counts their calls, `bare_door` and `bare_read_door` time SGLang's per-request loop in front of the floor
over a no-op and over the least-read early exit, and the limit probes in `targets` are read from the same run's
rows. A check of the probe, never of a figure (those come from the GPU
host, docs/performance.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "probes"))

import door_phases  # noqa: E402


def test_the_probe_times_each_mode_its_steps_and_both_doors(tmp_path: Path) -> None:
    out = tmp_path / "door.json"
    assert (
        door_phases.main(
            [
                "--device",
                "cpu",
                "--live",
                "96",
                "--pages",
                "16",
                "--iterations",
                "12",
                "--warmup",
                "4",
                "--modes",
                "adapter",
                "batch",
                "bare_door",
                "bare_read_door",
                "--detail",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    got = json.loads(out.read_text())
    rows = {r["mode"]: r for r in got["rows"]}
    assert list(rows) == ["adapter", "batch", "bare_door", "bare_read_door"]
    phases = {mode: set(r["phases_ms"]) for mode, r in rows.items()}
    assert {
        "_flush",
        "submit_reserved",
        "check_progress",
        "copy_engine.submit_d2h",
        "reserve_due",
        "_accept",
    } <= phases["adapter"]
    assert {"offload_batch", "_submit", "manager._copy_slots", "copy_engine.submit_d2h"} <= phases["batch"]
    assert {"noop_door", "offload_batch", "check_progress"} <= phases["bare_door"]
    assert "_submit" not in phases["bare_door"]  # the floor: none of kvfsm's manager calls
    assert rows["bare_door"]["phases_ms"]["noop_door"]["median"] > 0
    assert {"read_door", "offload_batch", "check_progress"} <= set(rows["bare_read_door"]["phases_ms"])
    assert "noop_door" not in rows["bare_read_door"]["phases_ms"]
    # the calls an iteration: one progress check, one submit; as many finishes through either door (same workload)
    calls = {mode: r["calls_per_iteration"] for mode, r in rows.items()}
    assert calls["adapter"]["check_progress"] == calls["batch"]["check_progress"] == 1.0
    assert calls["batch"]["_submit"] == calls["batch"]["offload_batch"] <= 1.0
    assert calls["batch"].get("finalize_batch", 0.0) <= 1.0  # the batch door: the iteration's finishes in one call
    assert set(calls["adapter"]) == {
        k for k in rows["adapter"]["phases_ms"] if not k.endswith("_ms") and k != "outermost"
    }

    def total(mode: str) -> float:
        p = rows[mode]["phases_ms"]
        return float(p["offload_ms"]["median"] + p["check_ms"]["median"])

    targets = {t["name"]: t for t in got["targets"]}
    for what, mode, key in (("noop", "bare_door", "noop_door"), ("read", "bare_read_door", "read_door")):
        limit = targets[f"limit probe: (batch + {what} door) / batch, median, 96 live 16/16"]
        door = rows[mode]["phases_ms"][key]["median"]
        assert limit["value"] == pytest.approx((total("batch") + door) / total("batch"))
    assert targets["adapter / batch, median calls + check, 96 live 16/16"]["value"] == pytest.approx(
        total("adapter") / total("batch")
    )


def test_the_no_op_door_calls_nothing_but_is_timed_only_in_timed_iterations() -> None:
    """The loop in front of the floor visits every live request, counts only what the floor's own offload
    returns, and adds its time to `noop_door` only while the iteration is timed."""
    seen: list[Any] = []
    live = [SimpleNamespace(finished_reason=None), SimpleNamespace(finished_reason="length")]
    loop = SimpleNamespace(live=live, offload=lambda ended, batch_args=None: seen.append((ended, batch_args)) or 3)
    into: dict[str, float] = {"noop_door": 0.0}
    timed = [False]
    door_phases._door_in_front(loop, into, timed, lambda req: False, "noop_door")
    assert loop.offload(["e"], "args") == 3 and seen == [(["e"], "args")]
    assert into["noop_door"] == 0.0
    timed[0] = True
    assert loop.offload([], None) == 3
    assert into["noop_door"] > 0.0 and len(seen) == 2


def test_the_read_door_reads_each_reqs_committed_length_and_is_never_due() -> None:
    """The least-read exit looks the Req up in its own state and reads `req.kv.kv_committed_len`; it answers False
    however long the Req grows (only the exit is timed), and a Req without `kv` fails it."""

    class Req:  # hashed by identity, as SGLang's Req
        def __init__(self) -> None:
            self.kv = SimpleNamespace(kv_committed_len=0)
            self.finished_reason = None

    exit_ = door_phases.CommittedExit()
    req = Req()
    assert exit_.offload_kv_cache(req) is False
    req.kv.kv_committed_len = 10**12
    assert exit_.offload_kv_cache(req) is False and list(exit_.due) == [req]
    with pytest.raises(AttributeError):
        exit_.offload_kv_cache(object())
    into: dict[str, float] = {"read_door": 0.0}
    seen: list[Any] = []
    loop = SimpleNamespace(live=[req, req], offload=lambda ended, batch_args=None: 0)

    def callee(r: Any) -> bool:
        seen.append(r)
        return exit_.offload_kv_cache(r)

    door_phases._door_in_front(loop, into, [True], callee, "read_door", exit_.forget)
    assert loop.offload([], None) == 0 and seen == [req, req] and into["read_door"] > 0.0
    assert req in exit_.due
    assert loop.offload([req], None) == 0 and req not in exit_.due  # a finished Req's state goes after the timed loop
