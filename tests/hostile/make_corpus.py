"""Write tests/hostile/corpus/: the hostile inputs every reader and CLI command is run on.

Each file is what an attacker or a broken generator hands kvfsm; the name says the reader and the shape.
Run from anywhere (`python tests/hostile/make_corpus.py`); the output is deterministic, so the committed
corpus is exactly what this writes.
"""

from __future__ import annotations

from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus"
MINIMAL = CORPUS.parents[1] / "specs" / "valid" / "minimal.yaml"


def billion_laughs(levels: int = 9, fan: int = 9) -> str:
    """Nested YAML aliases: `levels` anchors, each a list of `fan` aliases of the one before (fan**levels
    strings once expanded, about a kilobyte on disk)."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * fan)}]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fan)}]")
    return "\n".join(lines) + "\n"


def nested_lists(depth: int) -> str:
    return "[" * depth + "]" * depth


def files() -> dict[str, bytes]:
    laughs = billion_laughs()
    header = '{"kind": "header", "spec_sha256": "0"}\n'
    return {
        "spec_billion_laughs.yaml": ("machine: Laughs\n" + laughs).encode(),
        "spec_nested_5000.yaml": ("machine: Deep\nstates: " + nested_lists(5000) + "\n").encode(),
        "spec_not_utf8.yaml": b"machine: \xff\xfe\x00bad\n",
        "spec_empty.yaml": b"",
        "spec_garbage.yaml": bytes(range(256)) * 4,
        "spec_long_guard.yaml": MINIMAL.read_text()
        .replace("expr: jobs > 1", "expr: " + "(" * 3000 + "jobs > 1" + ")" * 3000)
        .encode(),
        "config_nested_3000.yaml": ("page_size: 1\nstorage_extra: " + nested_lists(3000) + "\n").encode(),
        "config_nested_3000.json": ('{"page_size": 1, "storage_extra": ' + nested_lists(3000) + "}\n").encode(),
        "config_billion_laughs.yaml": (
            "page_size: 1\nstorage_extra:\n" + "".join(f"  {l}\n" for l in laughs.splitlines())
        ).encode(),
        "config_not_utf8.yaml": b"page_size: \xff\xfe\n",
        "trace_nested_100000.jsonl": (nested_lists(100_000) + "\n").encode(),
        "trace_nested_1000.jsonl": (nested_lists(1000) + "\n").encode(),
        "trace_not_utf8.jsonl": b'{"kind": "\xff\xfe"}\n' + header.encode(),
    }


def main() -> None:
    CORPUS.mkdir(exist_ok=True)
    for name, data in files().items():
        (CORPUS / name).write_bytes(data)


if __name__ == "__main__":
    main()
