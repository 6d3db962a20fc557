"""KvfsmOffloadingSpec as vLLM's OffloadingSpecFactory loads it from a kv_connector_extra_config: the manager it
gives is kvfsm's, built from the same keys as vLLM's CPU spec builds its own (slots, policy, threshold, tracker,
info), with checked mode under `kvfsm_checked`; the worker side stays vLLM's CPUOffloadingSpec."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvfsm.integrations.vllm import KvfsmOffloadingManager, KvfsmOffloadingSpec

SELECT = {"spec_name": "KvfsmOffloadingSpec", "spec_module_path": "kvfsm.integrations.vllm.spec"}


def config(extra: dict[str, Any]) -> OffloadingConfig:
    """A one-group, one-rank offloading config (as vLLM's own kv_offload tests build it)."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer",), 0),),
        worker_kv_bytes_per_block=8,
        enable_kv_cache_events=True,
        extra_config={"cpu_bytes_to_use": 65536, **extra},
        engine_id="test-engine",
        model=OffloadingModelConfig(name="test-model", dtype="float16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        replicated_layout=False,
    )


@pytest.mark.parametrize("policy, policy_cls", [("lru", LRUCachePolicy), ("arc", ARCCachePolicy)])
def test_the_factory_loads_kvfsm_s_spec_and_its_manager_matches_vllm_s(policy: str, policy_cls: type) -> None:
    extra = {"eviction_policy": policy, "store_threshold": 2, "max_tracker_size": 77}
    cfg = config({**SELECT, **extra})
    assert OffloadingSpecFactory.get_spec_cls(cfg.extra_config) is KvfsmOffloadingSpec
    spec = OffloadingSpecFactory.create_spec(cfg)
    assert isinstance(spec, CPUOffloadingSpec)
    ours, theirs = spec.get_manager(), CPUOffloadingSpec(config(extra)).get_manager()
    assert type(ours) is KvfsmOffloadingManager and type(theirs) is CPUOffloadingManager
    assert spec.get_manager() is ours and not ours.checked
    assert isinstance(ours._policy, policy_cls) and isinstance(theirs._policy, policy_cls)
    for name in ("_num_chunks", "store_threshold", "max_tracker_size", "_config_info"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours._num_chunks > 0 and ours.events == [] and theirs.events == []
    assert ours.config_info() == theirs.config_info()


def test_kvfsm_checked_turns_on_checked_mode() -> None:
    assert OffloadingSpecFactory.create_spec(config({**SELECT, "kvfsm_checked": True})).get_manager().checked
