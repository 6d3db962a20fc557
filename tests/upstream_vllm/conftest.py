"""Tests of kvfsm's vLLM manager against vLLM 0.34.0's own (docs/vllm.md); `make test-vllm`.

They run in `.venv-vllm`: vLLM installed `--no-deps` beside the CPU torch, with only what its kv_offload import
path needs (tests/upstream_vllm/requirements.txt). In the main venv (no vLLM) they are not collected; with
`KVFSM_REQUIRE_VLLM=1` a missing vLLM fails the run instead.
"""

from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("KVFSM_REQUIRE_VLLM") == "1":
        raise RuntimeError(
            "KVFSM_REQUIRE_VLLM=1 but vllm is not importable: run `make vllm-venv` and use "
            ".venv-vllm/bin/python (`make test-vllm`)"
        )
    collect_ignore_glob = ["test_*.py"]
