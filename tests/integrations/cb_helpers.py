"""Helpers for the transformers continuous-batching tests: a tiny random Llama, no downloads.

Without transformers the tests skip with the reason; with KVFSM_REQUIRE_TRANSFORMERS=1 (for CI that
installs the `kvfsm[transformers]` extra) they fail instead, so CI cannot pass by skipping them.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

REQUIRED = os.environ.get("KVFSM_REQUIRE_TRANSFORMERS") == "1"


def require_transformers() -> Any:
    try:
        import transformers  # noqa: F401
        from transformers.generation.continuous_batching import ContinuousBatchingManager  # noqa: F401
    except ImportError as exc:
        reason = f"transformers with continuous batching is not installed ({exc}); pip install 'kvfsm[transformers]'"
        if REQUIRED:
            pytest.fail(f"{reason} (KVFSM_REQUIRE_TRANSFORMERS=1)", pytrace=False)
        pytest.skip(reason, allow_module_level=True)
    import kvfsm.integrations.transformers as kt

    return kt


def tiny_llama(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """2 layers, hidden 64, 4 heads / 2 KV heads of dim 16, vocab 128; random weights from a fixed seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def prompts(n: int, seed: int = 1, lo: int = 5, hi: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 128, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def generation_config(max_new_tokens: int) -> Any:
    from transformers import GenerationConfig

    # greedy, no EOS (-1): every request generates exactly max_new_tokens
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def reference_outputs(model: Any, inputs: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Per-request `generate`: what continuous batching must reproduce token for token."""
    gen = generation_config(max_new_tokens)
    out = []
    with torch.no_grad():
        for p in inputs:
            ids = torch.tensor([p], device=model.device)
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
            out.append(seq[0, len(p) :].tolist())
    return out


def cb_config(num_blocks: int, page_size: int = 4, sharing: bool = False, **kw: Any) -> Any:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    kw.setdefault("use_cuda_graph", False)
    return ContinuousBatchingConfig(
        page_size=page_size, num_blocks=num_blocks, max_batch_tokens=64, allow_block_sharing=sharing, **kw
    )
