"""ShardedStorage: one store spread over several, each key always in the same one, called at once.

One store process keeps up with decoding at 64-token pages but not at 16 (docs/performance.md, "The child's
writers"): at 4096 live requests a 16-token page stride is 256 page files an iteration, and a file costs Python
(a path, a temp name, a sidecar, two publishes) on the child's one interpreter, whatever its writer threads.
Several children have several interpreters. This backend routes each key to one shard by a stable hash of the
key (CRC-32: the same shard in every process and run, so a page is read where it was written) and sends one
call's keys to their shards at once, each shard's part on its own thread, which waits on its child while the
others write.

What it guarantees, as a `StorageBackend`:
- the per-key answers (`batch_set`, `batch_get`) come back in the caller's order;
- `batch_exists` is the length of the stored prefix of the whole key list: the shards' first missing keys
  give it (the first missing key of the list is the first missing key of its own shard);
- a call that fails in any shard raises that shard's error, after every other shard's part has finished (no
  write is left running behind a failed call); the backup worker counts the whole call as failed, as it
  does for one store that raises (B13);
- `close()` closes every shard; `stats` sums theirs.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from .base import StorageBackend, StorageStats, store_host_pages

T = TypeVar("T")


def shard_of(key: str, shards: int) -> int:
    """The shard that holds `key`: CRC-32 of its UTF-8 bytes, modulo the shard count (stable across processes,
    unlike `hash()`, which is salted per process)."""
    return zlib.crc32(key.encode()) % shards


class ShardedStorage:
    """A `StorageBackend` over `shards`, each key in `shards[shard_of(key, len(shards))]`."""

    def __init__(self, shards: Sequence[StorageBackend]) -> None:
        if not shards:
            raise ValueError("ShardedStorage needs at least one shard")
        self.shards = list(shards)
        self._pool = ThreadPoolExecutor(len(self.shards), thread_name_prefix="kvfsm-shard")
        self._closed = False

    @classmethod
    def of(cls, make: Callable[[], StorageBackend], shards: int) -> ShardedStorage:
        """`shards` stores built by `make` (a picklable factory, so that `storage_factory` can pass it on);
        those built before one that fails are closed."""
        if shards < 1:
            raise ValueError(f"shards must be at least 1, got {shards!r}")
        built: list[StorageBackend] = []
        try:
            for _ in range(shards):
                built.append(make())
        except BaseException:
            for store in built:
                _close(store)
            raise
        return cls(built)

    def _split(self, keys: Sequence[str]) -> dict[int, list[int]]:
        """Positions of `keys` by shard, each in the caller's order."""
        n = len(self.shards)
        parts: dict[int, list[int]] = {}
        for at, key in enumerate(keys):
            parts.setdefault(shard_of(key, n), []).append(at)
        return parts

    def _run(self, calls: dict[int, Callable[[], T]]) -> dict[int, T]:
        """Each shard's call, at once (one on the calling thread when only one shard has work); every call has
        finished when this returns or raises. A failure raises the first failing shard's error."""
        if self._closed:
            raise RuntimeError("ShardedStorage is closed")
        if len(calls) == 1:
            ((s, call),) = calls.items()
            return {s: call()}
        futures: dict[int, Future[T]] = {s: self._pool.submit(call) for s, call in calls.items()}
        out: dict[int, T] = {}
        error: BaseException | None = None
        for s, future in futures.items():  # wait for all before raising: no part runs on behind a failed call
            try:
                out[s] = future.result()
            except BaseException as exc:  # noqa: B036  re-raised below, once every part is done
                error = error or exc
        if error is not None:
            raise error
        return out

    def _per_key(self, keys: Sequence[str], call: Callable[[StorageBackend, list[int]], list[T]]) -> list[T]:
        parts = self._split(keys)
        answers = self._run({s: functools.partial(call, self.shards[s], at) for s, at in parts.items()})
        out: list[Any] = [None] * len(keys)
        for s, at in parts.items():
            got = list(answers[s])
            if len(got) != len(at):
                raise ValueError(f"shard {s} answered {len(got)} results for {len(at)} keys")
            for i, value in zip(at, got):
                out[i] = value
        return out

    # ---- the StorageBackend protocol --------------------------------------------------------------
    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys but {len(pages)} pages")
        return self._per_key(keys, lambda store, at: store.batch_set([keys[i] for i in at], [pages[i] for i in at]))

    def batch_set_from_host(self, keys: Sequence[str], host_pool: Any, host_indices: Any) -> list[bool]:
        """The pages at `host_indices` (whole pages of `host_pool`), each to its key's shard: a shard that gathers
        pages itself (`batch_set_from_host`: a store process over a shared pool reads them in place) is given
        its pages' slots, any other the pages' bytes."""
        pages = host_pool.pages_of(host_indices)  # whole pages, allocated: checked before any shard is called
        if len(pages) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")

        def part(store: StorageBackend, at: list[int]) -> list[bool]:
            return store_host_pages(
                store, [keys[i] for i in at], host_pool, host_pool.page_slots([pages[i] for i in at])
            )

        return self._per_key(keys, part)

    def batch_get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        return self._per_key(keys, lambda store, at: store.batch_get([keys[i] for i in at]))

    def batch_exists(self, keys: Sequence[str]) -> int:
        parts = self._split(keys)
        counts = self._run(
            {s: functools.partial(self.shards[s].batch_exists, [keys[i] for i in at]) for s, at in parts.items()}
        )
        # a shard's first missing key (if any) sits at parts[s][counts[s]]; the earliest of them ends the prefix
        return min((at[counts[s]] for s, at in parts.items() if counts[s] < len(at)), default=len(keys))

    @property
    def stats(self) -> StorageStats:
        """The shards' counters, summed (a shard that keeps none counts zeros)."""
        total = StorageStats()
        for store in self.shards:
            got = getattr(store, "stats", None)
            if got is not None:
                for name, value in vars(got).items():
                    setattr(total, name, getattr(total, name) + value)
        return total

    def close(self) -> None:
        """Close every shard (each after its call in progress) and the call threads; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        for store in self.shards:
            _close(store)


def _close(store: Any) -> None:
    close = getattr(store, "close", None)
    if close is not None:
        close()


__all__ = ["ShardedStorage", "shard_of"]
