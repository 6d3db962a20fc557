"""A dispatch mode that records every tensor copy: its source's device and memory, its destination's device.

Whether an upload from pageable host memory waits for the stream is the driver's choice (CUDA's API
synchronisation notes: a pageable copy "may synchronize with the stream"; in the H200 GPU mutation pass a busy-stream
test of a 1 MiB write did not fail against an unpinned upload), and `set_sync_debug_mode` reports neither kind. So a test that promises an upload never waits checks what the driver
is given: a pinned source and a non-blocking copy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class Copy:
    src: str  # the source's device type
    pinned: bool  # a host source in page-locked memory
    dst: str  # the destination's device type
    non_blocking: bool


class CopySpy(TorchDispatchMode):
    """`with CopySpy() as spy: ...`, then `spy.copies`, in the order they ran."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[Copy] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            self.copies.append(
                Copy(src.device.type, src.device.type == "cpu" and src.is_pinned(), dst.device.type, non_blocking)
            )
        return func(*args, **kwargs)
