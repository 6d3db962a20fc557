"""The README's table of tested versions (and docs/verification.md's) is the compatibility matrix that
`make test-compat` runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import matrix  # noqa: E402


@pytest.mark.parametrize("page", ["README.md", "docs/verification.md"])
def test_the_readme_lists_every_row_of_the_matrix(page: str) -> None:
    """The README's table, and the docs site's copy of it, are the matrix's rows."""
    text = (matrix.ROOT / page).read_text()
    table = "\n".join(matrix.table())
    assert table in text, f"{page}'s table of tested versions is not tests/compat/matrix.py's:\n{table}"


def test_each_row_pins_what_the_project_declares_it_supports() -> None:
    """A row is only as good as its pins: the oldest rows must sit at the declared lower bounds."""
    pyproject = (matrix.ROOT / "pyproject.toml").read_text()
    oldest = matrix.BY_NAME["oldest"]
    assert f'requires-python = ">={oldest.python}"' in pyproject
    assert f'"torch>={oldest.torch.rsplit(".", 1)[0]}"' in pyproject
    assert f'"pydantic>={oldest.pydantic.rsplit(".", 1)[0]},<3"' in pyproject
    assert f'"numpy>={oldest.numpy.rsplit(".", 1)[0]}"' in pyproject  # type: ignore[union-attr]
    lowest = matrix.BY_NAME["oldest-transformers"].transformers
    assert f'"transformers>={lowest.rsplit(".", 1)[0]},' in pyproject  # type: ignore[union-attr]


def test_the_transformers_integration_warns_outside_the_range_the_extra_declares() -> None:
    """install() warns on a transformers the extra does not admit: the two ranges are one."""
    import re

    pytest.importorskip("transformers")
    from kvfsm.integrations.transformers.compat import TESTED_VERSIONS

    extra = re.search(r'^transformers = \["transformers(.*?)"\]', (matrix.ROOT / "pyproject.toml").read_text(), re.M)
    assert extra is not None and extra.group(1) == ",".join(TESTED_VERSIONS)
