"""What an engine hands the manager: its request objects and its prefix cache's protected-size counter."""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, runtime_checkable

from kvfsm.errors import RequestFieldMissing


@runtime_checkable
class OffloadRequest(Protocol):
    """A decoding request as the manager sees it. Objects must support weak references (the manager keys
    its per-request machines by object identity, never by `rid`, so a reused rid cannot reach old state)."""

    rid: str
    origin_input_ids: Sequence[int]  # the prompt
    output_ids: Sequence[int]  # sampled tokens; the last one has no KV yet
    req_pool_idx: Optional[int]  # row in the request-to-token table; None once released
    kv_committed_len: int  # positions whose KV is final
    kv_allocated_len: int  # positions with device slots (> committed under speculative decoding)
    prefix_len: int  # tokens matched in the prefix cache and protected there

    def finished(self) -> bool: ...


REQUEST_FIELDS = tuple(OffloadRequest.__annotations__)  # the protocol's fields: what the manager reads


def describe(req: Any) -> str:
    """A request for an error message: its rid and type (the rid may be what is missing)."""
    rid = getattr(req, "rid", None)
    return f"{rid!r} ({type(req).__name__})" if rid is not None else f"<{type(req).__name__} object>"


def check_request_fields(req: Any) -> None:
    """Raise RequestFieldMissing naming the first OffloadRequest field `req` lacks (checked once, when a
    lifecycle starts, so that no later call fails half-way on a raw AttributeError)."""
    for name in REQUEST_FIELDS:
        if not hasattr(req, name):
            raise RequestFieldMissing(describe(req), name)


def raise_if_field_missing(req: Any, exc: AttributeError) -> None:
    """For an AttributeError raised while reading `req`: RequestFieldMissing (from it) when `req` lacks a
    protocol field; otherwise return, and the caller re-raises `exc` (an AttributeError of its own)."""
    try:
        check_request_fields(req)
    except RequestFieldMissing as missing:
        raise missing from exc


class PrefixCache(Protocol):
    """The prefix cache's protected-size accounting (SGLang's `protected_size_`)."""

    def release_protected(self, n: int) -> None: ...


class ProtectedSize:
    """A protected-size counter that refuses to go negative (B4) and can be audited at teardown (B3)."""

    def __init__(self) -> None:
        self.size = 0

    def protect(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"cannot protect a negative size {n}")
        self.size += n

    def release_protected(self, n: int) -> None:
        if n < 0 or n > self.size:
            raise ValueError(f"protected size underflow: releasing {n} of {self.size} (B4)")
        self.size -= n
