"""bench/tp_nccl.py: the demo workload under TP=2 (sharded model, per-rank managers) must apply identical
frees and storage writes on every rank and generate the TP=1 tokens. CPU twin over gloo; GPU run over NCCL."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from timing import run_watched

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(tmp_path: Path, backend: str, device: str, requests: int) -> dict:
    out = tmp_path / "tp.json"
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "bench" / "tp_nccl.py"),
        "--backend",
        backend,
        "--device",
        device,
        "--requests",
        str(requests),
        "--out",
        str(out),
    ]
    proc = run_watched(cmd, f"bench/tp_nccl.py over {backend} (torchrun, 2 ranks)", cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def _check(doc: dict) -> None:
    assert doc["world"] == 2
    assert doc["identical_free_and_write_sequences"]
    assert doc["tokens_match_tp1"], doc["requests_differing_from_tp1"]
    assert doc["device_frees"] > 0 and doc["host_frees"] > 0 and doc["storage_writes"] > 0


def test_tp2_over_gloo_on_cpu(tmp_path):
    _check(_torchrun(tmp_path, "gloo", "cpu", requests=6))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_over_nccl_on_two_gpus(tmp_path):
    _check(_torchrun(tmp_path, "nccl", "cuda", requests=16))
