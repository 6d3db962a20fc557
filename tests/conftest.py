"""Shared test configuration: hypothesis profiles and the GPU marker.

`KVFSM_FUZZ=deep` (or `pytest --fuzz=deep`) selects the long fuzz profile; CI runs the fast `ci` one.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=200, deadline=None, derandomize=False,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=5000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("KVFSM_FUZZ", "ci"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz", choices=("ci", "deep"), default=None, help="hypothesis profile (default: $KVFSM_FUZZ or ci)")


def pytest_configure(config: pytest.Config) -> None:
    profile = config.getoption("--fuzz")
    if profile:
        os.environ["KVFSM_FUZZ"] = profile
        settings.load_profile(profile)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; the CPU twin of this test runs instead")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def deep() -> bool:
    """Whether the deep fuzz profile is selected (for tests that size their own loops)."""
    return os.environ.get("KVFSM_FUZZ", "ci") == "deep"
