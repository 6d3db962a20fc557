"""The rows machine's generator (kvfsm/codegen/rows.py): `kvfsm gen --check` covers its file, guards become
numpy expressions that agree with the spec's evaluator, and each event's action calls keep every
transition's own order."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, strategies as st
from typer.testing import CliRunner

from kvfsm.cli import app
from kvfsm.codegen import generate
from kvfsm.codegen.rows import action_calls, render_rows, rows_module_name, vector
from kvfsm.spec import expr as ex, load_spec
from kvfsm.spec.compiled import Transition

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "spec").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("spec_rel", SPECS)
def test_committed_rows_machine_is_what_the_spec_generates(spec_rel: str) -> None:
    spec = load_spec(spec_rel)
    committed = ROOT / "generated" / f"{rows_module_name(spec)}.py"
    assert render_rows(spec, spec_rel) == render_rows(load_spec(spec_rel), spec_rel)  # deterministic
    assert committed.read_text() == render_rows(spec, spec_rel), f"run `kvfsm gen {spec_rel}`"


def test_gen_check_fails_on_a_stale_or_missing_rows_machine(tmp_path: Path) -> None:
    spec_rel = "spec/decode_offload.yaml"
    out = tmp_path / "generated"
    shutil.copytree(ROOT / "generated", out)
    result = cli("gen", spec_rel, "--out", str(out), "--check")
    assert result.exit_code == 0, result.output
    assert f"{out / 'decode_offload_rows.py'}: up to date" in result.stdout
    target = out / "decode_offload_rows.py"
    modified = target.read_text().replace("t11,  # release_request", "t10 | t11,  # release_request")
    assert modified != target.read_text()
    target.write_text(modified)
    result = cli("gen", spec_rel, "--out", str(out), "--check")
    assert result.exit_code == 1
    assert f"{target} is stale" in result.stderr and "decode_offload.py is stale" not in result.stderr
    assert target.read_text() == modified, "--check must write nothing"
    target.unlink()
    assert cli("gen", spec_rel, "--out", str(out), "--check").exit_code == 1 and not target.exists()
    result = cli("gen", spec_rel, "--out", str(out))
    assert result.exit_code == 0 and f"{target}: written" in result.stdout
    assert f"{out / 'decode_offload.py'}: up to date" in result.stdout
    assert generate(spec_rel, out, check=True).stale == []


def test_a_counter_named_like_the_rows_machine_own_names_is_refused(tmp_path: Path) -> None:
    text = (ROOT / "spec" / "cb_swap.yaml").read_text()
    spec = tmp_path / "spec" / "cb_swap.yaml"
    spec.parent.mkdir()
    spec.write_text(re.sub(r"\bswap_ins\b", "capacity", text))
    result = cli("gen", str(spec), "--out", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    assert "counter or param 'capacity' clashes" in result.stderr
    assert not (tmp_path / "out" / "cb_swap_rows.py").exists()


# --- guards as numpy expressions --------------------------------------------------------------------------

NAMES = ("a", "b", "c")


def exprs() -> st.SearchStrategy[str]:
    term = st.one_of(st.sampled_from(NAMES), st.integers(0, 3).map(str))
    summ = st.lists(term, min_size=1, max_size=3).flatmap(
        lambda ts: st.lists(st.sampled_from(["+", "-"]), min_size=len(ts) - 1, max_size=len(ts) - 1).map(
            lambda ops: " ".join([ts[0]] + [f"{o} {t}" for o, t in zip(ops, ts[1:])])
        )
    )
    cmp = st.tuples(summ, st.sampled_from(["==", "!=", "<", "<=", ">", ">="]), summ).map(" ".join)
    atom = st.one_of(cmp, st.sampled_from(["true", "false", "1 == 1", "2 < 1"]))
    return st.recursive(
        atom,
        lambda inner: st.one_of(
            inner.map(lambda e: f"not ({e})"),
            st.tuples(inner, st.sampled_from(["and", "or"]), inner).map(lambda t: f"({t[0]}) {t[1]} ({t[2]})"),
        ),
        max_leaves=6,
    )


def _vector_eval(node: ex.Node, env: dict[str, np.ndarray]) -> np.ndarray:
    n = len(next(iter(env.values())))
    value = eval(vector(node), {"np": np}, dict(env))  # noqa: S307 - the generator's own output, under test
    return np.broadcast_to(np.asarray(value, bool), (n,))


@given(text=exprs(), values=st.lists(st.tuples(*(st.integers(-2, 4) for _ in NAMES)), min_size=1, max_size=8))
def test_vector_guard_agrees_with_the_evaluator(text: str, values: list[tuple[int, ...]]) -> None:
    node = ex.parse(text)
    env = {name: np.array([v[i] for v in values], np.int64) for i, name in enumerate(NAMES)}
    got = _vector_eval(node, env)
    want = [bool(ex.evaluate(node, dict(zip(NAMES, v)))) for v in values]
    assert got.tolist() == want, vector(node)


@pytest.mark.parametrize("spec_rel", SPECS)
def test_every_spec_guard_agrees_with_the_evaluator(spec_rel: str) -> None:
    spec = load_spec(spec_rel)
    names = (*spec.counters, *spec.params)
    grid = np.array(np.meshgrid(*[np.arange(-1, 4)] * len(names))).reshape(len(names), -1)
    env = {n: grid[i] for i, n in enumerate(names)}
    for g, node in spec.guards.items():
        want = [
            bool(ex.evaluate(node, {n: int(grid[i, k]) for i, n in enumerate(names)})) for k in range(grid.shape[1])
        ]
        assert _vector_eval(node, env).tolist() == want, g


# --- action calls -----------------------------------------------------------------------------------------


def _t(tid: int, actions: tuple[str, ...]) -> Transition:
    return Transition(
        id=tid,
        src="s",
        event="e",
        guard=None,
        dst="s",
        actions=actions,
        update=(),
        acquires=(),
        reads=(),
        releases=(),
        line=1,
        rule=tid,
    )


def test_action_calls_follow_the_spec_order_where_every_transition_agrees() -> None:
    spec = load_spec("spec/cb_swap.yaml")
    ts = [t for t in spec.transitions if t.event == "swap_out_done"]
    calls = action_calls(spec, ts)
    assert [a for a, _ in calls] == [
        "verify_swap_out",
        "free_host_blocks",
        "release_device_blocks",
        "verify_landed_swap_out",
    ]  # one call each: one order keeps every transition's
    for t in ts:
        assert [a for a, tids in calls if t.id in tids] == list(t.actions)


def test_action_calls_repeat_an_action_only_where_transitions_disagree() -> None:
    fake = SimpleNamespace(model=SimpleNamespace(actions={"a": None, "b": None, "c": None}))
    ts = [_t(0, ("a", "b")), _t(1, ("b", "a")), _t(2, ("c",)), _t(3, ("c", "a"))]
    calls = action_calls(fake, ts)  # type: ignore[arg-type]
    for t in ts:
        assert [a for a, tids in calls if t.id in tids] == list(t.actions)
    assert len(calls) == 4 and [a for a, _ in calls].count("a") == 2
