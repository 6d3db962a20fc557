"""A tiny decoder whose attention reads and writes a paged KV pool through the request-to-token table.

Seeded random weights, no downloads. Every token is computed one position at a time, per request, so
a request's KV and logits do not depend on batch composition, prefill/decode split, retraction or
offload: the only way two runs of one workload can differ is a lifecycle bug that corrupts KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvfsm.dataplane import KVCacheConfig
from kvfsm.dataplane.pools.device_pool import DeviceKVPool


@dataclass(frozen=True)
class TinyModelConfig:
    vocab: int = 512
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    seed: int = 1234

    def kv_config(self) -> KVCacheConfig:
        return KVCacheConfig(
            num_layers=self.layers, kv_heads=self.kv_heads, head_dim=self.head_dim, attention="mha", dtype=torch.float32
        )


class TinyDecoder:
    def __init__(self, cfg: TinyModelConfig, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        g = torch.Generator().manual_seed(cfg.seed)
        scale = 1.0 / math.sqrt(cfg.hidden)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(self.device)

        self.embed = w(cfg.vocab, cfg.hidden) * math.sqrt(cfg.hidden)
        self.wq = [w(cfg.hidden, cfg.heads * cfg.head_dim) for _ in range(cfg.layers)]
        self.wk = [w(cfg.hidden, cfg.kv_heads * cfg.head_dim) for _ in range(cfg.layers)]
        self.wv = [w(cfg.hidden, cfg.kv_heads * cfg.head_dim) for _ in range(cfg.layers)]
        self.wo = [w(cfg.heads * cfg.head_dim, cfg.hidden) for _ in range(cfg.layers)]
        self.w1 = [w(cfg.hidden, 2 * cfg.hidden) for _ in range(cfg.layers)]
        self.w2 = [w(2 * cfg.hidden, cfg.hidden) * 0.5 for _ in range(cfg.layers)]
        self.local_heads, self.local_kv = cfg.heads, cfg.kv_heads  # a tensor-parallel shard holds fewer

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum partial attention/MLP outputs across tensor-parallel shards (one shard: nothing to do)."""
        return partial

    @torch.no_grad()
    def step(self, pool: DeviceKVPool, slots: torch.Tensor, token: int) -> int:
        """Compute one position: `slots` are the request's device slots for positions [0, p]; the last one
        receives this token's K and V. Returns the greedy next token."""
        c = self.cfg
        kv = pool.token_view()  # (2, L, slots, H_kv, D)
        h = self.embed[token].unsqueeze(0)  # [1, hidden]
        group = self.local_heads // self.local_kv
        last = slots[-1:]
        for layer in range(c.layers):
            x = torch.nn.functional.rms_norm(h, (c.hidden,))
            q = (x @ self.wq[layer]).view(self.local_heads, c.head_dim)
            kv[0, layer, last] = (x @ self.wk[layer]).view(1, self.local_kv, c.head_dim)
            kv[1, layer, last] = (x @ self.wv[layer]).view(1, self.local_kv, c.head_dim)
            k = kv[0, layer, slots].repeat_interleave(group, dim=1)  # [T, heads, D]
            v = kv[1, layer, slots].repeat_interleave(group, dim=1)
            att = torch.einsum("hd,thd->ht", q, k) / math.sqrt(c.head_dim)
            out = torch.einsum("ht,thd->hd", att.softmax(dim=-1), v).reshape(1, -1)
            h = h + self.reduce(out @ self.wo[layer])
            x = torch.nn.functional.rms_norm(h, (c.hidden,))
            h = h + self.reduce(torch.nn.functional.gelu(x @ self.w1[layer]) @ self.w2[layer])
        logits = torch.nn.functional.rms_norm(h, (c.hidden,)) @ self.embed.T
        return int(logits.argmax())
