"""The compatibility matrix: the oldest supported and the newest available Python, torch, transformers and
pydantic, one venv per row, the whole suite in each (`make test-compat`; README "Tested versions").

    python3 tests/compat/matrix.py list                 # the rows, as the README's table
    python3 tests/compat/matrix.py run [ROW ...]        # build .venv-compat-<row> and run the suite in it

A row pins what it tests; everything else resolves to the newest release that the project's ranges admit (the
newest with a wheel for the row's Python, where an older one has a wheel and the newest has none).
Where a machine's pip configuration caps torch through a constraint file (a CPU build lies on its disk), a row
installs with PIP_CONSTRAINT pointing to an empty file, for its own venv only: the newest torch on the registry
is then its CUDA build, which runs on a machine without a GPU (the suite's CUDA tests skip, as anywhere without
a device). transformers 5.24 needs Python >= 3.11 and torch >= 2.6, so the oldest Python and torch run without
the transformers integration (its tests skip), and a row of its own holds the integration's oldest versions.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Row:
    name: str
    why: str
    python: str
    torch: str
    pydantic: str
    transformers: str | None  # None: the integration is not installed (its tests skip)
    numpy: str | None = None  # None: the newest the others admit

    @property
    def venv(self) -> Path:
        return ROOT / f".venv-compat-{self.name}"

    def pins(self) -> list[str]:
        pins = [f"torch=={self.torch}", f"pydantic=={self.pydantic}"]
        if self.transformers:
            pins.append(f"transformers=={self.transformers}")
        if self.numpy:
            pins.append(f"numpy=={self.numpy}")
        return pins


ROWS = [
    Row(
        "oldest",
        "the oldest Python, torch, pydantic and numpy the project declares",
        python="3.10",
        torch="2.4.0",
        pydantic="2.5.0",
        transformers=None,
        numpy="1.24.4",
    ),
    Row(
        "oldest-transformers",
        "the oldest versions of the transformers integration",
        python="3.11",
        torch="2.6.0",
        pydantic="2.5.0",
        transformers="5.24.0",
    ),
    Row(
        "newest",
        "the newest releases on the registry",
        python="3.13",
        torch="2.15.0",
        pydantic="2.14.4",
        transformers="5.25.0",
    ),
]
BY_NAME = {r.name: r for r in ROWS}


def table() -> list[str]:
    """The README's table of tested versions (tests/compat/test_matrix.py keeps the two equal)."""
    lines = [
        "| row | Python | torch | transformers | pydantic | numpy | what it covers |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in ROWS:
        lines.append(
            f"| `{r.name}` | {r.python} | {r.torch} | {r.transformers or 'not installed'} | {r.pydantic} | "
            f"{r.numpy or 'newest'} | {r.why} |"
        )
    return lines


def _python(version: str) -> str:
    """An interpreter of `version` that runs: on PATH, or one pyenv installed but does not put on it."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [shutil.which(f"python{version}")] + sorted(
        str(p) for p in pyenv.glob(f"{version}.*/bin/python{version}")
    )
    for exe in filter(None, candidates):
        if subprocess.run([exe, "-c", "pass"], capture_output=True).returncode == 0:
            return exe
    raise SystemExit(f"no working python{version} on PATH or under {pyenv}: the row needs it")


def build(row: Row) -> None:
    """The row's venv: a fresh one each time, so that what it tests is what the pins and ranges resolve to."""
    if row.venv.exists():
        shutil.rmtree(row.venv)
    subprocess.run([_python(row.python), "-m", "venv", str(row.venv)], check=True)
    # --prefer-binary: a release that has no wheel for the row's Python is passed over for the newest one that has
    # (atheris 3.0 ships no Python 3.10 wheel, and its source build needs clang's libFuzzer)
    pip = [str(row.venv / "bin" / "python"), "-m", "pip", "install", "-q", "--prefer-binary"]
    empty = row.venv / "no-constraints.txt"
    empty.write_text("")
    env = dict(os.environ, PIP_CONSTRAINT=str(empty))  # this venv only: the machine's torch cap does not apply
    subprocess.run(pip + ["--upgrade", "pip"], check=True, env=env)
    subprocess.run(pip + [f"torch=={row.torch}"], check=True, env=env)  # first: nothing else picks another build
    extras = "dev,bench,mutation" + (",transformers" if row.transformers else "")
    # the editable install writes kvfsm.egg-info in the checkout: one at a time with the Makefile's builds
    lock = ["flock", str(ROOT / "pyproject.toml")] if shutil.which("flock") else []
    subprocess.run(lock + pip + ["-e", f"{ROOT}[{extras}]", *row.pins()], check=True, env=env, cwd=ROOT)


def versions(row: Row) -> str:
    code = (
        "import sys, torch, pydantic, numpy\n"
        "try:\n import transformers; t = transformers.__version__\nexcept ImportError:\n t = None\n"
        "print(f'Python {sys.version.split()[0]}, torch {torch.__version__}, transformers {t}, '"
        "f'pydantic {pydantic.VERSION}, numpy {numpy.__version__}')"
    )
    out = subprocess.run([str(row.venv / "bin" / "python"), "-c", code], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def run(row: Row, pytest_args: list[str]) -> int:
    build(row)
    print(f"[{row.name}] {versions(row)}", flush=True)
    env = dict(os.environ, KVFSM_REQUIRE_MUTMUT="1")
    if row.transformers:
        env["KVFSM_REQUIRE_TRANSFORMERS"] = "1"
    t0 = time.monotonic()
    rc = subprocess.run(
        [
            str(row.venv / "bin" / "python"),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "auto",
            "--dist",
            "loadfile",
            "--no-loadscope-reorder",
            *pytest_args,
        ],
        cwd=ROOT,
        env=env,
    ).returncode
    print(f"[{row.name}] suite exit {rc} after {time.monotonic() - t0:.0f} s", flush=True)
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list")
    r = sub.add_parser("run")
    r.add_argument("rows", nargs="*", help=f"rows to run (default: all): {', '.join(BY_NAME)}")
    args, rest = ap.parse_known_args()
    if args.cmd == "list":
        print("\n".join(table()))
        return 0
    unknown = [n for n in args.rows if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown rows {unknown}; the rows are {list(BY_NAME)}")
    failed = [n for n in (args.rows or list(BY_NAME)) if run(BY_NAME[n], rest) != 0]
    if failed:
        print(f"failed rows: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
