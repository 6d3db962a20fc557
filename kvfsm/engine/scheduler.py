"""A continuous-batching decode loop over a paged KV pool: admission, decode, finish, abort, retraction.

With a manager, every end of life goes through it (and offload happens after each decode step);
without one, the engine frees its own slots, as an engine without offload would. Running the same
workload both ways and comparing the generated tokens is the demo's proof that offload and release
never change what the model computes.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvfsm.dataplane import ReqToTokenPool, SlotFence, TokenSlotAllocator, wait_fences
from kvfsm.dataplane.pools.device_pool import DeviceKVPool
from kvfsm.engine.model import TinyDecoder
from kvfsm.runtime import DecodeOffloadManager, SimplePrefixCache


def grow_slots(
    allocator: TokenSlotAllocator,
    table: ReqToTokenPool,
    req,
    length: int,
    wait: Optional[Callable[[tuple[SlotFence, ...]], None]] = None,
) -> bool:
    """Give positions [0, length) of `req` device slots, in whole pages; False (nothing changed) when the
    pool or the table row has no room. With `wait`, slots released fenced may be among them (handed out
    last): `wait` gets their fences, to make the stream that writes the slots wait on them."""
    page = allocator.page_size
    have = -(-req.kv_allocated_len // page) * page
    need = -(-length // page) * page
    if need > table.max_context:
        return False
    if need > have:
        if wait is None:
            new = allocator.alloc(need - have)
            fences: tuple[SlotFence, ...] = ()
        else:
            got = allocator.alloc_fenced(need - have)
            new, fences = got if got is not None else (None, ())
        if new is None:
            return False
        table.write(req.req_pool_idx, have, new)
        if fences:
            wait(fences)  # type: ignore[misc]
    req.kv_allocated_len = max(req.kv_allocated_len, length)
    return True


class EngineRequest:
    """Implements kvfsm.runtime.OffloadRequest (a plain class: weak-referenceable, identity-hashed)."""

    def __init__(
        self, rid: str, prompt: list[int], max_new: int = 0, abort_at: Optional[int] = None, prefix_len: int = 0
    ) -> None:
        self.rid = rid
        self.origin_input_ids = prompt
        self.output_ids: list[int] = []
        self.req_pool_idx: Optional[int] = None
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.prefix_len = prefix_len
        self.lock = None  # the prefix cache's lock on [0, prefix_len), taken at admission
        self.max_new = max_new
        self.abort_at = abort_at
        self.done = False
        self.retractions = 0

    def finished(self) -> bool:
        return self.done

    @property
    def row(self) -> int:
        """Its row in the request-to-token table while admitted (`req_pool_idx`, None before and after)."""
        if self.req_pool_idx is None:
            raise RuntimeError(f"request {self.rid!r} holds no table row")
        return self.req_pool_idx


def make_workload(n: int, seed: int, vocab: int) -> list[EngineRequest]:
    """Mixed prompt and output lengths; some requests abort part way, some share a protected prefix."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(4, 64))]
        max_new = rng.randrange(8, 96)
        abort_at = rng.randrange(1, max_new) if rng.random() < 0.1 else None
        reqs.append(EngineRequest(f"req-{i}", prompt, max_new, abort_at, prefix_len=rng.choice([0, 0, 8])))
    return reqs


@dataclass
class EngineStats:
    steps: int = 0
    tokens: int = 0
    admissions: int = 0  # admissions and re-admissions
    batch_sum: int = 0  # sum over steps of the requests decoded (mean batch = batch_sum / steps)
    retractions: int = 0
    aborted: int = 0
    finished: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)


class DecodeEngine:
    def __init__(
        self,
        model: TinyDecoder,
        pool: DeviceKVPool,
        allocator: TokenSlotAllocator,
        table: ReqToTokenPool,
        protected: SimplePrefixCache,
        max_batch: int,
        manager: Optional[DecodeOffloadManager] = None,
        speculative: int = 0,
        fenced: bool = False,
    ) -> None:
        self.model, self.pool, self.allocator, self.table = model, pool, allocator, table
        self.protected, self.manager, self.max_batch = protected, manager, max_batch
        self.page = allocator.page_size
        self.speculative = speculative  # slots over-allocated past each decode step (speculative decoding)
        # take slots a fenced release returned too (alloc_fenced), the compute stream waiting on their fences
        self.fenced = fenced

    # --- memory ----------------------------------------------------------------------------------------
    def _grow(self, req: EngineRequest, length: int) -> bool:
        return grow_slots(self.allocator, self.table, req, length, self._wait if self.fenced else None)

    def _wait(self, fences: tuple[SlotFence, ...]) -> None:
        """The stream that writes the slots (the model's: the current one) waits on their fences."""
        wait_fences(fences, torch.cuda.current_stream(self.pool.device) if self.pool.device.type == "cuda" else None)

    def _release_without_manager(self, req: EngineRequest) -> None:
        """What the manager's release does: free the request's own pages [prefix_len, allocated), its row, and
        unlock its matched prefix (the prefix cache evicts those pages)."""
        held = -(-req.kv_allocated_len // self.page) * self.page
        starts = self.table.read(req.row, req.prefix_len, held)[:: self.page]
        slots = (starts[:, None] + torch.arange(self.page, device=starts.device)).reshape(-1)
        self.allocator.free(slots)
        self.table.free(req.row)
        self.protected.unlock(req.lock)
        req.lock = None
        req.req_pool_idx = None

    def _end(self, req: EngineRequest, how: str) -> None:
        if self.manager is None:
            self._release_without_manager(req)
        else:
            {"finish": self.manager.finalize, "abort": self.manager.abort, "retract": self.manager.retract}[how](req)

    # --- the loop --------------------------------------------------------------------------------------
    def _admit(self, req: EngineRequest) -> bool:
        row = self.table.alloc()
        if row is None:
            return False
        req.req_pool_idx, req.kv_allocated_len, req.kv_committed_len = row, 0, 0
        tokens = req.origin_input_ids + req.output_ids[:-1] if req.output_ids else req.origin_input_ids
        if not self._grow(req, len(tokens) + 1):
            self.table.free(row)
            req.req_pool_idx = None
            return False
        slots = self.table.read(row, 0, len(tokens))
        nxt = 0
        for p, tok in enumerate(tokens):  # (re)compute every position, one at a time
            nxt = self.model.step(self.pool, slots[: p + 1], tok)
        req.kv_committed_len = len(tokens)
        if req.output_ids:
            assert nxt == req.output_ids[-1], f"{req.rid}: recomputation after retraction disagrees"
        else:
            req.output_ids.append(nxt)
        self.protected.lock_prompt_prefix(req, self.table)
        return True

    def run(self, requests: list[EngineRequest], on_step: Optional[Callable[[int], None]] = None) -> EngineStats:
        stats = EngineStats()
        waiting = list(requests)
        live: list[EngineRequest] = []
        while waiting or live:
            while waiting and len(live) < self.max_batch and self._admit(waiting[0]):
                live.append(waiting.pop(0))
                stats.admissions += 1
            if not live:
                raise RuntimeError("a single request does not fit the device pool")
            stepped: list[EngineRequest] = []
            for req in list(live):
                pos = req.kv_committed_len
                if not self._grow(req, pos + 1 + self.speculative):
                    live.remove(req)  # memory pressure: retract; it is recomputed when re-admitted
                    self._end(req, "retract")
                    req.retractions += 1
                    stats.retractions += 1
                    waiting.insert(0, req)
                    continue
                slots = self.table.read(req.row, 0, pos + 1)
                req.output_ids.append(self.model.step(self.pool, slots, req.output_ids[-1]))
                req.kv_committed_len = pos + 1
                stats.tokens += 1
                stepped.append(req)
            stats.batch_sum += len(stepped)
            if self.manager is not None and stepped:  # the decode batch's new KV, in one call
                self.manager.offload_batch(stepped, [r.row for r in stepped], [r.kv_committed_len for r in stepped])
            for req in stepped:
                ended = (
                    "abort"
                    if req.abort_at is not None and len(req.output_ids) >= req.abort_at
                    else ("finish" if len(req.output_ids) >= req.max_new else None)
                )
                if ended:
                    live.remove(req)
                    req.done = True
                    self._end(req, ended)
                    stats.aborted += ended == "abort"
                    stats.finished += ended == "finish"
                    if on_step:
                        on_step(1)
            if self.manager is not None:
                self.manager.check_progress()
            stats.steps += 1
        if self.manager is not None:
            self.manager.drain()
        stats.outputs = {r.rid: list(r.output_ids) for r in requests}
        return stats
