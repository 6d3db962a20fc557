"""The transformers side of the integration: its continuous-batching names and the tested version range.

Every transformers import of the package happens here, under one guard, so that a missing or too old
transformers fails `import kvfsm.integrations.transformers` with one message naming the extra to install
(as the single-module integration did); the other modules take these names from here.
"""

from __future__ import annotations

from typing import Optional

try:
    import transformers
    from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION
    from transformers.generation.continuous_batching.continuous_api import (
        ContinuousBatchingManager,
        ContinuousBatchProcessor,
    )
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager
    from transformers.generation.continuous_batching.requests import RequestStatus
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvfsm.integrations.transformers needs Hugging Face transformers with continuous batching "
        "(pip install 'kvfsm[transformers]')"
    ) from exc

TESTED_VERSIONS = (">=5.24", "<5.26")  # the range of kvfsm[transformers]; others get a warning at install
_TESTED_MIN, _TESTED_MAX = (5, 24), (5, 26)


def _version_tuple(version: str) -> tuple[int, int]:
    parts = (version.split("+")[0].split(".") + ["0", "0"])[:2]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


def transformers_version_tested(version: Optional[str] = None) -> bool:
    """True when `version` (default: the installed one) is inside TESTED_VERSIONS."""
    v = _version_tuple(version or transformers.__version__)
    return _TESTED_MIN <= v < _TESTED_MAX


__all__ = [
    "ContinuousBatchProcessor",
    "ContinuousBatchingManager",
    "FULL_ATTENTION",
    "OffloadingManager",
    "RequestStatus",
    "TESTED_VERSIONS",
    "transformers",
    "transformers_version_tested",
]
