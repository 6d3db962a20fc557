"""`bench/sglang_adapter_gpu.py` runs, on CPU pools, in both call orders: every door makes its calls, the run's
JSON carries the order and a `targets` entry per adapter target, and each door accepted chunks. A check of the
script, never of a figure (the figures come from the GPU host, docs/performance.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import sglang_adapter_gpu as bench  # noqa: E402

# the old order's floor takes the batch door's branch of `Loop.calls`: one of the two is enough there
MODES = {"sglang": list(bench.MODES), "compact": ["adapter", "batch"]}


@pytest.mark.parametrize("order", bench.ORDERS)
def test_the_adapter_bench_runs_every_door_in_each_order(order: str, tmp_path: Path) -> None:
    out = tmp_path / "adapter.json"
    assert bench.main(["--quick", "--device", "cpu", "--order", order, "--modes", *MODES[order],
                       "--store-root", str(tmp_path), "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["settings"]["order"] == order
    assert [r["mode"] for r in got["rows"]] == MODES[order]
    for row in got["rows"]:
        assert row["iterations"] == 30 and row["chunks_per_iteration"] > 0, row["mode"]
        assert row["total_ms"]["median"] > 0
    assert {t["name"].split(",")[0] for t in got["targets"]} == {
        "adapter median / batch median", "adapter mean / batch mean", "adapter p99 / its median",
        "adapter max ms (GC on)"}
    assert all(set(t) == {"name", "value", "limit", "met"} for t in got["targets"])
