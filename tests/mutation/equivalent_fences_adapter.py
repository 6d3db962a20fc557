"""Survivors of the `fences-adapter` mutation scope (tests/mutation/mutate.py --scope fences-adapter; its section
of docs/mutation.md): the fences, the ledger's fence and wait checks, the coalescing copy engine and the SGLang
adapter. Entries are written as in equivalent.py: (function, change, reason).

Two lists, never mixed: EQUIVALENT holds the mutants no test can tell from the original, with why;
NEEDS_GPU_PASS holds those that survive this CPU run only because the difference shows on a CUDA device (a
tensor that stays on the CPU either way, a stream that is the CPU's no-op): they are not equivalent, and the
GPU pass decides them.
"""

from __future__ import annotations

from equivalent_helpers import _def, _lines  # noqa: F401

EQUIVALENT: list[tuple[str, str, str]] = [
]

NEEDS_GPU_PASS: list[tuple[str, str, str]] = [
]
