"""The machine-wide cache of SGLang's JIT-built native page hash (cuda_only/jit_cache.py): a build is kept under
the key of what makes its binary, a later process loads it from there without building, and that module hashes as
SGLang's own does; a change to any flag is a new key, hence a build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang.srt.mem_cache.cpp_utils import native_hash
from sglang.srt.mem_cache.utils import get_hash_str

from cuda_only import jit_cache

HERE = Path(__file__).resolve().parent
TOKENS = list(range(1, 65))
PRIOR = "ab" * 32

# A later process: loads the cached module with a loader that refuses to build, and hashes with it.
LATER = """
import json, sys
from array import array
sys.path.insert(0, sys.argv[1])
from cuda_only import jit_cache
def refusing(**kwargs):
    raise SystemExit("built " + kwargs["name"] + " although the cache holds it")
m = jit_cache.cached(refusing)(**json.loads(sys.argv[2]))
tokens, prior = json.loads(sys.argv[3]), bytes.fromhex(sys.argv[4])
print(json.dumps([m.__file__, m.get_hash(array("q", tokens), len(tokens), 1, False, prior, 16)]))
"""


def _upstream_args() -> dict:
    """What sglang 0.5.23's `_load_native_hash_module` passes its loader."""
    cflags = ["-O3", "-std=c++17", "-DNDEBUG"] + (["-mavx2"] if native_hash._cpu_supports_avx2() else [])
    return dict(
        name="hicache_hash_cpp",
        sources=[str(Path(native_hash.__file__).parent / "hash_binding.cpp")],
        extra_cflags=cflags,
        extra_ldflags=["-lcrypto"],
        with_cuda=False,
    )


def test_a_build_is_cached_and_a_later_process_loads_it_without_building(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import sglang.srt.utils.cpp_extension_loader as loader

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    upstream = loader.load_extension_with_recovery.original  # SGLang's own loader (jit_cache.install wrapped it)
    builds: list[str] = []

    def building(**kwargs):  # type: ignore[no-untyped-def]
        builds.append(kwargs["name"])
        return upstream(**kwargs)

    args = _upstream_args()
    jit_cache.cached(building)(**args)
    assert builds == ["hicache_hash_cpp"]
    (entry,) = (tmp_path / "kvfsm" / "torch_extensions").glob("*/hicache_hash_cpp.so")

    proc = subprocess.run(
        [sys.executable, "-c", LATER, str(HERE), json.dumps(args), json.dumps(TOKENS), PRIOR],
        capture_output=True,
        text=True,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded_from, hashes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(loaded_from) == entry
    assert hashes == get_hash_str(TOKENS, PRIOR, page_size=16) and len(hashes) == len(TOKENS) // 16

    def refusing(**kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError(f"built {kwargs['name']}")

    with pytest.raises(AssertionError, match="built hicache_hash_cpp"):  # another flag: another key
        jit_cache.cached(refusing)(**{**args, "extra_cflags": args["extra_cflags"] + ["-g"]})
