"""The seed's offload algorithm, as a baseline for bench/serving_loop.py (written from its behaviour).

SGLang's decode-side offload manager, in the version kvfsm started from, works request by request:
- `offload(req)` is called for every request of the decode batch. It rebuilds the request's token list
  (prompt + outputs), and when a whole stride past what it has offloaded is there, allocates host slots
  and submits one device-to-host copy for that request alone.
- `check_progress()` walks completed copies in order. For each one it hashes the chunk's pages (a
  chained sha256 per page, on the scheduler thread), hands the host pages to a backup thread, and
  releases a request that finished while the copy was in flight. Completed backups free their host slots.
- `finalize(req)` releases a finished request now, or leaves it to its last copy's completion.

It runs here on kvfsm's pools, allocator, request table (its host mirror, as kvfsm reads it) and copy
engine, so the serving loop compares the two algorithms on the same data plane in the same run. It has
no lifecycle checks at all: what kvfsm's manager spends on its spec is inside the ratio.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from kvfsm.dataplane import CopyEngine, HostKVPool, ReqToTokenPool, TokenSlotAllocator, page_hash
from kvfsm.dataplane.pools.device_pool import DeviceKVPool


class SeedAlgorithmOffload:
    """Per-request offload, per-chunk copies, hashing at completion on the scheduler thread."""

    def __init__(
        self,
        *,
        page_size: int,
        stride: int,
        device_pool: DeviceKVPool,
        allocator: TokenSlotAllocator,
        req_to_token: ReqToTokenPool,
        host_pool: HostKVPool,
        copy_engine: CopyEngine,
        storage: Any,
    ) -> None:
        self.page_size, self.stride = page_size, stride
        self.device_pool, self.allocator, self.table = device_pool, allocator, req_to_token
        self.host_pool, self.copy_engine, self.storage = host_pool, copy_engine, storage
        self.state: dict[str, list[Any]] = {}  # rid -> [prefill_len, inc_len, last_hash]
        self.inflight: dict[str, int] = {}  # rid -> copies in flight
        self.ongoing: dict[int, tuple[Any, list[int], list[int]]] = {}  # ack -> (req, host pages, tokens)
        self.writes: deque[tuple[Any, int]] = deque()  # (copy handle, ack), submission order
        self.backups: deque[tuple[Future[list[bool]], list[int]]] = deque()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seed-backup")
        self._acks = 0
        self.offloaded_tokens = 0

    def _hashes(self, tokens: list[int], prior: Optional[str]) -> list[str]:
        out, last = [], prior
        for i in range(0, len(tokens), self.page_size):  # one call per page, as the seed
            last = page_hash(tokens[i : i + self.page_size], last)
            out.append(last)
        return out

    def offload(self, req: Any) -> bool:
        if req.req_pool_idx is None or not req.output_ids:
            return False
        all_tokens = req.origin_input_ids + req.output_ids[:-1]
        prefill = len(req.origin_input_ids) // self.page_size * self.page_size
        st = self.state.get(req.rid)
        if st is None:
            hashes = self._hashes(req.origin_input_ids[:prefill], None)
            st = self.state[req.rid] = [prefill, 0, hashes[-1] if hashes else None]
        n = (len(all_tokens) - st[0] - st[1]) // self.stride * self.stride
        if n == 0:
            return False
        start = st[0] + st[1]
        pages = self.host_pool.allocator.alloc_pages(n // self.page_size)
        if pages is None:
            return False
        device = self.table.read_host(req.req_pool_idx, start, start + n)
        handle = self.copy_engine.submit_d2h(self.device_pool, device, self.host_pool, self.host_pool.page_slots(pages))
        self._acks += 1
        self.writes.append((handle, self._acks))
        self.ongoing[self._acks] = (req, pages, all_tokens[start : start + n])
        self.inflight[req.rid] = self.inflight.get(req.rid, 0) + 1
        st[1] += n
        self.offloaded_tokens += n
        return True

    def _write(self, hashes: list[str], pages: list[int]) -> list[bool]:
        if self.storage is None:
            return [False] * len(hashes)
        slots = self.host_pool.page_slots(pages)
        direct = getattr(self.storage, "batch_set_from_host", None)  # the same store path as kvfsm's
        if direct is not None:
            return list(direct(hashes, self.host_pool, slots))
        return list(self.storage.batch_set(hashes, list(self.host_pool.get_pages_bytes(slots).unbind(0))))

    def check_progress(self) -> None:
        while self.writes and self.writes[0][0].done():
            _, ack = self.writes.popleft()
            req, pages, tokens = self.ongoing.pop(ack)
            self.inflight[req.rid] -= 1
            st = self.state.get(req.rid)
            hashes = self._hashes(tokens, st[2] if st else None)
            if st is not None:
                st[2] = hashes[-1]
            self.backups.append((self._pool.submit(self._write, hashes, pages), pages))
            if req.finished() and not self.inflight[req.rid]:
                self._release(req)
        while self.backups and self.backups[0][0].done():
            future, pages = self.backups.popleft()
            future.result()
            self.host_pool.free_pages(pages)

    def finalize(self, req: Any) -> None:
        if req.req_pool_idx is None:
            return
        self.state.setdefault(req.rid, [len(req.origin_input_ids) // self.page_size * self.page_size, 0, None])
        if self.inflight.get(req.rid, 0):
            return  # released at its last copy's completion
        self._release(req)

    def _release(self, req: Any) -> None:
        ps = self.page_size
        held = -(-req.kv_allocated_len // ps) * ps
        starts = self.table.read_host(req.req_pool_idx, 0, held)[::ps]
        self.allocator.free_pages((starts // ps).tolist())
        self.table.free(req.req_pool_idx)
        req.req_pool_idx = None
        self.state.pop(req.rid, None)
        self.inflight.pop(req.rid, None)

    def idle(self) -> bool:
        return not self.writes and not self.backups

    def close(self) -> None:
        self._pool.shutdown(wait=True)


__all__ = ["SeedAlgorithmOffload"]
