"""`bench/sglang_adapter_gpu.py` runs, on CPU pools, in both call orders: every door makes its calls, the run's
JSON carries the order and a `targets` entry per adapter target, and each door accepted chunks; over repeated
runs the targets read the runs' medians. A check of the script, never of a figure (the figures come from the GPU
host, docs/performance.md)."""

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
def test_the_adapter_bench_runs_every_door_in_each_order(
    order: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "adapter.json"
    offload, grouped = bench.Loop.offload, []

    def offload_in_group(self: bench.Loop, *args: object) -> int:  # as SGLang's result processing makes them
        grouped.append(self.allocator.free_group is not None)
        return offload(self, *args)

    monkeypatch.setattr(bench.Loop, "offload", offload_in_group)
    assert (
        bench.main(
            [
                "--quick",
                "--device",
                "cpu",
                "--order",
                order,
                "--modes",
                *MODES[order],
                "--store-root",
                str(tmp_path),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    got = json.loads(out.read_text())
    assert got["settings"]["order"] == order
    assert [r["mode"] for r in got["rows"]] == MODES[order]
    for row in got["rows"]:
        assert row["iterations"] == 30 and row["chunks_per_iteration"] > 0, row["mode"]
        assert row["total_ms"]["median"] > 0
        slow = row["tail"]["slowest_mean"]  # the slowest iterations' time, split three ways
        parts = slow["gc_ms"] + slow["own_cpu_without_gc_ms"] + slow["off_cpu_ms"]
        assert row["tail"]["iterations"] >= 1 and parts == pytest.approx(slow["total_ms"]), row["tail"]
        assert set(row["tail"]["slowest_work_mean"]) == {"check_ms", "offload_ms", "chunks", *bench.WORK_COUNTERS}
    assert {t["name"].split(",")[0] for t in got["targets"]} == {
        "adapter median / batch median",
        "adapter mean / batch mean",
        "adapter p99 / its median",
        "adapter max ms (GC on)",
    }
    assert all(set(t) == {"name", "value", "limit", "met"} for t in got["targets"])
    assert grouped and all(grouped)  # every iteration's offload and finish calls inside the free group


def test_the_bench_can_call_the_doors_outside_a_free_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offload, grouped = bench.Loop.offload, []

    def offload_seen(self: bench.Loop, *args: object) -> int:
        grouped.append(self.allocator.free_group is not None)
        return offload(self, *args)

    monkeypatch.setattr(bench.Loop, "offload", offload_seen)
    out = tmp_path / "adapter.json"
    assert (
        bench.main(
            [
                "--quick",
                "--device",
                "cpu",
                "--modes",
                "adapter",
                "--no-free-group",
                "--store-root",
                str(tmp_path),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert grouped and not any(grouped)
    assert json.loads(out.read_text())["settings"]["no_free_group"] is True


def _row(mode: str, median: float, mean: float, p99: float, peak: float) -> dict:
    return {
        "mode": mode,
        "live": 64,
        "page": 16,
        "stride": 16,
        "total_ms": {"median": median, "mean": mean, "p99": p99, "max": peak},
    }


def test_repeated_runs_give_the_targets_their_medians_and_the_largest_max() -> None:
    rows = [
        _row("adapter", 3.0, 3.0, 5.0, 9.0),
        _row("batch", 2.0, 2.0, 3.0, 4.0),
        _row("batch", 2.5, 2.5, 3.5, 12.0),
        _row("adapter", 2.0, 2.6, 4.0, 11.0),
        _row("adapter", 2.6, 2.8, 6.0, 8.0),
        _row("batch", 1.0, 1.0, 2.0, 3.0),
    ]
    got = {t["name"]: t["value"] for t in bench.targets(rows)}
    at = "64 live 16/16, 3 runs"
    assert got == pytest.approx(
        {
            f"adapter median / batch median, {at}": 2.6 / 2.0,
            f"adapter mean / batch mean, {at}": 2.8 / 2.0,
            f"adapter p99 / its median, {at}": 5.0 / 2.6,
            f"adapter max ms (GC on), {at}": 11.0,
        }
    )
    one = {t["name"]: t["value"] for t in bench.targets(rows[:2])}  # one run each: its own figures
    assert one == pytest.approx(
        {
            "adapter median / batch median, 64 live 16/16": 1.5,
            "adapter mean / batch mean, 64 live 16/16": 1.5,
            "adapter p99 / its median, 64 live 16/16": 5.0 / 3.0,
            "adapter max ms (GC on), 64 live 16/16": 9.0,
        }
    )


def test_the_tail_splits_the_slowest_iterations_into_collections_own_cpu_and_waiting() -> None:
    """`tail_of` picks the iterations at or past the p99 and says what their time was made of; the p99 without
    the collector's pauses is what is left once they are taken out."""
    quiet = {"total_ms": 2.0, "gc_ms": 0.0, "own_cpu_ms": 2.0, "others_cpu_ms": 0.1, "check_ms": 0.5, "stored_pages": 4}
    collected = {"total_ms": 50.0, "gc_ms": 40.0, "own_cpu_ms": 45.0, "own_kernel_ms": 3.0, "others_cpu_ms": 0.5}
    waited = {"total_ms": 30.0, "gc_ms": 0.0, "own_cpu_ms": 3.0, "others_cpu_ms": 27.0}  # the lock held elsewhere
    # `collected` was off the CPU 5 ms; 3 ms of its own CPU was in the kernel
    collected.update(check_ms=45.0, stored_pages=900)  # a check that took in a burst of the store's completions
    waited.update(check_ms=1.0, stored_pages=100)
    per_iter = [dict(quiet) for _ in range(198)] + [collected, waited]
    tail = bench.tail_of(per_iter)
    assert tail["iterations"] == 2 and 2.0 < tail["p99_ms"] <= 30.0
    assert tail["slowest_mean"] == {
        "total_ms": 40.0,
        "gc_ms": 20.0,
        "own_cpu_without_gc_ms": 4.0,
        "off_cpu_ms": 16.0,
        "own_kernel_ms": 1.5,
        "others_cpu_ms": 13.75,
    }
    assert tail["all_median"]["total_ms"] == 2.0 and tail["all_median"]["off_cpu_ms"] == 0.0
    assert tail["slowest_work_mean"] == {"check_ms": 23.0, "stored_pages": 500.0}  # what is recorded, nothing more
    assert tail["all_work_median"] == {"check_ms": 0.5, "stored_pages": 4}
    assert tail["p99_without_gc_ms"] == pytest.approx(2.0 + 0.01 * 8.0)  # numpy's p99 of [2] * 198 + [10, 30]
