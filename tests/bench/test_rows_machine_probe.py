"""bench/probes/rows_machine_probe.py's serving regime: both doors fire the three events over the picked rows,
and the cycle's figure is the sum of its events."""

from __future__ import annotations


def test_serving_events_times_every_event_through_both_doors(import_probe) -> None:
    probe = import_probe("rows_machine_probe")
    row = probe.serving_events(table_rows=40, live=32, batch=8, cycles=5)
    assert (row["table_rows"], row["live"], row["batch"], row["cycles"]) == (40, 32, 8, 5)
    for door in ("rows", "each"):
        events = [row[door][f"{e}_us"] for e in probe.CYCLE]
        assert all(us > 0 for us in events)
        assert row[door]["cycle_us"] == round(sum(events), 1)
