"""Page hashes compatible with SGLang HiCache storage keys.

hash(page) = sha256( bytes.fromhex(prior_hash) if prior_hash else b"" ‖ token ids as uint32 little-endian )
as a hex digest; each page chains on the previous page's hash, so a page's key names its whole prefix.

Tokens are converted to little-endian uint32 bytes once (numpy), and each page is a memoryview slice of
that buffer: the only per-page Python work is one sha256 over prior digest + page bytes. The chain
feeds the raw 32-byte digest forward (equal to bytes.fromhex of the hex digest) instead of re-parsing hex.

Only whole pages are hashed: a trailing partial page raises ValueError, because its key would change as
the page fills and the seed never stores partial pages. Slice to `len // page_size * page_size` first.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence

import numpy as np
import torch

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
_NATIVE_LE = sys.byteorder == "little" and array.array("I").itemsize == 4


def _token_bytes(token_ids: TokenIds) -> np.ndarray | array.array:
    """Token ids as contiguous little-endian uint32s; ids outside [0, 2**32) are rejected."""
    if isinstance(token_ids, list) and _NATIVE_LE:
        try:  # the decode hot path: a chunk's token list, converted without numpy's per-call overhead
            return array.array("I", token_ids)
        except OverflowError:
            raise ValueError("token ids must be non-negative and fit in uint32") from None
        except TypeError:
            pass  # not all ints: numpy decides (and says why)
    if isinstance(token_ids, torch.Tensor):
        arr = token_ids.detach().to("cpu").reshape(-1).numpy()
    else:
        arr = np.asarray(token_ids).reshape(-1)
    if arr.size == 0:
        return np.empty(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype != np.dtype("<u4"):
        if arr.dtype.kind == "i" and int(arr.min()) < 0:
            raise ValueError("token ids must be non-negative (hashed as uint32)")
        if arr.dtype.itemsize > 4 and int(arr.max()) >= 2**32:
            raise ValueError("token ids must fit in uint32")
        arr = arr.astype("<u4")
    return np.ascontiguousarray(arr)


def page_hashes(token_ids: TokenIds, page_size: int, prior_hash: str | None = None) -> list[str]:
    """One chained sha256 hex digest per full page of `token_ids` (see the module doc)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    arr = _token_bytes(token_ids)
    n = len(arr)
    if n % page_size:
        raise ValueError(
            f"{n} tokens is not a whole number of pages of {page_size}; "
            f"hash tokens[: {n // page_size * page_size}] (the partial tail has no key)"
        )
    prev = bytes.fromhex(prior_hash) if prior_hash else b""
    if n == page_size:  # one page (a stride-sized decode chunk): no slicing
        return [hashlib.sha256(prev + arr.tobytes()).hexdigest()]
    mv = memoryview(arr.tobytes())
    step = page_size * 4
    digests: list[bytes] = []
    append = digests.append
    sha = hashlib.sha256
    for off in range(0, len(mv), step):
        prev = sha(prev + mv[off : off + step]).digest()  # one 32+4*page_size byte update
        append(prev)
    return list(map(bytes.hex, digests))


def page_hash(token_ids: TokenIds, prior_hash: str | None = None) -> str:
    """The hash of one page (all of `token_ids`)."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("a page has at least one token")
    return page_hashes(token_ids, n, prior_hash)[0]


class PageRun:
    """A run of whole pages in a request's hash chain, hashed on first use (`hashes`).

    `prior` is what the run chains on: None (chain start), a hex digest, or the preceding PageRun,
    resolved when this run is first hashed. Linking is O(1), so the scheduler thread only links a chunk
    into its request's chain and the backup worker, which needs the keys, does the hashing, off the
    decode step. Any thread may ask: the result is the same, and a run never loses its prior (it is
    replaced by the equal hex digest), so two threads racing compute equal lists. A hashed run drops
    its tokens (set after its hashes, so a racing reader that finds none finds the hashes): a prompt
    prefix is held only until the request's first backup hashes it."""

    __slots__ = ("tokens", "page_size", "prior", "_hashes")

    def __init__(self, tokens: TokenIds, page_size: int, prior: "PageRun | str | None" = None) -> None:
        self.tokens: TokenIds | None = tokens
        self.page_size, self.prior = page_size, prior
        self._hashes: list[str] | None = None

    @property
    def hashes(self) -> list[str]:
        """One chained sha256 hex digest per page (see `page_hashes`)."""
        got = self._hashes
        if got is not None:
            return got
        pending: list[PageRun] = [self]  # unhashed runs back to a resolved prior (iterative: chains can be long)
        prior = self.prior
        while isinstance(prior, PageRun) and prior._hashes is None:
            pending.append(prior)
            prior = prior.prior
        for run in reversed(pending):
            tokens = run.tokens
            if tokens is None or run._hashes is not None:
                continue  # another thread hashed it meanwhile
            p = run.prior
            prior_hex = p.last_hash if isinstance(p, PageRun) else p
            run._hashes = page_hashes(tokens, run.page_size, prior_hex)
            run.prior = prior_hex  # the same value, without keeping the predecessor alive
            run.tokens = None
        return self._hashes  # type: ignore[return-value]

    @property
    def last_hash(self) -> str | None:
        """The hash a following run chains on (the prior's, for a run without pages)."""
        hashes = self.hashes
        if hashes:
            return hashes[-1]
        p = self.prior
        return p.last_hash if isinstance(p, PageRun) else p
