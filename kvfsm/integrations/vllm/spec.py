"""KvfsmOffloadingSpec: vLLM's CPU offloading spec whose scheduler-side manager is KvfsmOffloadingManager.

Selected with `"spec_name": "KvfsmOffloadingSpec", "spec_module_path": "kvfsm.integrations.vllm.spec"` in the
OffloadingConnector's kv_connector_extra_config; vLLM's CPU worker still does the copies. `"kvfsm_checked": true`
turns on checked mode.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import OffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvfsm.integrations.vllm.manager import KvfsmOffloadingManager


class KvfsmOffloadingSpec(CPUOffloadingSpec):
    """CPUOffloadingSpec, its manager built as vLLM builds its own but on the chunk lifecycle's machine."""

    def get_manager(self) -> OffloadingManager:
        if not self._manager:  # type: ignore[has-type]  # vLLM's base sets it; vLLM is not installed beside mypy
            self._manager = KvfsmOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
                info=self.cpu_info,
                checked=bool(self.extra_config.get("kvfsm_checked", False)),
            )
        return self._manager
