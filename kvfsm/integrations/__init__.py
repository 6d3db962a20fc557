"""Engines that run their KV offload through kvfsm's spec'd lifecycles.

- `kvfsm.integrations.transformers`: Hugging Face transformers' continuous batching (`generate_batch`),
  whose swap-out/swap-in of preempted requests runs through spec/cb_swap.yaml (extra: `kvfsm[transformers]`).
- `kvfsm.integrations.vllm`: vLLM 0.34's KV offloading (OffloadingConnector), a drop-in for its CPU offload
  manager whose chunks run spec/offload_chunk.yaml (extra: `kvfsm[vllm]`).

Each integration imports its engine lazily, so `import kvfsm.integrations` works without any engine installed.
"""
