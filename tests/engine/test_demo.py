"""The demo's claims on a small workload: identical tokens with and without offload, bit-exact load-back,
every pool full at the end; and the same harness notices a lifecycle bug that corrupts KV."""

from __future__ import annotations

import pytest
import torch

from kvfsm.demo import run_demo
from kvfsm.runtime import effects


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_demo_outputs_identical_and_load_back_bit_exact(tmp_path, monkeypatch):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[2])
    report = run_demo(tmp_path, requests=10, batch=4)
    assert report.outputs_identical
    assert report.stored_pages > 0 and report.pages_loaded_back == report.stored_pages
    assert report.storage_hits == report.stored_pages
    assert report.transitions_checked > 0 and report.trace.exists() and report.docs.exists()


def test_demo_catches_a_premature_free(tmp_path, monkeypatch):
    """B1: free the request's slots at its first offload (while it still attends to them)."""
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[2])
    original = effects.OffloadEffects.start_copy

    def start_copy_and_free_early(self, m, chunk):
        original(self, m, chunk)
        rec = chunk.record
        if not getattr(rec, "freed_early", False):
            rec.freed_early = True
            self.allocator.free(chunk.device_indices[: self.page_size])  # the slots are still attended to

    monkeypatch.setattr(effects.OffloadEffects, "start_copy", start_copy_and_free_early)
    with pytest.raises(BaseException):  # noqa: B017 - any failure: a check, a fence or the demo's own verdict
        run_demo(tmp_path, requests=10, batch=4)


@pytest.mark.gpu
def test_demo_on_cuda_with_cuda_copy_engine(tmp_path, monkeypatch):
    """GPU twin: device pools on CUDA, pinned host pool, the CUDA copy engine on its own stream."""
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[2])
    report = run_demo(tmp_path, requests=12, batch=4, device="cuda")
    assert report.device == "cuda" and report.outputs_identical
    assert report.stored_pages > 0 and report.pages_loaded_back == report.stored_pages
