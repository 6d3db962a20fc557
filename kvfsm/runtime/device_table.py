"""Slot indices read on the device, for a request table that has no host mirror.

kvfsm's own `ReqToTokenPool` keeps a host mirror of its table, and the manager reads slots from it with
numpy. An engine whose table lives only on the GPU (SGLang's `req_to_token`, written by its kernels) has
none, and reading it on the host would wait for the decode step the GPU is running. There the manager
never sees slot *values*: it asks this class for device tensors of them (a gather on the caller's
current stream, so it is ordered after the engine's writes of the table and before the copy that reads
it), hands those to the copy engine and, at release, to the engine's allocator.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class DeviceTableSlots:
    """Reads of a `[rows, width]` integer slot table on its own device; nothing here waits for the GPU.

    Positions are computed on the host (rows and lengths are host values) and uploaded from pinned
    memory without blocking; every result is an int64 tensor on the table's device."""

    def __init__(self, table: torch.Tensor, page_size: int) -> None:
        if table.dim() != 2:
            raise ValueError(f"a request table is [rows, max_context], got shape {tuple(table.shape)}")
        self.table = table
        self.device = table.device
        self.width = int(table.shape[1])
        self.page_size = int(page_size)
        self._flat = table.view(-1)
        self._page_offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)

    def span(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of positions [start, end) of `row` (a copy: the table's row may be rewritten later)."""
        return self.table[row, start:end].to(torch.int64, copy=True)

    def spans(self, firsts: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
        """The slots of several spans, concatenated: flat table positions `firsts[i] + [0, lengths[i])`."""
        if len(firsts) == 1:
            row, start = divmod(int(firsts[0]), self.width)
            return self.span(row, start, start + int(lengths[0]))
        lens = np.asarray(lengths, dtype=np.int64)
        flat = np.repeat(np.asarray(firsts, dtype=np.int64) - (np.cumsum(lens) - lens), lens) + np.arange(
            int(lens.sum()), dtype=np.int64
        )
        return self._flat.index_select(0, self._uploaded(flat)).to(torch.int64)

    def page_ids(self, row: int, start: int, end: int) -> torch.Tensor:
        """The ids of the pages that positions [start, end) of `row` start on (start a page boundary): each
        page's first slot // page_size, int64, in one GPU op (the division writes the widened result)."""
        firsts = self.table[row, start : end : self.page_size]
        out = torch.empty(firsts.shape[0], dtype=torch.int64, device=self.device)
        return torch.div(firsts, self.page_size, rounding_mode="floor", out=out)

    def page_ids_many(self, rows: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> torch.Tensor:
        """`page_ids(rows[i], starts[i], ends[i])` for every i, concatenated in order, in one gather: the flat table
        positions of every page's first slot are computed on the host and uploaded (pinned, without blocking), so
        a batch of spans costs the same four GPU ops as one of them (an upload, a gather, the widened division
        and its output) where `page_ids` a span makes three."""
        ps, width = self.page_size, self.width
        begin = np.asarray(starts, dtype=np.int64)
        counts = np.maximum(-(-(np.minimum(np.asarray(ends, dtype=np.int64), width) - begin) // ps), 0)
        firsts = np.asarray(rows, dtype=np.int64) * width + begin
        total = int(counts.sum())
        flat = np.repeat(firsts - (np.cumsum(counts) - counts) * ps, counts) + np.arange(total, dtype=np.int64) * ps
        out = torch.empty(total, dtype=torch.int64, device=self.device)
        return torch.div(self._flat.index_select(0, self._uploaded(flat)), ps, rounding_mode="floor", out=out)

    def _uploaded(self, flat: np.ndarray) -> torch.Tensor:
        """Flat table positions computed on the host, on the table's device: from pinned memory without blocking."""
        positions = torch.from_numpy(flat)
        if self.device.type == "cuda":
            positions = positions.pin_memory().to(self.device, non_blocking=True)  # pageable would sync
        return positions

    def whole_pages(self, row: int, start: int, end: int) -> torch.Tensor:
        """Every slot of the pages that positions [start, end) of `row` start on (start a page boundary):
        each page's first slot, rounded down to its page, plus 0..page_size-1 (the paged layout)."""
        ps = self.page_size
        # Two GPU ops, the page ids in the table's dtype and one add that widens them: each small op costs the
        # scheduler's thread 15-20 us on a GPU host, and a release made four here (a widening copy, a remainder,
        # a subtraction, an add) before SGLang's free made two more (bench/probes/door_phases.py --detail,
        # `fx.request_slots`: 78 us a release at 4096 live on the H100 host of 2026-12-07)
        pages = self.table[row, start:end:ps] // ps
        return torch.add(self._page_offsets, pages.unsqueeze(1), alpha=ps).reshape(-1)
