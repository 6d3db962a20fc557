"""Equivalent survivors of `make mutate` in the generated machine (generated/decode_offload.py), and why (merged into equivalent.EQUIVALENT)."""

from __future__ import annotations

from equivalent_helpers import _def, _lines  # noqa: F401

EQUIVALENT: list[tuple[str, str, str]] = [
    (
        "xǁDecodeOffloadMachineǁ(finish|abort|retract)_each",
        _lines("_restore(undo)", "_restore(None)"),
        "the surviving copy of this change is the _restore before `raise GuardRejected` in the offloading branch, "
        "reached only when fences is neither 0 (deferred_release) nor 1 (fenced_release): fences is a param fixed "
        "when the machine is created, __init__ refuses any other value (ValueError) and nothing assigns it later, "
        "so that branch never runs (the same change in the raising-action path is killed)",
    ),
]
