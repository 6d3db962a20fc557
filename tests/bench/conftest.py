"""What the tests of bench/probes/ share: importing a probe by its file name, with bench/probes/ on sys.path only
while it loads (a probe imports bench/common.py itself)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

PROBES = Path(__file__).resolve().parents[2] / "bench" / "probes"


@pytest.fixture
def import_probe() -> Callable[[str], ModuleType]:
    def load(name: str) -> ModuleType:
        sys.path.insert(0, str(PROBES))
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(str(PROBES))

    return load
