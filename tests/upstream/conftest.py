"""The differential tests against the real SGLang 0.5.23 (docs/sglang-upstream.md); `make test-upstream`.

They run upstream's own `DecodeKVCacheOffloadManager`, `HiCacheController`, host pool, `HiCacheFile`,
`RadixCache`, `Req`, `ReqToTokenPool`, KV pools and allocators on a CPU with CPU torch, in `.venv-sglang`
(sglang installed `--no-deps` with tests/upstream/requirements.txt). Only what exists as a CUDA build alone
is replaced (`cuda_only.install()`), nothing else:

- **torchvision** -> `cuda_only/torchvision_stub.py`, a finder serving inert modules. The torchvision wheels
  that match torch 2.13 here are CUDA builds (their ops fail to register on CPU torch), and sglang imports it
  at module level only from multimodal helpers (`configs` -> `internvl_utils`, `deepseek_ocr`) that the
  offload path never calls.
- **cudaHostRegister** -> a no-op (`pool_host.common._cuda_host_register`). The host pool pins its buffers
  through `torch.cuda.cudart()`, which CPU torch lacks; on a CPU nothing needs pinning.
- **sgl_kernel's `transfer_kv_direct`** -> a torch index copy per layer. sgl_kernel ships only CUDA builds,
  so on CPU the host pool modules import no transfer op and the `direct` io backend would hit a NameError.

Upstream's native page hash (a C++ extension that torch JIT-builds) is not replaced: it needs g++, ninja and
OpenSSL headers, which this machine has. Backup failures in the scenarios are injected by the harness at the
storage object (a scenario, not a replacement).

In the main venv (no sglang) these tests are not collected; with `KVFSM_REQUIRE_SGLANG=1` a missing sglang
fails the run instead.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

if importlib.util.find_spec("sglang") is None:
    if os.environ.get("KVFSM_REQUIRE_SGLANG") == "1":
        raise RuntimeError(
            "KVFSM_REQUIRE_SGLANG=1 but sglang is not importable: run `make upstream-venv` "
            "and use .venv-sglang/bin/python (`make test-upstream`)"
        )
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, str(Path(__file__).parent))
    from cuda_only import install

    install()
