"""Every `kvfsm` command that reads a file, run on every hostile file of tests/hostile/corpus/ (and on a
directory, a FIFO, a device and a missing path), in one subprocess under a 1 GiB address-space limit: each
exits with its documented code (2: input it cannot use; `schema --check` 1: stale), never with an escaped
exception, names the file, and writes nothing. A 10 GiB sparse file stands for the file too large to read."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from timing import run_watched

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
ROOT = HERE.parents[1]
LIMIT_MIB = 1024
SPECS = sorted(CORPUS.glob("spec_*.yaml"))
TRACES = sorted(CORPUS.glob("trace_*.jsonl"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, ...], dict]:
    tmp = tmp_path_factory.mktemp("hostile_cli")
    out = tmp / "out"
    out.mkdir()
    fifo = tmp / "fifo.yaml"
    os.mkfifo(fifo)
    sparse = tmp / "sparse_10g.yaml"  # 10 GiB of zeros, no newline: read only up to each bound
    with open(sparse, "wb") as f:
        f.truncate(10 << 30)
    odd = [tmp, fifo, Path("/dev/zero"), tmp / "missing.yaml", sparse]
    trace = TRACES[0]
    argvs: list[list[str]] = []
    for spec in [*SPECS, *odd]:
        s = str(spec)
        argvs += [
            ["validate", s],
            ["gen", s, "--check", "--out", str(out)],
            ["gen", s, "--out", str(out)],
            ["diagram", s],
            ["docs", s, "--out", str(out / "spec.md")],
            ["check", "--spec", s],
            ["replay", str(trace), "--spec", s],
            ["demo", "--spec", s, "--dir", str(out / "demo"), "--requests", "1"],
        ]
    for t in [*TRACES, *odd]:
        argvs.append(["replay", str(t)])
    for f in [*SPECS, *TRACES, fifo, Path("/dev/zero"), sparse]:
        argvs.append(["schema", "--check", "--out", str(f)])
    argvs.append(["schema", "--check", "--out", str(tmp)])
    listing = tmp / "argv.json"
    listing.write_text(json.dumps(argvs))
    res = run_watched(
        [sys.executable, str(HERE / "limited.py"), str(LIMIT_MIB), "batch", str(listing)],
        "kvfsm commands on the hostile corpus",
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    assert not any(os.scandir(out)), f"a rejected input wrote {sorted(os.listdir(out))}"
    return {tuple(r["argv"]): r for r in results}


def _named(argv: tuple[str, ...]) -> str:
    """The hostile file of a command line: what --spec names, else schema's --out, else the first argument."""
    for flag in ("--spec", "--out" if argv[0] == "schema" else "--spec"):
        if flag in argv:
            return argv[argv.index(flag) + 1]
    return argv[1]


def test_every_command_exits_with_its_code_and_names_the_file(runs: dict[tuple[str, ...], dict]) -> None:
    assert len(runs) > 90
    for argv, r in runs.items():
        assert r["escaped"] is None, f"kvfsm {' '.join(argv)}: {r['escaped']}"
        stale_schema = argv[0] == "schema" and Path(argv[-1]).is_file()  # a regular file, not the schema
        expected = 1 if stale_schema else 2
        assert r["code"] == expected, f"kvfsm {' '.join(argv)}: exit {r['code']}, not {expected}: {r['stderr']}"
        named = _named(argv)
        assert named in r["stderr"], f"kvfsm {' '.join(argv)}: {named} not named in {r['stderr']!r}"
        assert "Traceback" not in r["stderr"] and "internal error" not in r["stderr"], r["stderr"]


def test_an_internal_error_is_one_line_with_a_hint_and_its_own_code(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import kvfsm.cli as cli
    from kvfsm.cli_errors import INTERNAL, TRACEBACK_VAR

    def broken(*_: object) -> str:
        raise KeyError("a bug\nover two lines")

    monkeypatch.setattr(cli, "render_diagram", broken)
    monkeypatch.delenv(TRACEBACK_VAR, raising=False)
    res = CliRunner().invoke(cli.app, ["diagram"])
    assert res.exit_code == INTERNAL and INTERNAL not in (0, 1, 2, 3)
    [line] = res.stderr.splitlines()
    assert line.startswith("kvfsm diagram: internal error: KeyError:") and f"{TRACEBACK_VAR}=1" in line
    monkeypatch.setenv(TRACEBACK_VAR, "1")
    res = CliRunner().invoke(cli.app, ["diagram"])
    assert isinstance(res.exception, KeyError)  # the traceback, when asked for
