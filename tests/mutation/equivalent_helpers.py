"""How an equivalent survivor's change is written (tests/mutation/equivalent*.py)."""

from __future__ import annotations

import re


def _lines(old: str, new: str) -> str:
    """The change of a one-line mutant, `old` becoming `new`, both matched literally."""
    return re.escape(f"- {old}") + "\n" + re.escape(f"+ {new}")


def _def(old: str, new: str) -> str:
    """The same for a mutant of a `def` line (a method's first line, which mutmut's diff does not indent)."""
    return re.escape(f"-{old}") + "\n" + re.escape(f"+{new}")
