"""FaultyStorage: any backend with faults chosen up front (failed writes, corrupt or dropped reads), for tests."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from .base import StorageBackend, _check_batch

KeySelector = Collection[str] | Callable[[str], bool]


def _selector(spec: KeySelector | None) -> Callable[[str], bool]:
    if spec is None:
        return lambda _k: False
    if callable(spec):
        return spec
    chosen = frozenset(spec)
    return chosen.__contains__


class FaultyStorage:
    """Wraps a backend and injects faults chosen up front, deterministically.

    fail_writes: keys (or a predicate) whose writes fail (reported False, never reach the inner store);
    fail_write_ordinals: 0-based positions, counted over all pages ever passed to batch_set, that fail;
    corrupt_reads: keys whose read returns the stored page with byte 0 flipped (silent corruption);
    drop_reads: keys whose read returns None (a lost or detected-bad page);
    raise_writes: key -> the exception a write of it raises (None: none), for faults outside the expected
    types, a client library's own error or a BaseException, say. The whole batch_set call raises, as a
    client's batch call would.
    """

    def __init__(
        self,
        inner: StorageBackend,
        fail_writes: KeySelector | None = None,
        fail_write_ordinals: Collection[int] = (),
        corrupt_reads: KeySelector | None = None,
        drop_reads: KeySelector | None = None,
        raise_writes: Callable[[str], BaseException | None] | None = None,
    ) -> None:
        self.inner = inner
        self._fail = _selector(fail_writes)
        self._fail_ordinals = frozenset(fail_write_ordinals)
        self._corrupt = _selector(corrupt_reads)
        self._drop = _selector(drop_reads)
        self._raise = raise_writes
        self.raised: list[str] = []  # keys whose write raised
        self.pages_written = 0
        self.failed_writes: list[str] = []
        self.corrupted_reads: list[str] = []
        self.dropped_reads: list[str] = []

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        _check_batch(keys, pages)
        if self._raise is not None:
            for k in keys:
                exc = self._raise(k)
                if exc is not None:
                    self.raised.append(k)
                    raise exc
        ok = [True] * len(keys)
        passed: list[int] = []
        for i, k in enumerate(keys):
            ordinal = self.pages_written + i
            if self._fail(k) or ordinal in self._fail_ordinals:
                ok[i] = False
                self.failed_writes.append(k)
            else:
                passed.append(i)
        self.pages_written += len(keys)
        if passed:
            inner_ok = self.inner.batch_set([keys[i] for i in passed], [pages[i] for i in passed])
            for i, r in zip(passed, inner_ok):
                ok[i] = bool(r)
        return ok

    def batch_get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        out = self.inner.batch_get(keys)
        for i, k in enumerate(keys):
            if out[i] is None:
                continue
            if self._drop(k):
                out[i] = None
                self.dropped_reads.append(k)
            elif self._corrupt(k):
                bad = out[i].clone()  # type: ignore[union-attr]
                if bad.numel():
                    bad[0] ^= 0xFF
                out[i] = bad
                self.corrupted_reads.append(k)
        return out

    def batch_exists(self, keys: Sequence[str]) -> int:
        return self.inner.batch_exists(keys)
