"""The CI step of mutation testing (docs/mutation.md): a fixed, seeded sample of the mutants `make mutate`
runs, every one of them, must be killed at no lower a rate than the committed full run killed the same mutants.
Its fixed costs are the mutants' generation and mutmut's stats pass (about 100 s), which learns which tests call
which function. The stats of an unchanged workspace are committed (tests/mutation/sample_stats.json.xz) with the draw
they were collected with, so CI runs no stats pass and generates only the files of the drawn mutants, and
test_the_committed_stats_are_this_workspaces says when a change needs them collected again; the generated mutants are
kept per workspace digest outside the checkout (mutate.MUTANTS_CACHE), so a fresh clone of a workspace this machine
has sampled before restores them. The sample is drawn from the mutants the committed run killed or
has not seen: one it lists as a survivor can only raise the rate, so running it could never fail this test. No time box: the same mutants are checked on a slow or busy machine as on an
idle one; a hang guard on progress (tests/timing.py) stops a run that stopped moving, and mutmut stops a mutant
that spins.

The committed run (tests/mutation/survivors.json, written with docs/mutation.md) lists every mutant that
survived it; every other mutant it ran was killed. So the sample's expected kill rate is known mutant by
mutant, and a test, source or spec change that lets a mutant survive which the committed run killed (or a
new mutant survive that no one has looked at) lowers the rate and fails here; killing more raises it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from timing import run_watched

HERE = Path(__file__).resolve().parent
N, SEED = 20, 18  # 20 of the ~8,300 mutants (40 took 280 s of mutmut's two children on 2026-12-06, a slow day)


def _mutate() -> ModuleType:
    """tests/mutation/mutate.py, imported without leaving its folder on sys.path."""
    sys.path.insert(0, str(HERE))
    try:
        import mutate
    finally:
        sys.path.remove(str(HERE))
    return mutate


def test_sampled_mutants_are_killed_as_in_the_committed_run() -> None:
    try:
        import mutmut  # noqa: F401
    except ImportError:
        if os.environ.get("CI") or os.environ.get("KVFSM_REQUIRE_MUTMUT"):
            pytest.fail("mutmut is missing: `make test-deps` installs the `mutation` extra")
        pytest.skip("mutmut not installed (pip install -e '.[mutation]')")
    proc = run_watched(
        [sys.executable, str(HERE / "mutate.py"), "sample", "--n", str(N), "--seed", str(SEED)],
        f"mutate.py sample of {N} mutants",
    )
    lines = [l.strip() for l in proc.stdout.replace("\r", "\n").splitlines() if l.strip().startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1])
    assert out["checked"] == N, f"only {out['checked']} of the {N} sampled mutants were checked: {out}"
    assert out["kill_rate"] >= out["committed_kill_rate_on_sample"], (
        f"kill rate {out['kill_rate']:.1%} on the sample, the committed run killed {out['committed_kill_rate_on_sample']:.1%} "
        f"of the same mutants; survivors the committed run does not list: {out['new_survivors']} "
        "(kill them with a test, or run `make mutate` and explain them in tests/mutation/equivalent.py)"
    )


def test_refresh_brings_every_workspace_file_from_its_source() -> None:
    """`mutate.py refresh` compares each file layout() copies with its source: the generated machines come
    from generated/ (the wheel's layout, one source per workspace path), and only MUTATE's files are mutated
    (a changed file that is not is also copied into mutmut's tree, which mutmut fills only once)."""
    mutate = _mutate()
    pairs = mutate.workspace_files()
    paths = [rel for _, rel in pairs]
    assert len(paths) == len(set(paths))
    src = dict((rel, s) for s, rel in pairs)
    assert src["kvfsm/generated/decode_offload.py"] == mutate.ROOT / "generated" / "decode_offload.py"
    assert src["kvfsm/generated/__init__.py"] == mutate.ROOT / "generated" / "__init__.py"
    assert src["kvfsm/generated/spec/decode_offload.yaml"] == mutate.ROOT / "spec" / "decode_offload.yaml"
    assert all(t in src for t in mutate.TESTS) and "tests/conftest.py" not in src
    assert mutate.mutated("kvfsm/dataplane/copy/base.py") and mutate.mutated("kvfsm/generated/decode_offload.py")
    assert not mutate.mutated("kvfsm/dataplane/copy/cuda.py") and not mutate.mutated("kvfsm/runtime/__init__.py")
    assert not mutate.mutated("kvfsm/dataplane/storage/mooncake/store.py")
    assert not mutate.mutated("kvfsm/dataplane/storage/process.py") and mutate.mutated(
        "kvfsm/dataplane/storage/file.py"
    )


def test_the_main_report_keeps_the_other_scopes_sections(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The main run writes the whole of docs/mutation.md; every other scope's section (between its markers, which
    `mutate.py --scope NAME` writes) comes through it unchanged, and the main scope's constants stay its own."""
    mutate = _mutate()
    report = tmp_path / "mutation.md"
    monkeypatch.setattr(mutate, "REPORT", report)
    start, end = mutate.SCOPES["fences-adapter"].markers
    section = f"{start}\n## a scope\n\n* `f` #1 (survived): `a` → `b`: why\n{end}"
    report.write_text("# Mutation testing\n\nold main text\n\n" + section + "\n")
    assert (
        mutate.keep_scope_sections("# Mutation testing\n\nnew main text\n")
        == "# Mutation testing\n\nnew main text\n\n" + section + "\n"
    )
    report.write_text("# Mutation testing\n")
    assert mutate.keep_scope_sections("new\n") == "new\n"
    main = mutate.SCOPES["main"]
    assert (mutate.SCOPE, main.work, main.survivors) == (main, mutate.WORK, mutate.SURVIVORS)
    assert main.tests == mutate.TESTS and not main.functions and mutate.in_scope("anything")
    scope = mutate.SCOPES["fences-adapter"]
    assert scope.work != main.work and scope.survivors != main.survivors and scope.equivalent != main.equivalent
    assert (
        "tests/upstream/test_kills_adapter.py" in scope.tests
        and "tests/upstream/test_kills_adapter.py" not in main.tests
    )


def test_the_draw_passes_over_committed_survivors_and_keeps_its_size_and_seed() -> None:
    """The sample is the first N of a seeded shuffle that are not committed survivors: the same draw for the same
    names and seed, N names whenever N are left, none of them excluded, and the excluded counted."""
    mutate = _mutate()
    names = [f"m{i}" for i in range(200)]
    survivors = {f"m{i}" for i in range(0, 200, 3)}
    asked: list[str] = []

    def passed_over(name: str) -> bool:
        asked.append(name)
        return name in survivors

    pick, left_out = mutate.draw(names, 40, SEED, passed_over)
    assert len(pick) == 40 and not set(pick) & survivors and pick == sorted(pick)
    assert left_out == len(asked) - 40 == sum(a in survivors for a in asked) > 0  # only the names reached are asked
    assert (pick, left_out) == mutate.draw(list(reversed(names)), 40, SEED, lambda n: n in survivors)
    assert mutate.draw(names, 40, SEED + 1, lambda n: n in survivors)[0] != pick
    assert mutate.draw(names[:50], 40, SEED, lambda n: n in survivors)[0] == sorted(set(names[:50]) - survivors)


def test_the_committed_stats_are_this_workspaces() -> None:
    """The sample uses the committed stats only in a workspace with their digest (the package, the generated
    machines, the test subset, mutmut's configuration, the versions of Python, mutmut and what the tests run on);
    after a change to any of them, the sample runs mutmut's stats pass, which costs about 100 s of CI time and loses
    nothing. This keeps CI from paying it for a change made here: the files must be those the stats were collected
    over. A package released since (the test venv takes the newest within pyproject.toml's ranges) changes only the
    versions; the sample then collects its own stats, as it must, and this test says nothing against it."""
    mutate = _mutate()
    record = mutate.committed_record()
    assert record is not None and record.get("files_digest") == mutate.files_digest(), (
        "tests/mutation/sample_stats.json.xz was collected over other files: the package, the mutation test subset or "
        "mutmut's configuration changed since. Collect them again (about 4 minutes): "
        f"`.venv/bin/python tests/mutation/mutate.py sample --save-stats --n {N} --seed {SEED}`"
    )
    digest, stats = mutate.committed_stats()
    if record["versions"] == mutate.versions():
        assert digest == mutate.workspace_digest()
    assert stats is not None and len(stats["tests_by_mangled_function_name"]) > 100
    drawn = mutate.recorded_draw(digest, N, SEED)
    assert drawn is not None and len(drawn[0]) == N, (
        "tests/mutation/sample_stats.json.xz holds no draw of this sample against the committed survivors, so the "
        f"sample generates every mutant to draw: `.venv/bin/python tests/mutation/mutate.py sample --save-stats --n {N} "
        f"--seed {SEED}` records it"
    )


def test_a_recorded_draw_serves_only_its_workspace_size_seed_and_survivors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The picks a --save-stats run drew are reused, and only their files mutated, where a draw again would give
    them: the same digest, n, seed and committed survivors; a record without a draw is no draw."""
    import lzma

    mutate = _mutate()
    monkeypatch.setattr(mutate, "SAMPLE_STATS", tmp_path / "stats.json.xz")
    monkeypatch.setattr(mutate, "SURVIVORS", tmp_path / "survivors.json")
    mutate.SURVIVORS.write_text('{"survivors": []}')
    picks = [
        "kvfsm.runtime.manager.xǁDecodeOffloadManagerǁcheck_progress__mutmut_32",
        "kvfsm.generated.decode_offload.x_violated_invariants__mutmut_85",
    ]
    draw_of = {"n": 2, "seed": 7, "survivors": mutate.survivors_digest(), "picks": picks, "passed_over": 3}
    mutate.SAMPLE_STATS.write_bytes(lzma.compress(json.dumps({"digest": "d", "stats": {}, "draw": draw_of}).encode()))
    assert mutate.recorded_draw("d", 2, 7) == (picks, 3)
    assert mutate.recorded_draw("e", 2, 7) is None and mutate.recorded_draw("d", 3, 7) is None
    assert mutate.recorded_draw("d", 2, 8) is None
    mutate.SURVIVORS.write_text('{"survivors": [1]}')
    assert mutate.recorded_draw("d", 2, 7) is None
    mutate.SAMPLE_STATS.write_bytes(lzma.compress(json.dumps({"digest": "d", "stats": {}}).encode()))
    assert mutate.recorded_draw("d", 2, 7) is None
    assert mutate.files_of(picks) == ["kvfsm/generated/decode_offload.py", "kvfsm/runtime/manager.py"]
    assert all(mutate.mutated(f) for f in mutate.files_of(picks))
    with pytest.raises(ValueError, match="not a mutant name"):
        mutate.files_of(["kvfsm.runtime.manager"])
    narrowed = mutate.mutmut_config(mutate.TESTS, only=mutate.files_of(picks)).splitlines()
    differ = [line for line, full in zip(narrowed, mutate.mutmut_config(mutate.TESTS).splitlines()) if line != full]
    assert differ == ['only_mutate = ["kvfsm/generated/decode_offload.py", "kvfsm/runtime/manager.py"]']


def _with_fake_generation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """mutate.py with its workspace and cache under tmp_path, and generate() standing in for mutmut's: it writes
    the mutated file `m.py` ("generated by run N") where the workspace has none, as mutmut skips an unmodified one."""
    mutate = _mutate()
    monkeypatch.setattr(mutate, "WORK", tmp_path / "work")
    monkeypatch.setattr(mutate, "MUTANTS_CACHE", tmp_path / "cache")
    runs: list[int] = []

    def fake_generate(max_children: int) -> int:
        out = mutate.WORK / "mutants" / "kvfsm" / "m.py"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(f"generated by run {len(runs)}")
        runs.append(max_children)
        return 0

    monkeypatch.setattr(mutate, "generate", fake_generate)
    return mutate


def test_generated_mutants_are_reused_only_under_their_workspace_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """generate_cached keeps what generate() wrote under the workspace's digest and gives it back, newer than the
    workspace's sources (mutmut regenerates a file whose mutants are not), to a workspace with that digest only."""
    mutate = _with_fake_generation(tmp_path, monkeypatch)
    source = mutate.WORK / "kvfsm" / "m.py"
    source.parent.mkdir(parents=True)
    source.write_text("source")
    assert mutate.generate_cached(2, "a" * 64) == (0, "generated")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["a" * 64 + ".tar"]
    shutil.rmtree(mutate.WORK / "mutants")
    assert mutate.generate_cached(2, "a" * 64) == (0, "cached")
    restored = mutate.WORK / "mutants" / "kvfsm" / "m.py"
    assert restored.read_text() == "generated by run 0" and restored.stat().st_mtime > source.stat().st_mtime
    shutil.rmtree(mutate.WORK / "mutants")
    assert mutate.generate_cached(2, "b" * 64) == (0, "generated")  # another digest: generated, and kept alone
    assert (mutate.WORK / "mutants" / "kvfsm" / "m.py").read_text() == "generated by run 2"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["b" * 64 + ".tar"]


def test_a_cache_that_cannot_be_written_costs_only_the_next_generation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache that cannot be written (here a file where its folder would be) leaves this sample its mutants."""
    mutate = _with_fake_generation(tmp_path, monkeypatch)
    (tmp_path / "cache").write_text("a file where the cache folder would be")
    assert mutate.generate_cached(2, "c" * 64) == (0, "generated")
    assert (mutate.WORK / "mutants" / "kvfsm" / "m.py").read_text() == "generated by run 0"


@pytest.mark.parametrize("rel", ["kvfsm/runtime/effects.py", "kvfsm/runtime/__init__.py"])
def test_refresh_collects_mutmuts_stats_again_after_a_change_to_a_mutated_file(
    rel: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mutmut's stats gain only tests it has not seen, so a function new in a changed file would be run against none
    of the tests that were there before: after a change to a mutated file, refresh drops the stats and mutmut's
    stats pass runs again; after a change to another file they are kept."""
    mutate = _mutate()
    work = tmp_path / "work"
    stats = work / "mutants" / "mutmut-stats.json"
    conftest = (mutate.ROOT / "tests" / "conftest.py").read_text() + mutate.CONFTEST_ADDENDUM
    for base in (work, work / "mutants"):
        (base / "tests").mkdir(parents=True)
        (base / "tests" / "conftest.py").write_text(conftest)
    stats.write_text("{}")
    source = tmp_path / "source.py"
    source.write_text("x = 2\n")
    (work / rel).parent.mkdir(parents=True)
    (work / rel).write_text("x = 1\n")
    ran: list[bool] = []
    monkeypatch.setattr(mutate, "WORK", work)
    monkeypatch.setattr(mutate, "workspace_files", lambda: [(source, rel)])
    monkeypatch.setattr(mutate, "run_unchecked", lambda *a: ran.append(stats.exists()) or 0)
    monkeypatch.setattr(mutate, "write_report", lambda *a: {})
    monkeypatch.setattr(mutate, "results", lambda: [])
    monkeypatch.setattr(mutate, "save_verdicts", lambda *a: None)
    assert mutate.cmd_refresh(argparse.Namespace(max_children=1, budget=None)) == 0
    assert (work / rel).read_text() == "x = 2\n"
    assert ran == [not mutate.mutated(rel)] and mutate.mutated(rel) == (rel == "kvfsm/runtime/effects.py")
