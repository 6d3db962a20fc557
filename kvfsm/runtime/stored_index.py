"""The index of stored pages: page hash -> (owning lifecycle's key, token position), newest `limit` kept.

Why not an OrderedDict of tuples: at the default million entries that is a million GC-tracked tuples,
and every full collection of a server process walks them all (tens of milliseconds, on the scheduler
thread, at random iterations). Here nothing the collector tracks grows with the index: a plain dict of
str -> int (CPython leaves such a dict untracked) maps each hash to its slot in a ring of numpy arrays
(object arrays of str are not traversed either), and the oldest entry is dropped first when full.
Storing a hash again updates its value and keeps its age, as an OrderedDict would.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np


class StoredPageIndex(Mapping[str, tuple[str, int]]):
    """Insertion-ordered, bounded map of page hash -> (lifecycle key, position)."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"stored-page index limit must be >= 0, got {limit}")
        self.limit = limit
        self._slot: dict[str, int] = {}  # hash -> sequence number (slot = seq % capacity)
        self._first = 0  # sequence number of the oldest entry
        self._next = 0  # sequence number of the next entry
        self._alloc(min(limit, 1024))

    def _alloc(self, capacity: int) -> None:
        self._hash = np.empty(capacity, dtype=object)
        self._owner = np.empty(capacity, dtype=object)
        self._pos = np.zeros(capacity, dtype=np.int64)

    def _grow(self) -> None:
        """Double the ring (up to the limit): each entry moves from slot seq % old to seq % new capacity, in
        three numpy gathers and scatters. What it saves: the Python loop that computed the slots cost a serving
        loop whose fresh index filled past 512 Ki pages a 273 ms call on this repository's CPU
        (bench/probes/stored_index_probe.py --grow, bench/results/stored_index_grow_probe-cpu.json)."""
        old = self._hash.size
        seqs = np.arange(self._first, self._next, dtype=np.int64)
        was = seqs % old
        h, o, p = self._hash[was], self._owner[was], self._pos[was]
        self._alloc(min(self.limit, max(2 * old, 1)))
        at = seqs % self._hash.size
        self._hash[at], self._owner[at], self._pos[at] = h, o, p

    def put(self, page_hash: str, owner: str, position: int) -> None:
        """Record a stored page (a hash stored again keeps its age); drops the oldest beyond the limit."""
        if not self.limit:
            return
        seq = self._slot.get(page_hash)
        if seq is None:
            if self._next - self._first == self._hash.size:
                if self._hash.size < self.limit:
                    self._grow()
                else:
                    self._drop_oldest()
            seq = self._next
            self._next += 1
            self._slot[page_hash] = seq
            self._hash[seq % self._hash.size] = page_hash
        slot = seq % self._hash.size
        self._owner[slot] = owner
        self._pos[slot] = position

    def put_many(self, hashes: Sequence[str], owners: Sequence[str], positions: Sequence[int]) -> None:
        """`put(h, o, p)` for each triple, in order, with the ring's writes made as three numpy assignments
        rather than three scalar ones a page. What it saves, with the index full at a million pages: about a
        third of a page's cost on this repository's CPU, 1.3-2.1 -> 0.9-1.3 us (bench/probes/stored_index_probe.py,
        bench/results/stored_index_probe-cpu.json); the dict's lookup, drop and insert are what is left. A batch
        longer than the ring goes put by put, since its drops would read slots written by the same batch."""
        n = len(hashes)
        if not self.limit or not n:
            return
        while self._next - self._first + n > self._hash.size < self.limit:
            self._grow()  # as put would grow, ahead of time: the capacity is all that differs
        size = self._hash.size
        if n > size:
            for h, o, p in zip(hashes, owners, positions):
                self.put(h, o, p)
            return
        slot_of, hash_ring = self._slot, self._hash
        first, nxt = self._first, self._next
        # the hashes this batch may drop, oldest first, read in one call (at the limit, every new page drops one)
        droppable = hash_ring.take(np.arange(first, first + n) % size).tolist() if nxt - first + n > size else []
        writes: dict[int, tuple[str, str, int]] = {}  # slot -> (hash, owner, position): the last write wins
        for h, o, p in zip(hashes, owners, positions):
            seq = slot_of.get(h)
            if seq is None:
                if nxt - first == size:  # full at the limit: drop the oldest, whose slot the new entry takes
                    del slot_of[droppable[first - self._first]]
                    first += 1
                seq = nxt
                nxt += 1
                slot_of[h] = seq
            writes[seq % size] = (h, o, p)
        self._first, self._next = first, nxt
        slots = np.fromiter(writes, dtype=np.int64, count=len(writes))
        new_hashes, new_owners, new_positions = zip(*writes.values())
        hash_ring[slots] = new_hashes
        self._owner[slots] = new_owners
        self._pos[slots] = new_positions

    def _drop_oldest(self) -> None:
        slot = self._first % self._hash.size
        del self._slot[self._hash[slot]]
        self._hash[slot] = self._owner[slot] = None
        self._first += 1

    def __getitem__(self, page_hash: str) -> tuple[str, int]:
        slot = self._slot[page_hash] % self._hash.size
        return self._owner[slot], int(self._pos[slot])

    def __contains__(self, page_hash: object) -> bool:
        return page_hash in self._slot

    def __iter__(self) -> Iterator[str]:
        """Oldest first."""
        cap = self._hash.size
        return (self._hash[s % cap] for s in range(self._first, self._next))

    def __len__(self) -> int:
        return self._next - self._first

    def __repr__(self) -> str:
        return f"StoredPageIndex({len(self)} of {self.limit} pages)"


__all__ = ["StoredPageIndex"]
