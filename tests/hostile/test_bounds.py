"""Each bound of kvfsm.input_limits, breached on each reader: a typed error naming the source, the line and
the bound, and nothing built from the input. In-process and small: the bounds are lowered where the
defaults would need large files."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from kvfsm.dataplane.storage import FileStorage
from kvfsm.errors import ConfigError, InputBoundExceeded, InputRejected
from kvfsm.input_limits import CONFIG_LIMITS, SPEC_LIMITS, TRACE_LIMITS, load_yaml_data
from kvfsm.runtime import OffloadConfig
from kvfsm.spec import SpecInvalid, load_spec
from kvfsm.spec.loader import load_yaml
from kvfsm.verify.replay import check_trace

ROOT = Path(__file__).resolve().parents[2]


def spec_errors(path: Path, **limits: int) -> list[str]:
    with pytest.raises(SpecInvalid) as info:
        load_yaml(path, dataclasses.replace(SPEC_LIMITS, **limits))
    return [str(e) for e in info.value.errors]


def test_spec_size_bound_names_the_line_where_it_is_crossed(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("machine: M\n" + "# padding\n" * 200)
    [msg] = spec_errors(big, max_bytes=105)
    assert msg.startswith(f"{big}:11: ") and "(bound max_bytes=105)" in msg


def test_spec_element_bound(tmp_path: Path) -> None:
    wide = tmp_path / "wide.yaml"
    wide.write_text("machine: M\nstates:\n" + "".join(f"  - s{i}\n" for i in range(100)))
    [msg] = spec_errors(wide, max_elements=50)
    assert msg.startswith(f"{wide}:") and "(bound max_elements=50)" in msg


def test_spec_aliases_are_refused_outright(tmp_path: Path) -> None:
    one = tmp_path / "alias.yaml"
    one.write_text("machine: &m M\ndoc: *m\n")
    [msg] = spec_errors(one)
    assert msg.startswith(f"{one}:2: ") and "aliases" in msg and "(bound max_aliases=0)" in msg


def test_the_shipped_specs_are_well_inside_the_bounds() -> None:
    for spec in sorted((ROOT / "spec").glob("*.yaml")):
        load_yaml(
            spec,
            dataclasses.replace(
                SPEC_LIMITS,
                max_bytes=SPEC_LIMITS.max_bytes // 16,
                max_depth=8,
                max_elements=SPEC_LIMITS.max_elements // 8,
            ),
        )


def test_config_aliases_count_at_their_expanded_size() -> None:
    text = "a: &a [1, 2, 3, 4]\nb: &b [*a, *a, *a, *a]\nc: [*b, *b, *b, *b]\n"
    assert load_yaml_data(text, CONFIG_LIMITS, "cfg", "config")["c"][3][3] == [1, 2, 3, 4]
    with pytest.raises(InputBoundExceeded) as info:
        load_yaml_data(text, dataclasses.replace(CONFIG_LIMITS, max_elements=60), "cfg", "config")
    assert (info.value.line, info.value.bound) == (3, "max_elements") and "expanded" in info.value.reason
    with pytest.raises(InputBoundExceeded) as info:
        load_yaml_data(text, dataclasses.replace(CONFIG_LIMITS, max_depth=3), "cfg", "config")
    assert (info.value.line, info.value.bound) == (3, "max_depth")
    with pytest.raises(InputBoundExceeded) as info:
        load_yaml_data(text, dataclasses.replace(CONFIG_LIMITS, max_aliases=5), "cfg", "config")
    assert (info.value.line, info.value.bound) == (3, "max_aliases")


def test_config_file_breaches_are_config_errors_naming_file_and_line(tmp_path: Path) -> None:
    cfg = tmp_path / "offload.yaml"
    cfg.write_text("page_size: 4\nstorage_extra:\n  fsync: true\n" + "# pad\n" * 10)
    assert OffloadConfig.from_file(cfg).page_size == 4
    with pytest.raises(ConfigError) as info:
        OffloadConfig.from_file(cfg, dataclasses.replace(CONFIG_LIMITS, max_bytes=40))
    assert info.value.source == f"{cfg}:3" and "(bound max_bytes=40)" in info.value.reason
    js = tmp_path / "offload.json"
    js.write_text(json.dumps({"page_size": 4, "storage_extra": {"x": list(range(50))}}))
    with pytest.raises(ConfigError) as info:
        OffloadConfig.from_file(js, dataclasses.replace(CONFIG_LIMITS, max_elements=20))
    assert info.value.source == f"{js}:1" and "(bound max_elements=20)" in info.value.reason
    with pytest.raises(ConfigError) as info:
        OffloadConfig.from_file(tmp_path)
    assert info.value.source == str(tmp_path)


def test_env_value_bounds_name_the_variable() -> None:
    with pytest.raises(ConfigError) as info:
        OffloadConfig.from_env({"KVFSM_STORAGE_EXTRA": "[" * 40 + "]" * 40})
    assert info.value.source == "environment (KVFSM_STORAGE_EXTRA)" and info.value.field == "storage_extra"
    assert "(bound max_depth=16)" in info.value.reason
    with pytest.raises(ConfigError) as info:
        OffloadConfig.from_env({"KVFSM_MODEL_NAME": "m" * 70_000})
    assert "(bound max_bytes=65536)" in info.value.reason


def _trace(tmp_path: Path, *lines: str) -> Path:
    from kvfsm.spec import load_spec
    from kvfsm.verify.replay import default_spec_path

    sha = load_spec(default_spec_path()).sha256
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join([json.dumps({"kind": "header", "spec_sha256": sha}), *lines]) + "\n")
    return path


@pytest.mark.parametrize(
    "limits, line, bound",
    [
        (dict(max_line_bytes=150), '{"req": "' + "r" * 200 + '"}', "max_line_bytes"),
        (dict(max_bytes=120), '{"req": "' + "r" * 50 + '"}', "max_bytes"),
        (dict(max_elements=10), json.dumps({"req": "r", "counters": {f"c{i}": i for i in range(20)}}), "max_elements"),
        (dict(), '{"req": ' + "[" * 9 + "]" * 9 + "}", "max_depth"),
    ],
)
def test_trace_bounds_are_input_errors_at_their_line(tmp_path: Path, limits: dict, line: str, bound: str) -> None:
    path = _trace(tmp_path, line)
    with pytest.raises(InputBoundExceeded) as info:
        check_trace(path, limits=dataclasses.replace(TRACE_LIMITS, **limits))
    assert (info.value.source, info.value.line, info.value.bound) == (str(path), 2, bound)


def test_trace_request_bound(tmp_path: Path) -> None:
    step = {"event": "admit", "from": "nowhere", "to": "nowhere", "transition": 0, "counters": {}}
    path = _trace(tmp_path, *(json.dumps({**step, "req": f"r{i}"}) for i in range(3)))
    res = check_trace(path)  # an illegal step, reported as one
    assert res.error is not None and res.error.line == 2
    with pytest.raises(InputBoundExceeded) as info:
        check_trace(path, max_requests=0)
    assert (info.value.line, info.value.bound) == (2, "max_requests")


def test_trace_not_utf8_or_not_a_file(tmp_path: Path) -> None:
    path = _trace(tmp_path)
    path.write_bytes(path.read_bytes() + b'{"req": "\xff"}\n')
    with pytest.raises(InputRejected) as info:
        check_trace(path)
    assert info.value.line == 2 and "UTF-8" in info.value.reason
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(InputRejected, match="not a regular file"):  # refused at once: no writer is waited for
        check_trace(fifo)


def test_file_storage_never_reads_a_page_grown_past_its_length(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "store", model_name="m")
    page = torch.arange(64, dtype=torch.uint8)
    assert store.batch_set(["k0", "k1"], [page, page]) == [True, True]
    for key in ("k0", "k1"):
        path = store.path_of(key)
        if key == "k1":
            os.unlink(store.sidecar_of(path))  # SGLang's kind of page: length-checked only
        with open(path, "r+b") as f:
            f.truncate(10 << 30)  # 10 GiB, sparse
    reads = []

    class Counting(bytearray):
        def __init__(self, n: int = 0) -> None:
            reads.append(n)
            super().__init__(n)

    import kvfsm.dataplane.storage.file as file_mod

    file_mod.bytearray = Counting  # type: ignore[attr-defined]
    try:
        assert store.batch_get(["k0", "k1"]) == [None, None]
    finally:
        del file_mod.bytearray
    assert reads and max(reads) < 1 << 20  # neither 10 GiB file was read into memory
    assert store.stats.reads_corrupt == 2


def test_spec_check_work_is_bounded(tmp_path: Path) -> None:
    """Counters, params and literals whose valuations times transitions and states would keep `validate`
    busy past SPEC_MAX_CHECK_WORK are refused before the enumeration starts."""
    base = (ROOT / "tests" / "specs" / "valid" / "minimal.yaml").read_text()

    def counters(n: int) -> str:
        extra = "".join(f"  c{i}:\n    doc: A counter of the test.\n" for i in range(n))
        return base.replace("counters:\n", "counters:\n" + extra, 1).replace(
            "expr: jobs > 1", "expr: jobs > 1 and c0 < 7"
        )

    ok, over = tmp_path / "ok.yaml", tmp_path / "over.yaml"
    ok.write_text(counters(3))
    over.write_text(
        counters(4).replace("resources:\n", "params:\n  p:\n    doc: A param of the test.\n\nresources:\n", 1)
    )
    load_spec(ok)  # 10**4 valuations of 8 transitions and states: within the bound (2 * 10**5 of them: past it)
    with pytest.raises(SpecInvalid) as info:
        load_spec(over)
    assert "SPEC_MAX_CHECK_WORK" in str(info.value) and str(over) in str(info.value)
