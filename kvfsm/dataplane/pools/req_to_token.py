"""Request rows → device slot indices.

Each live request owns one row of an int64 `[rows, max_context]` table; the attention kernels read
slot indices from it. Rows are few and handed out one at a time, so a Python free list is enough.

The table may live on the GPU (as SGLang keeps `req_to_token`), but it always has a host mirror,
`host_table`, written by the same `write()` call: the offload manager reads slots only from the mirror,
so no manager call ever reads GPU memory (which would wait for the decode step the GPU is running).
On a GPU table, `write()` uploads the new slots with a non-blocking copy from pinned memory on the
caller's current stream, ordered before whatever the caller enqueues next (the attention that reads them).
Writes must go through `write()`: a slot written into the device tensor directly is invisible to the mirror.
"""

from __future__ import annotations

from collections import deque

import torch

from ..errors import ConservationError, DoubleFree, NeverAllocated, NotAllocated, OutOfRange
from .allocator import IndexLike, as_index_tensor
from .device_pool import resolve_device


class ReqToTokenPool:
    """Row allocator plus the row → slot-index table."""

    def __init__(self, rows: int, max_context: int, device: torch.device | str = "cpu") -> None:
        if rows <= 0 or max_context <= 0:
            raise ValueError(f"rows and max_context must be positive, got {rows}, {max_context}")
        self.rows = int(rows)
        self.max_context = int(max_context)
        self.device = resolve_device(device)
        self.host_table = torch.zeros((self.rows, self.max_context), dtype=torch.int64)  # the mirror (CPU)
        # the table the kernels read: the mirror itself on the CPU, else a device copy kept equal by write()
        self.req_to_token = (
            self.host_table if self.device.type == "cpu" else torch.zeros_like(self.host_table, device=self.device)
        )
        self._free: deque[int] = deque(range(self.rows))
        self._allocated = [False] * self.rows
        self._ever = [False] * self.rows

    @property
    def free_rows(self) -> int:
        return len(self._free)

    def is_allocated(self, row: int) -> bool:
        self._check_row(row)
        return self._allocated[row]

    def alloc(self) -> int | None:
        """A free row, or None when every row is taken."""
        if not self._free:
            return None
        row = self._free.popleft()
        self._allocated[row] = True
        self._ever[row] = True
        return row

    def free(self, row: int) -> None:
        """Return a row; an unknown row or a row that is already free is rejected with no state change."""
        self._check_row(row)
        if not self._allocated[row]:
            if self._ever[row]:
                raise DoubleFree(f"request row {row} is already free")
            raise NeverAllocated(f"request row {row} was never allocated")
        self._allocated[row] = False
        self._free.append(row)

    def write(self, row: int, start: int, slots: IndexLike) -> None:
        """Store slot indices for positions `[start, start + len(slots))` of an allocated row, in the host
        mirror and (GPU table) the device table. Pass CPU slots (what TokenSlotAllocator.alloc returns on
        a CPU allocator): slots given on the GPU must be read into the mirror, which waits for the GPU."""
        self._check_live(row)
        idx = as_index_tensor(slots, torch.device("cpu"))
        end = start + idx.numel()
        if start < 0 or end > self.max_context:
            raise OutOfRange(f"positions [{start}, {end}) outside [0, {self.max_context})")
        self.host_table[row, start:end] = idx
        if self.req_to_token is not self.host_table:
            src = idx.pin_memory() if self.device.type == "cuda" else idx  # pageable memory would sync
            self.req_to_token[row, start:end].copy_(src, non_blocking=True)

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slot indices of positions `[start, end)` of an allocated row (a view of the table's device)."""
        self._check_span(row, start, end)
        return self.req_to_token[row, start:end]

    def read_host(self, row: int, start: int, end: int) -> torch.Tensor:
        """The same slots from the host mirror (a CPU view): reading them never waits for the GPU."""
        self._check_span(row, start, end)
        return self.host_table[row, start:end]

    def _check_span(self, row: int, start: int, end: int) -> None:
        self._check_live(row)
        if not 0 <= start <= end <= self.max_context:
            raise OutOfRange(f"positions [{start}, {end}) outside [0, {self.max_context})")

    def check_conservation(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise ConservationError("a request row is in the free list twice")
        if any(self._allocated[r] for r in free) or len(free) + sum(self._allocated) != self.rows:
            raise ConservationError("free rows and allocated rows do not partition the table")

    def _check_row(self, row: int) -> None:
        if not isinstance(row, int) or isinstance(row, bool) or not 0 <= row < self.rows:
            raise OutOfRange(f"request row {row!r} outside [0, {self.rows})")

    def _check_live(self, row: int) -> None:
        self._check_row(row)
        if not self._allocated[row]:
            raise NotAllocated(f"request row {row} is not allocated")
