"""Equivalent survivors of `make mutate` in storage/file.py, storage/sharded.py and hashing.py, and why (merged into equivalent.EQUIVALENT)."""

from __future__ import annotations

import re

from equivalent_helpers import _def, _lines  # noqa: F401

_CAST = re.escape(", (pages >= _U32).any(axis=1).tolist())")
_ARRAY = re.escape("words: array.array[int] | np.ndarray = array.array(")

EQUIVALENT: list[tuple[str, str, str]] = [
    # --- FileStorage reads ---------------------------------------------------------------------------------
    (
        "xǁFileStorageǁ_expected_len",
        _lines(
            "return 0 # not a sidecar of ours: the page is rejected on the sidecar alone",
            "return 1 # not a sidecar of ours: the page is rejected on the sidecar alone",
        ),
        "the branch is taken only for a sidecar shorter than the header, or without the magic, and _verify rejects "
        "exactly those on its first two checks (truncated sidecar, bad magic) before it looks at the page bytes: "
        "reading at most one byte of a one-byte page file instead of none gives the same None, count and move aside",
    ),
    (
        "xǁFileStorageǁ_expected_len",
        _lines(
            "elif len(side) >= _SIDECAR.size and side[:8] == _MAGIC:",
            "elif len(side) > _SIDECAR.size and side[:8] == _MAGIC:",
        ),
        "only a sidecar of exactly the header's size changes branch, and _verify rejects it before looking at the "
        "page bytes: it records a key and format of 0 bytes (else the length check calls it torn), and a stored key "
        "is never empty (path_of refuses one), so it names another key; the page is corrupt either way (same None, "
        "count and move aside), only whether its bytes were read into memory first differs",
    ),
    (
        "xǁFileStorageǁ_unverified",
        _lines("if n != len(buf) or want is None or n != want:", "if n != len(buf) and want is None or n != want:"),
        "with want None both conditions are true (n is an int); with want set, n != len(buf) implies n != want: buf "
        "holds want bytes when the file's size is want (readinto fills at most that, so a short read is below want), "
        "and is empty otherwise, with n the file's size, which is then not want (or 0 == len(buf) when size == want "
        "== 0); so the condition is the same for every read",
    ),
    # --- hashing -------------------------------------------------------------------------------------------
    (
        "x__wide_chain",
        re.escape('- wide = cast("list[bool]"')
        + _CAST
        + r"\n"
        + re.escape("+ wide = cast(")
        + r'(None|"XXlist\[bool\]XX"|"LIST\[BOOL\]")'
        + _CAST,
        "typing.cast returns its second argument unchanged at run time, whatever the type named first",
    ),
    (
        "x_page_hashes",
        re.escape("- ")
        + _ARRAY
        + re.escape('"I", token_ids)')
        + r"\n"
        + re.escape("+ ")
        + _ARRAY
        + r'(None, token_ids|"I", None|token_ids|"XXIXX", token_ids)\)',
        "the mutated call raises TypeError for every input (a type code must be one character; None initialises "
        "nothing), which the except catches, so every list goes to _from_list, whose first step is the same "
        "array.array('I', token_ids) with the same fallbacks (numpy on TypeError, the wide path on OverflowError) "
        "as the original's except: the same words and errors for every list, only slower",
    ),
    (
        "xǁPageRunǁ_hashed",
        _lines("got = self._hashes", "got = None"),
        "only the early return of a run already hashed is skipped: the slow path then finds the run's prior "
        "replaced by its digest (or None), so it walks no earlier run, skips the run itself (its hashes are set) "
        "and returns the same self._hashes",
    ),
    (
        "xǁPageRunǁ_hashed",
        _lines("if tokens is None or run._hashes is not None:", "if tokens is None and run._hashes is not None:"),
        "the two differ for a run that still has its tokens once hashed, and for one with neither: the first "
        "exists only while another thread is between setting its hashes and dropping its tokens, and hashing it "
        "again gives an equal tuple (its prior resolves to the same digest); the second never exists, since tokens "
        "are given at construction (the only caller, OffloadEffects, passes a list) and dropped only after the "
        "hashes are set (a PageRun built with tokens=None, outside TokenIds, fails either way, only the exception "
        "type differs)",
    ),
]

EQUIVALENT += [
    # --- ShardedStorage ------------------------------------------------------------------------------------
    (
        "xǁShardedStorageǁ__init__",
        _lines("self._closed = False", "self._closed = None"),
        "_closed is only tested for truth (_run, close) and set to True by close: None and False are both false",
    ),
]
