"""MemoryStorage: a dict-backed store (copies pages in and out), for tests and single-process demos."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import _check_batch


class MemoryStorage:
    """Dict-backed backend (copies pages in and out), for tests and single-process demos."""

    def __init__(self) -> None:
        self.pages: dict[str, torch.Tensor] = {}

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        _check_batch(keys, pages)
        for k, p in zip(keys, pages):
            self.pages.setdefault(k, p.detach().to("cpu").reshape(-1).clone())
        return [True] * len(keys)

    def batch_get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        return [None if (p := self.pages.get(k)) is None else p.clone() for k in keys]

    def batch_exists(self, keys: Sequence[str]) -> int:
        for i, k in enumerate(keys):
            if k not in self.pages:
                return i
        return len(keys)
