"""Mutation testing of the runtime, the data plane and the generated machine, with mutmut (docs/mutation.md).

    .venv/bin/python tests/mutation/mutate.py run [--max-children 2]   # `make mutate`: every mutant, then the report
    .venv/bin/python tests/mutation/mutate.py report                   # rewrite docs/mutation.md from the last run
    .venv/bin/python tests/mutation/mutate.py rerun                    # the last run's survivors, after adding tests
    .venv/bin/python tests/mutation/mutate.py refresh                  # after a change: the changed functions' mutants
    .venv/bin/python tests/mutation/mutate.py sample [--n 20 --seed 18 --budget S]     # the CI sample
    .venv/bin/python tests/mutation/mutate.py --scope fences-adapter run               # another scope (SCOPES)

mutmut never touches the checkout: this script lays out a workspace in build/mutation/ (the mutated files,
the rest of the package unmutated, the fast test subset, and a pyproject.toml holding mutmut's
configuration), and mutmut writes its mutated copy under build/mutation/mutants/ and runs the tests there.
A survivor of the full run is either killed by a test added to tests/mutation/test_kills.py (`rerun` then
runs the survivors again) or listed, with the reason it is equivalent, in tests/mutation/equivalent.py; the
report marks the rest unexplained. The report's survivors (tests/mutation/survivors.json) are what
tests/mutation/test_mutation_sample.py holds a seeded sample of mutants to. Each run, rerun and refresh also
writes tests/mutation/verdicts.json.xz (every mutant's exit code, every function's hash): a checkout without the
workspace (a fresh clone, a new session) runs `refresh` from it, and mutmut keeps the verdicts of the functions
whose hash did not change.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import filecmp
import fnmatch
import hashlib
import importlib
import json
import lzma
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "build" / "mutation"  # the full run's workspace (the CI sample uses build/mutation-sample/)
REPORT = ROOT / "docs" / "mutation.md"
SURVIVORS = Path(__file__).resolve().parent / "survivors.json"  # the full run's survivors, machine-readable
# mutmut's stats (which test calls which mutated function) for the CI sample's workspace, with the digest of the
# workspace they were collected in (sample_stats, below)
SAMPLE_STATS = Path(__file__).resolve().parent / "sample_stats.json.xz"
PY = sys.executable

# What is mutated: the runtime, the data plane's pools, copy planning, storage (not Mooncake) and hashing,
# and the generated decode-offload machine (fnmatch patterns: `*` also crosses `/`).
# The generated machines are laid out as the wheel installs them (kvfsm/generated/), so the module mutmut
# mutates has the name the runtime imports: kvfsm/generated/decode_offload.py is generated/decode_offload.py.
MUTATE = [
    "kvfsm/runtime/*.py",
    "kvfsm/dataplane/pools/*.py",
    "kvfsm/dataplane/copy/base.py",
    "kvfsm/dataplane/storage/*.py",
    "kvfsm/dataplane/hashing.py",
    "kvfsm/generated/decode_offload.py",
]
# ProcessStorage is left out: half of it runs in the store's child process, where mutmut's record of which
# test calls what cannot see it (every mutant of that half reads "no tests"), and every test of the other half
# starts a child (about a second each, per mutant). tests/dataplane/test_process_storage.py tests it by
# failure injection instead: a store that raises, a child killed, hung or unable to build its store, a parent
# that dies; the pool it maps (pools/shared_memory.py) stays in scope. The store processes' fork server
# (storage/fork_server.py) is left out for the same two reasons: its server loop runs in its own interpreter,
# which imports the unmutated module (every mutant of it survives whatever the tests do), and each test of its
# parent's side starts that interpreter; test_process_storage.py tests both sides (one server for every store
# process, a server killed or sent a request without a descriptor, the server off).
DO_NOT_MUTATE = [
    "kvfsm/dataplane/storage/mooncake/*",
    "kvfsm/dataplane/storage/process.py",
    "kvfsm/dataplane/storage/fork_server.py",
    "*/__init__.py",
]

# Lines whose statements are not mutated: what they change is wording for people, not behaviour (the text of
# a raised error or a log line, a repr). The tests pin down that the error is raised, its type, and where a
# message is an interface (a config error naming its field), what it names; mutating every word of it would
# bury the survivors that matter under hundreds that do not.
NOT_BEHAVIOUR = [
    r"^\s*raise \w+(\.\w+)*\(",
    r"\blogger\.(debug|info|warning|error|exception)\(",
    r"\bwarnings\.warn\(",
    r"^\s*def __repr__\(",
]

# The fast subset the mutants run against: about 15 s in all on 2 cores; mutmut runs, for each mutant,
# only the tests of this subset that call the mutated function (its first, clean run records which).
TESTS = [
    "tests/dataplane/test_allocator.py",
    "tests/dataplane/test_host_pool.py",
    "tests/dataplane/test_req_to_token.py",
    "tests/dataplane/test_hashing.py",
    "tests/dataplane/test_storage.py",
    "tests/dataplane/test_copy_engine.py",
    "tests/runtime/test_scenarios.py",
    "tests/runtime/test_backup_worker.py",
    "tests/runtime/test_stored_index.py",
    "tests/runtime/test_offload_batch.py",
    "tests/runtime/test_config_errors.py",
    "tests/runtime/test_first_use_traps.py",
    "tests/reference/test_differential.py",
    "tests/dataplane/test_layer_pool.py",
    "tests/runtime/test_device_table.py",
    "tests/dataplane/test_fences.py",
    "tests/runtime/test_fenced_release.py",
    "tests/dataplane/test_hashing_refusals.py",
    "tests/mutation/test_kills.py",
    "tests/mutation/test_kills_storage.py",
    "tests/mutation/test_kills_dataplane.py",
    "tests/mutation/test_kills_runtime.py",
    "tests/mutation/test_kills_fenced.py",
    "tests/mutation/test_kills_generated.py",
    "tests/mutation/test_kills_manager.py",
    "tests/mutation/test_kills_store_hash.py",
    "tests/mutation/test_kills_config.py",
    "tests/mutation/test_kills_shared_pool.py",
    "tests/runtime/test_fault_breadth.py",
    "tests/dataplane/test_sharded_storage.py",
    # last: in mutmut's stats pass (every test in one process) it segfaulted mutmut when it ran before the
    # files after it (reproduced 2026-12-01, not understood); the pass order does not change what is killed
    "tests/runtime/test_batch_events.py",
]
# Left out of the subset: the test that starts a real Mooncake master (2 s, and a mutant stopped mid-test
# leaves its master running), all but the first 60 seeds of the random batch-vs-loop test (the other 270 were left out
# when each case loaded the spec, 3 s per mutant of the generated machine; they now cost milliseconds, but the
# committed full run was made without them, so they come back with the next `make mutate`;
# tests/mutation/test_kills.py runs every pair of states), and
# the per-transition batch test (its search runs once per process; the committed run predates it).
DESELECT = (
    ["tests/runtime/test_config_errors.py::test_a_manager_built_from_a_mooncake_config_stores_and_reads_back"]
    + [
        f"tests/runtime/test_batch_events.py::test_batch_equals_loop_of_single_events[{seed}]"
        for seed in range(60, 330)
    ]
    + ["tests/runtime/test_batch_events.py::test_every_transition_in_a_batch_equals_the_loop"]
)
# Files the subset imports besides its test files (copied as they are).
SUPPORT = [
    "tests/conftest.py",
    "tests/catalog_faults.py",
    "tests/timing.py",
    "tests/copy_spy.py",
    "tests/dataplane/__init__.py",
    "tests/dataplane/conftest.py",
    "tests/dataplane/helpers.py",
    "tests/dataplane/stream_sim.py",
]
# Hypothesis runs derandomized in the workspace, so a mutant's verdict does not depend on luck.
CONFTEST_ADDENDUM = """

# --- added by tests/mutation/mutate.py: deterministic examples for mutation runs ---
settings.register_profile("mutation", parent=settings.get_profile("ci"), derandomize=True, database=None)
settings.load_profile("mutation")
"""


# --- scopes ------------------------------------------------------------------------------------------------
# The constants above are the main scope's (`make mutate`). Another scope mutates code the main run has not
# covered yet and reports its score apart: its own workspace, test subset, interpreter, survivors file and
# reasons, and its own section of docs/mutation.md. `--scope NAME` rebinds the module's scope constants
# (use_scope) before a command runs, so every command works on any scope.


@dataclass(frozen=True)
class Scope:
    name: str
    mutate: list[str]
    tests: list[str]
    support: list[str]
    deselect: list[str] = field(default_factory=list)
    do_not_mutate: list[str] = field(default_factory=lambda: list(DO_NOT_MUTATE))
    # fnmatch patterns over mutmut's names (`module.function*`): only these functions' mutants are run and
    # counted (none: every mutant of the mutated files); a pattern matches the function's name as well, which
    # is how mutmut finds the tests that call it
    functions: list[str] = field(default_factory=list)
    python: str = PY  # the interpreter mutmut runs under (its venv holds what the tests import)
    equivalent: str = "equivalent"  # the module whose EQUIVALENT (and NEEDS_GPU_PASS) explain the survivors
    title: str = ""  # the heading of its section of docs/mutation.md (the main scope has the whole page)
    doc: str = ""

    def mutates(self, rel: str) -> bool:
        """Whether this scope mutates the file at `rel` (a path from the repository root)."""
        return any(fnmatch.fnmatch(rel, p) for p in self.mutate) and not any(
            fnmatch.fnmatch(rel, p) for p in self.do_not_mutate
        )

    @property
    def work(self) -> Path:
        return ROOT / "build" / ("mutation" if self.name == "main" else f"mutation-{self.name}")

    @property
    def survivors(self) -> Path:
        here = Path(__file__).resolve().parent
        return here / ("survivors.json" if self.name == "main" else f"survivors_{self.name.replace('-', '_')}.json")

    @property
    def verdicts(self) -> Path:
        """The record of every mutant's verdict and every function's hash (`save_verdicts`), committed beside
        the survivors, from which `refresh` rebuilds a workspace that a fresh checkout does not have."""
        return self.survivors.with_name(self.survivors.stem.replace("survivors", "verdicts") + ".json.xz")

    @property
    def markers(self) -> tuple[str, str]:
        return f"<!-- mutation-scope {self.name} -->", f"<!-- /mutation-scope {self.name} -->"


_UPSTREAM = "tests/upstream"
_SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
_LEDGER = "kvfsm.runtime.ledger.x\u01c1SlotLedger\u01c1"

FENCES_ADAPTER_DOC = """
The fences of released device slots (`kvfsm/dataplane/fences.py`: `SlotFence`, `SlotFence.join`,
`wait_fences`), the slot ledger's functions that take or check fences and waits (`release_device`,
`release_owned`, `_covering`, `_needs`, `_landed`, `device_write`, `copy_completed` in
`kvfsm/runtime/ledger.py`; its other functions are the main scope's), the coalescing copy engine
(`kvfsm/dataplane/copy/coalescing.py`) and the SGLang drop-in adapter (`kvfsm/integrations/sglang/`:
`manager.py`, `objects.py`, `pool.py`, `settings.py`). mutmut does not mutate properties (nor any function
with a decorator other than `staticmethod` and `classmethod`), so `RequestView`'s fields and the engine's
`fences` and `queued` are not mutated.

- run: `.venv/bin/python tests/mutation/mutate.py --scope fences-adapter run --max-children 2` (every
  command takes `--scope`); the workspace is `build/mutation-fences-adapter/`, and mutmut runs under
  `.venv-sglang` (the adapter's tests import SGLang 0.5.23; that venv needs mutmut: `.venv-sglang/bin/pip
  install 'mutmut>=3.8,<3.9'`, the `mutation` extra's pin);
- the tests (`SCOPES["fences-adapter"].tests`): the fence, fence-wait, fenced-release and copy-engine tests
  (the deferred CPU engine records every stream wait made on its handles, so a wait skipped or only marked
  is seen on a CPU), the adapter's tests in tests/upstream/ against the real SGLang objects (its GPU test
  excepted), the differential test of the adapter against upstream's manager (its single-rank scenarios),
  tests/mutation/test_kills_fenced.py, and the tests written to kill survivors of this scope:
  tests/mutation/test_kills_fences_adapter.py (no SGLang needed: CI's main run has them) and
  tests/upstream/test_kills_adapter.py (over SGLang's objects: `make test-upstream` runs them), and the frees by
  page id through SGLang's paged allocator (tests/upstream/test_adapter_page_frees.py). The
  scenarios with two TP ranks (a process per rank, 20 to 50 s each) and the test that profiles the early
  exit call by call (mutmut's trampolines are calls too) are left out;
- survivors: tests/mutation/survivors_fences_adapter.json; reasons: tests/mutation/equivalent_fences_adapter.py,
  which keeps two lists apart: `EQUIVALENT` (no test can tell the mutant from the original, and why) and
  `NEEDS_GPU_PASS` (the mutant survives this CPU run because only a CUDA device shows the difference: it is
  not equivalent: tests/mutation/gpu_pass.py runs them with the main run's, and each line below ends with
  its verdict);
- the CI sample (tests/mutation/test_mutation_sample.py) does not cover this scope: its mutmut stats pass
  alone runs the scope's whole subset under `.venv-sglang`, far more than the sample's budget in `make test`.
"""


def _main_scope() -> Scope:
    return Scope("main", MUTATE, TESTS, SUPPORT, DESELECT)


SCOPES: dict[str, Scope] = {
    s.name: s
    for s in [
        _main_scope(),
        Scope(
            "fences-adapter",
            mutate=[
                "kvfsm/dataplane/fences.py",
                "kvfsm/runtime/ledger.py",
                "kvfsm/dataplane/copy/coalescing.py",
                "kvfsm/integrations/sglang/*.py",
            ],
            functions=["kvfsm.dataplane.fences.*", "kvfsm.dataplane.copy.coalescing.*", "kvfsm.integrations.sglang.*"]
            + [
                _LEDGER + f + "*"
                for f in (
                    "release_device",
                    "release_owned",
                    "_covering",
                    "_needs",
                    "_landed",
                    "device_write",
                    "copy_completed",
                )
            ],
            tests=[
                "tests/dataplane/test_fences.py",
                "tests/dataplane/test_fence_waits.py",
                "tests/runtime/test_fenced_release.py",
                "tests/dataplane/test_copy_engine.py",
                f"{_UPSTREAM}/test_adapter_pool.py",
                f"{_UPSTREAM}/test_adapter_config.py",
                f"{_UPSTREAM}/test_adapter_batch.py",
                f"{_UPSTREAM}/test_adapter_retraction.py",
                f"{_UPSTREAM}/test_differential.py",
                "tests/mutation/test_kills_fenced.py",
                "tests/mutation/test_kills_fences_adapter.py",
                f"{_UPSTREAM}/test_kills_adapter.py",
                f"{_UPSTREAM}/test_adapter_page_frees.py",
            ],
            # the scenarios with two TP ranks spawn a process per rank (20 to 50 s each; test_summary runs them all)
            deselect=[
                f"{_UPSTREAM}/test_adapter_batch.py::test_batched_submission_is_invisible_to_sglang[tp2]",
                f"{_UPSTREAM}/test_differential.py::test_adapter_matches_upstream[tp2]",
                f"{_UPSTREAM}/test_differential.py::test_adapter_reading_slots_on_the_device_matches_upstream[tp2]",
                f"{_UPSTREAM}/test_differential.py::test_tp_ranks_with_different_host_pools_are_refused",
                f"{_UPSTREAM}/test_differential.py::test_summary",
                # it traces every call the early exit makes (sys.setprofile), and mutmut's trampolines are calls
                f"{_UPSTREAM}/test_adapter_batch.py::test_a_call_with_no_chunk_due_makes_no_call_at_all",
            ],
            support=SUPPORT
            + [
                f"{_UPSTREAM}/{f}"
                for f in (
                    "conftest.py",
                    "harness.py",
                    "scenarios.py",
                    "cuda_only/__init__.py",
                    "cuda_only/jit_cache.py",
                    "cuda_only/torchvision_stub.py",
                )
            ],
            python=str(_SGLANG_PY),
            equivalent="equivalent_fences_adapter",
            title="Scope `fences-adapter`: fences, the coalescing copy engine and the SGLang adapter",
            doc=FENCES_ADAPTER_DOC,
        ),
    ]
}
SCOPE = SCOPES["main"]


def use_scope(name: str) -> None:
    """Point the module's scope constants (what layout(), mutmut() and the report read) at scope `name`."""
    global SCOPE, WORK, SURVIVORS, PY, MUTATE, DO_NOT_MUTATE, TESTS, DESELECT, SUPPORT
    SCOPE = SCOPES[name]
    if not Path(SCOPE.python).exists():
        raise SystemExit(
            f"scope {name} runs under {SCOPE.python}, which does not exist (`make upstream-venv` builds "
            "it; then install mutmut there)"
        )
    WORK, SURVIVORS, PY = SCOPE.work, SCOPE.survivors, SCOPE.python
    MUTATE, DO_NOT_MUTATE, TESTS, DESELECT, SUPPORT = (
        SCOPE.mutate,
        SCOPE.do_not_mutate,
        SCOPE.tests,
        SCOPE.deselect,
        SCOPE.support,
    )


def in_scope(name: str) -> bool:
    """Whether the mutant (or function) `name` is one the current scope runs and counts."""
    return not SCOPE.functions or any(fnmatch.fnmatch(name, p) for p in SCOPE.functions)


def run_unchecked(max_children: int, budget: float | None) -> int:
    """mutmut over the mutants without a verdict (after a change: those of the functions it changed). In a
    scope that runs only some functions of its files, the mutants are generated first and the unchecked ones
    of those functions named, keeping every other verdict (mutmut clears them in a named run)."""
    if not SCOPE.functions:
        return mutmut("run", "--max-children", str(max_children), timeout=budget)
    generate(max_children)
    names = [m.name for m in results() if m.status == "not checked"]
    if not names:
        return 0
    verdicts = exit_codes()
    rc = mutmut("run", "--max-children", str(max_children), *names, timeout=budget)
    restore_exit_codes(verdicts, keep=set(names))
    return rc


def mutmut_config(tests: list[str], only: list[str] | None = None) -> str:
    """mutmut's configuration; `only` narrows the files it mutates (the sample's recorded picks' files)."""

    def toml_list(items: list[str]) -> str:
        return "[" + ", ".join(json.dumps(i) for i in items) + "]"

    return "\n".join(
        [
            "# Written by tests/mutation/mutate.py; mutmut reads its configuration from here.",
            "[tool.mutmut]",
            'source_paths = ["kvfsm"]',
            f"only_mutate = {toml_list(only or MUTATE)}",
            f"do_not_mutate = {toml_list(DO_NOT_MUTATE)}",
            'also_copy = ["spec"]',
            f"pytest_add_cli_args_test_selection = {toml_list(tests)}",
            "pytest_add_cli_args = "
            + toml_list(
                ["-p", "no:cacheprovider", "-p", "no:randomly", "-q", "-x"]
                + [a for d in DESELECT for a in ("--deselect", d)]
            ),
            f"do_not_mutate_patterns = {toml_list(NOT_BEHAVIOUR)}",
            "use_git_change_detection = false",
            "track_dependencies = false",
            "use_setproctitle = false",
            # a mutant that spins is stopped after 2 x (its tests' clean time + 2 s) of CPU (mutmut doubles the multiplier),
            # not mutmut's 30 x: the CI sample's one spinning mutant (check_progress__mutmut_32) took 44 s of CPU at 4 x
            "timeout_multiplier = 1.0",
            "timeout_constant = 2.0",
            "",
            "[tool.pytest.ini_options]",
            'testpaths = ["tests"]',
            'markers = ["gpu: needs a CUDA device", "slow: long-running"]',
            "",
        ]
    )


def layout() -> None:
    """A fresh workspace: the package, the generated machines and specs, the test subset, the configuration."""
    if WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for top in ("kvfsm", "spec"):
        shutil.copytree(ROOT / top, WORK / top, ignore=ignore)
    gen = WORK / "kvfsm" / "generated"  # the wheel's layout: the machines in the package, the specs beside them
    for f in (ROOT / "generated").glob("*.py"):
        shutil.copy2(f, gen / f.name)
    shutil.copytree(ROOT / "spec", gen / "spec")
    for rel in TESTS + SUPPORT:
        (WORK / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, WORK / rel)
    conftest = WORK / "tests" / "conftest.py"
    conftest.write_text(conftest.read_text() + CONFTEST_ADDENDUM)
    (WORK / "pyproject.toml").write_text(mutmut_config(TESTS))


GENERATE = """
import sys
from pathlib import Path
import mutmut.__main__ as mm
mm.set_mutant_under_test("mutant_generation")
Path("mutants").mkdir(exist_ok=True)
mm.copy_src_dir(); mm.copy_also_copy_files(); mm.setup_source_paths(); mm.store_lines_covered_by_tests()
mm.create_mutants(int(sys.argv[1]))
"""


# The CI sample's `mutmut run`, without mutmut's clean run and forced-fail run (together about 35 s of the sample's
# 125-160 s here; the clean run of the sampled mutants' tests alone took 60 s on 2026-12-06, a slow day). Neither
# can let a mutant pass for killed. The clean run guards against a workspace whose tests fail unmutated, which
# would count every mutant killed: mutmut's stats pass runs every test of the subset unmutated and stops mutmut on
# a failure, and committed stats (SAMPLE_STATS) are used only in a workspace and environment with the digest of
# the one whose stats pass succeeded (the workspace runs hypothesis derandomized). A mutation that stopped taking
# effect lets the sampled mutants survive, which fails the sample. The full run (`run`, `rerun`, `refresh`) keeps
# both.
# In the clean run's place, a collection of the subset (mutmut's own warm-up, as its fork-server mode runs it): the
# clean run was what imported torch, the conftest, the test modules and the mutated package into the process every
# mutant's child is forked from, and without it each child imported them itself. What it saves: the sample's 20
# mutants took 158 s of CPU without it and 142 s with it, 106 -> 84 s alone (cached mutants, committed stats, 2026-12-06).
SAMPLE_RUN = """
import sys
import mutmut.__main__ as mm
mm.run_forced_fail_test = lambda runner: None
_runner = mm.get_mutant_runner
def runner(*args, **kwargs):
    r = _runner(*args, **kwargs)
    r.run_clean_tests = lambda tests: (r.test_runner.warm_up(), 0)[1]
    return r
mm.get_mutant_runner = runner
sys.exit(mm.cli())
"""


def generate(max_children: int) -> int:
    """Write the mutants (and their .meta files) without running any test."""
    return mutmut_python(GENERATE, str(max_children))


def mutmut_python(code: str, *args: str, timeout: float | None = None) -> int:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    try:
        return subprocess.run([PY, "-c", code, *args], cwd=WORK, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return 124


def mutmut(*args: str, timeout: float | None = None) -> int:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    cmd = [PY, "-c", "import sys; from mutmut.__main__ import cli; sys.exit(cli())", *args]
    try:
        return subprocess.run(cmd, cwd=WORK, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return 124


# --- results ---------------------------------------------------------------------------------------------

STATUS = {
    1: "killed",
    3: "killed",
    0: "survived",
    5: "no tests",
    33: "no tests",
    34: "skipped",
    36: "timeout",
    -24: "timeout",
    24: "timeout",
    152: "timeout",
    255: "timeout",
    -11: "segfault",
    -9: "segfault",
}
KILLED = {"killed", "timeout", "segfault"}  # a mutant that hangs or crashes the tests is caught too


@dataclass
class Mutant:
    name: str
    path: str
    status: str

    @property
    def function(self) -> str:
        return self.name.rsplit("__mutmut_", 1)[0]


def results() -> list[Mutant]:
    out = []
    for meta in sorted((WORK / "mutants").rglob("*.py.meta")):
        path = str(meta.relative_to(WORK / "mutants"))[: -len(".meta")]
        data = json.loads(meta.read_text())
        for name, code in sorted(data.get("exit_code_by_key", {}).items()):
            if not in_scope(name):
                continue
            out.append(Mutant(name, path, "not checked" if code is None else STATUS.get(code, "suspicious")))
    return out


def exit_codes() -> dict[Path, dict[str, int | None]]:
    """Every mutant's recorded exit code, per meta file."""
    return {
        meta: dict(json.loads(meta.read_text()).get("exit_code_by_key", {}))
        for meta in sorted((WORK / "mutants").rglob("*.py.meta"))
    }


def restore_exit_codes(before: dict[Path, dict[str, int | None]], keep: set[str]) -> None:
    """Put back the verdicts of mutants a `mutmut run NAME...` did not run: mutmut 3 rewrites every meta file
    with the other mutants' exit codes cleared (seen 2026-12-02: a rerun of 531 survivors left 7048 killed
    mutants `not checked`). The source is the run's, so their verdicts still hold."""
    for meta, codes in before.items():
        if not meta.exists():
            continue
        data = json.loads(meta.read_text())
        now = data.setdefault("exit_code_by_key", {})
        for name, code in codes.items():
            if name not in keep and code is not None and now.get(name) is None:
                now[name] = code
        meta.write_text(json.dumps(data))


def save_verdicts(path: Path | None = None) -> Path:
    """Write the workspace's verdicts to the committed record (SCOPE.verdicts): per mutated file, mutmut's meta
    data (each mutant's exit code, each function's hash), xz-compressed JSON keyed by the file's path."""
    metas = {
        str(meta.relative_to(WORK / "mutants")): json.loads(meta.read_text())
        for meta in sorted((WORK / "mutants").rglob("*.py.meta"))
    }
    files = {
        rel: {k: data.get(k, {}) for k in ("exit_code_by_key", "hash_by_function_name")} for rel, data in metas.items()
    }
    run = json.loads((WORK / "run.json").read_text()) if (WORK / "run.json").exists() else {}
    record = {"files": files, "run": run}  # run.json too: the report's wall time and later passes
    path = path or SCOPE.verdicts
    path.write_bytes(lzma.compress(json.dumps(record, sort_keys=True).encode()))
    return path


def restore_verdicts(path: Path | None = None) -> int:
    """Lay out a workspace and put the committed verdicts where mutmut keeps them, before it generates any
    mutant. mutmut then does what it does after a change in a workspace it made: a file's mutants are made anew
    from today's source, and a mutant keeps its recorded exit code only where its function's hash is the
    recorded one (mutmut's create_mutants_for_file); the mutants of changed or new functions are left unchecked,
    for `run_unchecked`. As in a refresh of the workspace itself, a change to the tests alone resets no verdict
    (the CI sample runs its mutants afresh). Returns how many verdicts the record held."""
    record = json.loads(lzma.decompress((path or SCOPE.verdicts).read_bytes()))
    layout()
    held = 0
    (WORK / "run.json").write_text(json.dumps(record["run"]))
    for rel, data in record["files"].items():
        meta = WORK / "mutants" / rel
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(
            json.dumps(
                {**data, "type_check_error_by_key": {}, "durations_by_key": {}, "estimated_durations_by_key": {}}
            )
        )
        held += sum(code is not None for code in data["exit_code_by_key"].values())
    return held


def diff_of(m: Mutant) -> str:
    """The mutant's change, as the `-`/`+` lines of mutmut's diff."""
    cwd = os.getcwd()
    os.chdir(WORK)
    try:
        from mutmut.mutation.diff_apply import get_diff_for_mutant

        diff = get_diff_for_mutant(m.name, path=m.path)
    finally:
        os.chdir(cwd)
    return "\n".join(l for l in diff.splitlines() if l[:1] in "+-" and not l.startswith(("+++", "---")))


def equivalents() -> list[tuple[str, re.Pattern[str], str]]:
    sys.path.insert(0, str(Path(__file__).parent))
    return [
        (fn, re.compile(change, re.S), why) for fn, change, why in importlib.import_module(SCOPE.equivalent).EQUIVALENT
    ]


def equivalent_reason(equiv: list[tuple[str, re.Pattern[str], str]], function: str, change: str) -> str | None:
    """The reason the first matching entry gives (function: a regex over mutmut's name for the function
    without its module; change: a regex over the whole normalized change; both must match whole), or None."""
    short = function.rsplit(".", 1)[-1]
    for fn, pattern, why in equiv:
        if re.fullmatch(fn, short) and pattern.fullmatch(_norm(change)):
            return why
    return None


def _norm(change: str) -> str:
    return "\n".join(re.sub(r"\s+", " ", l.strip()) for l in change.strip().splitlines())


# --- the report -------------------------------------------------------------------------------------------


def _md(text: str) -> str:
    text = text.replace("`", "'").replace("|", "\\|")
    return text if len(text) <= 160 else text[:157] + "..."


# A survivor whose reason says that only a CUDA host can tell it from the original (a tensor that stays on the
# CPU either way, pinning that needs CUDA). It is not equivalent: no test that ran could see it. The GPU pass
# (tests/mutation/gpu_pass.py) runs each one against the GPU tests; its verdicts are in GPU_PASS.
NEEDS_CUDA = re.compile(r"CPU-only|without CUDA|GPU run|needs CUDA|CUDA host|on CUDA")
GPU_PASS = Path(__file__).resolve().parent / "gpu_pass.json"
GPU_SECTION = ("<!-- gpu-pass -->", "<!-- /gpu-pass -->")


def gpu_pass() -> dict | None:
    """The last GPU pass (tests/mutation/gpu_pass.py run), or None before the first."""
    return json.loads(GPU_PASS.read_text()) if GPU_PASS.exists() else None


def gpu_verdict(function: str, change: str, gpu: dict | None) -> str:
    """What the GPU pass said of one survivor of the CPU run, in the report's words."""
    rec = next(
        (r for r in (gpu or {}).get("mutants", []) if r["function"] == function and r["change"] == _norm(change)), None
    )
    if rec is None:
        return "not yet run on a GPU"
    clean = (gpu or {}).get("clean") or {}
    provisional = (
        ", provisionally: that pass was stopped before its unmutated run finished"
        if rec.get("provisional") or not clean
        else ""
    )
    void = clean.get("first_failure") if clean.get("rc") not in (0, None) else None
    if rec["status"].startswith("killed"):
        if void and rec.get("first_failure") == void:
            return f"not decided on the GPU: the unmutated tree failed `{void}` too, so it runs again"
        by = f" by `{rec['first_failure']}`" if rec.get("first_failure") else " (its failing test not recorded)"
        return f"killed on the GPU{by}{provisional}"
    if rec["status"] == "survived":
        return f"**survived the GPU pass**{provisional}"
    return f"{rec['status']} on the GPU: {rec.get('why', '')}"


def scope_gpu_reason(why: str, function: str, change: str, gpu: dict | None) -> str:
    """A scope's survivor that only a CUDA device tells apart: its reason, then what the GPU pass said of it."""
    return f"{why} (GPU pass: {gpu_verdict(function, change, gpu)})"


def survivor_reason(function: str, change: str, why: str | None, gpu: dict | None) -> str:
    """Why one survivor survived, in the report's words: its equivalence, what the GPU pass said of a mutant only
    a CUDA host tells apart, or **unexplained**."""
    if why is None:
        return "**unexplained**"
    if NEEDS_CUDA.search(why):
        return f"not equivalent, told apart only on a CUDA host ({gpu_verdict(function, change, gpu)}): {why}"
    return why


def survivor_line(function: str, num: str, status: str, change: str, why: str | None, gpu: dict | None) -> str:
    """One survivor of the report: the mutated function, mutmut's number, the line it changes and what it becomes
    (the first "`: " after " → `" ends that part), then why it survived."""
    fn, old, new = _readable(function, change)
    return f"- `{fn}` #{num} ({status}): `{old}` → `{new}`: {survivor_reason(function, change, why, gpu)}"


def _readable(function: str, change: str) -> tuple[str, str, str]:
    """A mutant for people: the function as written in its module, the line it changes and what it becomes."""
    fn = function.rsplit(".", 1)[-1]  # mutmut's x_func or x\u01c1Class\u01c1method ("Index" ends in an x too)
    fn = fn[2:].replace("\u01c1", ".") if fn.startswith("x\u01c1") else fn.removeprefix("x_")
    old = " / ".join(l[1:].strip() for l in change.splitlines() if l.startswith("-"))
    new = " / ".join(l[1:].strip() for l in change.splitlines() if l.startswith("+"))
    return fn, _md(old), _md(new)


def summary_lines(survivors: int, needs_cuda: int, unexplained: int) -> list[str]:
    """The survivors' counts in the report's "Last full run", which tell the equivalent apart from the rest."""
    return [
        f"- survivors explained as equivalent: {survivors - needs_cuda - unexplained}; told apart only on a "
        f"CUDA host: {needs_cuda} (not equivalent: [the GPU pass](#gpu-pass) runs them); unexplained: {unexplained}"
    ]


def gpu_section(
    gpu: dict | None, needs_cuda: list[tuple[str, str]], by_scope: dict[str, int] | None = None
) -> list[str]:
    """The GPU pass's section of the report: what ran where, and the verdicts on the CPU runs' survivors that only
    a CUDA host tells apart (each survivor's line carries its own; `by_scope`: how many each scope's run left)."""
    verdicts = [gpu_verdict(f, c, gpu) for f, c in needs_cuda]
    count = {
        k: sum(v.startswith(p) for v in verdicts)
        for k, p in (
            ("killed", "killed"),
            ("survived", "**survived"),
            ("not run", ("not yet run", "not decided")),
            ("other", "not run on"),
        )
    }
    named = sum("by `" in v for v in verdicts)
    lines = [
        GPU_SECTION[0],
        "",
        "## GPU pass",
        "",
        "The survivors of the CPU run that only a CUDA host can tell apart are not equivalent. "
        "`tests/mutation/gpu_pass.py run` applies each one to a copy of the tree and runs the GPU tests "
        "(every test marked `gpu`, then the CPU tests that take CUDA branches when a device is present) in a "
        "fresh process per mutant: mutmut forks its test process, and a process that has initialised CUDA "
        "cannot fork a child that uses it. `gpu_pass.py report` rewrites this section and the survivors' "
        "lines from `tests/mutation/gpu_pass.json`.",
        "",
    ]
    if gpu is None:
        lines += ["No GPU pass has run yet.", "", GPU_SECTION[1]]
        return lines
    m = gpu.get("machine", {})
    clean = gpu.get("clean") or {}
    wanted = {(f, _norm(c)) for f, c in needs_cuda}  # a verdict on a mutant the CPU now kills is not counted
    cards = collections.Counter(
        r.get("gpu", m.get("gpu", "?")) for r in gpu.get("mutants", []) if (r["function"], r["change"]) in wanted
    )
    logs = sorted(p.name for p in (ROOT / "bench/results").glob("mutation_gpu-*.log"))
    lines += [
        f"- the last pass: {m.get('gpu', '?')}, torch {m.get('torch', '?')}, Python {m.get('python', '?')}; "
        f"started {gpu.get('utc', '?')}",
        "- verdicts by card, on this section's mutants (a pass keeps the named kills of the earlier ones): "
        + ", ".join(f"{card} {n}" for card, n in sorted(cards.items())),
        "- unmutated tree: "
        + (
            "passed"
            if clean.get("rc") == 0
            else "not finished (the pass was stopped), so its kills are provisional"
            if not clean
            else f"failed `{clean.get('first_failure')}` (its first failure; every test "
            "before it passed), so a kill by that test decides nothing and its mutant runs "
            "again, while a kill by a test before it stands"
        ),
        *(
            [f"- stopped: {gpu['stopped']}; the mutants it had not decided run first in the next pass"]
            if gpu.get("stopped")
            else []
        ),
        *(
            ["- the kills carried from an earlier pass, whose unmutated run never finished, are provisional"]
            if any(r.get("provisional") for r in gpu.get("mutants", []))
            else []
        ),
        f"- mutants: {len(needs_cuda)}"
        + (
            " ("
            + ", ".join(
                f"{n} from the {k} run" if k == "main" else f"{n} from the `{k}` scope" for k, n in by_scope.items()
            )
            + ")"
            if by_scope
            else ""
        )
        + f"; killed {count['killed']} ({named} with the failing test named); "
        f"survived {count['survived']}; not yet run or not decided {count['not run']}; not run here {count['other']}"
        + (" (ProgressConsensus: an NCCL reduction needs a rank per GPU)" if count["other"] else ""),
        "- the device logs, one a card, each of the mutants its pass ran: "
        + ", ".join(f"`bench/results/{name}`" for name in logs)
        if logs
        else "- no device log was kept; the next pass writes `bench/results/mutation_gpu-<gpu>.log`",
        "",
    ]
    survived = [(f, c) for (f, c), v in zip(needs_cuda, verdicts) if v.startswith("**survived")]
    if survived:
        lines += ["Survivors of the GPU pass (each needs a GPU test that kills it, or a reason it is equivalent):", ""]
        lines += [
            "- `{}`: `{}` → `{}`".format(*_readable(f, c))
            + (" (provisional: it runs again)" if "provisionally" in v else "")
            for (f, c), v in zip(needs_cuda, verdicts)
            if (f, c) in survived
        ]
        lines.append("")
    lines.append(GPU_SECTION[1])
    return lines


def _later_pass(r: dict) -> str:
    """The report's words for one pass after the full run (`run.json`'s reruns), with its wall time."""
    took = f"{r['seconds'] / 60:.1f} min"
    if r.get("restored"):
        return (
            "; then, in a workspace rebuilt from tests/mutation/verdicts.json.xz, the mutants of the functions "
            f"changed since (`mutate.py refresh`): {took}"
        )
    if "changed" in r:
        return (
            f"; then, after a change to {sum(1 for c in r['changed'] if mutated(c))} mutated files, the mutants "
            f"of the functions it changed (`mutate.py refresh`): {took}"
        )
    return f"; then {r['survivors']} survivors run again against the tests added to kill them: {took}"


def write_report(mutants: list[Mutant], seconds: float, run: dict | None) -> dict:
    if SCOPE.name != "main":
        return write_scope_section(mutants, seconds, run)
    equiv = equivalents()
    checked = [m for m in mutants if m.status not in ("not checked", "skipped")]
    unchecked = [m for m in mutants if m.status == "not checked"]  # a run stopped before them
    killed = [m for m in checked if m.status in KILLED]
    survivors = [m for m in checked if m.status not in KILLED]
    rows, unexplained, needs_cuda = [], 0, []
    for m in survivors:
        change = diff_of(m)
        why = equivalent_reason(equiv, m.function, change)
        if why is None:
            unexplained += 1
        elif NEEDS_CUDA.search(why):
            needs_cuda.append((m.function, _norm(change)))
        rows.append((m, change, why))
    gpu = gpu_pass()
    rate = len(killed) / len(checked) if checked else 0.0
    max_children = (run or {}).get("max_children", 2)
    per_file: dict[str, list[int]] = {}
    for m in checked:
        k = per_file.setdefault(m.path, [0, 0])
        k[0] += m.status in KILLED
        k[1] += 1
    summary = {
        "mutants": len(checked),
        "killed": len(killed),
        "survived": len(survivors),
        "equivalent": len(survivors) - unexplained - len(needs_cuda),
        "needs_cuda": len(needs_cuda),
        "unexplained": unexplained,
        "kill_rate": round(rate, 4),
        "seconds": round(seconds),
        "not_checked": len(unchecked),
    }
    lines = [
        "# Mutation testing",
        "",
        "<!-- GENERATED by `make mutate` (tests/mutation/mutate.py): the text from DOC in that script, the numbers "
        "and survivors from the last run, the reasons from tests/mutation/equivalent.py. Do not edit. -->",
        "",
        *DOC.strip("\n").splitlines(),
        "",
        "## Last full run",
        "",
        f"- mutants: {len(checked)} over {len(per_file)} files; killed {len(killed)} "
        f"(timeouts and crashes count as killed); survived {len(survivors)}",
        f"- **kill rate: {rate:.2%}** (`kill_rate = {rate:.4f}`); the CI sample is held to this run's verdict on "
        "each mutant it picks (tests/mutation/survivors.json)",
        *summary_lines(len(survivors), len(needs_cuda), unexplained),
        *(
            [
                f"- not checked: {len(unchecked)} (the run was stopped before them; tests/mutation/survivors.json lists "
                "them as `not checked`, so the CI sample never counts one of them against this run)"
            ]
            if unchecked
            else []
        ),
        f"- wall time: {seconds / 60:.1f} min for the run on {os.cpu_count()} cores, {max_children} mutants at a time"
        + "".join(_later_pass(r) for r in (run or {}).get("reruns", [])),
        "",
        f"<!-- mutation-summary: {json.dumps(summary, sort_keys=True)} -->",
        "",
        "| file | mutants | killed | kill rate |",
        "|---|---|---|---|",
    ]
    for path, (k, n) in sorted(per_file.items()):
        lines.append(f"| `{path}` | {n} | {k} | {k / n:.1%} |")
    lines += [
        "",
        "### Survivors",
        "",
        "Each survivor is an equivalent mutant (no test of the subset can tell it from the original; the reason is "
        "given, from tests/mutation/equivalent.py), one that only a CUDA host tells apart (with the GPU pass's "
        "verdict), or **unexplained**: a behaviour no test of the subset pins down. "
        "One line per mutant: the mutated function, mutmut's number, the line it changes and what it becomes.",
        "",
    ]
    if not rows:
        lines.append("None.")
    by_path: dict[str, list[tuple[Mutant, str, str | None]]] = {}
    for row in rows:
        by_path.setdefault(row[0].path, []).append(row)
    for path, group in sorted(by_path.items()):
        lines += [f"#### `{path}` ({len(group)})", ""]
        for m, change, why in group:
            lines.append(survivor_line(m.function, m.name.rsplit("__mutmut_", 1)[-1], m.status, change, why, gpu))
        lines.append("")
    lines += gpu_section(gpu, needs_cuda)
    REPORT.write_text(keep_scope_sections("\n".join(lines).rstrip("\n") + "\n"))
    SURVIVORS.write_text(
        json.dumps(
            {
                "summary": summary,
                "survivors": [
                    {
                        "function": m.function,
                        "change": _norm(change),
                        "status": m.status,
                        "equivalent": why is not None and not NEEDS_CUDA.search(why),
                        **({"needs_cuda": True} if why is not None and NEEDS_CUDA.search(why) else {}),
                    }
                    for m, change, why in rows
                ]
                + [
                    {"function": m.function, "change": _norm(diff_of(m)), "status": m.status, "equivalent": False}
                    for m in unchecked
                ],
            },
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )
    return summary


def needs_gpu_pass(scope: Scope | None = None) -> list[tuple[str, re.Pattern[str], str]]:
    """The scope's (default: the current one's) survivors that a CPU run cannot tell apart and a CUDA device can
    (NEEDS_GPU_PASS, written as EQUIVALENT is): not equivalent, so counted and listed apart."""
    sys.path.insert(0, str(Path(__file__).parent))
    module = importlib.import_module((scope or SCOPE).equivalent)
    return [(fn, re.compile(change, re.S), why) for fn, change, why in getattr(module, "NEEDS_GPU_PASS", [])]


def _survivor_text(m: Mutant, change: str, why: str) -> str:
    """A survivor of a scope, as the main report writes one, but bulleted `*`: the main report's survivor lines
    (`- `) are what gpu_pass.py rewrites and counts against tests/mutation/survivors.json."""
    fn, old, new = _readable(m.function, change)
    return f"* `{fn}` #{m.name.rsplit('__mutmut_', 1)[-1]} ({m.status}): `{old}` → `{new}`: {why}"


def write_scope_section(mutants: list[Mutant], seconds: float, run: dict | None) -> dict:
    """A scope's section of docs/mutation.md (between its markers; the rest of the page is left as it is) and
    its survivors file: its score apart from the main run's, and each survivor with its reason, in three
    lists: equivalent, needs the GPU pass, unexplained."""
    equiv, gpu = equivalents(), needs_gpu_pass()
    checked = [m for m in mutants if m.status not in ("not checked", "skipped")]
    unchecked = [m for m in mutants if m.status == "not checked"]
    killed = [m for m in checked if m.status in KILLED]
    kinds: dict[str, list[tuple[Mutant, str, str]]] = {"equivalent": [], "needs_gpu_pass": [], "unexplained": []}
    for m in checked:
        if m.status in KILLED:
            continue
        change = diff_of(m)
        why = equivalent_reason(equiv, m.function, change)
        on_gpu = equivalent_reason(gpu, m.function, change)
        kind = "equivalent" if why else "needs_gpu_pass" if on_gpu else "unexplained"
        if kind == "needs_gpu_pass":
            on_gpu = scope_gpu_reason(on_gpu, m.function, change, gpu_pass())
        kinds[kind].append((m, change, why or on_gpu or "**unexplained**"))
    rate = len(killed) / len(checked) if checked else 0.0
    per_file: dict[str, list[int]] = {}
    for m in checked:
        k = per_file.setdefault(m.path, [0, 0])
        k[0] += m.status in KILLED
        k[1] += 1
    summary = {
        "mutants": len(checked),
        "killed": len(killed),
        "survived": len(checked) - len(killed),
        **{k: len(v) for k, v in kinds.items()},
        "kill_rate": round(rate, 4),
        "seconds": round(seconds),
        "not_checked": len(unchecked),
    }
    max_children = (run or {}).get("max_children", 2)
    start, end = SCOPE.markers
    lines = [
        start,
        f"<!-- GENERATED by `tests/mutation/mutate.py --scope {SCOPE.name} run` (or `rerun`, `refresh`, `report`): "
        f"the text from the scope's doc, the numbers from its last run, the reasons from "
        f"tests/mutation/{SCOPE.equivalent}.py. Do not edit. -->",
        "",
        f"## {SCOPE.title}",
        "",
        *SCOPE.doc.strip("\n").splitlines(),
        "",
        f"### Last run of `{SCOPE.name}`",
        "",
        f"- mutants: {len(checked)} over {len(per_file)} files; killed {len(killed)} (timeouts and crashes count "
        f"as killed); survived {len(checked) - len(killed)}",
        f"- **kill rate: {rate:.2%}** (`kill_rate = {rate:.4f}`), this scope's alone (the main run's is above)",
        f"- survivors: equivalent {len(kinds['equivalent'])}; survive the CPU run and need the GPU pass "
        f"{len(kinds['needs_gpu_pass'])}; unexplained {len(kinds['unexplained'])}",
        *([f"- not checked: {len(unchecked)} (the run was stopped before them)"] if unchecked else []),
        f"- wall time: {seconds / 60:.1f} min for the run on {os.cpu_count()} cores, {max_children} mutants at a time"
        + "".join(
            f"; then, after a change, the mutants of the functions it changed: {r['seconds'] / 60:.1f} min"
            if "changed" in r
            else (
                f"; then {r['survivors']} survivors run again against the tests added to "
                f"kill them: {r['seconds'] / 60:.1f} min"
            )
            for r in (run or {}).get("reruns", [])
        ),
        "",
        f"<!-- mutation-scope-summary {SCOPE.name}: {json.dumps(summary, sort_keys=True)} -->",
        "",
        "| file | mutants | killed | kill rate |",
        "|---|---|---|---|",
        *[f"| `{path}` | {n} | {k} | {k / n:.1%} |" for path, (k, n) in sorted(per_file.items())],
        "",
    ]
    heads = {
        "needs_gpu_pass": "Survives the CPU run; needs the GPU pass (not equivalent: a CUDA device shows "
        "the difference, and the GPU pass gives the verdict)",
        "equivalent": "Equivalent (no test can tell it from the original; the reason)",
        "unexplained": "Unexplained (a behaviour no test of the subset pins down)",
    }
    for kind in ("needs_gpu_pass", "equivalent", "unexplained"):
        rows = kinds[kind]
        lines += [f"### {heads[kind]}: {len(rows)}", ""]
        lines += [
            _survivor_text(m, change, why) for m, change, why in sorted(rows, key=lambda r: (r[0].path, r[0].name))
        ]
        lines += [""] if rows else ["None.", ""]
    lines.append(end)
    section = "\n".join(lines)
    text = REPORT.read_text() if REPORT.exists() else ""
    if start in text and end in text:
        text = text[: text.index(start)] + section + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    REPORT.write_text(text)
    SURVIVORS.write_text(
        json.dumps(
            {
                "summary": summary,
                "survivors": [
                    {
                        "function": m.function,
                        "change": _norm(change),
                        "status": m.status,
                        "equivalent": kind == "equivalent",
                        "needs_gpu_pass": kind == "needs_gpu_pass",
                    }
                    for kind, rows in kinds.items()
                    for m, change, _ in rows
                ]
                + [
                    {
                        "function": m.function,
                        "change": _norm(diff_of(m)),
                        "status": m.status,
                        "equivalent": False,
                        "needs_gpu_pass": False,
                    }
                    for m in unchecked
                ],
            },
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )
    return summary


def keep_scope_sections(page: str) -> str:
    """The main report's page with every other scope's section of the current page kept, after it."""
    old = REPORT.read_text() if REPORT.exists() else ""
    kept = []
    for scope in SCOPES.values():
        start, end = scope.markers
        if scope.name != "main" and start in old and end in old:
            kept.append(old[old.index(start) : old.index(end) + len(end)])
    return page.rstrip("\n") + "".join("\n\n" + s for s in kept) + "\n"


DOC = """
`make mutate` runs [mutmut](https://github.com/boxed/mutmut) 3 over the runtime, the data plane and the
generated machine, against a fast subset of the test suite, and regenerates this page; a seeded sample of
the same mutants runs in `make test` (tests/mutation/test_mutation_sample.py) and fails when its kill rate
falls below the one recorded here. (These are mechanical mutants, every small change mutmut can make; the
hand-written faults of the bug classes in [bug-catalog.md](bug-catalog.md) and what catches them are
[mutants.md](mutants.md).)

## Why mutmut

The two maintained Python mutation testers, mutmut 3.8 and cosmic-ray 8.7, both install on Python 3.11
without touching the pinned CPU torch. mutmut was chosen after running it on this layout; cosmic-ray was
judged from its documented execution model:

- **mutmut 3** writes every mutant of a file into one mutated copy of the tree (`mutants/`, here under
  `build/mutation/`), selected at run time through a trampoline per function, and forks the already
  initialised test process for each mutant: torch, the package and the test modules are imported once,
  and each mutant runs only the tests that called its function in the clean run, stopping at the first
  failure. The checkout is never modified, which matters in a working tree several engineers share, and a
  mutant can be named (`mutmut run NAME`), so the CI sample runs exactly the mutants it picked.
- **cosmic-ray 8** applies each mutation to the source file in place and runs the test command afresh for
  it: every mutant pays the torch import and pytest start-up (a few seconds here) and runs the whole
  subset, and while it runs the shared checkout holds a mutated file that other engineers' test runs import.

Two things this layout needed: mutmut names a module after its path, so the workspace lays the generated
machines out as the wheel does (`kvfsm/generated/decode_offload.py`, the module the runtime imports; from
`generated/` mutmut would mutate a module nothing imports by that name); and mutmut's configuration lives
in the workspace's own `pyproject.toml`, written by the script, not in the project's. mutmut 3 mutates code
inside functions only (module constants and class bodies are not mutated): the logic the tests must pin
down is in functions and methods.

## Scope

- mutated (`MUTATE` in tests/mutation/mutate.py): `kvfsm/runtime/`, `kvfsm/dataplane/pools/`,
  `kvfsm/dataplane/copy/base.py` (copy planning), `kvfsm/dataplane/storage/` without Mooncake (its tests need
  a Mooncake master) and without `process.py` and `fork_server.py` (half of each runs in a child process, out of
  mutmut's sight; tests/dataplane/test_process_storage.py tests them by failure injection), `kvfsm/dataplane/hashing.py` and `generated/decode_offload.py` (named
  `kvfsm/generated/decode_offload.py` below); no `__init__.py`. The text of raised errors, log lines,
  warnings and reprs is not mutated (`NOT_BEHAVIOUR`): it is wording, and its mutants would bury the ones
  that matter; that an error is raised, and its type, still is;
- the tests (`TESTS`): the data plane's pool, allocator, table, hashing, storage and copy-engine tests, the
  runtime's scenario, batch-event, backup-worker, offload-batch, config-error and first-use tests, the
  generated-vs-reference differential test, and tests/mutation/test_kills.py (tests written to kill
  survivors of this run). The stateful suite and the explorer are left out: a few seconds per mutant is
  the budget, and they take minutes. Hypothesis runs derandomized in the workspace;
- a survivor that no test can kill is listed in tests/mutation/equivalent.py with the reason (keyed by its
  function and its change, so the entry survives renumbering); the report marks every other survivor
  **unexplained**;
- a survivor whose reason says that only a CUDA host tells it apart (a tensor that stays on the CPU either
  way, pinning that needs CUDA) is not equivalent: the CPU run could not see it. It is counted apart, and
  the GPU pass (below) runs it against the GPU tests on a GPU machine.

## Files

- `tests/mutation/mutate.py`: lays out the workspace, runs mutmut and writes this page (`run`), runs the
  last run's survivors again after tests were added to kill them (`rerun`), after a source change runs the
  mutants of the functions it changed, keeping every other verdict (`refresh`; in a checkout without the
  workspace it first rebuilds it from `tests/mutation/verdicts.json.xz`), rewrites this page (`report`) and
  runs the CI sample (`sample`);
- `tests/mutation/verdicts.json.xz`: every mutant's verdict and every mutated function's hash from the last run
  (written by `run`, `rerun` and `refresh`), so that a later change costs the mutants of the functions it
  changed, not a full run;
- `tests/mutation/equivalent.py` (with `equivalent_*.py`, one per group of modules): the equivalent survivors
  and why;
- `tests/mutation/test_kills.py` and `test_kills_*.py`: the tests added to kill survivors;
- `tests/mutation/gpu_pass.py` and `gpu_pass.json`: the GPU pass and its last verdicts (on the device machine,
  `tests/mutation/run_on_device.sh`; a mutant first runs the test that killed it in the last pass);
- `tests/mutation/rekey.py`: carries the GPU pass's verdicts across a change that moves no mutant, such as a
  formatter's rewrite of the mutated modules (their records match mutmut's diff lines by their text): it
  generates the mutants from the revision before and from the checkout, requires the same mutants with every
  mutated function the same AST and every equivalence reason kept, and rewrites the verdicts' change texts.
  The CPU records come from the scopes' next runs;
- `tests/mutation/survivors.json`: this run's survivors, machine-readable (function, change, status);
- `tests/mutation/test_mutation_sample.py`: the CI step (`make test` runs it), 20 mutants picked with a fixed
  seed from those survivors.json does not list, every one checked (no time box, a hang guard on progress),
  failing when fewer of them are killed than this run killed of the same mutants (a mutant not listed in
  survivors.json counts as killed by this run; a listed one could only raise the sample's rate, so none is
  drawn). It skips mutmut's clean run (the stats pass, or the one whose stats it uses, ran every test
  unmutated) and forced-fail run (a broken mutation can only fail the sample);
- `tests/mutation/sample_stats.json.xz`: mutmut's stats (which test calls which function) for the sample's
  workspace, with the digest of the workspace and of the packages it ran on (`mutate.py sample --save-stats`
  writes it, after a stats pass that ran every test of the subset unmutated). The sample uses them only where
  the digest is the same, and skips mutmut's stats pass (about 100 s on the 2-core CI machine on a slow day);
  elsewhere mutmut collects them.
"""


# --- commands ---------------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    layout()
    t0 = time.monotonic()
    rc = mutmut("run", "--max-children", str(args.max_children), *SCOPE.functions)
    seconds = time.monotonic() - t0
    (WORK / "run.json").write_text(json.dumps({"seconds": seconds, "rc": rc, "max_children": args.max_children}))
    summary = write_report(results(), seconds, {"seconds": seconds})
    save_verdicts()
    print(json.dumps(summary))
    return 0 if rc == 0 else rc


def cmd_rerun(args: argparse.Namespace) -> int:
    """Run the last run's survivors again against the current test files (after tests were added to kill
    them), without generating or running anything else; then rewrite the report. The tests are the run's (those
    its workspace holds) plus the kill tests (the files named test_kills*.py): a test file added since the run
    may exercise code the run's source does not have, and would fail on every mutant of it."""
    tests = [t for t in TESTS if (WORK / t).exists() or Path(t).name.startswith("test_kills")]
    (WORK / "pyproject.toml").write_text(mutmut_config(tests))
    for rel in tests + SUPPORT:
        for base in (WORK, WORK / "mutants"):
            (base / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, base / rel)
    for base in (WORK, WORK / "mutants"):
        (base / "tests" / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text() + CONFTEST_ADDENDUM)
    again = ("timeout",) if args.timeouts else ()
    survivors = [
        m.name
        for m in results()
        if (m.status not in KILLED or m.status in again)
        and m.status not in ("not checked", "skipped")
        and re.search(args.only or "", m.name)
    ]
    verdicts = exit_codes()
    t0 = time.monotonic()
    rc = mutmut("run", "--max-children", str(args.max_children), *survivors, timeout=args.budget) if survivors else 0
    restore_exit_codes(verdicts, keep=set(survivors))
    run = json.loads((WORK / "run.json").read_text()) if (WORK / "run.json").exists() else {"seconds": 0}
    run.setdefault("reruns", []).append({"survivors": len(survivors), "seconds": time.monotonic() - t0, "rc": rc})
    (WORK / "run.json").write_text(json.dumps(run))
    print(json.dumps(write_report(results(), run["seconds"], run)))
    save_verdicts()
    return 0 if rc == 0 else rc


def workspace_files() -> list[tuple[Path, str]]:
    """(source, path in the workspace) of every file layout() copies, the conftest excepted."""
    pairs: list[tuple[Path, str]] = []
    generated = {f"kvfsm/generated/{f.name}" for f in (ROOT / "generated").glob("*.py")}
    for top in ("kvfsm", "spec"):
        for f in sorted((ROOT / top).rglob("*")):
            rel = str(f.relative_to(ROOT))
            if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc" and rel not in generated:
                pairs.append((f, rel))  # (the generated machines' files come from generated/, as in layout())
    for f in sorted((ROOT / "generated").glob("*.py")):
        pairs.append((f, f"kvfsm/generated/{f.name}"))
    for f in sorted((ROOT / "spec").rglob("*")):
        if f.is_file():
            pairs.append((f, f"kvfsm/generated/spec/{f.relative_to(ROOT / 'spec')}"))
    pairs += [(ROOT / rel, rel) for rel in TESTS + SUPPORT if rel != "tests/conftest.py"]
    return pairs


def mutated(rel: str) -> bool:
    return SCOPE.mutates(rel)


def cmd_refresh(args: argparse.Namespace) -> int:
    """After a change to the source or the tests: bring the last run's workspace up to date and run only what
    the change left unchecked, then rewrite the report. mutmut hashes every function: it regenerates the
    mutants of a mutated file whose source is newer than its mutants, resets the verdicts of the functions
    whose code changed, and keeps the others. A file it does not mutate is copied into its mutated tree as
    well (mutmut copies those only once). After a change to a mutated file, mutmut's stats pass runs again."""
    if not (WORK / "mutants").exists():
        if not SCOPE.verdicts.exists():
            raise SystemExit("no run to refresh: run `mutate.py run` first")
        print(f"refresh: no workspace; {restore_verdicts()} verdicts restored from {SCOPE.verdicts.name}", flush=True)
        restored = True
    else:
        restored = False
    changed: list[str] = []
    for src, rel in workspace_files():
        dst = WORK / rel
        if dst.exists() and filecmp.cmp(src, dst, shallow=False):
            continue
        changed.append(rel)
        targets = [dst] if mutated(rel) else [dst, WORK / "mutants" / rel]
        for t in targets:
            t.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, t)
        if mutated(rel):
            os.utime(dst)  # newer than its mutants: mutmut regenerates them
    conftest = (ROOT / "tests" / "conftest.py").read_text() + CONFTEST_ADDENDUM
    for base in (WORK, WORK / "mutants"):
        if (base / "tests" / "conftest.py").read_text() != conftest:
            (base / "tests" / "conftest.py").write_text(conftest)
            changed.append(str((base / "tests" / "conftest.py").relative_to(WORK)))
    (WORK / "pyproject.toml").write_text(mutmut_config(TESTS))
    if any(mutated(rel) for rel in changed):
        # mutmut adds to its stats (which test calls which function) only the tests it has not seen: a function
        # new in a changed file, or code moved into one, would be run against no test that was there before
        (WORK / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    print(f"refresh: {len(changed)} files changed: {', '.join(changed)}", flush=True)
    t0 = time.monotonic()
    rc = run_unchecked(args.max_children, args.budget)
    run = json.loads((WORK / "run.json").read_text()) if (WORK / "run.json").exists() else {"seconds": 0}
    entry = {"changed": changed, "seconds": time.monotonic() - t0, "rc": rc, **({"restored": True} if restored else {})}
    run.setdefault("reruns", []).append(entry)  # in order
    (WORK / "run.json").write_text(json.dumps(run))
    print(json.dumps(write_report(results(), run["seconds"], run)))
    save_verdicts()
    return 0 if rc == 0 else rc


def cmd_report(args: argparse.Namespace) -> int:
    run = json.loads((WORK / "run.json").read_text()) if (WORK / "run.json").exists() else {"seconds": 0}
    print(json.dumps(write_report(results(), run["seconds"], run)))
    return 0


def committed() -> tuple[dict, set[tuple[str, str]]]:
    """The committed full run: its summary and the (function, change) of every mutant that survived it."""
    data = json.loads(SURVIVORS.read_text())
    return data["summary"], {(s["function"], s["change"]) for s in data["survivors"]}


def draw(names: list[str], n: int, seed: int, passed_over: Callable[[str], bool]) -> tuple[list[str], int]:
    """The sample: the first `n` names of a seeded shuffle that `passed_over` does not exclude (sorted), and how
    many it excluded on the way. The test is asked only of names the shuffle reaches."""
    order = sorted(names)  # the draw depends on the names and the seed, not on the order they came in
    random.Random(seed).shuffle(order)
    pick, left_out = [], 0
    for name in order:
        if len(pick) == n:
            break
        if passed_over(name):
            left_out += 1
        else:
            pick.append(name)
    return sorted(pick), left_out


# the packages whose versions a workspace's digest holds: mutmut, and what the test subset runs on
DIGEST_PACKAGES = ("mutmut", "pytest", "hypothesis", "torch", "numpy", "pydantic")


def files_digest() -> str:
    """The part of `workspace_digest` this repository decides: every file of the sample's workspace (the package,
    the generated machines and specs, the test subset with its support files and conftest) and mutmut's
    configuration."""
    h = hashlib.sha256()
    for src, rel in sorted(workspace_files(), key=lambda pair: pair[1]):
        data = src.read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode() + data)
    h.update(((ROOT / "tests" / "conftest.py").read_text() + CONFTEST_ADDENDUM).encode())
    h.update(mutmut_config(TESTS).encode())
    return h.hexdigest()


def versions() -> str:
    """The part the installed packages decide: Python's version and DIGEST_PACKAGES'. The test venv takes the newest
    release within pyproject.toml's ranges, so a release upstream changes this part alone."""
    from importlib.metadata import version

    return f"python {sys.version_info[0]}.{sys.version_info[1]} " + " ".join(
        f"{name} {version(name)}" for name in DIGEST_PACKAGES
    )


def workspace_digest() -> str:
    """What mutmut's stats, and the tests' passing unmutated, depend on: `files_digest` and `versions`. Equal
    digests, equal stats: the workspace runs hypothesis derandomized."""
    return hashlib.sha256(f"{files_digest()}\0{versions()}".encode()).hexdigest()


def committed_record() -> dict | None:
    """The committed SAMPLE_STATS (digest, stats and, since it was first kept, the draw), or None."""
    if not SAMPLE_STATS.exists():
        return None
    return json.loads(lzma.decompress(SAMPLE_STATS.read_bytes()))


def committed_stats() -> tuple[str | None, dict | None]:
    """(digest, mutmut's stats) of the committed SAMPLE_STATS, or (None, None) when there is none."""
    record = committed_record()
    return (None, None) if record is None else (record["digest"], record["stats"])


def sample_stats(digest: str) -> str:
    """Give the sample's workspace the committed stats when they were collected in a workspace like this one, and
    say where its stats come from: "committed", or "collected" (mutmut's stats pass runs every test of the
    subset in one traced process: about 100 s of the sample's 256 s on the CI machine on 2026-12-06, a slow day).
    Stale stats are never used: a test that newly calls a function would not run against its mutants, and no
    stats pass would have shown the workspace's tests passing unmutated."""
    committed_digest, stats = committed_stats()
    if committed_digest != digest or stats is None:
        return "collected"
    (WORK / "mutants").mkdir(parents=True, exist_ok=True)
    (WORK / "mutants" / "mutmut-stats.json").write_text(json.dumps(stats))
    return "committed"


# The sample's generated mutants, kept per workspace digest outside the checkout (as pip's and mypy's caches are), so a
# fresh clone of an unchanged workspace skips the generation: about 64 s of the sample's 129 s on the 2-core CI machine
# on 2026-12-06, where restoring them takes about a second. Generation is a function of what the digest covers (the
# mutated files, mutmut's configuration and version, Python's version), so a restored tree is what generating would
# write; any other digest generates afresh.
MUTANTS_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvfsm" / "mutation-sample"


def generate_cached(max_children: int, digest: str) -> tuple[int, str]:
    """generate(), or the mutants it wrote for a workspace with this digest; (exit status, "cached" or "generated").
    The tree is saved right after generation, before any mutant ran, so it holds no verdict."""
    package = WORK / "mutants" / "kvfsm"
    cached = MUTANTS_CACHE / f"{digest}.tar"
    if cached.exists():
        try:
            with tarfile.open(cached) as tar:
                tar.extractall(WORK / "mutants", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
            now = time.time() + 1  # newer than the workspace's sources: mutmut regenerates a file whose source is not
            for f in package.rglob("*"):
                os.utime(f, (now, now))
            rc = generate(max_children)  # copies the rest of the workspace; every mutated file is found unmodified
            if rc == 0:
                return rc, "cached"
        except (OSError, tarfile.TarError) as exc:
            print(f"the cached mutants could not be used ({exc!r}): generating them", flush=True)
        shutil.rmtree(WORK / "mutants", ignore_errors=True)
    rc = generate(max_children)
    if rc == 0:
        part = cached.with_suffix(f".{os.getpid()}.part")
        try:  # a cache that cannot be written (a full disk, a read-only home) costs the next sample its generation only
            MUTANTS_CACHE.mkdir(parents=True, exist_ok=True)
            for old in MUTANTS_CACHE.glob("*.tar"):  # one workspace's mutants at a time: about 21 MB
                old.unlink(missing_ok=True)
            with tarfile.open(part, "w") as tar:
                tar.add(package, arcname="kvfsm")
            part.replace(cached)
        except OSError as exc:
            with contextlib.suppress(OSError):
                part.unlink(missing_ok=True)
            print(f"the generated mutants were not cached ({exc!r})", flush=True)
    return rc, "generated"


def save_sample_stats(digest: str, draw_of: dict) -> None:
    """The committed record: the workspace's digest, mutmut's stats, and the draw (`n`, `seed`, the survivors'
    digest, `picks`, `passed_over`) that generating every mutant of that workspace gave."""
    stats = json.loads((WORK / "mutants" / "mutmut-stats.json").read_text())
    record = {"digest": digest, "files_digest": files_digest(), "versions": versions(), "stats": stats, "draw": draw_of}
    SAMPLE_STATS.write_bytes(lzma.compress(json.dumps(record, sort_keys=True).encode()))


def survivors_digest() -> str:
    """What the draw passes over besides the names: the committed run's survivors."""
    return hashlib.sha256(SURVIVORS.read_bytes()).hexdigest()


def recorded_draw(digest: str, n: int, seed: int) -> tuple[list[str], int] | None:
    """(picks, passed over) of the committed record when it was drawn with this n and seed, in a workspace with
    this digest, against these committed survivors; else None. Generation is a function of what the digest
    covers and the draw of the names, the seed and the survivors, so these are the picks that generating every
    mutant and drawing again would give."""
    record = committed_record()
    d = record and record.get("draw")
    if (
        record is None
        or record["digest"] != digest
        or not d
        or (d["n"], d["seed"], d["survivors"]) != (n, seed, survivors_digest())
    ):
        return None
    return list(d["picks"]), int(d["passed_over"])


def files_of(mutants: list[str]) -> list[str]:
    """The source files (workspace paths) that hold these mutants: `kvfsm.a.b.x_f__mutmut_3` -> kvfsm/a/b.py."""
    files = set()
    for name in mutants:
        match = re.match(r"(kvfsm(?:\.\w+)*?)\.x[_ǁ]", name)
        if match is None:
            raise ValueError(f"not a mutant name: {name!r}")
        files.add(match.group(1).replace(".", "/") + ".py")
    return sorted(files)


def cmd_sample(args: argparse.Namespace) -> int:
    """Draw a seeded sample of the mutants and run it (all of it, or what `--budget` seconds allow); print the
    kill rate, and the kill rate the committed full run had on the same mutants (those it lists as survivors
    survived it, the rest were killed), so the two are compared mutant for mutant, not as two samples of a rate.
    Drawing needs every mutant generated, unless the committed record holds this workspace's draw
    (`recorded_draw`): then only the files of its picks are mutated. `--save-stats` always draws afresh.

    The sample is drawn from the mutants the committed run does not list as survivors: one it lists can only
    raise the sample's rate (it counts as survived on both sides, or as a new kill), so it could never fail the
    check, and it is the dearest kind to run (a survivor runs every test that reaches it, where a kill stops at
    the first failure)."""
    global WORK
    WORK = WORK.with_name(WORK.name + "-sample")
    layout()
    t0 = time.monotonic()
    digest = workspace_digest()
    recorded = None if args.save_stats else recorded_draw(digest, args.n, args.seed)
    if recorded is not None:
        # The committed record holds this workspace's draw: mutmut mutates only the files of its picks (8 of 28
        # files, 4,685 of the 8,299 mutants for the draw recorded on 2026-12-06). What it saves where the mutant
        # cache is cold, as on a fresh CI machine: the sample alone 96 -> 81 s, 160 -> 123 s of CPU (55 s, 85 s of
        # CPU, with the cache), on the 2-core CI machine.
        files = files_of(recorded[0])
        (WORK / "pyproject.toml").write_text(mutmut_config(TESTS, only=files))
        # cached apart from a full generation, and per set of files (a tree holds the mutants of its files only)
        of_files = hashlib.sha256("\n".join(files).encode()).hexdigest()[:16]
        rc, mutants = generate_cached(args.max_children, f"{digest}-{of_files}")
    else:
        rc, mutants = generate_cached(args.max_children, digest)
    stats = "collected" if args.save_stats else sample_stats(digest)
    which = " (the recorded draw's files)" if recorded is not None else ""
    print(f"mutants: {mutants}{which}; mutmut's stats: {stats}", flush=True)
    every = {m.name: m for m in results()}
    if not every:
        print(f"no mutants generated (mutmut exit {rc})")
        return 2
    summary, survived_before = committed()
    survivor_functions = {f for f, _ in survived_before}

    def committed_survivor(name: str) -> bool:  # the diff is read only for a function with a listed survivor
        m = every[name]
        return m.function in survivor_functions and (m.function, _norm(diff_of(m))) in survived_before

    if recorded is not None:
        pick, left_out = recorded
        missing = [name for name in pick if name not in every]
        if missing:
            print(f"the recorded draw names mutants that generating their files did not write: {missing}")
            return 2
    else:
        pick, left_out = draw(list(every), args.n, args.seed, committed_survivor)
    crashes = 0
    while True:
        left = None if args.budget is None else max(30.0, args.budget - (time.monotonic() - t0))
        rc = mutmut_python(SAMPLE_RUN, "run", "--max-children", str(args.max_children), *pick, timeout=left)
        # mutmut first runs every test of the subset in its own process to learn which tests call what; that
        # pass has died by SIGSEGV inside a garbage collection (2026-12-01 here, 2026-12-02 in a clean-clone CI
        # run; not reproduced in 3 direct runs of the same tests, cause not found), before any mutant ran.
        # A fresh process gets one more try; a crash while mutants run is a verdict, not retried.
        if (
            rc >= 0
            or crashes
            or any(m.status not in ("not checked", "skipped") for m in results() if m.name in set(pick))
        ):
            break
        crashes += 1
        print(f"\nmutmut died by signal {-rc} before any sampled mutant ran (its stats pass): once more", flush=True)
    done = {m.name: m for m in results() if m.name in set(pick)}
    checked = [m for m in done.values() if m.status not in ("not checked", "skipped")]
    killed = sum(m.status in KILLED for m in checked)
    keys = {m.name: (m.function, _norm(diff_of(m))) for m in checked}
    before = sum(keys[m.name] not in survived_before for m in checked)
    new_survivors = [m.name for m in checked if m.status not in KILLED and keys[m.name] not in survived_before]
    out = {
        "sampled": len(pick),
        "checked": len(checked),
        "killed": killed,
        "kill_rate": round(killed / len(checked), 4) if checked else None,
        "committed_kill_rate_on_sample": round(before / len(checked), 4) if checked else None,
        "committed_kill_rate": summary["kill_rate"],
        "seconds": round(time.monotonic() - t0),
        "new_survivors": new_survivors,
        "committed_survivors_passed_over": left_out,
        "mutmut_exit": rc,
        "stats_pass_crashes": crashes,
        "stats": stats,
        "mutants": mutants,
    }
    if args.save_stats and rc == 0 and checked and out["kill_rate"] >= out["committed_kill_rate_on_sample"]:
        save_sample_stats(
            digest,
            {"n": args.n, "seed": args.seed, "survivors": survivors_digest(), "picks": pick, "passed_over": left_out},
        )
        # (only from a sample that passed: its stats pass ran every test unmutated)
    print("\n" + json.dumps(out))  # on a line of its own: mutmut's spinner ends its lines with \r only
    (WORK / "sample.json").write_text(json.dumps(out))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--scope",
        choices=sorted(SCOPES),
        default="main",
        help="what to mutate and test (default: main, `make mutate`'s)",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="every mutant, then docs/mutation.md")
    run.add_argument("--max-children", type=int, default=2)
    sub.add_parser("report", help="docs/mutation.md from the last run")
    rerun = sub.add_parser("rerun", help="the last run's survivors again, against the current tests")
    rerun.add_argument("--max-children", type=int, default=2)
    rerun.add_argument("--only", default=None, help="a regex: only the survivors whose mutmut name it matches")
    rerun.add_argument(
        "--timeouts",
        action="store_true",
        help="the mutants stopped for CPU time too: a run that shared the machine's cores can stop a mutant that "
        "would finish alone (seen: 30 survivors read as timeouts beside another test suite)",
    )
    rerun.add_argument(
        "--budget",
        type=float,
        default=None,
        help="stop after this many seconds (the rest keep their verdict of the last run)",
    )
    refresh = sub.add_parser("refresh", help="after a change: the mutants of changed functions (and unchecked ones)")
    refresh.add_argument("--max-children", type=int, default=2)
    refresh.add_argument("--budget", type=float, default=None, help="stop after this many seconds")
    sample = sub.add_parser("sample", help="a seeded sample")
    sample.add_argument("--n", type=int, default=20)
    sample.add_argument("--seed", type=int, default=18)
    sample.add_argument(
        "--budget", type=float, default=None, help="stop after this many seconds (default: run the whole sample)"
    )
    sample.add_argument("--max-children", type=int, default=2)
    sample.add_argument(
        "--save-stats",
        action="store_true",
        help=f"collect mutmut's stats afresh and commit them "
        f"as {SAMPLE_STATS.name}, for the samples of an unchanged workspace",
    )
    args = ap.parse_args()
    use_scope(args.scope)
    return {"run": cmd_run, "report": cmd_report, "rerun": cmd_rerun, "refresh": cmd_refresh, "sample": cmd_sample}[
        args.cmd
    ](args)


if __name__ == "__main__":
    sys.exit(main())
