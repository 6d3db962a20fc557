"""Token ids the page hash refuses, on every path (the u32 fast path and the u64 path of wide pages)."""

from __future__ import annotations

import numpy as np
import pytest

from kvfsm.dataplane import page_hashes


def test_a_float_among_wide_ids_is_refused_not_truncated() -> None:
    """A page with an id >= 2**32 goes the u64 way; a float beside it must be refused there too, as it is
    on the u32 way, instead of being hashed as its truncation (found by mutation testing)."""
    with pytest.raises(ValueError, match="integers"):
        page_hashes([2**40, 1.5], 2)
    with pytest.raises(ValueError, match="integers"):
        page_hashes([1.0, 2.0], 2)
    assert page_hashes([2**40, 1], 2) == page_hashes(np.array([2**40, 1], dtype=np.int64), 2)
