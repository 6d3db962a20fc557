"""The hostile inputs that once escaped as raw tracebacks or took the machine's memory, each run in a
subprocess under a 1 GiB address-space limit (tests/hostile/limited.py): a typed error naming the file,
the line and the bound, with the command's documented exit code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from timing import run_watched

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
ROOT = HERE.parents[1]
LIMIT_MIB = 1024
INVALID = 2  # the CLI's exit code for an input it cannot use


def limited(*args: str):
    return run_watched([sys.executable, str(HERE / "limited.py"), str(LIMIT_MIB), *args], f"kvfsm {' '.join(args)}",
                       cwd=ROOT)


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


@pytest.mark.parametrize("name, bound", [("config_nested_3000.yaml", "(bound max_depth="),
                                         ("config_nested_3000.json", "(bound max_depth="),
                                         ("config_billion_laughs.yaml", "(bound max_elements="),
                                         ("config_not_utf8.yaml", "not UTF-8")])
def test_hostile_config_file_is_a_config_error(name: str, bound: str) -> None:
    path = CORPUS / name
    res = limited("call", "kvfsm.runtime.config:OffloadConfig.from_file", str(path))
    assert res.returncode == 3, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stdout.startswith("error kvfsm.errors.ConfigError:"), res.stdout[-2000:]
    assert f"{path}:" in res.stdout and bound in res.stdout


@pytest.mark.parametrize("name, bound", [("trace_nested_100000.jsonl", "max_line_bytes"),
                                         ("trace_nested_1000.jsonl", "max_depth")])
def test_deeply_nested_trace_line_is_unreadable_input_not_an_illegal_step(name: str, bound: str) -> None:
    path = CORPUS / name
    res = limited("cli", "replay", str(path))
    assert res.returncode == INVALID, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "illegal step" not in res.stderr
    assert f"{path}:1:" in res.stderr and f"(bound {bound}=" in res.stderr
