"""The hostile inputs that once escaped as raw tracebacks or took the machine's memory, each run in a
subprocess under a 1 GiB address-space limit (tests/hostile/limited.py): a typed error naming the file,
the line and the bound, with the command's documented exit code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from timing import run_watched

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
ROOT = HERE.parents[1]
LIMIT_MIB = 1024
INVALID = 2  # the CLI's exit code for an input it cannot use


def limited(*args: str):
    return run_watched(
        [sys.executable, str(HERE / "limited.py"), str(LIMIT_MIB), *args], f"kvfsm {' '.join(args)}", cwd=ROOT
    )


def test_billion_laughs_spec_is_refused_without_expanding() -> None:
    path = CORPUS / "spec_billion_laughs.yaml"
    res = limited("cli", "validate", str(path))
    assert res.returncode == INVALID, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert f"{path}:3:" in res.stderr and "alias" in res.stderr


def test_deeply_nested_spec_is_refused_at_the_depth_bound() -> None:
    path = CORPUS / "spec_nested_5000.yaml"
    res = limited("cli", "validate", str(path))
    assert res.returncode == INVALID, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert f"{path}:2:" in res.stderr and "(bound max_depth=" in res.stderr


CONFIGS = {
    "config_nested_3000.yaml": "(bound max_depth=",
    "config_nested_3000.json": "(bound max_depth=",
    "config_billion_laughs.yaml": "(bound max_elements=",
    "config_not_utf8.yaml": "not UTF-8",
}


def test_hostile_config_files_are_config_errors() -> None:
    paths = [CORPUS / name for name in CONFIGS]
    res = limited("calls", "kvfsm.runtime.config:OffloadConfig.from_file", *map(str, paths))
    assert res.returncode == 0, res.stderr[-2000:]
    for path, outcome in zip(paths, json.loads(res.stdout.strip().splitlines()[-1])):
        assert outcome.startswith("error kvfsm.errors.ConfigError:"), outcome
        assert f"{path}:" in outcome and CONFIGS[path.name] in outcome, outcome


def test_deeply_nested_trace_lines_are_unreadable_input_not_illegal_steps(tmp_path: Path) -> None:
    traces = {CORPUS / "trace_nested_100000.jsonl": "max_line_bytes", CORPUS / "trace_nested_1000.jsonl": "max_depth"}
    listing = tmp_path / "argv.json"
    listing.write_text(json.dumps([["replay", str(t)] for t in traces]))
    res = limited("batch", str(listing))
    assert res.returncode == 0, res.stderr[-2000:]
    for (path, bound), run in zip(traces.items(), json.loads(res.stdout.strip().splitlines()[-1])):
        assert run["escaped"] is None and run["code"] == INVALID, run
        assert "illegal step" not in run["stderr"]
        assert f"{path}:1:" in run["stderr"] and f"(bound {bound}=" in run["stderr"], run
