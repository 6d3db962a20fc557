"""bench/stall_stacks.py: a call that runs past the threshold is sampled, with its own frame in the stack; a call
that ends before it never is; nothing is sampled outside an armed call, and closing the sampler stops its thread."""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
try:
    from stall_stacks import StallSampler, frame_label
finally:
    sys.path.remove(str(BENCH))


def slow_call(sampler: StallSampler, samples: int) -> None:
    """Runs until the sampler has taken `samples` samples of it: waits on progress, not on a clock (a sampler that
    never samples makes the test fail with what it saw, after a limit no working sampler comes near)."""
    deadline = time.monotonic() + 60.0
    while sampler.samples < samples:
        assert time.monotonic() < deadline, f"no sample after 60 s: {sampler.report()}"
        sum(range(1000))


def test_a_call_past_the_threshold_is_sampled_in_its_own_frames_and_a_quick_one_is_not() -> None:
    sampler = StallSampler(after_ms=1.0, every_ms=0.5)
    try:
        with sampler.call():
            slow_call(sampler, 3)
        report = sampler.report()
        assert report["slow_calls"] == 1 and report["samples"] >= 3
        assert any("slow_call" in frame for entry in report["top"] for frame in entry["stack"])
        assert sum(entry["count"] for entry in report["top"]) == report["samples"]
        taken = sampler.samples
        quick = StallSampler(after_ms=60_000.0, every_ms=0.5)  # no call here comes near a minute
        try:
            for _ in range(50):
                with quick.call():
                    sum(range(100))
            time.sleep(0.01)  # an unarmed sampler takes nothing, however long it is left
            assert quick.report()["samples"] == 0 and quick.report()["slow_calls"] == 0
        finally:
            quick.close()
        assert sampler.samples == taken  # nothing sampled once the call ended
    finally:
        sampler.close()
    assert not sampler._thread.is_alive() and sampler._on_gc not in gc.callbacks


def test_frame_labels_start_at_the_package_or_the_repository_folder() -> None:
    assert frame_label("/x/lib/python3.12/site-packages/torch/cuda/streams.py", 7, "wait") == (
        "torch/cuda/streams.py:7 wait"
    )
    assert frame_label("/work/main/kvfsm/runtime/manager.py", 3, "offload") == "kvfsm/runtime/manager.py:3 offload"
    assert frame_label("/elsewhere/tool.py", 1, "f") == "/elsewhere/tool.py:1 f"
