"""The generated machines, as the package `kvfsm.generated` (written by `kvfsm gen`; never edit by hand).

In a source checkout the modules live in the repository's top-level `generated/` (the project's layout) and
this file points the package there. The wheel maps `generated/` onto `kvfsm/generated/` instead, with the
specs they came from beside them in `kvfsm/generated/spec/`, so no top-level `generated` is ever installed.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "generated")]
