"""MkDocs hook: the repository files the docs link to become pages of the site.

The pages in docs/ link into the repository (`../spec/decode_offload.yaml#L42`, `../tests/catalog_faults.py`,
`../kvfsm/dataplane/pools/`), so that they read the same on a repository host as in a checkout. A site built
from docs/ alone has none of those files. This hook adds one page per linked file, its text with numbered
lines, and one per linked folder, its listing, under `source/`, and points each such link there (`#L42`
becomes the anchor of line 42), so every link of the site resolves and `mkdocs build --strict` checks them.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

# a Markdown link or image target that is relative: ](path) or ](path#anchor)
LINK = re.compile(r"(\]\()(?![a-z][a-z0-9+.-]*:|#|/)([^)\s#]+)(#[^)\s]*)?(\))")
LANGUAGES = {".py": "python", ".yaml": "yaml", ".yml": "yaml", ".json": "json", ".toml": "toml", ".sh": "bash"}
SOURCE = "source"


def _outside_target(config: MkDocsConfig, page_uri: str, target: str) -> str | None:
    """The repository path a page's link points at, when it leaves docs/ and stays in the repository."""
    root = Path(config.config_file_path).resolve().parent
    docs = Path(config.docs_dir).resolve()
    resolved = (docs / posixpath.dirname(page_uri) / target).resolve()
    if docs in (resolved, *resolved.parents) or root not in resolved.parents or not resolved.exists():
        return None
    return resolved.relative_to(root).as_posix() + ("/" if resolved.is_dir() else "")


def _page_uri(repo_path: str) -> str:
    return f"{SOURCE}/{repo_path}index.md" if repo_path.endswith("/") else f"{SOURCE}/{repo_path}.md"


def _content(root: Path, repo_path: str) -> str:
    path = root / repo_path
    if path.is_dir():
        entries = sorted(
            p.name + ("/" if p.is_dir() else "")
            for p in path.iterdir()
            if p.name != "__pycache__" and not p.name.startswith(".")
        )
        return f"# `{repo_path}`\n\n" + "".join(f"- `{e}`\n" for e in entries)
    text = path.read_text()
    fence = "~" * max([3, *(len(run) + 1 for run in re.findall(r"~{3,}", text))])
    language = LANGUAGES.get(path.suffix, "text")
    return f'# `{repo_path}`\n\n{fence} {language} linenums="1"\n{text.rstrip()}\n{fence}\n'


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = Path(config.config_file_path).resolve().parent
    wanted: set[str] = set()
    for file in list(files.documentation_pages()):
        if file.abs_src_path is None:
            continue
        text = Path(file.abs_src_path).read_text()
        for m in LINK.finditer(text):
            repo_path = _outside_target(config, file.src_uri, m.group(2))
            if repo_path is not None:
                wanted.add(repo_path)
    for repo_path in sorted(wanted):
        files.append(
            File.generated(
                config, _page_uri(repo_path), content=_content(root, repo_path), inclusion=InclusionLevel.NOT_IN_NAV
            )
        )
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.src_uri.startswith(f"{SOURCE}/"):
        return markdown  # a repository file's own text, shown as it is

    def rewrite(m: re.Match[str]) -> str:
        repo_path = _outside_target(config, page.file.src_uri, m.group(2))
        if repo_path is None:
            return m.group(0)
        anchor = m.group(3) or ""
        line = re.fullmatch(r"#L(\d+)", anchor)
        if line:
            anchor = f"#__codelineno-0-{line.group(1)}"
        target = posixpath.relpath(_page_uri(repo_path), posixpath.dirname(page.file.src_uri) or ".")
        return f"{m.group(1)}{target}{anchor}{m.group(4)}"

    return LINK.sub(rewrite, markdown)


def on_page_content(html: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """A source page's line anchors are made by the highlighter, after the Markdown that mkdocs reads its
    anchors from: they are added here, so that the links to a line are checked like any other anchor."""
    if page.file.src_uri.startswith(f"{SOURCE}/") and page.present_anchor_ids is not None:
        page.present_anchor_ids.update(re.findall(r'id="(__codelineno-[\d-]+)"', html))
    return html
