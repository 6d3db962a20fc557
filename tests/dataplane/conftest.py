"""Shared fixtures for the data-plane tests (CPU unless marked gpu)."""

from __future__ import annotations

import pytest

from kvfsm.dataplane import KVCacheConfig


@pytest.fixture(params=["mha", "mla"])
def config(request: pytest.FixtureRequest) -> KVCacheConfig:
    return KVCacheConfig.tiny(request.param)


@pytest.fixture(params=["layer_first", "page_first"])
def layout(request: pytest.FixtureRequest) -> str:
    return request.param
