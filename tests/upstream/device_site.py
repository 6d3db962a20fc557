"""Build the sglang 0.5.23 site that the GPU runs of tests/upstream carry to the device machine.

The device has Python 3.12 with torch, numpy, triton, jinja2, PyYAML, rich and pytest, no network, and
a 64 MiB limit on what travels with the working tree; sglang's wheel and the pure-Python packages its
decode offload path imports are 278 MB unpacked. This keeps only what that path imports: it takes the
modules a CPU run of the harness loaded (`sys.modules` under .venv-sglang, listed by `--list`), maps each
to the same file of the Python 3.12 wheels (`--wheels`, from `pip download --python-version 3.12`), and
packs them into one tar.xz. Packages the device already has are left out.

    python tests/upstream/device_site.py --wheels DIR --out .device/sglang-site.tar.xz
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ON_DEVICE = {
    "torch",
    "numpy",
    "triton",
    "jinja2",
    "markupsafe",
    "yaml",
    "_yaml",
    "rich",
    "pygments",
    "markdown_it",
    "mdurl",
    "typer",
    "click",
    "pytest",
    "_pytest",
    "pluggy",
    "iniconfig",
    "hypothesis",
    "sympy",
    "mpmath",
    "networkx",
    "filelock",
    "fsspec",
    "setuptools",
    "pkg_resources",
    "_distutils_hack",
    "typing_extensions",
    "nvidia",
    "cuda",
    "packaging",
    "attr",
    "attrs",
    "sortedcontainers",
    "exceptiongroup",
    "shellingham",
}

# data that imported modules look for when they load (sglang's JIT kernel tree is checked for at import)
DATA_DIRS = ("sglang/kernels/jit/include/", "sglang/kernels/jit/csrc/")
# sglang's Python is taken whole (a CUDA run imports modules a CPU run does not), but for what the offload
# path can never reach; its compiled modules only where a CPU run imported one
SGLANG_SKIP = ("sglang/multimodal_gen/", "sglang/test/", "sglang/benchmark/")

LISTER = """
import json, os, sys
sys.path.insert(0, {here!r})
import harness
for name in ("plain-p1-s-", "plain-p4-s8", "mla", "prefix-matched", "namespaced", "wide-tokens"):
    try:
        harness.run_scenario(name, harness.UpstreamManager)
    except KeyError:
        pass
site = [p for p in sys.path if p.endswith("site-packages")][0]
files = sorted({{os.path.relpath(m.__file__, site) for m in list(sys.modules.values())
                if getattr(m, "__file__", None) and m.__file__.startswith(site)}})
json.dump(files, sys.stdout)
"""


def imported_files(python: str) -> list[str]:
    out = subprocess.run([python, "-c", LISTER.format(here=str(HERE))], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def build(wheels: Path, files: list[str], out: Path) -> tuple[int, int]:
    wanted = {f.replace("cpython-311", "cpython-312") for f in files if f.split("/")[0].split(".")[0] not in ON_DEVICE}
    # every package a CPU run imported from is taken whole (a CUDA run reaches further into them)
    whole = tuple(f.split("/")[0] + "/" for f in wanted if "/" in f)
    # a compiled module's name differs between wheels (cpython-312 or abi3): take every extension module
    # of a directory that holds an imported one
    so_dirs = {f.rsplit("/", 1)[0] for f in wanted if f.endswith(".so")}
    # every package __init__ on the way to a wanted module
    for f in list(wanted):
        parts = f.split("/")
        for i in range(1, len(parts)):
            wanted.add("/".join(parts[:i]) + "/__init__.py")
    out.parent.mkdir(parents=True, exist_ok=True)
    taken = size = 0
    with tarfile.open(out, "w:xz") as tar:
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                for name in z.namelist():
                    top = name.split("/")[0]
                    # modules imported; the shared libraries a wheel vendors (auditwheel's <name>.libs/);
                    # metadata (importlib.metadata reads versions) without entry points, which would make
                    # pytest load plugins of packages only partly carried
                    meta = ".dist-info/" in name and not name.endswith("entry_points.txt")
                    so = name.endswith(".so") and name.rsplit("/", 1)[0] in so_dirs
                    data = (
                        name.startswith(DATA_DIRS)
                        or (
                            name.startswith("sglang/") and not name.endswith(".so") and not name.startswith(SGLANG_SKIP)
                        )
                        or (name.startswith(whole) and not name.startswith("sglang/"))
                    )
                    if name in wanted or so or data or top.endswith(".libs") or meta:
                        data = z.read(name)
                        info = tarfile.TarInfo(name)
                        info.size, info.mode = len(data), 0o755 if name.endswith(".so") else 0o644
                        tar.addfile(info, io.BytesIO(data))
                        taken += 1
                        size += len(data)
    return taken, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", type=Path, required=True, help="Python 3.12 wheels of tests/upstream/requirements.txt")
    ap.add_argument("--python", default=str(HERE.parents[1] / ".venv-sglang/bin/python"))
    ap.add_argument("--out", type=Path, default=HERE.parents[1] / ".device/sglang-site.tar.xz")
    args = ap.parse_args()
    files = imported_files(args.python)
    taken, size = build(args.wheels, files, args.out)
    print(f"{taken} files, {size / 2**20:.1f} MiB unpacked -> {args.out} ({os.path.getsize(args.out) / 2**20:.1f} MiB)")
    if os.path.getsize(args.out) > 40 * 2**20:
        sys.exit("the site is over 40 MiB packed: it would not travel with the working tree")


if __name__ == "__main__":
    main()
