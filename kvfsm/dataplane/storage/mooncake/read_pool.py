"""Recycled receive buffers for batch_get (and staging for transports that need registered memory).

Reads land straight in page buffers that the returned tensors alias, so a read neither copies nor
page-faults fresh memory; a buffer is reused only once nothing references it any more (see _ReadPool).
The backend keeps one pool per object size.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from collections.abc import Callable


class _Slab:
    """One anonymous mmap of `pages` page buffers at a stable address, with a free flag per page."""

    __slots__ = ("mm", "anchor", "whole", "base", "free")

    def __init__(self, pages: int, page_nbytes: int) -> None:
        self.mm = mmap.mmap(-1, pages * page_nbytes)
        self.anchor = ctypes.c_char.from_buffer(self.mm)  # keeps the mapping exported (its address stable)
        self.base = ctypes.addressof(self.anchor)
        self.whole = memoryview(self.mm)
        self.free = bytearray(b"\x01" * pages)  # 1: no lease covers the page


class _ReadPool:
    """Page buffers for reads, handed out as leases and reused once nothing references them.

    Buffers live in anonymous mmap slabs (registered with the client when the transport needs it). A
    lease is a memoryview over a run of consecutive pages; the tensors returned for it are rows of one
    `torch.frombuffer` of the lease, so any row or view derived from one keeps the lease referenced, and
    the lease's reference count says when its pages are free again.
    """

    def __init__(self, page_nbytes: int, cap_bytes: int, register: Callable[[int, int], bool] | None) -> None:
        self.page_nbytes = page_nbytes
        self.cap_pages = max(0, cap_bytes // page_nbytes)
        self._register = register
        self.slabs: list[_Slab] = []
        self.pages = 0
        self._leases: list[tuple[memoryview, int, int, int]] = []  # (lease, slab, first page, pages)
        self._probe = [(memoryview(b""), 0, 0, 0)]  # never handed out: what "unreferenced" counts as
        self._lock = threading.Lock()

    @staticmethod
    def _refs(buf: memoryview) -> int:
        return sys.getrefcount(buf)

    def _reclaim(self) -> None:
        entry = self._probe[0]
        lease = entry[0]
        baseline = self._refs(lease)  # measured exactly as each lease is below
        keep = []
        for entry in self._leases:
            lease = entry[0]
            if self._refs(lease) <= baseline:
                _, si, first, n = entry
                self.slabs[si].free[first : first + n] = b"\x01" * n
            else:
                keep.append(entry)
        del lease, entry
        self._leases = keep

    def _grow(self, want: int) -> bool:
        n = min(self.cap_pages - self.pages, max(want, min((64 << 20) // self.page_nbytes, 1024)))
        if n < want:
            return False
        slab = _Slab(n, self.page_nbytes)
        if self._register is not None and not self._register(slab.base, n * self.page_nbytes):
            return False  # not registered now (client busy or master away): fresh memory this time
        self.slabs.append(slab)
        self.pages += n
        return True

    def _lease(self, si: int, first: int, n: int) -> tuple[memoryview, int]:
        slab, pb = self.slabs[si], self.page_nbytes
        slab.free[first : first + n] = bytes(n)
        lease = slab.whole[first * pb : (first + n) * pb]
        self._leases.append((lease, si, first, n))
        return lease, slab.base + first * pb

    def take(self, n: int) -> list[tuple[memoryview, int, int]]:
        """Leases covering up to n pages: (lease, address, pages); fewer pages once the cap is reached."""
        with self._lock:
            self._reclaim()
            run = b"\x01" * n
            for si, slab in enumerate(self.slabs):  # one run of n free pages: one lease
                first = slab.free.find(run)
                if first >= 0:
                    lease, addr = self._lease(si, first, n)
                    return [(lease, addr, n)]
            if self._grow(n):
                lease, addr = self._lease(len(self.slabs) - 1, 0, n)
                return [(lease, addr, n)]
            out: list[tuple[memoryview, int, int]] = []  # fragmented or full: whatever runs are free
            need = n
            for si, slab in enumerate(self.slabs):
                first = slab.free.find(1)
                while first >= 0 and need:
                    end = slab.free.find(0, first)
                    k = min((len(slab.free) if end < 0 else end) - first, need)
                    lease, addr = self._lease(si, first, k)
                    out.append((lease, addr, k))
                    need -= k
                    first = slab.free.find(1, first + k)
                if not need:
                    break
            return out
