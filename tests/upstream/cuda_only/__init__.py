"""The three things sglang 0.5.23 reaches for on the decode offload path that exist only as CUDA builds.

`install()` puts all three in place, and only these; tests/upstream/conftest.py says why each is needed. It also
routes SGLang's JIT builds through a machine-wide cache of built modules (`jit_cache`), so a venv whose build is
cached builds nothing.
It must run before sglang is imported (the torchvision finder) and is idempotent, so the harness calls it
again in every spawned TP rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from . import jit_cache, torchvision_stub

_done = False


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """sgl_kernel.kvcacheio.transfer_kv_direct as a torch index copy: layer i's rows src_indices go to
    dst_indices of dst_layers[i] (page_size only groups the kernel's copies)."""
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def cuda_host_register(buffer, registration_granularity_bytes=None) -> None:
    """cudaHostRegister as a no-op: CPU torch has no CUDA runtime and host memory needs no pinning."""


def _missing_cuda_kernels() -> tuple[str, ...]:
    """On a CUDA machine, SGLang's compiled kernel packages that are not installed (see torchvision_stub)."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return ()
    return tuple(name for name in ("sgl_kernel", "flashinfer") if importlib.util.find_spec(name) is None)


def install() -> None:
    global _done
    if _done:
        return
    # The native page hash is a JIT C++ extension: built beside the venv, the module then kept in a
    # machine-wide cache by its sources and flags (jit_cache), so a fresh clone's venv builds nothing.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    torchvision_stub.install(_missing_cuda_kernels())
    import sglang.srt.mem_cache.memory_pool_host as legacy_host
    import sglang.srt.mem_cache.pool_host.common as host_common
    import sglang.srt.mem_cache.pool_host.mha as mha_host
    import sglang.srt.mem_cache.pool_host.mla as mla_host

    host_common._cuda_host_register = cuda_host_register
    # On CPU these modules import no transfer kernel at all; the name is looked up at call time.
    for module in (mha_host, mla_host, legacy_host):
        module.transfer_kv_direct = transfer_kv_direct
    jit_cache.install()
    _done = True
