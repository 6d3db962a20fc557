"""A scheduler's call sequence, driven through two OffloadingManagers at once and compared call by call.

Each request owns a chain of chunk keys (a block hash per position, one or two KV groups) and a ReqContext
per manager (the managers keep per-request state in it). A step follows the OffloadingConnector's scheduler:
a prefix scan of lookup that stops at the first MISS and waits on HIT_PENDING, one prepare_load per loading
request, one prepare_store per storing request, on_request_finished, on_schedule_end; workers then report
jobs, which complete_store (success or not) or complete_load. reset_cache drops the jobs before it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key


def key(chain: int, position: int, group: int = 0) -> bytes:
    return make_offload_key(bytes([chain, position]) * 4, group)


@dataclass
class Job:
    req: int
    keys: tuple[bytes, ...]
    store: bool


@dataclass
class Request:
    keys: list[bytes]
    contexts: tuple[ReqContext, ...]
    loading: bool = False
    finished: bool = False
    stored: set[bytes] = field(default_factory=set)


def _norm(value: Any) -> Any:
    """A manager's answer as plain data: specs as their slot ids, store outputs as their three fields."""
    if value is None or isinstance(value, (LookupResult, bool, int)):
        return value
    if hasattr(value, "keys_to_store"):
        return ("store", list(value.keys_to_store), value.store_spec.block_ids.tolist(), list(value.evicted_keys))
    if hasattr(value, "block_ids"):
        return ("spec", value.block_ids.tolist())
    return value


class Pair:
    """Two managers fed the same calls; every call's answers (or raised error types) must be equal."""

    def __init__(self, managers: list[Any], check: Callable[[Any], None] | None = None) -> None:
        self.managers = managers
        self.requests: dict[int, Request] = {}
        self.jobs: list[Job] = []
        self.check = check
        self.calls = 0

    def call(self, method: str, *args: Any, req: int | None = None, **kwargs: Any) -> Any:
        answers = []
        for i, m in enumerate(self.managers):
            ctx_args = args if req is None else (*args, self.requests[req].contexts[i])
            try:
                answers.append(("ok", _norm(getattr(m, method)(*ctx_args, **kwargs))))
            except AssertionError:
                answers.append(("assert", None))
        assert all(a == answers[0] for a in answers), (method, args, answers)
        self.calls += 1
        if self.check is not None:
            for m in self.managers:
                self.check(m)
        return answers[0][1]

    def new_request(self, rid: int, keys: list[bytes]) -> None:
        contexts = tuple(ReqContext(req_id=str(rid)) for _ in self.managers)
        for ctx in contexts:
            for pos, k in enumerate(keys):
                ctx.set_offload_key_position(k, (pos + 1) * 16)
        self.requests[rid] = Request(keys, contexts)
        self.call("on_new_request", req=rid)

    def step(self, storing: dict[int, int], finishing: list[int], reoffer: bool = False) -> None:
        """One scheduler step: lookups and a load for each live request, a store of its next `storing[rid]`
        keys (with `reoffer`, of its first ones again, stored or not, as after a preemption), then the finishes
        and the end of the step."""
        for rid, r in self.requests.items():
            if r.finished or r.loading:
                continue
            hits: list[bytes] = []
            pending = False
            for k in r.keys:
                res = self.call("lookup", k, req=rid)
                if res is LookupResult.MISS:
                    break
                if res is LookupResult.HIT_PENDING:
                    pending = True
                    break
                hits.append(k)
            if hits and not pending and not (set(hits) <= r.stored):
                self.call("prepare_load", hits, req=rid)
                self.jobs.append(Job(rid, tuple(hits), store=False))
                r.loading = True
                r.stored.update(hits)
        for rid, n in storing.items():
            r = self.requests[rid]
            if r.finished or n <= 0:
                continue
            todo = r.keys[:n] if reoffer else [k for k in r.keys if k not in r.stored][:n]
            if not todo:
                continue
            out = self.call("prepare_store", todo, req=rid)
            if out is not None:
                r.stored.update(todo)
                if out[1]:
                    self.jobs.append(Job(rid, tuple(dict.fromkeys(out[1])), store=True))
        for rid in finishing:
            r = self.requests[rid]
            if not r.finished:
                r.finished = True
                self.call("on_request_finished", req=rid)
        self.call("on_schedule_end", ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def complete(self, index: int, success: bool) -> None:
        job = self.jobs.pop(index % len(self.jobs))
        if job.store:
            self.call("complete_store", list(job.keys), req=job.req, success=success)
        else:
            self.call("complete_load", list(job.keys), req=job.req)
            self.requests[job.req].loading = False

    def reset(self) -> None:
        for rid, r in self.requests.items():
            if not r.finished:
                r.finished = True
                self.call("on_request_finished", req=rid)
        self.call("reset_cache")
        self.jobs.clear()

    def events(self) -> list[Any]:
        drained = [list(m.take_events()) for m in self.managers]
        assert all(d == drained[0] for d in drained), drained
        return drained[0]
