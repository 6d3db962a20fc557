"""bench/probes/fenced_release_cost.py: each finalize it times releases a request fenced by the one copy still
reading its slots, with the FIFO it says it built, and its target names the two FIFO sizes it compares."""

from __future__ import annotations

import kvfsm.generated.decode_offload as spec_gen


def test_every_timed_finalize_is_a_fenced_release_over_the_fifo_it_built(import_probe, monkeypatch) -> None:
    probe = import_probe("fenced_release_cost")
    seen: list[tuple[str, int]] = []
    finalize = probe.SimEngine.__post_init__

    def spy(self) -> None:  # every manager the probe builds reports each finalize's state and FIFO length
        finalize(self)
        manager, inner = self.manager, self.manager.finalize

        def timed(req) -> None:
            fifo = len(manager.fx.copy_fifo)
            inner(req)
            seen.append((spec_gen.STATES[manager.machine_of(req).state], fifo))

        manager.finalize = timed

    monkeypatch.setattr(probe.SimEngine, "__post_init__", spy)
    times = probe.finalize_us(fifo=8, finishes=3)
    assert len(times) == 3 and all(us > 0 for us in times)
    assert seen[:3] == [("fenced", 8)] * 3  # released at once under its in-flight copy, the FIFO unchanged
    rows = [{"fifo": 8, "later_finalize_us_median": 2.0}, {"fifo": 32, "later_finalize_us_median": 5.0}]
    (t,) = probe.targets(rows)
    assert t["name"] == "later finalize, FIFO 32 / FIFO 8" and t["value"] == 2.5 and t["met"] is False
