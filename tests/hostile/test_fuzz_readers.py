"""Property-based fuzzing of every reader of outside input: the spec loader, the config file and environment
loaders, the trace reader and FileStorage's read path (page and sidecar bytes).

The invariant, for any input: a valid result or the reader's typed error (SpecInvalid, ConfigError,
InputRejected; FileStorage: a miss, never an exception), naming the source; nothing written outside the
store. Inputs are generated YAML, JSON and bytes: mutations of real files (the minimal spec, a legal trace,
a stored page and its sidecar) and structures built from the readers' own vocabulary, so that examples get
past the parser into the checks behind it. Memory stays bounded by the readers' bounds: every example runs
under an address-space limit a fixed headroom above the worker's own (`address_space_headroom`).

The `ci` profile runs a short budget (EXAMPLES each); `KVFSM_FUZZ=deep` runs DEEP_EXAMPLES. Every input
that once broke a reader is kept in tests/hostile/regressions/ and replayed by test_regressions.py.
"""

from __future__ import annotations

import json
import os
import resource
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import HealthCheck, example, given, settings, strategies as st

from limited import cap_address_space

from kvfsm.dataplane.storage import FileStorage, file as file_mod
from kvfsm.errors import ConfigError, InputRejected
from kvfsm.runtime import OffloadConfig
from kvfsm.spec import CompiledSpec, SpecInvalid, load_spec
from kvfsm.verify.replay import ReplayResult, check_trace, default_spec_path

ROOT = Path(__file__).resolve().parents[2]
MINIMAL_TEXT = (ROOT / "tests" / "specs" / "valid" / "minimal.yaml").read_text()
MINIMAL = yaml.safe_load(MINIMAL_TEXT)
SPEC = load_spec(default_spec_path())
HEADROOM_MIB = 1024

EXAMPLES = {"spec": 100, "config": 150, "env": 150, "trace": 150, "storage": 150}
DEEP_EXAMPLES = 3000


def budget(reader: str) -> Any:
    deep = os.environ.get("KVFSM_FUZZ", "ci") == "deep"  # the deep profile (tests/conftest.py)
    return settings(
        max_examples=DEEP_EXAMPLES if deep else EXAMPLES[reader],
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    )


@contextmanager
def address_space_headroom(mib: int = HEADROOM_MIB) -> Iterator[None]:
    """RLIMIT_AS lowered to this process's current address space plus `mib` for the block, then restored:
    a reader that tried to expand its input would fail with MemoryError here (not a typed error)."""
    soft, hard = cap_address_space(mib)
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def tree(path: Path) -> dict[str, int]:
    """Every file under `path` with its size (what a reader must not change outside the store)."""
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}


# ---- generated YAML, JSON and bytes --------------------------------------------------------------------
names = st.sampled_from(["jobs", "idle", "busy", "done", "start", "stop", "slot", "buffer", "more_jobs", "x", ""])
scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | names | st.text(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(names | st.text(max_size=8), inner, max_size=4),
    max_leaves=24,
)
YAML_NOISE = st.text(alphabet="[]{}&*!|>-:?#,'\"%@` \n\tab01\\", max_size=40)


@st.composite
def mutated_text(draw: st.DrawFn, base: str) -> str:
    """`base` with a few edits: a span replaced by YAML-significant noise, deleted, or repeated."""
    text = base
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 40)))
        how = draw(st.sampled_from(["noise", "delete", "repeat"]))
        patch = draw(YAML_NOISE) if how == "noise" else "" if how == "delete" else text[i:j] * draw(st.integers(2, 5))
        text = text[:i] + patch + text[j:]
    return text


@st.composite
def mutated_data(draw: st.DrawFn, base: Any) -> Any:
    """`base` (parsed YAML) with one value somewhere replaced by a generated one."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node, key=str)))
            return {**node, key: walk(node[key])}
        if isinstance(node, list) and node and draw(st.booleans()):
            i = draw(st.integers(0, len(node) - 1))
            return node[:i] + [walk(node[i])] + node[i + 1 :]
        return draw(values)

    return walk(base)


def nested(depth: int, alias: bool) -> str:
    inner = "[*a]" if alias else "[]"
    return ("a: &a [x, y]\nb: " if alias else "b: ") + "[" * depth + inner + "]" * depth + "\n"


EXPR_TOKENS = st.sampled_from(
    ["jobs", "1", "0", "+", "-", "==", ">", "<=", "and", "or", "not", "(", ")", "true", "9" * 40, "x"]
)
expressions = (
    st.lists(EXPR_TOKENS, max_size=30).map(" ".join)
    | st.builds(
        lambda n, op: op * n + "jobs > 1" + ")" * n * (op == "("), st.integers(0, 600), st.sampled_from(["(", "not "])
    )
    | st.builds(lambda n: "jobs" + " + jobs" * n + " > 1", st.integers(0, 1500))
)
guarded = expressions.map(lambda e: MINIMAL_TEXT.replace("expr: jobs > 1", f"expr: {json.dumps(e)}"))
spec_texts = (
    mutated_text(MINIMAL_TEXT)
    | guarded
    | mutated_data(MINIMAL).map(lambda d: yaml.safe_dump(d, sort_keys=False))
    | st.builds(nested, st.integers(0, 40), st.booleans()).map(lambda t: "machine: M\n" + t)
    | YAML_NOISE
)


# ---- the spec loader -----------------------------------------------------------------------------------
@budget("spec")
@given(text=spec_texts)
def test_fuzz_spec_loader(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    d = tmp_path_factory.mktemp("spec")
    path = d / "fuzz.yaml"
    path.write_text(text)
    with address_space_headroom():
        try:
            spec = load_spec(path)
        except SpecInvalid as exc:
            assert exc.errors and all(e.file == str(path) and e.line >= 0 for e in exc.errors)
        else:
            assert isinstance(spec, CompiledSpec)
    assert tree(d) == {"fuzz.yaml": len(text.encode())}


# ---- the config loaders --------------------------------------------------------------------------------
FIELDS = sorted(OffloadConfig.model_fields)
config_values = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), values, max_size=5)
config_yaml = (
    config_values.map(lambda d: yaml.safe_dump(d))
    | mutated_text("page_size: 4\noffload_stride: 8\nstorage_extra: &x {fsync: true}\nmodel_name: m\n")
    | st.builds(nested, st.integers(0, 40), st.booleans())
)
config_json = (
    config_values.map(json.dumps)
    | values.map(json.dumps)
    | mutated_text('{"page_size": 4, "storage_extra": {"a": [1, 2]}}')
)


@budget("config")
@given(
    text=st.one_of(config_yaml.map(lambda t: ("yaml", t)), config_json.map(lambda t: ("json", t))),
    raw=st.none() | st.binary(max_size=64),
)
def test_fuzz_config_file(tmp_path_factory: pytest.TempPathFactory, text: tuple[str, str], raw: bytes | None) -> None:
    d = tmp_path_factory.mktemp("config")
    path = d / f"offload.{text[0]}"
    data = raw if raw is not None else text[1].encode()
    path.write_bytes(data)
    with address_space_headroom():
        try:
            cfg = OffloadConfig.from_file(path)
        except ConfigError as exc:
            assert exc.source.startswith(str(path))
        else:
            assert isinstance(cfg, OffloadConfig)
    assert tree(d) == {path.name: len(data)}


env_names = st.sampled_from([f"KVFSM_{f.upper()}" for f in FIELDS] + ["KVFSM_PAGESIZE", "OTHER"])
env_values = (
    values.map(json.dumps) | st.text(max_size=30) | st.builds(lambda n: "[" * n + "]" * n, st.integers(0, 3000))
)


@budget("env")
@given(env=st.dictionaries(env_names, env_values, max_size=4))
def test_fuzz_config_env(env: dict[str, str]) -> None:
    with address_space_headroom():
        try:
            cfg = OffloadConfig.from_env(env)
        except ConfigError as exc:
            assert exc.source.startswith("environment")
        else:
            assert isinstance(cfg, OffloadConfig)


# ---- the trace reader ----------------------------------------------------------------------------------
STATES, EVENTS = sorted(SPEC.states), sorted(SPEC.events)
RESOURCES = sorted(SPEC.model.resources)
counters = st.fixed_dictionaries({c: st.integers(0, 3) for c in SPEC.counters}) | values
record = st.fixed_dictionaries(
    {},
    optional={
        "req": st.sampled_from(["a", "b"]) | values,
        "event": st.sampled_from(EVENTS) | values,
        "from": st.sampled_from(STATES) | values,
        "to": st.sampled_from(STATES) | values,
        "transition": st.integers(-2, len(SPEC.transitions) + 1) | values,
        "counters": counters,
        "acquired": st.lists(st.sampled_from(RESOURCES), max_size=3) | values,
        "released": st.lists(st.sampled_from(RESOURCES), max_size=3) | values,
        "kind": st.just("header") | values,
    },
)
trace_line = record.map(json.dumps) | values.map(json.dumps) | mutated_text('{"req": "a", "event": "offload"}')


@budget("trace")
@given(lines=st.lists(trace_line, max_size=6), header=st.booleans(), raw=st.none() | st.binary(max_size=80))
def test_fuzz_trace_reader(
    tmp_path_factory: pytest.TempPathFactory, lines: list[str], header: bool, raw: bytes | None
) -> None:
    d = tmp_path_factory.mktemp("trace")
    path = d / "trace.jsonl"
    head = [json.dumps({"kind": "header", "spec_sha256": SPEC.sha256})] if header else []
    data = "\n".join(head + lines).encode() + (raw or b"")
    path.write_bytes(data)
    with address_space_headroom():
        try:
            res = check_trace(path, SPEC)
        except InputRejected as exc:
            assert exc.source == str(path) and exc.line >= 0
        else:
            assert isinstance(res, ReplayResult)
            assert res.error is None or res.error.line >= 1
    assert tree(d) == {"trace.jsonl": len(data)}


# ---- FileStorage's read path ---------------------------------------------------------------------------
DIMS = (2, 3, 4)
PAGE = torch.arange(2 * 3 * 4 * 8, dtype=torch.uint8)
KEY = b"k_m_0_1"  # the key "k" with the store's suffix (model "m", TP rank 0 of 1)


def sidecar(key: bytes, fmt: bytes, page: bytes, plen: int, klen: int, flen: int) -> bytes:
    """A sidecar whose own checksum is right, with the given (possibly lying) fields."""
    return (
        file_mod._SIDECAR.pack(
            file_mod._MAGIC, zlib.crc32(page) & 0xFFFFFFFF, zlib.crc32(key + fmt) & 0xFFFFFFFF, plen, klen, flen
        )
        + key
        + fmt
    )


@st.composite
def stored_files(draw: st.DrawFn) -> dict[str, Any]:
    page = PAGE.numpy().tobytes()
    page_how = draw(st.sampled_from(["keep", "bytes", "flip", "truncate", "grow"]))
    if page_how == "bytes":
        page = draw(st.binary(max_size=400))
    elif page_how == "flip":
        i = draw(st.integers(0, len(page) - 1))
        page = page[:i] + bytes([page[i] ^ (1 << draw(st.integers(0, 7)))]) + page[i + 1 :]
    elif page_how == "truncate":
        page = page[: draw(st.integers(0, len(page)))]
    elif page_how == "grow":
        page = page + draw(st.binary(min_size=1, max_size=64))
    side_how = draw(st.sampled_from(["keep", "none", "bytes", "forged"]))
    forged = None
    if side_how == "bytes":
        forged = draw(st.binary(max_size=200))
    elif side_how == "forged":
        key = draw(st.sampled_from([KEY, b"other"]) | st.binary(max_size=12))
        fmt = draw(
            st.sampled_from(
                [
                    b"layout=layer_first;dims=2x3x4;dtype=uint8",
                    b"layout=page_first;dims=2x3x4;dtype=uint8",
                    b"layout=page_first",
                    b"layout=layer_first",
                    b"layout=layer_first;dims=9x9x9",
                ]
            )
            | st.binary(max_size=30)
        )
        plen = draw(st.sampled_from([len(page), len(page) + 1, 0, 2**63]) | st.integers(0, 2**64 - 1))
        forged = sidecar(
            key,
            fmt,
            page,
            plen,
            draw(st.sampled_from([len(key)]) | st.integers(0, 2**32 - 1)),
            draw(st.sampled_from([len(fmt)]) | st.integers(0, 2**32 - 1)),
        )
        forged = forged[: draw(st.integers(0, len(forged)))] if draw(st.booleans()) else forged
    return {
        "page": page,
        "side": side_how,
        "forged": forged,
        "layout": draw(st.sampled_from(["layer_first", "page_first"])),
        "known": draw(st.booleans()),
    }


# found by fuzzing: a page_first page whose sidecar vouches for a length that does not split into the page's
# dims made the reorder raise ValueError out of batch_get
SHORT_PAGE_FIRST = {
    "page": b"abc",
    "side": "forged",
    "layout": "page_first",
    "known": False,
    "forged": sidecar(KEY, b"layout=page_first;dims=2x3x4;dtype=uint8", b"abc", 3, len(KEY), 40),
}


@budget("storage")
@given(case=stored_files())
@example(case=SHORT_PAGE_FIRST)
def test_fuzz_file_storage_reads(tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]) -> None:
    d = tmp_path_factory.mktemp("l3")
    (d / "outside.txt").write_text("not the store's")
    store_dir = d / "store"
    writer = FileStorage(store_dir, model_name="m", layout=case["layout"], page_dims=DIMS, dtype=torch.uint8)
    assert writer.batch_set(["k"], [PAGE]) == [True]
    path = Path(writer.path_of("k"))
    side = Path(writer.sidecar_of(str(path)))
    path.write_bytes(case["page"])
    if case["side"] == "none":
        side.unlink()
    elif case["forged"] is not None:
        side.write_bytes(case["forged"])
    reader = FileStorage(
        store_dir,
        model_name="m",
        layout=case["layout"],
        page_dims=DIMS,
        dtype=torch.uint8,
        page_nbytes=PAGE.numel() if case["known"] else None,
    )
    with address_space_headroom():
        [got] = reader.batch_get(["k"])
        assert reader.batch_exists(["k"]) in (0, 1)
    if got is not None:  # returned: the bytes are the page's, vouched for by its sidecar or by its length
        assert got.dtype == torch.uint8 and got.numel() == len(case["page"])
        expected = torch.frombuffer(bytearray(case["page"]), dtype=torch.uint8) if case["page"] else got
        if case["layout"] == "layer_first":
            assert torch.equal(got, expected)
        assert case["side"] != "none" or len(case["page"]) == PAGE.numel()
    outside = tree(d)
    assert outside.pop("outside.txt") == len("not the store's")
    assert all(name.startswith("store/") for name in outside), outside
