"""Per-event cost of the generated machine vs the `transitions` reference, on one event stream, one run.

Targets: generated <= 0.3 us/event and >= 25x faster than the reference; construction <= 2 us.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import target, write_result  # noqa: E402

import kvfsm.generated.decode_offload as gen  # noqa: E402
from kvfsm.reference import ReferenceMachine  # noqa: E402
from kvfsm.spec import load_spec  # noqa: E402


class NullEffects:
    """Actions that do nothing: we time the lifecycle, not the data plane."""

    def seed_hash_chain(self, m, arg):
        pass

    def start_copy(self, m, arg):
        pass

    def count_host_full(self, m, arg):
        pass

    def hash_chunk(self, m, arg):
        pass

    def submit_backup(self, m, arg):
        pass

    def park_chunk(self, m, arg):
        pass

    def mark_stored(self, m, arg):
        pass

    def count_backup_failure(self, m, arg):
        pass

    def free_host_chunk(self, m, arg):
        pass

    def release_request(self, m, arg):
        pass


# A decode-like cycle that returns to `allocated`: two chunks in flight, one backup fails, a full host pool.
CYCLE = ("offload", "offload", "host_full", "copy_done", "copy_done", "backup_done", "backup_failed")


def per_event(machine, cycles: int) -> float:
    calls = [getattr(machine, e) for e in CYCLE] * cycles
    t0 = time.perf_counter()
    for call in calls:
        call()
    elapsed = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _call in calls:  # loop overhead alone, to report the machine's own cost too
        pass
    return elapsed / len(calls), (time.perf_counter() - t0) / len(calls)


def construction(factory, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        factory()
    return (time.perf_counter() - t0) / n


def targets(result: dict) -> list[dict]:
    """The verdict: the generated machine's cost an event and to construct, and its speed-up over the reference."""
    return [
        target("generated machine, us an event", result["generated_us_per_event"], 0.3),
        target(
            "generated machine's speed-up over the transitions reference (at least)",
            result["speedup_vs_reference"],
            25,
            at_least=True,
        ),
        target("generated machine, us to construct", result["generated_construct_us"], 2.0),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cycles", type=int, default=200_000)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run (checks the script, not the numbers): results under bench/results/quick/",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    spec = load_spec("spec/decode_offload.yaml")
    fx = NullEffects()
    best_gen, best_loop = min(per_event(gen.DecodeOffloadMachine(fx), args.cycles) for _ in range(5))
    ref_cycles = max(args.cycles // 50, 200)
    best_ref, _ = min(per_event(ReferenceMachine(spec, fx), ref_cycles) for _ in range(3))
    build_gen = min(construction(lambda: gen.DecodeOffloadMachine(fx), 200_000) for _ in range(5))
    build_ref = min(construction(lambda: ReferenceMachine(spec, fx), 300) for _ in range(3))
    result = {
        "events_per_cycle": list(CYCLE),
        "generated_us_per_event": best_gen * 1e6,
        "generated_us_per_event_net_of_loop": (best_gen - best_loop) * 1e6,
        "reference_us_per_event": best_ref * 1e6,
        "speedup_vs_reference": best_ref / best_gen,
        "generated_construct_us": build_gen * 1e6,
        "reference_construct_us": build_ref * 1e6,
    }
    result["targets"] = targets(result)
    result["meets_targets"] = all(t["met"] for t in result["targets"])
    path = write_result("event_runtime", result, args.out, quick=args.quick)
    for k, v in result.items():
        print(f"{k}: {v}")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
