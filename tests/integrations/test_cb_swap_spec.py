"""spec/cb_swap.yaml is valid and generated/cb_swap.py is fresh (needs no transformers)."""

from __future__ import annotations

from pathlib import Path

from kvfsm.codegen.generator import generate
from kvfsm.spec.checks import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "spec" / "cb_swap.yaml"


def test_spec_is_valid_and_declares_the_swap_lifecycle() -> None:
    spec = load_spec(SPEC)
    assert spec.name == "CbSwap"
    assert {"preempt", "swap_out_done", "restore", "swap_in_done", "finish", "cancel", "soft_reset"} <= set(spec.events)
    assert {"device_blocks", "host_blocks"} <= set(spec.model.resources)
    preempt = next(t for t in spec.transitions if t.event == "preempt")
    restore = next(t for t in spec.transitions if t.event == "restore")
    assert preempt.acquires == ("host_blocks",) and "device_blocks" in preempt.reads
    assert restore.acquires == ("device_blocks",) and "host_blocks" in restore.reads


def test_generated_machine_is_fresh() -> None:
    result = generate(SPEC, ROOT / "generated", check=True)
    assert not result.changed, "generated/cb_swap.py is stale: run `kvfsm gen spec/cb_swap.yaml`"
