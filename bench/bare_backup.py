"""The floor of an offload manager that also backs its pages up, in bench/serving_loop.py (`--floors backup`).

bench/bare_offload.py's floor copies and frees, and stores nothing. Every manager that backs pages up to a
store keyed by chained page hashes, kvfsm or SGLang's, must also, per chunk: keep the chunk's tokens, hash its
pages behind the request's last page (the prompt's pages first), hand the pages to the store, keep the host
pages until the store has them, and record the stored pages in an index. This floor does exactly that and
nothing else, with kvfsm's own parts where the work is the same: the same backup thread (`ThreadBackupWorker`,
hashing on it as kvfsm's does), the same store (the loop's, e.g. four store processes), `store_host_pages`,
`page_hashes` and `StoredPageIndex.put_many`. It keeps no lifecycle, no checks, no per-chunk object (one
backup job a batch, not one a chunk) and no failure handling.

What it is for: the serving loop's targets hold kvfsm's median to 1.5x (64/64) and 2x (16/16) the copy-only
floor. This floor's own ratio to the copy-only floor, in the same run, is the part of that budget that backing
up costs any manager whose backups run in the scheduler's process; kvfsm's ratio to it is what kvfsm's
lifecycle costs on top.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

from bare_offload import BareOffload

from kvfsm.dataplane.hashing import page_hashes
from kvfsm.dataplane.storage.base import store_host_pages
from kvfsm.runtime.backup import BackupJob, ThreadBackupWorker
from kvfsm.runtime.effects import token_slice
from kvfsm.runtime.stored_index import StoredPageIndex


class _Batch:
    """One offload call's chunks, from its copy until the store has its pages."""

    __slots__ = ("chunks", "pages", "keys")

    def __init__(self, chunks: list[tuple[int, str, int, list[int] | None, list[int]]], pages: list[int]) -> None:
        self.chunks = chunks  # (row, rid, start, the prompt's aligned tokens on a request's first chunk, tokens)
        self.pages = pages  # the batch's host pages, in chunk order
        self.keys: list[str] = []  # set by the backup thread


class BareBackupOffload(BareOffload):
    """BareOffload, plus: tokens kept per chunk, hashed and stored on a backup thread, host pages freed once
    stored, stored pages indexed."""

    def __init__(self, *, storage: Any, stored_limit: int = 1 << 20, **floor: Any) -> None:
        super().__init__(**floor)
        self.storage = storage
        self.worker = ThreadBackupWorker(capacity=1 << 30)
        self.stored = StoredPageIndex(stored_limit)
        self.chained = np.zeros(self.table.rows, dtype=bool)  # per row: its request's chain has started
        self.last_hash: dict[int, str | None] = {}  # per row: the chain's last page hash (the backup thread's)
        self.stored_pages = 0

    def offload_batch(self, reqs: list[Any], rows: np.ndarray, committed: np.ndarray) -> int:
        """BareOffload.offload_batch, keeping each chunk's tokens (and, on a request's first chunk, its prompt's
        aligned tokens, which its chain starts with). A copy of the floor's loop rather than a hook in it, so
        that the copy-only floor pays nothing for this one."""
        ps, stride = self.page_size, self.stride
        picked = np.flatnonzero(committed >= self.due[rows])
        firsts: list[int] = []
        chunks: list[tuple[int, str, int, list[int] | None, list[int]]] = []
        for i in picked.tolist():
            req, row = reqs[i], int(rows[i])
            start = int(self.start[row])
            if start < 0:
                start = len(req.origin_input_ids) // ps * ps
            n = (min(int(committed[i]), len(req.origin_input_ids) + len(req.output_ids) - 1) - start) // stride * stride
            if n > 0:
                base = row * self.width + start
                firsts += range(base, base + n, ps)
                prompt = None
                if not self.chained[row]:
                    prompt = list(req.origin_input_ids[: len(req.origin_input_ids) // ps * ps])
                    self.chained[row] = True
                chunks.append((row, req.rid, start, prompt, token_slice(req, start, start + n)))
                start += n
            self.start[row] = start
            self.due[row] = start + stride
        if not firsts:
            return 0
        pages = self.host_pool.allocator.alloc_pages(len(firsts))
        if pages is None:
            return 0
        starts = self.flat[firsts]
        device = torch.from_numpy(np.add.outer(starts, self.offsets).reshape(-1))
        handle = self.copy_engine.submit_d2h(self.device_pool, device, self.host_pool, self.host_pool.page_slots(pages))
        self.serial += 1
        self.inflight.append((self.serial, handle, pages, _Batch(chunks, pages)))  # type: ignore[arg-type]
        self.offloaded_tokens += len(firsts) * ps
        return len(chunks)

    def _write(self, batch: _Batch) -> list[bool]:
        """On the backup thread: the batch's keys, chained per request, and one store call for its pages."""
        ps, last = self.page_size, self.last_hash
        keys: list[str] = []
        for row, _, _, prompt, tokens in batch.chunks:
            if prompt is not None:  # a request's first chunk: its chain starts with the prompt's pages
                head = page_hashes(prompt, ps) if prompt else []
                last[row] = head[-1] if head else None
            hashes = page_hashes(tokens, ps, last.get(row))
            last[row] = hashes[-1]
            keys += hashes
        batch.keys = keys
        if self.storage is None:  # the loop's `--storage none`: every backup fails, its pages are freed
            return [False] * len(keys)
        return store_host_pages(self.storage, keys, self.host_pool, self.host_pool.page_slots(batch.pages))

    def check_progress(self) -> None:
        """Stored batches free their host pages and enter the index; landed copies go to the backup thread (one
        job a batch); finished requests are released once their copies landed, as the floor does. The backup
        thread is woken last, as kvfsm's progress check wakes it: woken sooner, its hashing would take the
        interpreter lock from the rest of the check."""
        done = self.worker.completed()
        if done:
            ps = self.page_size
            for job in self.worker.collect_many(done):
                batch = job.payload
                self.host_pool.free_pages(batch.pages)
                if job.ok:
                    owners: list[str] = []
                    positions: list[int] = []
                    for _, rid, start, _, tokens in batch.chunks:
                        k = len(tokens) // ps
                        owners += [rid] * k
                        positions += range(start, start + k * ps, ps)
                    self.stored.put_many(batch.keys, owners, positions)
                    self.stored_pages += len(batch.keys)
        queued: deque[Any] = self.inflight  # (serial, handle, pages, batch)
        jobs = []
        while queued and queued[0][1].done():
            jobs.append(BackupJob(queued.popleft()[3], self._write))
        if jobs:
            self.worker.submit_many(jobs)
        landed = queued[0][0] - 1 if queued else self.serial
        while self.finished and self.finished[0][0] <= landed:
            self._release(self.finished.popleft()[1])
        self.worker.flush()

    def _release(self, req: Any) -> None:
        self.chained[req.req_pool_idx] = False
        super()._release(req)

    def idle(self) -> bool:
        return super().idle() and self.worker.outstanding() == 0

    def close(self) -> None:
        self.worker.close()


__all__ = ["BareBackupOffload"]
