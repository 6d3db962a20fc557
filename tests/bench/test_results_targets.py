"""Every result JSON in bench/results/ that checks targets lists them one way: `{name, value, limit, met}`
(bench/common.py's `target`), so a reader sees at once what a run met. A limit is a ceiling, or a floor where the
name ends in "(at least)"; `met` is what the value and the limit say, and a target without a value is not met."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
WITH_TARGETS = sorted(p for p in RESULTS.glob("*.json") if "targets" in json.loads(p.read_text()))


def test_the_verdict_benches_results_carry_targets() -> None:
    """The GPU verdicts and the CPU benches with limits: each of their committed results checks targets."""
    names = {p.name for p in WITH_TARGETS}
    for prefix in (
        "serving_loop_4096-",
        "sglang_adapter_gpu-",
        "submit_cost-",
        "offload_bandwidth-",
        "manager_overhead-",
        "event_runtime-",
        "vllm_manager-",
        "cli_startup-",
    ):
        assert any(n.startswith(prefix) for n in names), f"no committed {prefix}*.json checks its targets"


@pytest.mark.parametrize("path", WITH_TARGETS, ids=lambda p: p.name)
def test_targets_are_name_value_limit_met(path: Path) -> None:
    targets = json.loads(path.read_text())["targets"]
    assert isinstance(targets, list) and targets, f"{path.name}: targets is not a list of entries"
    for t in targets:
        assert isinstance(t, dict) and set(t) == {"name", "value", "limit", "met"}, f"{path.name}: {t}"
        assert isinstance(t["name"], str) and isinstance(t["met"], bool) and isinstance(t["limit"], (int, float))
        value = t["value"]
        if value is None:
            assert not t["met"], f"{path.name}: {t['name']} has no value and is met"
            continue
        floor = t["name"].endswith("(at least)")
        assert t["met"] == (value >= t["limit"] if floor else value <= t["limit"]), f"{path.name}: {t}"
