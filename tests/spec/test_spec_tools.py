"""The spec tools on the shipped spec (validate, gen, diagram, docs) and the guard expression language."""

from __future__ import annotations

import builtins
import hashlib
import importlib.util
import itertools
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvfsm.cli import app
from kvfsm.codegen import generate, module_name, render
from kvfsm.spec import expr as ex, load_spec

ROOT = Path(__file__).resolve().parents[2]
SPEC_REL = "spec/decode_offload.yaml"
SPEC = ROOT / SPEC_REL
GENERATED = ROOT / "generated"


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # `kvfsm gen` stamps the spec path relative to the working directory, as `make test` runs it.
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="module")
def spec():
    return load_spec(SPEC)


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def _import_file(path: Path, name: str):
    mod_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module  # dataclasses/typing may look the module up while it executes
    try:
        mod_spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


# --- validate ---------------------------------------------------------------------------------------


def test_shipped_spec_validates(spec) -> None:
    result = cli("validate", SPEC_REL)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{SPEC_REL}: ok: {len(spec.states)} states")
    assert result.stderr == ""
    assert spec.sha256 == hashlib.sha256(SPEC.read_bytes()).hexdigest()


# --- gen ----------------------------------------------------------------------------------------------


def test_gen_check_passes_on_committed_output() -> None:
    result = cli("gen", SPEC_REL, "--check")
    assert result.exit_code == 0, result.output
    assert "up to date" in result.stdout


def test_gen_check_fails_on_modified_copy(tmp_path: Path, spec) -> None:
    out = tmp_path / "generated"
    shutil.copytree(GENERATED, out)
    assert cli("gen", SPEC_REL, "--out", str(out), "--check").exit_code == 0
    target = out / f"{module_name(spec)}.py"
    before = target.read_bytes()
    target.write_bytes(before.replace(b"SPEC_SHA256 = '", b"SPEC_SHA256 = 'x", 1))
    modified = target.read_bytes()
    result = cli("gen", SPEC_REL, "--out", str(out), "--check")
    assert result.exit_code == 1, result.output
    assert "stale" in result.stderr
    assert target.read_bytes() == modified, "--check must write nothing"
    target.unlink()  # a missing module is stale too
    assert cli("gen", SPEC_REL, "--out", str(out), "--check").exit_code == 1
    assert not target.exists()


def test_gen_is_deterministic_and_matches_committed(tmp_path: Path, spec) -> None:
    first, second = render(spec, SPEC_REL), render(load_spec(SPEC), SPEC_REL)
    assert first == second
    committed = (GENERATED / f"{module_name(spec)}.py").read_text()
    assert first == committed
    for out in (tmp_path / "a", tmp_path / "b"):
        result = generate(SPEC_REL, out)
        assert result.changed and result.path == out / "decode_offload.py"
        assert result.path.read_text() == committed
        assert generate(SPEC_REL, out).changed is False  # a second run finds it up to date
    assert (tmp_path / "a" / "decode_offload.py").read_bytes() == (tmp_path / "b" / "decode_offload.py").read_bytes()
    via_cli = tmp_path / "c"
    result = cli("gen", SPEC_REL, "--out", str(via_cli))
    assert result.exit_code == 0 and "written" in result.stdout, result.output
    assert (via_cli / "decode_offload.py").read_bytes() == (tmp_path / "a" / "decode_offload.py").read_bytes()


def test_generated_module_imports_and_is_stamped(tmp_path: Path, spec) -> None:
    sha = hashlib.sha256(SPEC.read_bytes()).hexdigest()
    generate(SPEC_REL, tmp_path)
    for i, path in enumerate((GENERATED / "decode_offload.py", tmp_path / "decode_offload.py")):
        mod = _import_file(path, f"_kvfsm_generated_under_test_{i}")
        assert mod.SPEC_SHA256 == sha
        assert mod.SPEC_PATH == SPEC_REL
        assert mod.STATES == spec.states and mod.EVENTS == spec.events and mod.COUNTERS == spec.counters
        assert len(mod.TRANSITIONS) == len(spec.transitions)

        class Effects:  # every action a no-op that records its name
            def __init__(self) -> None:
                self.calls: list[str] = []

            def __getattr__(self, name: str):
                return lambda m, arg: self.calls.append(name)

        fx = Effects()
        m = mod.DecodeOffloadMachine(fx)
        assert fx.calls == ["seed_hash_chain"] and mod.STATES[m.state] == spec.initial
        m.offload()
        m.copy_done()
        assert mod.STATES[m.state] == "inflight" and mod.violated_invariants(m) == []
        with pytest.raises(mod.EventRejected):
            m.copy_done()


# --- diagram and docs ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, marker", [("mermaid", "stateDiagram-v2"), ("dot", "digraph DecodeOffload")])
def test_diagram_names_every_state(fmt: str, marker: str, spec) -> None:
    result = cli("diagram", SPEC_REL, "--format", fmt)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert marker in text
    for s in spec.states:
        assert s in text, f"state {s!r} missing from the {fmt} diagram"
    for t in spec.transitions:
        assert t.event in text


def test_diagram_rejects_unknown_format() -> None:
    assert cli("diagram", SPEC_REL, "--format", "png").exit_code != 0


def test_docs_name_every_element(spec, tmp_path: Path) -> None:
    result = cli("docs", SPEC_REL)
    assert result.exit_code == 0, result.output
    text = result.stdout
    model = spec.model
    names = {
        "state": model.states,
        "event": model.events,
        "guard": model.guards,
        "action": model.actions,
        "counter": model.counters,
        "resource": model.resources,
        "invariant": [inv.name for inv in model.invariants],
    }
    for kind, pool in names.items():
        assert pool, kind
        for name in pool:
            assert f"`{name}`" in text, f"{kind} {name!r} missing from the docs"
    assert spec.sha256 in text
    out = tmp_path / "docs" / "spec.md"
    assert cli("docs", SPEC_REL, "--out", str(out)).exit_code == 0
    assert out.read_text() == text


def test_tools_exit_2_on_invalid_spec() -> None:
    bad = "tests/specs/invalid/unknown_event.yaml"
    line = int((ROOT / bad).read_text().split(maxsplit=3)[2])  # its `# expect: <line> ...` header
    for args in (["diagram", bad], ["docs", bad], ["gen", bad, "--check"]):
        result = cli(*args)
        assert result.exit_code == 2, (args, result.output)
        assert f"{bad}:{line}: " in result.stderr


# --- the expression language -----------------------------------------------------------------------

ROUND_TRIP = [
    "a > 1",
    "a == 0 and b + c == 0",
    "a >= 1 and b + c > 1",
    "a - b + 3 >= c",
    "a > 1 or b < 2 and not c == 0",
    "not (a > 1 or b > 1)",
    "(a > 1 or b > 1) and c != 1",
    "not not a <= 1",
    "a < b or b < c or c < a",
]
VALUATIONS = [dict(zip("abc", v)) for v in itertools.product(range(4), repeat=3)]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_parse_render_round_trip(text: str) -> None:
    node = ex.parse(text)
    rendered = ex.render(node)
    assert ex.parse(rendered) == node
    assert ex.render(ex.parse(rendered)) == rendered  # render is a fixed point after one pass
    for env in VALUATIONS:  # the rendering means the same, in our language and in Python
        assert ex.evaluate(ex.parse(rendered), env) == ex.evaluate(node, env)
        assert eval(ex.render(node, lambda n: f"env[{n!r}]"), {"env": env}) == ex.evaluate(node, env)  # noqa: S307


def test_render_maps_counter_names() -> None:
    assert (
        ex.render(ex.parse("copies > 1 and parked + backups == 0"), lambda n: f"self.{n}")
        == "self.copies > 1 and self.parked + self.backups == 0"
    )


def test_constants_render_as_python() -> None:
    # `true`/`false` render in Python spelling (the generator's target), which the language itself does not read.
    assert ex.evaluate(ex.parse("true"), {}) is True and ex.evaluate(ex.parse("not true"), {}) is False
    assert ex.render(ex.parse("true or false")) == "True or False"


def test_precedence_not_and_or() -> None:
    # not binds tighter than and, and tighter than or
    assert ex.parse("not a > 1 and b > 1") == ex.parse("(not a > 1) and b > 1")
    assert ex.parse("a > 1 or b > 1 and c > 1") == ex.parse("a > 1 or (b > 1 and c > 1)")
    assert ex.parse("a > 1 and b > 1 or c > 1") == ex.parse("(a > 1 and b > 1) or c > 1")
    assert ex.parse("not a > 1 or b > 1") == ex.parse("(not a > 1) or b > 1")
    assert ex.parse("a > 1 or b > 1 and c > 1") != ex.parse("(a > 1 or b > 1) and c > 1")
    # and the evaluation follows
    env = {"a": 2, "b": 0, "c": 0}
    assert ex.evaluate(ex.parse("a > 1 or b > 1 and c > 1"), env) is True
    assert ex.evaluate(ex.parse("(a > 1 or b > 1) and c > 1"), env) is False
    assert ex.evaluate(ex.parse("not a > 1 and b > 1"), {"a": 0, "b": 2}) is True
    assert ex.evaluate(ex.parse("not (a > 1 and b > 1)"), {"a": 2, "b": 0}) is True
    # subtraction is left-associative
    assert ex.evaluate(ex.parse("a - b - c == 1"), {"a": 5, "b": 3, "c": 1}) is True


def test_names_and_literals() -> None:
    node = ex.parse("copies > 1 and parked + backups >= 12 or not copies == 3")
    assert ex.names(node) == {"copies", "parked", "backups"}
    assert ex.literals(node) == {1, 12, 3}
    assert ex.names(ex.parse("true")) == set()


@pytest.mark.parametrize(
    "text, column, fragment",
    [
        ("", 1, "expected a counter or an integer"),
        ("a >", 4, "found 'end of expression'"),
        ("a", 2, "expected a comparison"),
        ("a = 1", 3, "unexpected character '='"),
        ("a > 1 )", 7, "unexpected ')'"),
        ("(a > 1", 7, "expected ')'"),
        ("a > -1", 5, "found '-'"),
        ("a > 1 and", 10, "expected a counter or an integer"),
        ("a ** 2 > 1", 3, "unexpected character '*'"),
        ("a > 1 if a else 0", 7, "unexpected 'if'"),
        ("   b >= x.y", 10, "unexpected character '.'"),
        ("a > 1; b > 1", 6, "unexpected character ';'"),
        ("and > 1", 1, "found 'and'"),
    ],
)
def test_errors_carry_columns(text: str, column: int, fragment: str) -> None:
    with pytest.raises(ex.ExprError) as info:
        ex.parse(text)
    assert info.value.column == column
    assert fragment in str(info.value) and f"(column {column})" in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "__import__('os')",
        "eval('1') > 0",
        "abs(a) > 1",
        "open('/etc/passwd') == 0",
        "a.__class__ == 1",
        "[a] > 1",
        "lambda: 1",
        "a > 1 if True else 0",
    ],
)
def test_never_evaluates_python(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("the expression language must never call eval/exec/compile/__import__")

    for name in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, name, forbidden)
    with pytest.raises(ex.ExprError):
        ex.parse(text)


def test_dunder_name_is_only_a_counter_name(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, name, lambda *a, **k: pytest.fail("eval-like call"))
    node = ex.parse("__import__ > 1")
    assert ex.names(node) == {"__import__"}
    assert ex.evaluate(node, {"__import__": 2}) is True
    with pytest.raises(KeyError):  # an unknown name is looked up in the valuation, never in Python's namespace
        ex.evaluate(node, {})
