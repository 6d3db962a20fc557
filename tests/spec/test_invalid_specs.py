"""Every file in tests/specs/invalid/ carries one defect and names, on its first line, the error it must raise.

Header format: `# expect: <line> <substring of the message>`. The checker must report an error with exactly
that line and a message containing that substring (other errors caused by the same defect are allowed).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvfsm.cli import app
from kvfsm.spec import SpecInvalid, load_spec
from kvfsm.spec.checks import CHECKS, check_updates
from kvfsm.spec.compiled import build

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "tests" / "specs"
INVALID = sorted((SPECS / "invalid").glob("*.yaml"))
MINIMAL = SPECS / "valid" / "minimal.yaml"
SHIPPED = ROOT / "spec" / "decode_offload.yaml"
HEADER = re.compile(r"^# expect: (\d+) (.+)$")


def expectation(path: Path) -> tuple[int, str]:
    """The (line, substring) of a spec's `# expect:` header; read as bytes so non-UTF-8 files work too."""
    first = path.read_bytes().split(b"\n", 1)[0].decode("utf-8")
    m = HEADER.match(first)
    assert m, f"{path.name}: first line must be `# expect: <line> <substring>`, got {first!r}"
    return int(m.group(1)), m.group(2)


def errors_of(path: Path) -> list:
    try:
        load_spec(path)
    except SpecInvalid as exc:
        return exc.errors
    pytest.fail(f"{path.name} was accepted; it should be invalid")


def _params():
    for p in INVALID:
        yield pytest.param(p, id=p.stem)


@pytest.mark.parametrize("path", list(_params()))
def test_invalid_spec_reports_expected_error(path: Path) -> None:
    line, substring = expectation(path)
    errors = errors_of(path)
    assert errors, path.name
    for e in errors:  # every error is fully located
        assert e.file == str(path) and e.line >= 1 and e.element and e.message, e
    hits = [e for e in errors if e.line == line and substring in e.message]
    assert hits, f"{path.name}: no error at line {line} containing {substring!r}; got:\n" + "\n".join(
        str(e) for e in errors
    )


def test_invalid_set_is_large_and_distinct() -> None:
    assert len(INVALID) >= 24, f"only {len(INVALID)} invalid specs"
    digests = {}
    for p in INVALID:
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        assert digest not in digests, f"{p.name} is identical to {digests[digest]}"
        digests[digest] = p.name
    # each defect is a change to a valid spec, so no body equals one of the valid bases
    bases = {MINIMAL.read_bytes().split(b"\n", 2)[2], SHIPPED.read_bytes()}
    for p in INVALID:
        body = p.read_bytes().split(b"\n", 2)[2]  # drop `# expect:` and `# defect:`
        assert body not in bases, f"{p.name} has no defect"


def test_minimal_and_shipped_specs_are_valid() -> None:
    for path in (MINIMAL, SHIPPED):
        spec = load_spec(path)
        assert spec.transitions and spec.states


CLI_CASES = [
    "unknown_event.yaml",
    "nondeterministic.yaml",
    "malformed_yaml.yaml",
    "resource_leak.yaml",
    "shipped_update_of_another_action.yaml",
]


@pytest.mark.parametrize("name", CLI_CASES)
def test_cli_validate_exits_2_with_file_line(name: str) -> None:
    path = SPECS / "invalid" / name
    line, substring = expectation(path)
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert f"{path}:{line}: " in result.stderr
    assert substring in result.stderr
    for row in result.stderr.splitlines():  # one `file:line: element: message` per error
        assert re.match(rf"^{re.escape(str(path))}:\d+: [^:]+.*: .+", row), row
    assert result.stdout == ""


def test_cli_validate_accepts_minimal() -> None:
    result = CliRunner().invoke(app, ["validate", str(MINIMAL)])
    assert result.exit_code == 0, result.output
    assert "ok:" in result.stdout and result.stderr == ""


# --- counter updates tied to the actions and events that imply them --------------------

UPDATE_CASES = [
    "shipped_update_of_another_action",
    "shipped_implied_update_missing",
    "update_not_implied",
    "double_implied_update",
]


@pytest.mark.parametrize("name", UPDATE_CASES)
def test_counter_update_disagreeing_with_its_actions_is_rejected(name: str) -> None:
    """Each of these passes every other check (so `kvfsm validate` once accepted it, and only the stateful suite
    could notice); the update check rejects it at the transition's line, naming the counter and the action or
    event whose `implies` disagrees, with that declaration's line."""
    path = SPECS / "invalid" / f"{name}.yaml"
    spec = build(path)
    assert [e for check in CHECKS if check is not check_updates for e in check(spec)] == []
    line, substring = expectation(path)
    errors = check_updates(spec)
    assert errors and all(e.element.startswith("transitions[") for e in errors), errors
    assert any(e.line == line and substring in e.message for e in errors), "\n".join(map(str, errors))


def test_shipped_specs_declare_what_their_updates_imply() -> None:
    """Every counter update of the shipped specs has a cause: some action or event implies each counter's moves."""
    for path in sorted((ROOT / "spec").glob("*.yaml")):
        spec = load_spec(path)
        causes = {c for a in spec.model.actions.values() for c in a.implies} | {
            c for e in spec.model.events.values() for c in e.implies
        }
        updated = {c for t in spec.transitions for c, _ in t.update}
        assert updated and updated <= causes, path.name


# --- specs the checker once accepted by mistake: now each must be rejected ------------------------


def _minimal_with(tmp_path: Path, old: str, new: str) -> Path:
    text = MINIMAL.read_text()
    assert old in text
    out = tmp_path / "spec.yaml"
    out.write_text(text.replace(old, new, 1))
    return out


GAPS = {
    "duplicate_invariant_name": (
        "    expr: jobs >= 0\n",
        "    expr: jobs <= 1\n  - name: jobs_non_negative\n    doc: Same name, another invariant.\n    expr: jobs >= 0\n",
        "compiled.py build keys invariants by name, so a second invariant of the same name silently replaces the "
        "first, which is then never checked (here the non-inductive `jobs <= 1`)",
    ),
    "python_keyword_event": (
        "  stop:\n    doc: Stop the runner.\n",
        "  import:\n    doc: Stop the runner.\n",
        "model.py Name accepts Python keywords; an event `import` validates but `kvfsm gen` emits "
        "`def import(self, ...)`, a SyntaxError",
    ),
}


@pytest.mark.parametrize("case", sorted(GAPS))
def test_former_checker_gaps_are_rejected(case: str, tmp_path: Path) -> None:
    old, new, reason = GAPS[case]
    path = _minimal_with(tmp_path, old, new)
    if case == "python_keyword_event":
        path.write_text(path.read_text().replace("on: stop", "on: import").replace("on: [stop]", "on: [import]"))
    with pytest.raises(SpecInvalid):
        load_spec(path)
