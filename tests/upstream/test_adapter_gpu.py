"""kvfsm's SGLang adapter on a GPU server's layout: SGLang 0.5.23's own `ReqToTokenPool`, KV pools
and allocators on CUDA, `req_to_token` on the GPU, driven by the differential harness as SGLang's scheduler
drives the manager.

Each scenario runs twice on kvfsm's adapter, once with every pool on the CPU and once on CUDA; the two runs
must agree on everything the differential test compares (offloads, releases, device frees by owner and
position, host slots, storage keys, stored bytes), and every stored page must hold the KV the harness wrote.
The CPU run is the one `test_differential.py` proves equal to upstream's manager in CI, so the CUDA path
matches upstream's frees and keys. On CUDA, every call into the manager runs under
`torch.cuda.set_sync_debug_mode("error")`: none may wait for the GPU (the harness's own reads of freed
slots are exempt: `harness.observing`). The checked run (kvfsm's slot ledger reads device values, which
waits) runs without that mode.

Needs CUDA and sglang: on the device machine, `tests/upstream/run_on_device.sh` (after `make device-sglang-site`);
skipped elsewhere.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import harness
from scenarios import SCENARIOS, Scenario
from test_differential import INTENDED, ProbedAdapter, _KvfsmProbe

from kvfsm.integrations.sglang import DecodeKVCacheOffloadManager

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# one GPU here: the TP scenarios (a process per rank) run on the CPU in test_differential.py
GPU_SCENARIOS = [s for s in SCENARIOS if s.tp == 1 and s.name not in INTENDED]


class HotPathAdapter(DecodeKVCacheOffloadManager):
    """The adapter as a server runs it (unchecked), with the harness's probe."""

    @staticmethod
    def harness_probe() -> harness.Probe:
        return _KvfsmProbe()


def _run(sc: Scenario, cls: type, device: str, sync_check: bool) -> list[harness.RunResult]:
    with harness.on_device(device, sync_check):
        return harness.run_scenario(sc, cls)


def _content_ok(runs: list[harness.RunResult]) -> list[str]:
    bad = []
    for r in runs:
        for key, data in r.stored.items():
            want = r.expected.get(key)
            if want is None or want[2] != data:
                bad.append(f"{r.scenario}: page {key[:12]} holds other bytes than the KV written")
    return bad


@pytest.mark.parametrize("sc", GPU_SCENARIOS, ids=lambda s: s.name)
def test_adapter_on_cuda_matches_its_cpu_run_without_waiting_for_the_gpu(sc: Scenario) -> None:
    cpu = _run(sc, HotPathAdapter, "cpu", False)
    cuda = _run(sc, HotPathAdapter, "cuda", True)
    diffs = harness.diff_runs(cpu, cuda)
    assert diffs == [], "\n".join(diffs)
    assert _content_ok(cuda) == []
    assert any(r.stored for r in cuda) or not any(r.stored for r in cpu)


@pytest.mark.parametrize(
    "sc",
    [
        s
        for s in GPU_SCENARIOS
        if s.name in ("prefix-matched", "mla", "host-pool-full", "abort-mid-offload", "spec-decode-overalloc")
    ],
    ids=lambda s: s.name,
)
def test_checked_adapter_on_cuda(sc: Scenario) -> None:
    """kvfsm's slot ledger and the spec's invariants on every transition, over SGLang's CUDA pools."""
    cuda = _run(sc, ProbedAdapter, "cuda", False)
    assert harness.diff_runs(_run(sc, HotPathAdapter, "cpu", False), cuda) == []


def test_a_manager_call_that_waits_for_the_gpu_is_caught() -> None:
    """The sync check can fail: a manager that reads a slot value on the host is refused."""

    class Reads(HotPathAdapter):
        def offload_kv_cache(self, req: Any) -> bool:
            int(self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, 0])  # waits for the GPU
            return super().offload_kv_cache(req)

    with pytest.raises(RuntimeError, match="synchroniz"):
        _run(GPU_SCENARIOS[0], Reads, "cuda", True)
