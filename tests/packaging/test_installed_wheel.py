"""kvfsm as users install it: the wheel, in a fresh venv, used from a directory outside the checkout.

The venv gets the pinned CPU torch first (the machine's fast local build), then the wheel with only its
declared dependencies, so an undeclared import fails here. Every command runs from a temporary directory
that has a `generated/` package of its own: a wheel that installed a top-level `generated`, or code that
still imported it, would pick up the user's package (which raises) or clobber it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from timing import run_watched

from kvfsm.generated.decode_offload import STATES as SPEC_STATES  # the shipped spec's states, as generated

ROOT = Path(__file__).resolve().parents[2]
UV = ROOT / "build" / "uv" / "bin" / "uv"  # the uv `make test` installs (Makefile: UV)
TORCH_PIN = "torch==2.13.0"  # the Makefile's pin: the CPU build, so the range in pyproject installs nothing bigger
# (".venv*": the main venv and sglang's, which `make test` builds before the suite; ".device": GPU runs' site)
_NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv*",
    ".device",
    ".whl",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".hypothesis",
    ".pytest_cache",
    "results",
    "tests",
)


def _find_links(env: dict[str, str]) -> list[str]:
    """pip's find-links (where this machine keeps its CPU torch), which uv does not read by itself."""
    links = (
        env.get("PIP_FIND_LINKS")
        or subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True, env=env
        ).stdout
    )
    return links.split()


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The command must exit 0; a hang guard on its progress (tests/timing.py), not a fixed timeout."""
    proc = run_watched([str(c) for c in cmd], " ".join(map(str, cmd)), cwd=cwd, env=env)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    """(the venv's bin/, a user's working directory outside the checkout, the environment to run in)."""
    base = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "KVFSM_"))}
    # Build from a copy of the sources, so the checkout gets no build/ or egg-info, with build isolation,
    # so pyproject's build requirements are what is tested.
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(base / "dist"), str(src)], base, env)
    (wheel,) = (base / "dist").glob("kvfsm-*.whl")
    bin_dir = base / "venv" / "bin"
    # --no-compile: as `make test` installs (the Makefile says why); the venv compiles what it imports, at import
    if UV.exists():
        # As `make test` sets up its venvs (Makefile: NEW_VENV, PIP_TORCH): uv makes the venv and installs torch
        # alone, from the machine's own wheels where they hold the pinned build (else pip, from the index), then
        # the wheel with its declared dependencies. What it saves against pip alone into a venv with its own pip:
        # this module took 46 s of CPU that way, 35 s with pip installing torch, on the 2-core CI machine.
        _run([UV, "venv", "-q", "--python", sys.executable, base / "venv"], base, env)
        links = _find_links(env)
        uv_torch = [UV, "pip", "install", "-q", "--python", bin_dir / "python", "--no-index", "--no-deps"]
        if (
            not links
            or run_watched(
                [str(c) for c in uv_torch + [f"--find-links={x}" for x in links] + [TORCH_PIN]],
                "uv pip install torch",
                cwd=base,
                env=env,
            ).returncode
        ):
            _run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "--python",
                    bin_dir / "python",
                    "install",
                    "-q",
                    "--no-compile",
                    TORCH_PIN,
                ],
                base,
                env,
            )
        _run([UV, "pip", "install", "-q", "--python", bin_dir / "python", wheel], base, env)
    else:
        venv.create(base / "venv", with_pip=True)
        _run([bin_dir / "python", "-m", "pip", "install", "-q", "--no-compile", TORCH_PIN], base, env)
        _run([bin_dir / "python", "-m", "pip", "install", "-q", "--no-compile", wheel], base, env)
    user = base / "user"
    (user / "generated").mkdir(parents=True)
    (user / "generated" / "__init__.py").write_text("USERS_OWN = True\n")
    (user / "generated" / "decode_offload.py").write_text("raise ImportError('the user\\'s generated/ was imported')\n")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return bin_dir, user, env


def test_import_and_no_top_level_generated(installed) -> None:
    bin_dir, user, env = installed
    code = (
        "import kvfsm, kvfsm.runtime, kvfsm.generated.decode_offload as m, generated, pathlib; "
        "assert generated.USERS_OWN; site = pathlib.Path(kvfsm.__file__).parents[1]; "
        "assert not (site / 'generated').exists(), 'a top-level generated/ was installed'; "
        "assert pathlib.Path(m.__file__).is_relative_to(site / 'kvfsm'); print(site)"
    )
    site = Path(_run([str(bin_dir / "python"), "-c", code], user, env).stdout.strip())
    assert not site.is_relative_to(ROOT)


def test_cli_works_outside_the_checkout(installed) -> None:
    bin_dir, user, env = installed
    kvfsm = str(bin_dir / "kvfsm")
    assert "validate" in _run([kvfsm, "--help"], user, env).stdout
    version = _run([kvfsm, "--version"], user, env).stdout
    assert version.startswith("kvfsm ") and "sha256" in version
    assert f"ok: {len(SPEC_STATES)} states" in _run([kvfsm, "validate"], user, env).stdout
    assert "up to date" in _run([kvfsm, "gen", "--check"], user, env).stdout
    assert "up to date" in _run([kvfsm, "schema", "--check"], user, env).stdout
    docs = _run([kvfsm, "docs"], user, env).stdout
    assert docs.startswith("<!-- GENERATED by `kvfsm docs spec/decode_offload.yaml`")
    checked = _run([kvfsm, "check", "--requests", "1", "--slots", "8"], user, env).stdout
    assert "no invariant violated" in checked
    demo_dir = user / "demo"
    _run([kvfsm, "demo", "--requests", "8", "--dir", str(demo_dir)], user, env)
    replayed = _run([kvfsm, "replay", str(demo_dir / "trace.jsonl")], user, env).stdout
    assert ": ok: " in replayed


@pytest.mark.parametrize("steps", [10, 20])
def test_integration_example_runs_installed(installed, steps: int) -> None:
    bin_dir, user, env = installed
    spec = importlib.util.spec_from_file_location("_readme_example", ROOT / "tests" / "docs" / "readme_example.py")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    script = user / f"example_{steps}.py"
    script.write_text(helper.example_source((ROOT / helper.PAGE).read_text(), steps))
    _run([str(bin_dir / "python"), str(script)], user, env)
