"""Build the tree of vLLM 0.34.0's own tests that `make test-vllm` runs against kvfsm's manager.

    python tests/upstream_vllm/upstream/assemble.py DEST

`vllm-tests/` mirrors vLLM's `tests/` directory: each `X.py.orig` is that file from vLLM 0.34.0's PyPI source
archive, unchanged (checked here against `SHA256SUMS`), and an `X.py.patch` beside it, if any, is kvfsm's change
to it (README.md says what each does). This copies every original to `DEST/tests/X.py`, creates the packages'
`__init__.py` files (empty; vLLM's are empty but for a license line in one), installs `stub_conftest.py.in` as
`DEST/tests/conftest.py` in place of vLLM's top-level conftest, writes an empty `DEST/pytest.ini` (the rootdir),
and applies each patch with `git apply`, failing if one does not apply or changes nothing. Then
`cd DEST && pytest tests` runs them.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORIGINALS = HERE / "vllm-tests"


def assemble(dest: Path) -> None:
    tests = dest / "tests"
    if tests.exists():
        shutil.rmtree(tests)
    sums = {}
    for line in (HERE / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        sums[name] = digest
    found = sorted(p.relative_to(ORIGINALS).as_posix() for p in ORIGINALS.rglob("*.orig"))
    if found != sorted(sums):
        raise SystemExit(f"vllm-tests/ holds {found}, SHA256SUMS lists {sorted(sums)}")
    for name, digest in sums.items():
        data = (ORIGINALS / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise SystemExit(f"vllm-tests/{name} is not vLLM 0.34.0's file (sha256 differs from SHA256SUMS)")
        target = tests / name.removesuffix(".orig")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    for directory in [tests, *(p for p in tests.rglob("*") if p.is_dir())]:
        (directory / "__init__.py").touch()
    shutil.copyfile(HERE / "stub_conftest.py.in", tests / "conftest.py")
    # DEST is pytest's rootdir, so kvfsm's own pytest settings (pyproject.toml) do not apply to vLLM's tests
    (dest / "pytest.ini").write_text("[pytest]\n")
    for patch in sorted(ORIGINALS.rglob("*.py.patch")):
        target = tests / patch.relative_to(ORIGINALS).as_posix().removesuffix(".patch")
        before = target.read_bytes()
        # paths in each patch are a/X.py, b/X.py, relative to the file's own directory
        subprocess.run(["git", "apply", "-p1", "--whitespace=nowarn", str(patch)], cwd=target.parent, check=True)
        if target.read_bytes() == before:
            raise SystemExit(f"{patch.relative_to(HERE)} changed nothing in {target}")
        print(f"applied {patch.relative_to(HERE)}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    assemble(Path(sys.argv[1]))
