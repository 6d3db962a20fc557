"""bench/probes/gc_pause_probe.py: the three collections it times, over the objects it says it built; nothing
is left frozen, and the thresholds are untouched."""

from __future__ import annotations

import gc


def test_measure_builds_what_it_reports_and_leaves_the_collector_as_it_was(import_probe) -> None:
    probe = import_probe("gc_pause_probe")
    thresholds = gc.get_threshold()
    row = probe.measure(requests=20, objects=500, repeats=2, prompt=(4, 4), output=(6, 6))
    assert (row["requests"], row["manager_objects"], row["token_ids_in_lists"]) == (20, 500, 20 * (4 + 6))
    assert all(row[k] >= 0 for k in ("engine_requests_ms", "both_ms", "manager_objects_ms"))
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds
