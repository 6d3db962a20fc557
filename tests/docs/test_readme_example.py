"""The integration example of docs/integrations.md frees everything it allocates at any step count (trap: at 10 steps
it used to leave 12 of 252 slots allocated, because it wrote 32 slots into the table but told the manager
only its committed length was allocated)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from readme_example import PAGE, ReadmeExampleError, example_source
from timing import run_watched

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_PAGE = (ROOT / PAGE).read_text()


@pytest.mark.parametrize("steps", [0, 1, 7, 10, 11, 20, 33, 100])
def test_example_frees_every_slot_at_any_step_count(steps: int) -> None:
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(example_source(EXAMPLE_PAGE, steps), f"{PAGE} (integration example)", "exec"), namespace)
    allocator, manager = namespace["allocator"], namespace["manager"]
    assert allocator.free_slots == allocator.capacity  # type: ignore[attr-defined]
    assert manager.idle() and manager.host_pool.free_slots == manager.host_pool.capacity  # type: ignore[attr-defined]
    assert namespace["table"].free_rows == namespace["table"].rows  # type: ignore[attr-defined]
    if steps >= 10:  # 10 prompt tokens: whole strides of decode KV exist from here on
        assert manager.metrics.stored_pages > 0  # type: ignore[attr-defined]
    assert not os.path.exists(namespace["store"].name)  # type: ignore[attr-defined]


@pytest.mark.parametrize("steps", [10, 20])
def test_example_runs_as_a_script_outside_the_checkout(steps: int, tmp_path: Path) -> None:
    """As a user runs it: its own process, a working directory that is not the checkout."""
    script = tmp_path / "example.py"
    script.write_text(example_source(EXAMPLE_PAGE, steps))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFSM_")}
    proc = run_watched([sys.executable, str(script)], "the integration example as a script", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no warning either: the example configures everything it relies on
    assert sorted(p.name for p in tmp_path.iterdir()) == ["example.py"]  # nothing written beside it


def test_substitution_and_its_errors() -> None:
    code = example_source(EXAMPLE_PAGE, 3)
    assert "DECODE_STEPS = 3\n" in code or "DECODE_STEPS = 3 " in code
    assert "range(DECODE_STEPS)" in code
    with pytest.raises(ReadmeExampleError, match="section"):
        example_source("# kvfsm\n", 10)
    with pytest.raises(ReadmeExampleError, match="python block"):
        example_source("## Integrating with an engine\n\ntext\n\n## Next\n```python\nx = 1\n```\n", 10)
    with pytest.raises(ReadmeExampleError, match="DECODE_STEPS"):
        example_source("## Integrating with an engine\n```python\nfor s in range(20): pass\n```\n", 10)
    with pytest.raises(ValueError, match="decode_steps"):
        example_source(EXAMPLE_PAGE, -1)
