"""Coverage-guided fuzzing of the readers of outside input with atheris (libFuzzer for Python), beside the
property-based fuzzers of test_fuzz_readers.py: atheris mutates raw bytes toward inputs that reach new
branches of kvfsm's own code, which generated YAML and JSON do not aim at.

    python tests/hostile/atheris_fuzz.py TARGET [libFuzzer flags] CORPUS_DIR...

TARGET is `spec`, `config`, `env`, `trace` or `storage`. The invariant, for any input: the reader returns a valid
result or raises its typed error (SpecInvalid, ConfigError, InputRejected; FileStorage: a miss, never an
exception). Anything else escapes, and libFuzzer saves the input (`-artifact_prefix`) and exits non-zero.
test_atheris.py runs each target from the corpus of tests/hostile/ with a short budget; KVFSM_FUZZ=deep
runs longer.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import atheris

from limited import cap_address_space

TARGET = sys.argv[1] if __name__ == "__main__" and len(sys.argv) > 1 else ""
# The spec and trace readers import no torch: their runs skip its import (about 2 s of CPU each) and its
# instrumentation. libFuzzer ends the process without Python's exit handlers, so the work folder is the
# caller's (KVFSM_ATHERIS_WORK, which test_atheris.py puts under its tmp_path), never one left in /tmp.
with atheris.instrument_imports(include=["kvfsm"]):
    from kvfsm.errors import ConfigError, InputRejected
    from kvfsm.spec import CompiledSpec, SpecInvalid, load_spec
    from kvfsm.verify.replay import ReplayResult, check_trace, default_spec_path

    if TARGET not in ("spec", "trace"):
        import torch

        from kvfsm.dataplane.storage import FileStorage
        from kvfsm.runtime import OffloadConfig

WORK = Path(os.environ.get("KVFSM_ATHERIS_WORK") or tempfile.mkdtemp(prefix="kvfsm-atheris-"))
WORK.mkdir(parents=True, exist_ok=True)
SPEC = load_spec(default_spec_path())


def _file(name: str, data: bytes) -> Path:
    path = WORK / name
    path.write_bytes(data)
    return path


def spec(data: bytes) -> None:
    path = _file("fuzz.yaml", data)
    try:
        assert isinstance(load_spec(path), CompiledSpec)
    except SpecInvalid as exc:
        assert exc.errors and all(e.file == str(path) for e in exc.errors)


def config(data: bytes) -> None:
    for suffix in (".yaml", ".json"):
        path = _file("offload" + suffix, data)
        try:
            assert isinstance(OffloadConfig.from_file(path), OffloadConfig)
        except ConfigError as exc:
            assert exc.source.startswith(str(path))


def env(data: bytes) -> None:
    """Lines `NAME=VALUE`, as an environment: the KVFSM_* variables of OffloadConfig.from_env."""
    environ = dict(line.partition("=")[::2] for line in data.decode("utf-8", "replace").splitlines())
    try:
        assert isinstance(OffloadConfig.from_env(environ), OffloadConfig)
    except ConfigError as exc:
        assert exc.source.startswith("environment")


def trace(data: bytes) -> None:
    path = _file("trace.jsonl", data)
    try:
        assert isinstance(check_trace(path, SPEC), ReplayResult)
    except InputRejected as exc:
        assert exc.source == str(path)


DIMS = (2, 3, 4)
if TARGET in ("", "storage"):
    PAGE = torch.arange(2 * 3 * 4 * 8, dtype=torch.uint8)
    STORE = FileStorage(WORK / "store", model_name="m", layout="page_first", page_dims=DIMS, dtype=torch.uint8)
    assert STORE.batch_set(["k"], [PAGE]) == [True]
    PAGE_FILE = Path(STORE.path_of("k"))
    SIDECAR = Path(STORE.sidecar_of(str(PAGE_FILE)))
    SIDECAR_BYTES = SIDECAR.read_bytes()


def storage(data: bytes) -> None:
    """The input's first byte picks what it replaces: the page, the sidecar, or both (split at the second)."""
    if not data:
        return
    how, rest = data[0] % 3, data[1:]
    cut = rest[0] if rest else 0
    page, side = {0: (rest, SIDECAR_BYTES), 1: (PAGE.numpy().tobytes(), rest), 2: (rest[1 : 1 + cut], rest[1 + cut :])}[
        how
    ]
    PAGE_FILE.parent.mkdir(parents=True, exist_ok=True)
    PAGE_FILE.write_bytes(page)
    SIDECAR.write_bytes(side)
    for known in (None, PAGE.numel()):
        reader = FileStorage(
            WORK / "store", model_name="m", layout="page_first", page_dims=DIMS, dtype=torch.uint8, page_nbytes=known
        )
        [got] = reader.batch_get(["k"])
        assert got is None or got.numel() == len(page)
        assert reader.batch_exists(["k"]) in (0, 1)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "spec": spec,
    "config": config,
    "env": env,
    "trace": trace,
    "storage": storage,
}


HEADROOM_MIB = 1024  # what one input may add to the address space of the loaded process


if __name__ == "__main__":
    target = TARGETS[sys.argv[1]]
    # The memory bound is an address-space limit a fixed headroom above what the loaded process maps, as in
    # limited.py: libFuzzer's own RSS limit reads the peak RSS, which Linux carries over from the parent
    # across fork and exec (a pytest worker's peak of 2 GiB made every input "out of memory").
    cap_address_space(HEADROOM_MIB)
    atheris.Setup([sys.argv[0], "-rss_limit_mb=0", *sys.argv[2:]], target)
    atheris.Fuzz()
