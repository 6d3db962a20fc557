"""Bounded exhaustive exploration of the chunk lifecycle through the real manager, in lockstep with vLLM's.

A world is vLLM's CPUOffloadingManager and kvfsm's (checked) on 2 slots, 3 keys and 2 requests, with the jobs in
flight. From each world every call the scheduler could make next is tried: a request's prepare_store of one
key, a prepare_load of a key its lookup answers HIT, the completion of any job in flight (a store succeeding or
failing, a load), a cache reset (its jobs dropped, as the connector drops stale jobs). Each call must give both
managers the same answer and drained events, checked mode must accept it, and kvfsm's audit must find nothing;
worlds already seen (by their chunks, slots, jobs and lookups) are not expanded again. Every transition of
spec/offload_chunk.yaml must be fired within the bound."""

from __future__ import annotations

import copy
from collections import deque
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from driver import _norm, key

from kvfsm.generated.offload_chunk import TRANSITIONS
from kvfsm.integrations.vllm import KvfsmOffloadingManager

KEYS = (key(1, 0), key(1, 1), key(2, 0))
REQUESTS = ("r1", "r2")
DEPTH = 7
REACHED: set[int] = set()


def _world() -> dict[str, Any]:
    ours = KvfsmOffloadingManager(2, cache_policy="lru", enable_events=True, checked=True)
    ours.observer = lambda _m, _e, _s, _d, tid: REACHED.add(tid)
    world: dict[str, Any] = {"managers": (CPUOffloadingManager(2, enable_events=True), ours), "jobs": ()}
    world["contexts"] = {r: tuple(ReqContext(req_id=r) for _ in range(2)) for r in REQUESTS}
    for pair in world["contexts"].values():
        for ctx in pair:
            for pos, k in enumerate(KEYS):
                ctx.set_offload_key_position(k, (pos + 1) * 16)
    return world


def _both(world: dict[str, Any], method: str, *args: Any, req: str | None = None, **kw: Any) -> Any:
    answers = []
    for i, m in enumerate(world["managers"]):
        full = args if req is None else (*args, world["contexts"][req][i])
        answers.append(_norm(getattr(m, method)(*full, **kw)))
    assert answers[0] == answers[1], (method, args, answers)
    drained = [list(m.take_events()) for m in world["managers"]]
    assert drained[0] == drained[1], (method, args, drained)
    assert world["managers"][1].audit() == []
    return answers[0]


def _moves(world: dict[str, Any]) -> list[tuple[str, Any]]:
    moves: list[tuple[str, Any]] = [("reset", None)] if world["jobs"] else []
    moves += [
        ("complete", (i, ok)) for i, job in enumerate(world["jobs"]) for ok in ((True, False) if job[0] else (True,))
    ]
    moves += [(kind, (r, k)) for r in REQUESTS for k in KEYS for kind in ("store", "load")]
    return moves


def _apply(world: dict[str, Any], move: tuple[str, Any]) -> bool:
    """Make the move in `world` (a copy); False when the scheduler would not make it there."""
    kind, arg = move
    if kind == "reset":
        _both(world, "reset_cache")
        world["jobs"] = ()
        return True
    if kind == "complete":
        i, ok = arg
        store, r, k = world["jobs"][i]
        world["jobs"] = world["jobs"][:i] + world["jobs"][i + 1 :]
        if store:
            _both(world, "complete_store", [k], req=r, success=ok)
        else:
            _both(world, "complete_load", [k], req=r)
        return True
    r, k = arg
    if kind == "load":
        if _both(world, "lookup", k, req=r) is not LookupResult.HIT or any(j[1] == r for j in world["jobs"]):
            return False
        _both(world, "prepare_load", [k], req=r)
        world["jobs"] += ((False, r, k),)
        return True
    out = _both(world, "prepare_store", [k], req=r)
    if out is None or not out[1]:
        return out is None  # a refused store is a move (it records the offer); a skipped key changes nothing
    world["jobs"] += ((True, r, k),)
    return True


def _signature(world: dict[str, Any]) -> Any:
    ours = world["managers"][1]
    chunks = tuple(sorted((k, c.state, c.pins, c.chunk_id) for k, c in ours._chunks.items()))
    order = tuple(_norm(ours.lookup(k, world["contexts"]["r1"][1])) for k in KEYS)
    return chunks, tuple(ours._free_list), ours._num_allocated_chunks, world["jobs"], order


def test_every_world_within_the_bound_answers_alike_and_fires_every_transition() -> None:
    REACHED.clear()
    start = _world()
    seen = {_signature(start)}
    frontier = deque([(start, 0)])
    worlds = 0
    while frontier:
        world, depth = frontier.popleft()
        worlds += 1
        if depth == DEPTH:
            continue
        for move in _moves(world):
            nxt = copy.deepcopy(world)
            if not _apply(nxt, move):
                continue
            sig = _signature(nxt)
            if sig not in seen:
                seen.add(sig)
                frontier.append((nxt, depth + 1))
    assert worlds > 300, worlds  # 361 at this bound, and a search to depth 10 finds no other
    assert REACHED == set(range(len(TRANSITIONS))), sorted(set(range(len(TRANSITIONS))) - REACHED)
