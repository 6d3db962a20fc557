"""Each reader of outside input under atheris's coverage-guided fuzzing (tests/hostile/atheris_fuzz.py), from
the hostile corpus and the shipped files as seeds: a short budget here, a long one under KVFSM_FUZZ=deep. A
crash names the input libFuzzer saved; keep it under tests/hostile/regressions/ once fixed."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from timing import run_watched

pytest.importorskip("atheris")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEEP = os.environ.get("KVFSM_FUZZ", "ci") == "deep"
RUNS = {"spec": 150, "config": 300, "env": 300, "trace": 300, "storage": 300}
SEEDS = {
    "spec": [*(ROOT / "tests" / "specs" / "valid").glob("*.yaml"), *(HERE / "corpus").glob("spec_*")],
    "config": list((HERE / "corpus").glob("config_*")),
    "trace": list((HERE / "corpus").glob("trace_*")),
}


@pytest.mark.parametrize("target", sorted(RUNS))
def test_atheris_finds_no_input_that_escapes_the_typed_errors(target: str, tmp_path: Path) -> None:
    corpus, crashes = tmp_path / "corpus", tmp_path / "crashes"
    corpus.mkdir()
    crashes.mkdir()
    for seed in SEEDS.get(target, []):
        shutil.copy(seed, corpus / seed.name)
    if target == "env":
        (corpus / "env").write_text('KVFSM_PAGE_SIZE=4\nKVFSM_OFFLOAD_STRIDE=8\nKVFSM_STORAGE_EXTRA={"fsync": true}\n')
    if target == "storage":  # the page, then the sidecar, replaced (atheris_fuzz.storage's first byte)
        (corpus / "page").write_bytes(b"\x00" + bytes(range(192)))
        (corpus / "sidecar").write_bytes(b"\x01KVFSM")
    runs = 20_000 if DEEP else RUNS[target]
    proc = run_watched(
        [
            sys.executable,
            str(HERE / "atheris_fuzz.py"),
            target,
            f"-runs={runs}",
            "-max_len=4096",
            f"-artifact_prefix={crashes}/",
            str(corpus),
        ],
        f"atheris on the {target} reader",
        cwd=ROOT,
        env=dict(os.environ, KVFSM_ATHERIS_WORK=str(tmp_path / "work")),
    )
    found = sorted(p.name for p in crashes.iterdir())
    assert proc.returncode == 0 and not found, (
        f"atheris found an input the {target} reader does not answer with a typed error: {found}\n{proc.stderr[-3000:]}"
    )
