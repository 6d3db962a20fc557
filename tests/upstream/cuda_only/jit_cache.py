"""SGLang's JIT C++ extensions (its native page hash), built once per machine instead of once per venv.

SGLang builds `hicache_hash_cpp` with torch's `cpp_extension.load` on first use. torch decides whether to
rebuild by the build command, which names the source file's path inside the venv, so every fresh clone
compiled it again: 19-23 s of CPU alone on the 2-core CI machine, 44 s beside the suite, in every `make test`.
Here the built module is kept under a key of what determines its binary: the extension's name, each source
file's bytes, the compiler and linker flags, torch's version and the interpreter's ABI. A venv whose key is
cached loads that module; any other builds it with upstream's own loader, unchanged, then caches it. The cache
lives outside the checkout, as `make test`'s mypy cache does ($XDG_CACHE_HOME or ~/.cache, under kvfsm/).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvfsm" / "torch_extensions"


def build_key(name: str, sources: Sequence[str], flags: Sequence[Any]) -> str:
    """What the extension's binary depends on; any change to it is a new key, hence a build."""
    h = hashlib.sha256()
    for part in (name, torch.__version__, sys.version, sysconfig.get_config_var("EXT_SUFFIX") or "", repr(flags)):
        h.update(part.encode() + b"\0")
    for src in sources:
        h.update(Path(src).read_bytes() + b"\0")
    return h.hexdigest()[:32]


def _load_module(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def cached(load: Callable[..., Any]) -> Callable[..., Any]:
    """`load` (SGLang's `load_extension_with_recovery`) behind the machine-wide cache of built modules."""

    def load_cached(
        name: str,
        sources: Sequence[str],
        extra_cflags: Sequence[str] | None = None,
        extra_cuda_cflags: Sequence[str] | None = None,
        extra_ldflags: Sequence[str] | None = None,
        with_cuda: bool | None = None,
        verbose: bool = False,
    ) -> Any:
        kwargs = dict(
            extra_cflags=extra_cflags,
            extra_cuda_cflags=extra_cuda_cflags,
            extra_ldflags=extra_ldflags,
            with_cuda=with_cuda,
            verbose=verbose,
        )
        flags = [extra_cflags, extra_cuda_cflags, extra_ldflags, with_cuda]
        entry = cache_root() / build_key(name, sources, flags) / f"{name}.so"
        if entry.is_file():
            return _load_module(name, entry)
        module = load(name=name, sources=sources, **kwargs)
        built = Path(module.__file__)
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial = entry.with_suffix(f".{os.getpid()}.part")
        shutil.copyfile(built, partial)
        os.replace(partial, entry)  # whole or absent: a concurrent reader never loads a partial copy
        return module

    load_cached.original = load  # type: ignore[attr-defined]
    return load_cached


def install() -> None:
    """Route SGLang's extension loads through the cache (its callers import the loader at call time)."""
    import sglang.srt.utils.cpp_extension_loader as loader

    if not hasattr(loader.load_extension_with_recovery, "original"):  # not wrapped yet (install is idempotent)
        loader.load_extension_with_recovery = cached(loader.load_extension_with_recovery)
