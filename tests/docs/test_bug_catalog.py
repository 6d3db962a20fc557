"""docs/bug-catalog.md defines every bug id the project uses, and each entry is true to the repository:
the spec elements it names exist at the lines it gives, its mutant exists and is run, its title is the
bug class docs/mutants.md reports, and its upstream reference agrees with the one the code cites. The
docs link to it, every relative link in README.md and docs/ resolves inside the repository, and no doc
points into ../shared."""

from __future__ import annotations

import ast
import functools
import os
import re
from pathlib import Path

import pytest

from kvfsm.spec.loader import load_yaml

ROOT = Path(__file__).resolve().parents[2]
CATALOG = ROOT / "docs" / "bug-catalog.md"
TEXT = CATALOG.read_text() if CATALOG.exists() else ""
BUG_ID = re.compile(r"(?<![\w#])B(\d{1,2})(?!\d)")
SCANNED = ("spec", "kvfsm", "tests", "docs", "bench", "generated")
SUFFIXES = {".py", ".yaml", ".yml", ".md", ".json", ".txt", ".toml"}
SPEC_REF = re.compile(
    r"(invariant|state|guard|action|event|resource|error|ignore) `(\w+)`(?: in `(\w+)`)? "
    r"\(\[spec/(\w+)\.yaml:(\d+)\]\(\.\./spec/(\w+)\.yaml#L(\d+)\)\)"
)
MUTANT_REF = re.compile(r"`(\w+)` in \[(tests/[\w/]+\.py)\]\(\.\./(tests/[\w/]+\.py)\)")
SECTIONS = {"action": "actions", "state": "states", "guard": "guards", "event": "events", "resource": "resources"}
UPSTREAM_LINK = re.compile(r"\[([\w.-]+/[\w.-]+)#(\d+)\]\(https://github\.com/([\w.-]+/[\w.-]+)/(pull|issues)/(\d+)\)")
CITED = re.compile(r"\((S|V|D|HF PR) #(\d+)\)")  # how tests/catalog_faults.py cites upstream threads
PROJECT = {
    "S": "sgl-project/sglang",
    "V": "vllm-project/vllm",
    "D": "ai-dynamo/dynamo",
    "HF PR": "huggingface/transformers",
}


def _entries() -> dict[str, str]:
    """B-id -> the text of its section (`## Bn: title` up to the next section)."""
    parts = re.split(r"^## (B\d+): ", TEXT, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


ENTRIES = _entries()


def _files():
    for top in SCANNED:
        for path in (ROOT / top).rglob("*"):
            if path.suffix in SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                yield path
    yield ROOT / "README.md"


def _ids_used() -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    for path in _files():
        text = path.read_text(errors="replace")
        for m in BUG_ID.finditer(text):
            used.setdefault(f"B{int(m.group(1))}", []).append(
                f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            )
    return used


def _as_list(v) -> list:
    return v if isinstance(v, list) else [v]


@functools.cache
def _spec_yaml(spec: str) -> tuple:
    """A shipped spec's YAML with its line map, read once (0.15 s a read; the entries ask 51 times)."""
    return load_yaml(ROOT / "spec" / f"{spec}.yaml")


def _spec_line(kind: str, name: str, state: str | None, spec: str) -> int | None:
    data, lines, _ = _spec_yaml(spec)
    if kind == "invariant":
        hits = [i for i, inv in enumerate(data.get("invariants", [])) if inv["name"] == name]
        return lines.line(("invariants", hits[0])) if hits else None
    if kind in ("error", "ignore"):
        section = "errors" if kind == "error" else "ignore"
        hits = [
            i for i, e in enumerate(data.get(section, [])) if name in _as_list(e["on"]) and state in _as_list(e["in"])
        ]
        return lines.line((section, hits[0])) if hits else None
    return lines.line((SECTIONS[kind], name)) if name in data.get(SECTIONS[kind], {}) else None


def _functions(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def _mutants_md_rows() -> dict[str, str]:
    """mutant id -> bug class, from docs/mutants.md's table."""
    rows = {}
    for line in (ROOT / "docs" / "mutants.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| B") and len(cells) > 2:
            rows[cells[0]] = cells[1]
    return rows


def test_the_catalog_exists():
    assert CATALOG.exists(), "docs/bug-catalog.md is missing (the docs refer to it)"
    assert ENTRIES, "docs/bug-catalog.md has no `## Bn: title` entries"


def test_every_bug_id_used_is_defined_in_the_catalog():
    used = _ids_used()
    assert used, "no bug ids found: the scan is broken"
    missing = {b: where[:3] for b, where in used.items() if b not in ENTRIES}
    assert not missing, f"bug ids used but not defined in docs/bug-catalog.md: {missing}"
    for b in ENTRIES:
        assert re.search(rf'<a id="{b.lower()}"></a>\n## {b}: ', TEXT), f"{b} has no anchor #{b.lower()}"


@pytest.mark.parametrize("bug", sorted(ENTRIES, key=lambda b: int(b[1:])))
def test_each_entry_is_complete_and_true_to_the_repository(bug):
    body = ENTRIES[bug]
    title = body.splitlines()[0].strip()
    assert title, f"{bug} has no title"
    for field in ("What goes wrong", "Upstream", "Spec", "Mutant"):
        assert f"- **{field}**: " in body, f"{bug} has no {field}"

    def field(name: str) -> str:
        return re.search(rf"- \*\*{name}\*\*: (.*?)(?=\n- \*\*|\Z)", body, re.S).group(1)

    # the title is the bug class the mutant report gives for this id
    assert _mutants_md_rows().get(bug) == title, (
        f"{bug}: title {title!r}, docs/mutants.md says {_mutants_md_rows().get(bug)!r}"
    )

    # every spec element named exists in that spec, at the line given
    refs = SPEC_REF.findall(field("Spec"))
    assert refs, f"{bug} names no spec invariant, guard or other element with its line"
    for kind, name, state, spec, line, spec2, line2 in refs:
        assert (spec, line) == (spec2, line2), f"{bug}: link text and target differ for {name}"
        actual = _spec_line(kind, name, state or None, spec)
        assert actual is not None, f"{bug}: spec/{spec}.yaml has no {kind} {name!r}" + (
            f" in {state!r}" if state else ""
        )
        assert int(line) == actual, f"{bug}: {kind} {name} is at spec/{spec}.yaml:{actual}, not :{line}"

    # its mutant(s) exist and are run by the mutant suite
    mutants = MUTANT_REF.findall(field("Mutant"))
    assert mutants, f"{bug} names no mutant"
    suite = (ROOT / "tests" / "stateful" / "test_mutants.py").read_text()
    for name, path, path2 in mutants:
        assert path == path2 and path in ("tests/catalog_faults.py", "tests/stateful/test_mutants.py"), path
        assert name in _functions(ROOT / path), f"{bug}: {path} defines no {name}"
        if path == "tests/catalog_faults.py":
            assert re.search(rf"\b{name}\b", suite.split("MUTANTS", 1)[1]), f"{bug}: {name} is not in the mutant suite"

    # the upstream reference: a link to a real thread, or the plain statement that none was found; and the
    # thread the code cites for this class (tests/catalog_faults.py's docstrings) is the one linked
    upstream = field("Upstream")
    links = UPSTREAM_LINK.findall(upstream)
    for shown, number, repo, _, number2 in links:
        assert (shown, number) == (repo, number2), f"{bug}: link text {shown}#{number} points at {repo}/{number2}"
    assert links or "no upstream reference found" in upstream, (
        f"{bug}: neither an upstream link nor 'no upstream reference found'"
    )
    faults = ast.parse((ROOT / "tests" / "catalog_faults.py").read_text())
    for fn in (n for n in faults.body if isinstance(n, ast.FunctionDef) and n.name.split("_")[0] == bug.lower()):
        for project, number in CITED.findall(ast.get_docstring(fn) or ""):
            assert f"{PROJECT[project]}#{number}" in upstream, (
                f"{bug}: tests/catalog_faults.py:{fn.name} cites {project} #{number}; the catalog does not"
            )


def test_docs_that_mention_bug_ids_link_to_the_catalog():
    docs = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
    for path in docs:
        rel = str(path.relative_to(ROOT))
        if path == CATALOG:
            continue
        text = path.read_text()
        if BUG_ID.search(text):
            target = os.path.relpath(CATALOG, path.parent)
            assert re.search(rf"\]\({re.escape(target)}(#b\d+)?\)", text), (
                f"{rel} mentions bug ids but does not link to {target}"
            )


def _links(text: str):
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    for m in re.finditer(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)", text):
        yield m.group(1) or m.group(2)


def _anchors(path: Path) -> set[str]:
    text = path.read_text()
    ids = set(re.findall(r'<a id="([^"]+)"></a>', text))
    for heading in re.findall(r"^#+ (.+)$", text, re.M):  # GitHub's heading slugs
        ids.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return ids


def test_every_relative_link_in_the_docs_resolves_inside_the_repository():
    broken = []
    for path in [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md")):
        text = path.read_text()
        assert "../shared" not in text and "](shared/" not in text, f"{path.relative_to(ROOT)} points into shared/"
        for link in _links(text):
            if re.match(r"[a-z]+:", link) or link.startswith("#") and not link[1:]:
                continue
            target, _, anchor = link.partition("#")
            resolved = (path.parent / target).resolve() if target else path.resolve()
            where = f"{path.relative_to(ROOT)} -> {link}"
            if ROOT.resolve() not in resolved.parents and resolved != ROOT.resolve():
                broken.append(f"{where} (outside the repository)")
            elif (ROOT / "shared").resolve() in (resolved, *resolved.parents):
                broken.append(f"{where} (into shared/)")
            elif not resolved.exists():
                broken.append(f"{where} (missing)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{where} (no anchor #{anchor})")
            elif (
                anchor
                and resolved.suffix in (".yaml", ".py")
                and re.fullmatch(r"L(\d+)", anchor)
                and int(anchor[1:]) > resolved.read_text().count("\n") + 1
            ):
                broken.append(f"{where} (past the end of the file)")
    assert not broken, "broken links: " + "; ".join(broken)
