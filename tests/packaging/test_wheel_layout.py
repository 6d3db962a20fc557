"""The wheel's package list is the tree's: a new subpackage cannot be left out of the distribution.

pyproject.toml lists packages explicitly (the package-dir mapping of generated/ and spec/ into kvfsm
rules out automatic discovery), so this test is what keeps that list honest.
"""

from __future__ import annotations

from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, which pytest itself requires there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_of_the_tree_is_in_the_wheel_and_nothing_else() -> None:
    tree = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kvfsm").rglob("__init__.py")}
    templates = {".".join(p.relative_to(ROOT).parts) for p in (ROOT / "kvfsm").rglob("templates") if p.is_dir()}
    listed = set(_setuptools()["packages"])
    assert listed == tree | templates | {"kvfsm.generated.spec"}


def test_generated_code_and_specs_install_inside_kvfsm_only() -> None:
    cfg = _setuptools()
    assert cfg["package-dir"] == {"kvfsm.generated": "generated", "kvfsm.generated.spec": "spec"}
    assert all(p == "kvfsm" or p.startswith("kvfsm.") for p in cfg["packages"])  # no top-level `generated`
    data = cfg["package-data"]
    assert set(data["kvfsm.generated.spec"]) == {"*.yaml", "*.json"}
    shipped = {p.name for pattern in data["kvfsm.generated.spec"] for p in (ROOT / "spec").glob(pattern)}
    assert {"decode_offload.yaml", "cb_swap.yaml", "kvfsm-spec.schema.json"} <= shipped
    for package, patterns in data.items():
        folder = ROOT / cfg["package-dir"].get(package, package.replace(".", "/"))
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"package data {package}:{pattern} matches nothing in {folder}"


def test_checkout_resolves_kvfsm_generated_to_the_top_level_folder() -> None:
    import kvfsm.generated.decode_offload as machine
    from kvfsm.spec.locations import generated_dir, packaged_spec, schema_path

    assert Path(machine.__file__).resolve() == ROOT / "generated" / "decode_offload.py"
    assert generated_dir() == ROOT / "generated"
    assert packaged_spec() == ROOT / "spec" / "decode_offload.yaml"
    assert schema_path() == ROOT / "spec" / "kvfsm-spec.schema.json"


def test_no_module_imports_a_top_level_generated() -> None:
    """Installed, there is no top-level `generated`: such an import would find the user's package, or none."""
    import ast

    offenders = []
    for path in (
        sorted((ROOT / "kvfsm").rglob("*.py"))
        + sorted((ROOT / "bench").rglob("*.py"))
        + sorted((ROOT / "tests").rglob("*.py"))
    ):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            offenders += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {n}"
                for n in names
                if n == "generated" or n.startswith("generated.")
            ]
    assert not offenders, offenders
