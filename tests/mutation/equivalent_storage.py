"""Equivalent survivors of `make mutate` in the storage modules, and why (merged into equivalent.EQUIVALENT)."""

from __future__ import annotations

from equivalent_helpers import _def, _lines  # noqa: F401

EQUIVALENT: list[tuple[str, str, str]] = [
    # --- devices: a CPU-only host --------------------------------------------------------------------------
    (
        "x_run_plan",
        r"- (.*)\.to\((dev|host)\.device\)(.*)\n\+ \1\.to\(None\)\3",
        "not told apart on a CPU-only host: the pools and the plan's indices are all on the CPU, so leaving a tensor "
        "where it is and moving it to the other pool's device give the same tensor (only a CUDA device pool "
        "without a token view could tell)",
    ),
    # --- codecs -----------------------------------------------------------------------------------------------
    (
        "x_available_host_memory",
        r'- with open\("/proc/meminfo", encoding="ascii"\) as f:\n'
        r'\+ with open\("/proc/meminfo", (encoding=None|encoding="ASCII"|)\) as f:',
        "/proc/meminfo is ASCII text: codec names are looked up ignoring case, and the default (locale) encoding "
        "is an ASCII superset on every Linux host, so each decodes the same lines",
    ),
    (
        "xǁFileStorageǁ_verify",
        _lines(
            'fmt = side[_SIDECAR.size + klen :].decode("ascii", "replace")',
            'fmt = side[_SIDECAR.size + klen :].decode("ASCII", "replace")',
        ),
        "codec names are looked up ignoring case: 'ASCII' is the ascii codec",
    ),
    # --- numpy reshape ------------------------------------------------------------------------------------------
    (
        "xǁFileStorageǁ_(to|from)_file_order",
        r"- (.*)-1\)(.*)\n\+ \1-2\)\2",
        "numpy's reshape takes any negative size as the one dimension it infers, so -2 is -1",
    ),
    # --- fast paths ---------------------------------------------------------------------------------------------
    (
        "xǁFileStorageǁ_write",
        r'- if self\.layout != "layer_first":\n\+ if self\.layout != "(XXlayer_firstXX|LAYER_FIRST)":',
        "the test only skips a pass through _to_file_order, which returns a layer_first store's payload unchanged: "
        "every store then writes the same bytes, paths and counts",
    ),
    (
        "xǁFileStorageǁ_get_one",
        r"- side: bytes \| None = f\.read\(_SIDECAR_MAX \+ 1\)\n"
        r"\+ side: bytes \| None = f\.read\((None|_SIDECAR_MAX \+ 2)\)",
        "a sidecar of at most _SIDECAR_MAX bytes is read whole either way, and a longer one yields more than "
        "_SIDECAR_MAX bytes either way, which _verify rejects as a truncated sidecar (same count, same move aside)",
    ),
    (
        "xǁFileStorageǁ_verify",
        _lines(
            "if len(side) < _SIDECAR.size or len(side) > _SIDECAR_MAX:",
            "if len(side) <= _SIDECAR.size or len(side) > _SIDECAR_MAX:",
        ),
        "a sidecar of exactly the header's size records an empty key, and a stored key is never empty (path_of "
        "refuses one), so the page is corrupt either way (bad magic, bad checksum or another key instead of a "
        "truncated sidecar): the same count and move aside, only the logged reason differs",
    ),
    # --- wording ------------------------------------------------------------------------------------------------
    (
        "xǁFileStorageǁ_unverified",
        r"- why = .*\n\+ why = .*",
        "`why` is only the reason given in the no-sidecar WARNING",
    ),
    (
        "xǁFileStorageǁ_get_one",
        _lines("return self._unverified(key, buf, n)", "return self._unverified(None, buf, n)"),
        "_unverified uses the key only to name the page in its WARNING",
    ),
]
