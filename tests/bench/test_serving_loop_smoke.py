"""bench/serving_loop.py's CPU smoke run: the script, its baseline and its report work (never a figure:
the verdict comes from the GPU run, bench/results/serving_loop-h200.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_serving_loop_runs_and_reports_every_figure(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import serving_loop
    finally:
        sys.path.remove(str(BENCH))
    out = tmp_path / "serving.json"
    assert (
        serving_loop.main(
            [
                "--device",
                "cpu",
                "--live",
                "48",
                "--pages",
                "16/16",
                "--iterations",
                "40",
                "--warmup",
                "30",
                "--step-ms",
                "1",
                "--host-gib",
                "0.125",
                "--prefill-index",
                "5000",
                "--output",
                "8",
                "40",
                "--store-root",
                str(tmp_path),
                "--quick",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    kvfsm, seed, bare, backup = doc["rows"]
    assert (kvfsm["algo"], seed["algo"], bare["algo"], backup["algo"]) == ("kvfsm", "seed", "bare", "bare-backup")
    for row in (kvfsm, seed, bare, backup):
        assert row["iterations_timed"] == 40 and row["chunks_per_iteration"]["mean"] > 0
        assert row["bytes_offloaded_per_step"] > 0
        assert row["teardown"]["device_slots_leaked"] == 0 and row["teardown"]["host_slots_leaked"] == 0
        assert row["teardown"]["garbage_of_kvfsm"] == 0
    assert kvfsm["stored_index"]["entries"] >= 5000 and not kvfsm["stored_index"]["dict_gc_tracked"]
    assert kvfsm["metrics"]["stored_pages"] > 0 and kvfsm["metrics"]["releases"] > 0
    names = [t["name"] for t in doc["targets"]]
    assert all(set(t) == {"name", "value", "limit", "met"} for t in doc["targets"])
    assert any(n.startswith("median / bare floor median, 48 live 16/16") for n in names), names
    assert backup["metrics"]["stored_pages"] > 0
    limit = next(t for t in doc["targets"] if t["name"].startswith("limit probe"))
    assert limit["value"] == backup["total"]["median"] / bare["total"]["median"] and limit["limit"] == 2.0
    assert any(n.startswith("p99 / median") for n in names) and any(n.startswith("max ms") for n in names)
    assert doc["verdict"] is True
    assert not list(tmp_path.glob("kvfsm-serving-*"))  # each run's store is removed
    # the same rows from a probe run (a Python thread beside the loop, a shorter switch interval): every
    # target's name says it is not the verdict's regime
    probe = serving_loop.probe_of(
        serving_loop.argparse.Namespace(contender=True, switch_interval_ms=0.5, prefill_index=serving_loop.PREFILL_FULL)
    )
    assert probe == "a thread running Python beside the loop, switch interval 0.5 ms"
    assert (
        serving_loop.probe_of(
            serving_loop.argparse.Namespace(
                contender=False, switch_interval_ms=None, prefill_index=serving_loop.PREFILL_FULL
            )
        )
        is None
    )
    fresh = serving_loop.probe_of(
        serving_loop.argparse.Namespace(contender=False, switch_interval_ms=None, prefill_index=0)
    )
    assert fresh == "the stored-page index starts empty (a new server's first minutes)"
    probed = serving_loop.targets(doc["rows"], probe)
    assert [t["name"] for t in probed] == [f"probe run ({probe}), not the verdict: {n}" for n in names]
