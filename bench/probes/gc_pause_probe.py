"""What a full collection's length is made of at 4096 live: the engine's token lists, or a manager's objects.

A decode engine keeps each live request's prompt and output token ids in Python lists (SGLang's Req, the
serving loop's LoopRequest); a full collection visits every element of every tracked list. A manager adds
small objects (records, machines, chunks, jobs). This probe builds each kind alone and together, with the
start-up objects frozen as the serving loop does, and times `gc.collect(2)` (the fastest of `--repeats`): so a
reader can tell which part of a full collection's pause a manager could remove. The sizes default to the
serving loop's: prompts of 32-256 tokens and outputs of 64-512, uniform, and the 40k tracked objects kvfsm's
heap held at 4096 live, 16/16 (`tracked_objects` in bench/results/serving_loop_*-h100.json).

    python3 bench/probes/gc_pause_probe.py [--requests 3000] [--objects 40000] [--repeats 5] [--out FILE]
Writes bench/results/quick/gc_pause_probe-<machine>.json (or --out): a probe, never a verdict.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common
from common import full_collection_ms, write_result  # noqa: E402


class EngineRequest:
    """A decoding request's token ids, as an engine keeps them: two lists."""

    def __init__(self, rng: random.Random, prompt: tuple[int, int], output: tuple[int, int]) -> None:
        self.origin_input_ids = [rng.randrange(128_000) for _ in range(rng.randint(*prompt))]
        self.output_ids = [rng.randrange(128_000) for _ in range(rng.randint(*output))]


class ManagerObject:
    """A small tracked object with a few references, the shape of a record, a machine or a chunk."""

    __slots__ = ("a", "b", "c")

    def __init__(self) -> None:
        self.a = self.b = self.c = None


def measure(
    requests: int, objects: int, repeats: int, prompt: tuple[int, int] = (32, 256), output: tuple[int, int] = (64, 512)
) -> dict[str, Any]:
    """The full collection's length with the engine's requests, then with the manager's objects beside them,
    then with the manager's objects alone; every earlier object frozen first, as the serving loop freezes its
    start-up objects, and unfrozen at the end (the probe runs in a process of its own)."""
    rng = random.Random(0)
    gc.collect()
    gc.freeze()
    try:
        engine = [EngineRequest(rng, prompt, output) for _ in range(requests)]
        token_ids = sum(len(r.origin_input_ids) + len(r.output_ids) for r in engine)
        engine_ms = round(full_collection_ms(repeats), 3)
        manager = [ManagerObject() for _ in range(objects)]
        both_ms = round(full_collection_ms(repeats), 3)
        del engine
        manager_ms = round(full_collection_ms(repeats), 3)
        del manager
    finally:
        gc.unfreeze()
    return {
        "requests": requests,
        "token_ids_in_lists": token_ids,
        "manager_objects": objects,
        "engine_requests_ms": engine_ms,
        "both_ms": both_ms,
        "manager_objects_ms": manager_ms,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--objects", type=int, default=40_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    row = measure(args.requests, args.objects, args.repeats)
    print(row)
    write_result("gc_pause_probe", row, args.out, quick=True)


if __name__ == "__main__":
    main()
