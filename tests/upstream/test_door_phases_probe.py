"""`bench/probes/door_phases.py` on CPU pools: each mode's phases are timed, `--detail` times the steps inside
them, `bare_door` times SGLang's per-request loop over a no-op in front of the floor, and the limit probe in
`targets` is read from the same run's rows. A check of the probe, never of a figure (those come from the GPU
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


def test_the_probe_times_each_mode_its_steps_and_the_no_op_door(tmp_path: Path) -> None:
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
                "--detail",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    got = json.loads(out.read_text())
    rows = {r["mode"]: r for r in got["rows"]}
    assert list(rows) == ["adapter", "batch", "bare_door"]
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

    def total(mode: str) -> float:
        p = rows[mode]["phases_ms"]
        return float(p["offload_ms"]["median"] + p["check_ms"]["median"])

    targets = {t["name"]: t for t in got["targets"]}
    limit = targets["limit probe: (batch + no-op door) / batch, median, 96 live 16/16"]
    door = rows["bare_door"]["phases_ms"]["noop_door"]["median"]
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
    door_phases._door_in_front(loop, into, timed)
    assert loop.offload(["e"], "args") == 3 and seen == [(["e"], "args")]
    assert into["noop_door"] == 0.0
    timed[0] = True
    assert loop.offload([], None) == 3
    assert into["noop_door"] > 0.0 and len(seen) == 2
