"""Page hashes bit-identical with SGLang 0.5.23's HiCache storage keys (its native `get_hash_str`).

A page's key is the sha256 hex digest of

    prior ‖ token ids as uint32 little-endian             (every id < 2**32: the common case)
    prior ‖ 0xff ‖ token ids as uint64 little-endian      (a "wide" page: any id >= 2**32)

where `prior` is the previous page's raw 32-byte digest, or, for the first page of a chain, the request's
namespace seed (`storage_namespace_seed`) as 32 raw bytes, or nothing when the request has no namespace.
Each page chains on the one before, so a key names its whole prefix and its tenant. The odd byte count of a
wide page (the 0xff tag) keeps it from ever colliding with a uint32 page. Wideness is decided per page:
one large id widens only its own page. Ids below 0 or above 2**63 - 1 are rejected (ValueError naming the
position), as upstream rejects them.

The namespace is upstream's tenant isolation: `Req` carries `extra_key` (with a LoRA id appended) and
`cache_salt`; the seed is None when both are None, so un-namespaced keys are the plain chain. A prior,
when given, already carries the namespace, so the namespace seeds only a chain that has no prior (upstream:
`prior_hash or storage_namespace_seed(...)`). `request_namespace` applies `Req`'s normalisation to raw
request fields.

Only whole pages are hashed: a trailing partial page raises ValueError, because its key would change as
the page fills and kvfsm never stores partial pages (upstream hashes a partial tail; slice to
`len // page_size * page_size` first). Speed: a list of small ids becomes one `array("I")` (no numpy
call), each page is a memoryview slice of its bytes, and the chain feeds raw 32-byte digests forward.
"""

from __future__ import annotations

import array
import hashlib
import operator
import sys
from collections.abc import Sequence
from typing import cast

import numpy as np
import torch

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
_NATIVE_LE = sys.byteorder == "little" and array.array("I").itemsize == 4 and array.array("Q").itemsize == 8
_U32 = 2**32
_I64_MAX = 2**63 - 1
_WIDE_TAG = b"\xff"
_NAMESPACE_DOMAIN = b"sglang-cache-namespace-v1"


# ---- namespaces -----------------------------------------------------------------------------------------
def storage_namespace_seed(extra_key: str | None, cache_salt: str | None) -> str | None:
    """The hex seed of a namespaced chain, as SGLang's `mem_cache.utils.storage_namespace_seed`; None when
    both parts are None (so un-namespaced keys stay the plain chain).

    sha256(b"sglang-cache-namespace-v1", then per part: b"\\x00" for None, else b"\\x01" + its UTF-8 byte
    length as u64 little-endian + the UTF-8 bytes). The presence byte and the length keep None, "" and
    ("a", "b") vs ("ab", None) apart."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(_NAMESPACE_DOMAIN)
    for name, part in (("extra_key", extra_key), ("cache_salt", cache_salt)):
        if part is None:
            digest.update(b"\x00")
            continue
        if not isinstance(part, str):
            raise TypeError(f"{name} must be a str or None, got {type(part).__name__}")
        try:
            encoded = part.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{name} {part!r} is not encodable as UTF-8: {e.reason}") from None
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def request_namespace(
    extra_key: str | None = None, cache_salt: str | None = None, lora_id: str | None = None
) -> tuple[str | None, str | None]:
    """A request's raw `(extra_key, cache_salt, lora_id)` normalised as SGLang's `Req.__init__` does:
    `(extra_key, cache_salt)` to pass to `storage_namespace_seed`.

    `cache_salt` "" becomes None; `extra_key` "" is kept (it is a namespace of its own); a `lora_id`
    (even "") is appended to `extra_key` (None counting as ""), so two adapters never share pages. Apply it
    once, to the fields as the client sent them: an SGLang `Req`'s attributes are already normalised (pass
    `req.extra_key, req.cache_salt` straight to `storage_namespace_seed`, or a LoRA id would be appended
    twice)."""
    for name, v in (("extra_key", extra_key), ("cache_salt", cache_salt), ("lora_id", lora_id)):
        if v is not None and not isinstance(v, str):
            raise TypeError(f"{name} must be a str or None, got {type(v).__name__}")
    if lora_id is not None:
        extra_key = (extra_key or "") + lora_id
    return extra_key, (cache_salt or None)


def _index(page_size: object) -> int:
    """An integer page size of another type (a numpy int); a float, bool or str is refused."""
    if isinstance(page_size, bool):
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    try:
        return operator.index(page_size)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}") from None


def _prior_bytes(prior_hash: str | None, what: str = "prior_hash") -> bytes:
    if not prior_hash:
        return b""
    try:
        raw = bytes.fromhex(prior_hash)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != 32 or len(prior_hash) != 64:  # fromhex skips spaces: both lengths pin 64 hex digits
        raise ValueError(f"{what} must be 64 hex digits (a sha256), got {prior_hash!r:.80}")
    return raw


# ---- token bytes ----------------------------------------------------------------------------------------
def _bad_id_error(value: object, position: int) -> ValueError:
    return ValueError(f"token id {value} at position {position} is out of range: ids must be in [0, 2**63 - 1]")


def _from_list(token_ids: list[int]) -> array.array[int] | np.ndarray:
    """A list of ids: array("I") when all are uint32 (the hot path), else u64 words (checked)."""
    try:
        return array.array("I", token_ids)
    except OverflowError:
        pass
    except TypeError:
        return _from_array(np.asarray(token_ids))  # not all ints: numpy decides (and says why)
    for i, t in enumerate(token_ids):  # some id is negative or >= 2**32: find a bad one, else go wide
        if not isinstance(t, (int, np.integer)):  # a float would be truncated by the u64 conversion below
            raise ValueError(f"token ids must be integers, got {t!r} at position {i}")
        if not 0 <= t <= _I64_MAX:
            raise _bad_id_error(t, i)
    return np.array(token_ids, dtype="<u8")


def _from_array(arr: np.ndarray) -> np.ndarray:
    """An integer array as little-endian u32 (no id >= 2**32) or u64 words (some are: wide pages)."""
    arr = arr.reshape(-1)
    if arr.size == 0:
        return np.empty(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype == np.dtype("<u4"):
        return np.ascontiguousarray(arr)
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        i = int(np.argmax(arr < 0))  # only on the error path: the position to name
        raise _bad_id_error(int(arr[i]), i)
    if arr.dtype.itemsize <= 4:
        return np.ascontiguousarray(arr.astype("<u4"))
    top = int(arr.max())
    if top < _U32:
        return np.ascontiguousarray(arr.astype("<u4"))
    if top > _I64_MAX:
        i = int(np.argmax(arr > _I64_MAX))
        raise _bad_id_error(int(arr[i]), i)
    return np.ascontiguousarray(arr.astype("<u8"))


def _token_words(token_ids: TokenIds) -> array.array[int] | np.ndarray:
    """Token ids as contiguous little-endian words: uint32 (itemsize 4) or, with a wide id, uint64."""
    if isinstance(token_ids, list) and _NATIVE_LE:
        return _from_list(token_ids)
    if isinstance(token_ids, torch.Tensor):
        return _from_array(token_ids.detach().to("cpu").reshape(-1).numpy())
    return _from_array(np.asarray(token_ids))


# ---- chains -----------------------------------------------------------------------------------------------
def page_hashes(
    token_ids: TokenIds,
    page_size: int,
    prior_hash: str | None = None,
    *,
    extra_key: str | None = None,
    cache_salt: str | None = None,
) -> list[str]:
    """One chained sha256 hex digest per full page of `token_ids` (see the module doc).

    `prior_hash` (64 hex digits) continues a chain; without one (None or ""), the chain starts from the
    namespace seed of `(extra_key, cache_salt)`, which are then the already-normalised values (see
    `request_namespace`); with one, the namespace is not used (the prior already carries it)."""
    if type(page_size) is not int:  # the hot path passes an int: one check
        page_size = _index(page_size)
    if page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if prior_hash:  # inline: the per-chunk path of a decode offload
        try:
            prev = bytes.fromhex(prior_hash)
        except (TypeError, ValueError):
            prev = b""
        if len(prev) != 32 or len(prior_hash) != 64:
            prev = _prior_bytes(prior_hash)  # raises, naming the argument
    elif extra_key is None and cache_salt is None:
        prev = b""
    else:
        prev = bytes.fromhex(storage_namespace_seed(extra_key, cache_salt))  # type: ignore[arg-type]
    if isinstance(token_ids, list) and _NATIVE_LE:
        try:  # the decode hot path: a chunk's token list, converted without numpy's per-call overhead
            words: array.array[int] | np.ndarray = array.array("I", token_ids)
        except (OverflowError, TypeError):
            words = _from_list(token_ids)
    else:
        words = _token_words(token_ids)
    n = len(words)
    if n % page_size:
        raise ValueError(
            f"{n} tokens is not a whole number of pages of {page_size}; "
            f"hash tokens[: {n // page_size * page_size}] (the partial tail has no key)"
        )
    if words.itemsize == 8:
        return _wide_chain(words, page_size, prev)  # type: ignore[arg-type]
    if n == page_size:  # one page (a stride-sized decode chunk): no slicing
        return [hashlib.sha256(prev + words.tobytes()).hexdigest()]
    mv = memoryview(words.tobytes())
    step = page_size * 4
    digests: list[bytes] = []
    append = digests.append
    sha = hashlib.sha256
    for off in range(0, len(mv), step):
        prev = sha(prev + mv[off : off + step]).digest()  # one 32+4*page_size byte update
        append(prev)
    return list(map(bytes.hex, digests))


def _wide_chain(words: np.ndarray, page_size: int, prev: bytes) -> list[str]:
    """The chain of u64 words: a page with an id >= 2**32 hashes its u64 bytes behind the 0xff tag, the
    others their u32 bytes, exactly as a page of small ids would."""
    pages = words.reshape(-1, page_size)
    wide = cast("list[bool]", (pages >= _U32).any(axis=1).tolist())
    narrow = pages.astype("<u4")
    out: list[str] = []
    for i, is_wide in enumerate(wide):
        data = _WIDE_TAG + pages[i].tobytes() if is_wide else narrow[i].tobytes()
        prev = hashlib.sha256(prev + data).digest()
        out.append(prev.hex())
    return out


def page_hash(
    token_ids: TokenIds, prior_hash: str | None = None, *, extra_key: str | None = None, cache_salt: str | None = None
) -> str:
    """The hash of one page (all of `token_ids`)."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("a page has at least one token")
    return page_hashes(token_ids, n, prior_hash, extra_key=extra_key, cache_salt=cache_salt)[0]


class PageRun:
    """A run of whole pages in a request's hash chain, hashed on first use (`hashes`).

    `prior` is what the run chains on: None (chain start), a hex digest, or the preceding PageRun,
    resolved when this run is first hashed. `namespace` is the request's seed (`storage_namespace_seed`:
    64 hex digits, or None); it is used only when the prior resolves to none, so it may be given to the
    first run or to every run of a request alike, and an empty first run passes it on as its `last_hash`:
    lazy keys equal `page_hashes(..., extra_key=..., cache_salt=...)`.
    Linking is O(1), so the scheduler thread only links a chunk into its request's chain and the backup
    worker, which needs the keys, does the hashing, off the decode step. Any thread may ask: the result is
    the same, and a run never loses its prior (it is replaced by the equal hex digest), so two threads
    racing compute equal lists. A hashed run drops its tokens (set after its hashes, so a racing reader
    that finds none finds the hashes): a prompt prefix is held only until the request's first backup
    hashes it."""

    __slots__ = ("tokens", "page_size", "prior", "namespace", "_hashes")

    def __init__(
        self, tokens: TokenIds, page_size: int, prior: PageRun | str | None = None, *, namespace: str | None = None
    ) -> None:
        if namespace is not None:
            _prior_bytes(namespace, "namespace")  # a bad seed fails here, not later on the backup worker
        self.tokens: TokenIds | None = tokens
        self.page_size, self.prior, self.namespace = page_size, prior, namespace or None
        self._hashes: tuple[str, ...] | None = None

    def _resolved_prior(self) -> str | None:
        p = self.prior
        hexd = p.last_hash if isinstance(p, PageRun) else p
        return hexd or self.namespace

    @property
    def hashes(self) -> list[str]:
        """One chained sha256 hex digest per page (see `page_hashes`), as a new list."""
        return list(self._hashed())

    def _hashed(self) -> tuple[str, ...]:
        """The digests, computed on first use and kept as a tuple of str, which the collector stops tracking
        at its first pass: a run waits for its backup for many iterations, and a list would be walked by every
        collection meanwhile (one tracked object a waiting chunk: 2,105 of them at 2,048 live, 64/64, in a CPU
        census of bench/serving_loop.py)."""
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
            prior_hex = run._resolved_prior()
            run._hashes = tuple(page_hashes(tokens, run.page_size, prior_hex))
            run.prior = prior_hex  # the same value, without keeping the predecessor alive
            run.tokens = None
        return self._hashes  # type: ignore[return-value]

    @property
    def last_hash(self) -> str | None:
        """The hash a following run chains on (for a run without pages: its prior's, else its namespace)."""
        hashes = self._hashed()
        if hashes:
            return hashes[-1]
        return self._resolved_prior()
