"""Equivalent survivors of `make mutate` in kvfsm/runtime/config.py, and why (merged into equivalent.EQUIVALENT)."""

from __future__ import annotations

from equivalent_helpers import _def, _lines  # noqa: F401

_TEXT_LEN = (
    "text_len only lets count_elements skip its walk when the JSON text is too short to hold more than "
    "max_elements values (k values take at least 2k - 1 characters: a scalar one, a container two more "
    "than its items and a separator between items), so a walk that would raise is never skipped; "
    "without it the value is always walked, with the same verdict"
)

EQUIVALENT: list[tuple[str, str, str]] = [
    # --- config: the element count's short cut ---------------------------------------------------------
    (
        "xǁOffloadConfigǁfrom_env",
        r'- count_elements\(values\[name\], ENV_VALUE_LIMITS, source, 1, "the value", len\(raw\)\)\n'
        r'\+ count_elements\(values\[name\], ENV_VALUE_LIMITS, source, 1, "the value", (None)?\)',
        _TEXT_LEN,
    ),
    (
        "xǁOffloadConfigǁfrom_file",
        r'- count_elements\(data, limits, source, 1, "offload config", len\(text\)\)\n'
        r'\+ count_elements\(data, limits, source, 1, "offload config", (None)?\)',
        _TEXT_LEN,
    ),
]
