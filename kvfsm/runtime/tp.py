"""Tensor-parallel progress consensus: every rank processes the same prefix of its FIFO queues (B14).

Each rank's copy stream and backup worker finish at different times; taking the MIN of the completed
counts over the TP group means every rank applies the same transitions, frees and writes in the same
order, whatever its own timing.
"""

from __future__ import annotations

from typing import Any

import torch


class ProgressConsensus:
    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.world = 1
        self.device = torch.device("cpu")
        if group is not None:
            import torch.distributed as dist

            self.world = dist.get_world_size(group=group)
            if dist.get_backend(group) == "nccl":
                self.device = torch.device("cuda", torch.cuda.current_device())

    def agree(self, *counts: int) -> tuple[int, ...]:
        """The element-wise MIN of `counts` over the group (identity on one rank)."""
        if self.world <= 1:
            return counts
        import torch.distributed as dist

        t = torch.tensor(counts, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return tuple(int(x) for x in t.tolist())

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on some rank (a MAX all-reduce; identity on one rank)."""
        if self.world <= 1:
            return bool(flag)
        return -self.agree(-int(bool(flag)))[0] > 0

    def check_same(self, *values: int) -> bool:
        """Whether every rank passed the same values (used to reject a group that disagrees on sizes)."""
        if self.world <= 1:
            return True
        lo = self.agree(*values)
        hi = self.agree(*(-v for v in values))
        return all(a == -b for a, b in zip(lo, hi))
