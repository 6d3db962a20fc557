"""Every input that once broke a reader (found by fuzzing or by hand), kept in tests/hostile/regressions/
and replayed: each must now end in the reader's typed error (or a valid result), naming the file.
A trace's `{SPEC_SHA256}` is replaced by the shipped spec's hash, so its later lines are read at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfsm.errors import ConfigError, InputRejected
from kvfsm.runtime import OffloadConfig
from kvfsm.spec import SpecInvalid, load_spec
from kvfsm.verify.replay import check_trace, default_spec_path

REGRESSIONS = Path(__file__).resolve().parent / "regressions"
SPEC = load_spec(default_spec_path())


@pytest.mark.parametrize("path", sorted(REGRESSIONS.glob("spec_*.yaml")), ids=lambda p: p.stem)
def test_spec_regression(path: Path) -> None:
    with pytest.raises(SpecInvalid) as info:
        load_spec(path)
    assert all(e.file == str(path) for e in info.value.errors)


@pytest.mark.parametrize("path", sorted(REGRESSIONS.glob("trace_*.jsonl")), ids=lambda p: p.stem)
def test_trace_regression(path: Path, tmp_path: Path) -> None:
    trace = tmp_path / path.name
    trace.write_text(path.read_text().replace("{SPEC_SHA256}", SPEC.sha256))
    try:
        res = check_trace(trace, SPEC)
    except InputRejected as exc:
        assert exc.source == str(trace)
    else:
        assert res.error is not None and res.error.line == 2  # past the header: the line itself is judged


@pytest.mark.parametrize("path", sorted(REGRESSIONS.glob("config_*.yaml")), ids=lambda p: p.stem)
def test_config_regression(path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        OffloadConfig.from_file(path)
    assert info.value.source.startswith(str(path))
