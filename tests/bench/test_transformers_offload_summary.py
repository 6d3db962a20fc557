"""bench/transformers_offload.py's warm-repeat summary: ratios pair the engine and kvfsm runs of one repeat, and
the first repeat (cold start) is left out."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH.parent / "tests" / "integrations"))
from cb_helpers import require_transformers  # noqa: E402


@pytest.fixture(scope="module")
def bench() -> Any:
    require_transformers()  # here, not at import: every test worker imports this module to collect it
    sys.path.insert(0, str(BENCH))
    try:
        import transformers_offload as module
    finally:
        sys.path.remove(str(BENCH))
    return module


def _row(mode: str, repeat: int, offload: float, tput: float, sync: bool = False) -> dict[str, Any]:
    return {"mode": mode, "repeat": repeat, "sync_timing": sync, "time_in_offload_s": offload, "throughput_tok_s": tput}


def test_warm_repeats_pair_runs_of_one_repeat_and_skip_the_cold_one(bench: Any) -> None:
    runs = [
        _row("engine", 0, 0.090, 250.0),
        _row("kvfsm_fenced", 0, 0.020, 300.0),
        _row("engine", 1, 0.020, 300.0),
        _row("kvfsm_fenced", 1, 0.022, 300.0),
        _row("engine", 2, 0.025, 280.0),
        _row("kvfsm_fenced", 2, 0.020, 308.0),
        _row("engine", 3, 0.020, 290.0),
        _row("kvfsm_fenced", 3, 0.021, 290.0),
        _row("engine", 0, 0.100, 100.0, sync=True),
        _row("kvfsm_fenced", 0, 0.001, 100.0, sync=True),
    ]
    warm = bench.warm_repeats(runs)
    assert set(warm) == {"kvfsm_fenced_vs_engine_warm"}  # no kvfsm (deferred) runs
    w = warm["kvfsm_fenced_vs_engine_warm"]
    assert w["repeats"] == [1, 2, 3]
    assert w["time_in_offload_ratios"] == [1.1, 0.8, 1.05] and w["time_in_offload_ratio_median"] == 1.05
    assert w["throughput_ratios"] == [1.0, 1.1, 1.0] and w["throughput_ratio_median"] == 1.0


def test_one_repeat_has_no_warm_summary(bench: Any) -> None:
    assert bench.warm_repeats([_row("engine", 0, 0.02, 300.0), _row("kvfsm", 0, 0.02, 300.0)]) == {}
