"""Where the shipped specs and generated machines are, in a checkout and in an installed wheel alike.

A checkout keeps the project's layout: `spec/` and `generated/` at the top. The wheel maps them into the
package (`kvfsm/generated/`, with the specs in `kvfsm/generated/spec/`), so the CLI finds its spec from any
directory and no top-level `generated` is installed. Every default spec path goes through here.
"""

from __future__ import annotations

from pathlib import Path

import kvfsm.generated

DEFAULT_SPEC_NAME = "decode_offload"
SCHEMA_FILE = "kvfsm-spec.schema.json"


def generated_dir() -> Path:
    """The folder that holds the generated machines (`kvfsm.generated`)."""
    return Path(next(iter(kvfsm.generated.__path__))).resolve()


def spec_dir() -> Path:
    """The folder of the shipped specs: `kvfsm/generated/spec/` installed, `spec/` in a checkout."""
    shipped = generated_dir() / "spec"
    return shipped if shipped.is_dir() else generated_dir().parent / "spec"


def packaged_spec(name: str = DEFAULT_SPEC_NAME) -> Path:
    """The shipped spec `name` (`decode_offload` is the manager's)."""
    return spec_dir() / f"{name}.yaml"


def schema_path() -> Path:
    """The spec format's JSON Schema as shipped (what `kvfsm schema` writes and `--check` compares)."""
    return spec_dir() / SCHEMA_FILE


def default_out_dir(spec_path: Path) -> Path:
    """Where `kvfsm gen` writes a spec's machine: the shipped specs' own package, else the `generated/`
    beside the spec's folder (the project layout), whatever the working directory."""
    spec_path = Path(spec_path).resolve()
    if spec_path.parent == spec_dir():
        return generated_dir()
    return spec_path.parent.parent / "generated"


def spec_stamp(spec_path: Path) -> str:
    """The spec path stamped into generated code and docs: `<folder>/<file>`, e.g. `spec/decode_offload.yaml`,
    the same from any working directory and in a wheel (whose specs sit in `generated/spec/`)."""
    spec_path = Path(spec_path).resolve()
    return f"{spec_path.parent.name}/{spec_path.name}"
