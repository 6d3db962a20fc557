"""Copy engines: device <-> pinned-host copies of KV rows, behind one interface.

- `base`: the CopyEngine / CopyHandle interface, copy planning and validation (`plan_copy`).
- `cpu`: the CPU engines (synchronous, threaded, deferred) for CI and model checking.
- `cuda`: the CUDA engine and its backend policy (direct kernel, staged DMA pipeline, torch fallback),
  with its parts: `pipeline` (the staged pipeline), `dma` (copy-list planning, pure numpy), `cuda_driver`
  (batched driver copies), `triton_kernels` (the row-copy kernel), `staging` (pinned index uploads).

A new copy path implements `CopyEngine` in a module of its own here.
"""
