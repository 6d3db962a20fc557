"""A stand-in for torchvision, whose only wheels matching torch 2.13 here are CUDA builds (and, on the GPU
machine, for SGLang's CUDA-only kernel packages).

SGLang imports torchvision at module level from multimodal helpers that the decode offload path never
calls (configs -> internvl_utils, deepseek_ocr). Any `torchvision[.x]` import resolves to an empty module
whose attributes are inert placeholders, so the import succeeds and any real use fails loudly.
On a machine with CUDA, SGLang imports its compiled kernel packages (sgl_kernel, flashinfer) at module
level too. The device machine has neither (they are CUDA builds of hundreds of MB), and the adapter never
calls them (kvfsm copies with its own kernels); `install(extra=...)` stubs them the same way.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder:
    """Stands for any torchvision object; using it (calling it) raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is stubbed in the upstream differential tests")

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self) -> str:
        return f"<torchvision stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: tuple[str, ...] = ("torchvision",)) -> None:
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        module.__version__ = "0.0.0+stub"


def install(extra: tuple[str, ...] = ()) -> None:
    """Put the finder first on sys.meta_path (idempotent); a real torchvision, if any, is shadowed, and so
    is each package named in `extra`."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(("torchvision", *extra)))
