"""What an engine hands the manager: its request objects and its prefix cache's protected-size counter."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from kvfsm.dataplane.hashing import storage_namespace_seed
from kvfsm.errors import InvalidRequest, RequestFieldInvalid, RequestFieldMissing


@runtime_checkable
class OffloadRequest(Protocol):
    """A decoding request as the manager sees it. Objects must support weak references (the manager keys
    its per-request machines by object identity, never by `rid`, so a reused rid cannot reach old state)."""

    # Read-only members: the manager never writes them, so an engine's request may hold each as a plain
    # attribute of the type given or a narrower one (a list for a Sequence).
    @property
    def rid(self) -> str: ...
    @property
    def origin_input_ids(self) -> Sequence[int]: ...  # the prompt
    @property
    def output_ids(self) -> Sequence[int]: ...  # sampled tokens; the last one has no KV yet
    @property
    def req_pool_idx(self) -> Optional[int]: ...  # row in the request-to-token table; None once released
    @property
    def kv_committed_len(self) -> int: ...  # positions whose KV is final
    @property
    def kv_allocated_len(self) -> int: ...  # positions with device slots (> committed under speculative decoding)
    @property
    def prefix_len(
        self,
    ) -> int: ...  # positions [0, prefix_len) matched in the prefix cache (whole pages): the cache's pages

    # Optional (read with a default of None): the storage namespace, as SGLang's Req holds it, already
    # normalised (cache_salt "" is None, a LoRA id is appended to extra_key: see
    # kvfsm.dataplane.hashing.request_namespace for raw client fields). Keys of a namespaced request chain
    # on storage_namespace_seed(extra_key, cache_salt), so tenants never see each other's pages.
    # extra_key: Optional[str]
    # cache_salt: Optional[str]
    # Optional too: `lock`, the prefix cache's lock on the matched prefix (None: nothing to unlock), read
    # when the lifecycle starts and unlocked at its release (SGLang's req.lock).
    # lock: Any

    def finished(self) -> bool: ...


# the protocol's fields: what the manager reads
REQUEST_FIELDS = (
    "rid",
    "origin_input_ids",
    "output_ids",
    "req_pool_idx",
    "kv_committed_len",
    "kv_allocated_len",
    "prefix_len",
)
NAMESPACE_FIELDS = ("extra_key", "cache_salt")  # optional fields, None when absent


def request_namespace_seed(req: Any) -> Optional[str]:
    """The seed of `req`'s page-hash chain from its optional `extra_key` and `cache_salt` (None: no
    namespace, the plain chain); InvalidRequest naming the field when one is not a str."""
    parts = [getattr(req, name, None) for name in NAMESPACE_FIELDS]
    try:
        return storage_namespace_seed(*parts)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"request {describe(req)}: {exc}") from exc


def describe(req: Any) -> str:
    """A request for an error message: its rid and type (the rid may be what is missing)."""
    rid = getattr(req, "rid", None)
    return f"{rid!r} ({type(req).__name__})" if rid is not None else f"<{type(req).__name__} object>"


LENGTH_FIELDS = ("kv_committed_len", "kv_allocated_len")  # compared and converted as integers


def check_request_fields(req: Any) -> None:
    """Raise RequestFieldMissing naming the first OffloadRequest field `req` lacks, or RequestFieldInvalid
    naming a length that is not an integer (checked once, when a lifecycle starts, so that no later call
    fails half-way on a raw AttributeError or TypeError)."""
    for name in REQUEST_FIELDS:
        if not hasattr(req, name):
            raise RequestFieldMissing(describe(req), name)
    check_request_lengths(req)


def check_request_lengths(req: Any) -> None:
    """RequestFieldInvalid naming the first length of `req` that is not an integer (a numpy or torch integer
    scalar is one): the manager compares and converts them."""
    for name in LENGTH_FIELDS:
        value = getattr(req, name)
        try:
            operator.index(value)
        except TypeError:
            raise RequestFieldInvalid(describe(req), name, value) from None


def offloadable_tokens(prompt: Sequence[int], outputs: Sequence[int], committed: Any) -> int:
    """How many of a request's tokens have KV that may be offloaded: never the last sampled token (it has no KV
    yet) and never past the committed length. operator.index: a length that is no integer (a float) is a
    TypeError here, before anything is taken."""
    return min(len(prompt) + len(outputs) - 1, operator.index(committed))


def raise_if_length_invalid(req: Any, exc: TypeError) -> None:
    """For a TypeError raised while comparing `req`'s lengths: RequestFieldInvalid (from it) when one is not
    an integer; otherwise return, and the caller re-raises `exc`. The hot paths compare first and check only
    when that fails, so a well-typed request pays nothing."""
    try:
        check_request_lengths(req)
    except RequestFieldInvalid as bad:
        raise bad from exc


def raise_if_field_missing(req: Any, exc: AttributeError) -> None:
    """For an AttributeError raised while reading `req`: RequestFieldMissing (from it) when `req` lacks a
    protocol field; otherwise return, and the caller re-raises `exc` (an AttributeError of its own)."""
    try:
        check_request_fields(req)
    except RequestFieldMissing as missing:
        raise missing from exc


class PrefixCache(Protocol):
    """The engine's prefix cache, as the manager sees it (SGLang 0.5.23's `tree_cache.unlock`).

    The pages of a request's matched prefix, positions [0, prefix_len), belong to the cache, not to the
    request: at admission the engine locks them for the request (the lock is the request's optional `lock`
    field); at release the manager unlocks that lock, exactly once, and never frees those pages. Evicting
    them, once no request holds a lock on them, is the cache's business. A cache whose unlock never frees a device
    page (SGLang's tree cache) may say so with `frees_at_unlock = False`: the manager then frees the pages of the
    releases one batch event makes in one call, before their unlocks; otherwise it releases them one by one, since
    an unlock's evictions would come between two requests' pages (kvfsm's SimplePrefixCache)."""

    def unlock(self, lock: Any) -> None: ...


@dataclass(eq=False)
class PrefixLock:
    """One holder's lock on the device slots of a matched prefix (whole pages)."""

    slots: torch.Tensor
    released: bool = False

    @property
    def tokens(self) -> int:
        return int(self.slots.numel())


class SimplePrefixCache:
    """A prefix cache that keeps a matched prefix's pages exactly while a request holds a lock on them, and
    evicts them (returns them to the allocator) at the last unlock: the smallest cache an engine without a
    radix tree can give the manager, and the one kvfsm's engines and tests use. It refuses to unlock a lock
    twice (B4) and can be audited at teardown (`size`, `locked_pages`; B3)."""

    frees_at_unlock = True  # the last unlock of a page evicts it to the allocator

    def __init__(self, allocator: Optional[Any] = None) -> None:
        self.allocator = allocator  # where evicted pages go (None: nothing is ever locked with slots)
        self._holders: dict[int, int] = {}  # device page -> locks holding it
        self.size = 0  # tokens locked (SGLang's protected size)

    def lock(self, slots: Any) -> Optional[PrefixLock]:
        """Lock the device slots of a matched prefix (whole pages, as the request's table row holds them);
        None for an empty prefix, which needs no lock."""
        slots = torch.as_tensor(slots, dtype=torch.int64).reshape(-1).cpu().clone()  # not a view of the table
        if slots.numel() == 0:
            return None
        if self.allocator is None:
            raise ValueError("SimplePrefixCache(allocator) is needed to lock pages: it evicts them there")
        ps = self._page_size()
        if slots.numel() % ps:
            raise ValueError(f"a prefix lock covers whole pages of {ps}; got {slots.numel()} slots")
        for page in self._pages(slots):
            self._holders[page] = self._holders.get(page, 0) + 1
        self.size += int(slots.numel())
        return PrefixLock(slots)

    def lock_prompt_prefix(self, req: Any, table: Any) -> None:
        """The engine's side of a prefix match, for engines without a radix tree: `req.prefix_len` becomes
        whole pages of its prompt (what admission accepts) and `req.lock` a lock on those slots of its table
        row (None for no prefix)."""
        ps = self._page_size()
        req.prefix_len = min(req.prefix_len, len(req.origin_input_ids)) // ps * ps
        req.lock = self.lock(table.read_host(req.req_pool_idx, 0, req.prefix_len))

    def unlock(self, lock: Optional[PrefixLock]) -> None:
        """Drop one lock; pages no lock holds any more are evicted. Unlocking None is a no-op (no prefix)."""
        if lock is None:
            return
        if not isinstance(lock, PrefixLock) or lock.released:
            raise ValueError(f"prefix lock unlocked twice or never taken: {lock!r} (B4)")
        lock.released = True
        self.size -= lock.tokens
        evict = []
        for page in self._pages(lock.slots):
            left = self._holders[page] - 1
            if left:
                self._holders[page] = left
            else:
                del self._holders[page]
                evict.append(page)
        if evict and self.allocator is not None:
            ps = self._page_size()
            self.allocator.free(torch.tensor([p * ps + k for p in evict for k in range(ps)], dtype=torch.int64))

    def locked_pages(self) -> set[int]:
        """Device pages some lock holds."""
        return set(self._holders)

    def _page_size(self) -> int:
        return int(getattr(self.allocator, "page_size", 1))

    def _pages(self, slots: torch.Tensor) -> list[int]:
        ps = self._page_size()
        return sorted({int(s) // ps for s in slots.tolist()})
