"""Shared test configuration: hypothesis profiles, the GPU marker, and the order modules start in.

`KVFSM_FUZZ=deep` (or `pytest --fuzz=deep`) selects the long fuzz profile; CI runs the fast `ci` one.

`make test` runs the suite on every core with pytest-xdist, a module at a time (`-n auto --dist loadfile
--no-loadscope-reorder`): a module's tests share one worker, so its module fixtures are built once and the
tests that check what the tests before them recorded (`test_zz_*`, and the benchmark figures' last check) see
every one of them. Workers take modules in collection order, which puts LONG_MODULES first, longest first:
a long module started last would run alone at the end while the other core idles.
"""

from __future__ import annotations

import gc
import os

# One torch thread per process. The suite already fills every core with its own processes (xdist workers, and
# sglang's and vLLM's suites beside them in `make test`); torch's OpenMP pool adds a thread per core to each
# process, and its threads spin while they wait for work, taking the cores from the other processes: with the
# pool, `kvfsm bench --quick` beside the stateful fuzz took 80 s on the 2-core CI machine, without it 25 s.
# Set before torch is imported, so it holds for this process and every process the tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=200, deadline=None, derandomize=False, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("deep", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("KVFSM_FUZZ", "ci"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz", choices=("ci", "deep"), default=None, help="hypothesis profile (default: $KVFSM_FUZZ or ci)"
    )


def pytest_configure(config: pytest.Config) -> None:
    profile = config.getoption("--fuzz")
    if profile:
        os.environ["KVFSM_FUZZ"] = profile
        settings.load_profile(profile)


# Seconds each took in the suite on the 2-core CI machine, idle, 2 workers (pytest --durations=0, 2026-12-06, a
# day the machine ran the suite about 1.7x slower than on 2026-12-05; the mutation sample runs two mutmut children
# of its own, and its figure is estimated from 132 s alone for its 20 mutants with committed stats); every module
# not listed takes under 25 s that day and keeps its place after these (test_batch_events.py, 52 s then, and
# test_transformers_swap.py, 31 s, since take 4 and 16 s of CPU). The figures only order the start, a stale one costs
# time, not a result.
LONG_MODULES = {
    "tests/mutation/test_mutation_sample.py": 180,
    "tests/stateful/test_mutants.py": 114,
    "tests/verify/test_reduction_soundness.py": 112,
    "tests/stateful/test_production_matrix.py": 77,
    "tests/verify/test_ci_bound.py": 68,
    "tests/packaging/test_installed_wheel.py": 55,
    "tests/stateful/test_manager_machine.py": 47,
    "tests/stateful/test_production_mutants.py": 47,
    "tests/hostile/test_atheris.py": 46,
    "tests/verify/test_explorer.py": 44,
    "tests/mooncake/test_mooncake_store.py": 38,
    "tests/bench/test_bench_quick.py": 30,
    "tests/verify/test_parallel_jobs.py": 26,
}


def _module_cost(item: pytest.Item) -> int:
    return LONG_MODULES.get(item.nodeid.split("::", 1)[0], 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: -_module_cost(item))  # stable: each module's tests stay in file order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; the CPU twin of this test runs instead")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, transformers, hypothesis, every test module) is moved out of the collector's
    reach, so that a full collection walks only what the tests themselves made. Full collections run in the
    tests: transformers' continuous batching calls `gc.collect()` when it stops, which over that heap took 11 of
    test_transformers_swap.py's 30 s of CPU (19 s with the freeze); the rest are the interpreter's own, triggered
    by the tests' allocations. Objects made before the freeze are never freed by a collection, only by their
    reference counts, which a test suite that imports once loses nothing by."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def schema_as_committed() -> None:
    """Skips a test that compares spec/kvfsm-spec.schema.json with this pydantic's rendering of the spec models
    where the two differ by pydantic alone: older pydantic (2.5, the oldest rows of tests/compat/matrix.py)
    writes no `propertyNames` for a mapping's constrained keys, which the committed schema, written by a newer
    one, has."""
    from typing import Annotated

    import pydantic
    from pydantic import StringConstraints, TypeAdapter

    if "propertyNames" not in TypeAdapter(dict[Annotated[str, StringConstraints(max_length=1)], int]).json_schema():
        pytest.skip(
            f"pydantic {pydantic.VERSION} renders the JSON Schema without propertyNames for constrained "
            "mapping keys; spec/kvfsm-spec.schema.json is a newer pydantic's rendering"
        )


def deep() -> bool:
    """Whether the deep fuzz profile is selected (for tests that size their own loops)."""
    return os.environ.get("KVFSM_FUZZ", "ci") == "deep"
