"""Carry the GPU pass's verdicts across a change that moves no mutant: a reformatting of mutated modules.

    .venv/bin/python tests/mutation/rekey.py --base REV [--scope main] [--write]

tests/mutation/gpu_pass.json keys each verdict by its mutant's change text (mutmut's `-`/`+` lines), and so do
the equivalences of tests/mutation/equivalent*.py. A formatter rewrites those lines without changing any mutant.
This script proves that and re-keys what only a GPU host can re-decide:

1. it generates the scope's mutants twice, from REV's tree and from the checkout, each in a workspace of its own
   under a temporary folder (the scope's own workspace, where a run may be going on, is not touched);
2. it requires the same mutant names, and every mutated function (mutmut's `x_f__mutmut_N`, its trampoline's
   body) identical as an AST, with positions left out. A change that fails this moved a mutant: the GPU pass
   has to run again, and nothing is written;
3. it requires every survivor the scope's records hold (survivors*.json, REV's texts) to take the same reason
   from REV's equivalent*.py (its old text) as from the checkout's (its new text), and names each one that does
   not, so a survivor's reason is neither lost nor changed. A killed mutant whose reason changes only counts: no
   record holds its reason (a reformatted line can share its text with another's, which an entry then matches too);
4. with `--write`, it rewrites each verdict of gpu_pass.json whose mutant is the scope's, from its old change text
   to its new one, and records the rekey (the base revision, how many moved) under `rekeyed`.

The CPU run's records (survivors, docs/mutation.md) come from the scope's next run (`mutate.py run`).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mutate  # noqa: E402


def _tree_at(rev: str, dest: Path) -> Path:
    """REV's tracked files (git archive) at `dest`."""
    archive = subprocess.run(["git", "archive", rev], cwd=mutate.ROOT, capture_output=True, check=True).stdout
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def _commit(rev: str) -> str:
    """REV as the commit it names (a record outlives what HEAD or a branch names)."""
    return subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=mutate.ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def _checkout_at(dest: Path) -> Path:
    """The checkout's files as they are now (tracked, and untracked but not ignored) at `dest`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=mutate.ROOT, capture_output=True, check=True
    ).stdout
    for rel in filter(None, listed.decode().split("\0")):
        src = mutate.ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(src.read_bytes())
    return dest


def mutants_of(tree: Path, scope: str) -> tuple[dict[str, str], dict[str, str]]:
    """Generate `scope`'s mutants from `tree` in a workspace of its own: (name -> change, name -> AST dump of every
    mutated function). The mutate module is the checkout's; only its tree and workspace are pointed at `tree`."""
    mutate.use_scope(scope)
    root, work = mutate.ROOT, mutate.WORK
    mutate.ROOT, mutate.WORK = tree, tree / "build" / "rekey"
    try:
        mutate.layout()
        if mutate.generate(2) != 0:
            raise SystemExit(f"mutmut could not generate the mutants of {tree}")
        changes = {m.name: mutate.diff_of(m) for m in mutate.results()}
        bodies: dict[str, str] = {}
        for path in sorted((mutate.WORK / "mutants").rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "__mutmut_" in node.name:
                    bodies[f"{path.relative_to(mutate.WORK / 'mutants')}:{node.name}"] = ast.dump(node)
        return changes, bodies
    finally:
        mutate.ROOT, mutate.WORK = root, work


def reasons(tree: Path, scope: str, changes: dict[str, str]) -> dict[str, str | None]:
    """Each mutant's reason under `tree`'s equivalent*.py: equivalent (EQUIVALENT), or left to the GPU pass
    (NEEDS_GPU_PASS), or None. In a process of its own: the modules of two trees share their names."""
    code = (
        "import json, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import mutate\n"
        "mutate.SCOPE = mutate.SCOPES[sys.argv[2]]  # its lists only: its venv is the checkout's, not the tree's\n"
        "lists = mutate.equivalents(), mutate.needs_gpu_pass()\n"
        "def why(name, change):\n"
        "    function = name.rsplit('__mutmut_', 1)[0]\n"
        "    return next(filter(None, (mutate.equivalent_reason(l, function, change) for l in lists)), None)\n"
        "print(json.dumps({n: why(n, c) for n, c in json.load(sys.stdin).items()}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tree / "tests" / "mutation"), scope],
        input=json.dumps(changes),
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"the reasons of {tree} could not be read:\n{out.stderr}")
    return json.loads(out.stdout)


def rekey_verdicts(verdicts: list[dict], moves: dict[tuple[str, str], set[str]]) -> tuple[int, list[dict]]:
    """Rewrite, in place, each verdict whose (function, change) `moves` maps to one new change text; (how many,
    the verdicts left because two mutants of the function shared their old text and not their new one)."""
    rekeyed, ambiguous = 0, []
    for m in verdicts:
        moved_to = moves.get((m["function"], m["change"]))
        if moved_to is None:
            continue
        if len(moved_to) > 1:
            ambiguous.append(m)
            continue
        (m["change"],) = moved_to
        rekeyed += 1
    return rekeyed, ambiguous


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the revision whose mutant texts gpu_pass.json holds")
    ap.add_argument("--scope", choices=sorted(mutate.SCOPES), default="main")
    ap.add_argument("--write", action="store_true", help="rewrite gpu_pass.json (default: check only)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvfsm-rekey-") as tmp:
        old, old_bodies = mutants_of(_tree_at(args.base, Path(tmp) / "base"), args.scope)
        current = _checkout_at(Path(tmp) / "current")
        new, new_bodies = mutants_of(current, args.scope)
        if set(old) != set(new) or set(old_bodies) != set(new_bodies):
            print(f"the mutants differ: {len(set(old) ^ set(new))} names in one tree only; run the GPU pass again")
            return 1
        moved = sorted(k for k in old_bodies if old_bodies[k] != new_bodies[k])
        if moved:
            print(f"{len(moved)} mutated functions differ as ASTs (first: {moved[0]}); run the GPU pass again")
            return 1
        before, after = reasons(Path(tmp) / "base", args.scope, old), reasons(current, args.scope, new)
        recorded = {
            (s["function"], mutate._norm(s["change"]))
            for s in json.loads(mutate.SCOPES[args.scope].survivors.read_text())["survivors"]
        }
        moved_reasons = [n for n in old if before[n] != after[n]]
        lost = sorted(n for n in moved_reasons if (n.rsplit("__mutmut_", 1)[0], mutate._norm(old[n])) in recorded)
        for n in lost:
            print(f"{n}: its equivalence reason changed\n  was: {before[n]}\n  now: {after[n]}\n{new[n]}")
        texts: dict[tuple[str, str], set[str]] = {}
        for n in old:
            if old[n] != new[n]:
                texts.setdefault((n.rsplit("__mutmut_", 1)[0], mutate._norm(old[n])), set()).add(mutate._norm(new[n]))
    record = json.loads(mutate.GPU_PASS.read_text())
    rekeyed, ambiguous = rekey_verdicts(record["mutants"], texts)
    print(
        f"{len(old)} mutants, each the same AST in both trees; {len(texts)} changed their text, {rekeyed} of them "
        f"GPU pass verdicts; {len(lost)} recorded survivors' reasons changed, and "
        f"{len(moved_reasons) - len(lost)} other mutants'"
    )
    for m in ambiguous:
        print(f"{m['function']}: two mutants shared the old text and now differ; this verdict was left:\n{m['change']}")
    if lost or ambiguous:
        return 1
    if args.write and rekeyed:
        record["mutants"].sort(key=lambda r: (r["function"], r["change"]))
        record.setdefault("rekeyed", []).append(
            {
                "base": _commit(args.base),
                "scope": args.scope,
                "verdicts": rekeyed,
                "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
        )
        mutate.GPU_PASS.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
