"""The GPU mutation pass: the survivors of `make mutate` that only a CUDA host can tell apart, run against the
GPU tests on a GPU machine (docs/mutation.md, "GPU pass").

    python tests/mutation/gpu_pass.py list                        # the mutants this pass runs, and why
    python tests/mutation/gpu_pass.py run --out DIR [--jobs 8]    # on the GPU machine: every mutant, then the log
                                                                  # (there: tests/mutation/run_on_device.sh)
    python tests/mutation/gpu_pass.py report                      # docs/mutation.md's GPU section, from gpu_pass.json

The CPU run (mutate.py) marks a survivor as told apart only on a CUDA host when its reason in
tests/mutation/equivalent*.py says the difference needs a CUDA device to show (a tensor that stays on the CPU
either way, pinning that needs CUDA; `mutate.NEEDS_CUDA`). That is a statement about where the tests ran, not
about the mutant, so such a survivor is never counted equivalent: it runs here, against every test marked `gpu`.
A pass's `gpu_pass.json` (written under --out) is copied to tests/mutation/gpu_pass.json, and its device log,
`mutation_gpu-<gpu>.log` (h100, h200: the card that ran it), is added to the end of that card's log in
bench/results/ (a pass with --previous logs only the mutants it ran), before `report`. mutmut itself cannot run them: it forks its test process for each mutant, and a
process that has initialised CUDA cannot fork a child that uses it. So each mutant is applied to a copy of the
tree from its recorded change (function and `-`/`+` lines, tests/mutation/survivors.json) and its tests run in
a fresh process; the unmutated tree runs first, and a pass whose clean run fails reports nothing.
"""

from __future__ import annotations

import argparse
import ast
import collections
import concurrent.futures as cf
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import mutate  # noqa: E402  (the CPU run: its survivors, equivalence reasons and normalisation)

RESULTS = mutate.GPU_PASS  # the last GPU pass, machine-readable (what the report and the docs read)
# What each mutant's tree leaves out of the checkout (it holds the rest), and the tests it runs: every test marked `gpu`. The SGLang adapter's
# GPU test needs SGLang importable (it skips otherwise, and the pass records that it skipped).
SKIP = {".git", ".old", "build", "kvfsm-store", "kvfsm.egg-info", ".device", ".whl"}
# -p no:anyio: the anyio carried for SGLang shadows the device's own, whose pytest plugin it does not carry
PYTEST = [
    "-m",
    "pytest",
    "-q",
    "-x",
    "-p",
    "no:cacheprovider",
    "-p",
    "no:randomly",
    "-p",
    "no:anyio",
    "-o",
    "addopts=",
    "--tb=line",
    "-rfEs",
]
# (pytest arguments, test files): the tests marked `gpu`, then the files whose CPU tests take CUDA branches
# when a device is present (pinned host pools, a CUDA request table, the kill tests of the CPU run).
# The files that killed the most mutants of earlier passes come first: a mutant dies at its first failure (-x).
SUITES = [
    (
        ["-m", "gpu"],
        [
            "tests/gpu/test_cross_device_inputs_gpu.py",
            "tests/gpu/test_device_placement_gpu.py",
            "tests/upstream/test_adapter_devices_gpu.py",
            "tests/dataplane/test_layer_pool.py",
            "tests/dataplane/test_copy_engine.py",
            "tests/engine/test_demo.py",
            "tests/upstream/test_adapter_gpu.py",
            "tests/gpu",
            "tests/dataplane/test_cuda_pipeline.py",
            "tests/runtime/test_config_errors.py",
            "tests/runtime/test_tp_demo.py",
            "tests/stateful/test_production_mutants.py",
            "tests/stateful/test_production_matrix.py",
            "tests/dataplane/test_process_storage.py",
        ],
    ),
    (
        [],
        [
            "tests/dataplane/test_host_pool.py",
            "tests/runtime/test_offload_batch.py",
            "tests/mutation/test_kills.py",
            # ProgressConsensus reduces only in a group of two or more ranks; these tests stand in a collective
            # that checks the device its counts arrive on (NCCL's is the rank's GPU), on one GPU or none
            "tests/mutation/test_kills_runtime.py",
            # the shared pool's pinning: its CUDA branch and the page locks a dropped pool gives back
            "tests/mutation/test_kills_shared_pool.py",
        ],
    ),
]
MUTANT_TIMEOUT_S = 420  # a mutant whose tests hang past this is killed (as mutmut counts a timeout)


@dataclass(frozen=True)
class Mutant:
    function: str  # mutmut's name: module.x_function or module.xǁClassǁmethod
    change: str  # normalised `-`/`+` lines
    reason: str  # why the CPU run could not tell it apart
    scope: str = "main"  # the mutation scope whose run left it (mutate.SCOPES)

    @property
    def module_path(self) -> str:
        module = self.function.rsplit(".", 1)[0]
        if module.startswith("kvfsm.generated."):  # laid out as the wheel does in the CPU run
            return "generated/" + module.rsplit(".", 1)[1] + ".py"
        return module.replace(".", "/") + ".py"

    @property
    def qualname(self) -> list[str]:
        short = self.function.rsplit(".", 1)[1]
        if short.startswith("x\u01c1"):
            return short[2:].split("\u01c1")
        return [short.removeprefix("x_")]

    @property
    def key(self) -> str:
        return f"{self.function}\n{self.change}"


def selected() -> list[Mutant]:
    """The CPU runs' survivors whose only reason is the missing CUDA device: the main run's (their reason in
    equivalent*.py matches NEEDS_CUDA), then each other scope's (listed in its module's NEEDS_GPU_PASS)."""
    equiv = mutate.equivalents()
    out = []
    for s in json.loads(mutate.SURVIVORS.read_text())["survivors"]:
        why = mutate.equivalent_reason(equiv, s["function"], s["change"])
        if why and mutate.NEEDS_CUDA.search(why):
            out.append(Mutant(s["function"], s["change"], why))
    for scope in mutate.SCOPES.values():
        if scope.name == "main" or not scope.survivors.exists():
            continue
        needs = mutate.needs_gpu_pass(scope)
        for s in json.loads(scope.survivors.read_text())["survivors"]:
            why = mutate.equivalent_reason(needs, s["function"], s["change"]) if s.get("needs_gpu_pass") else None
            if why:
                out.append(Mutant(s["function"], s["change"], why, scope.name))
    return out


def _function_span(tree: ast.Module, qualname: list[str]) -> tuple[int, int]:
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in qualname:
        node = next(
            (
                n
                for n in body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part
            ),
            None,
        )
        if node is None:
            raise LookupError(f"no {'.'.join(qualname)}")
        body = node.body  # type: ignore[attr-defined]
    assert node is not None and node.end_lineno is not None
    return node.lineno, node.end_lineno  # type: ignore[attr-defined]


def _norm_line(line: str) -> str:
    return re.sub(r"\s+", " ", line.strip())


def apply(mutant: Mutant, root: Path) -> None:
    """Write the mutant into the tree at `root`: its `-` lines, found in order inside its function, become its
    `+` lines (each at the indentation of the line it replaces). Raises LookupError when the change does not
    apply, which the pass reports rather than counting the mutant."""
    path = root / mutant.module_path
    src = path.read_text().splitlines(keepends=True)
    start, end = _function_span(ast.parse("".join(src)), mutant.qualname)
    old = [l[1:].strip() for l in mutant.change.splitlines() if l.startswith("-")]
    new = [l[1:].strip() for l in mutant.change.splitlines() if l.startswith("+")]
    if not old:
        raise LookupError("a change with no removed line")
    hits = [
        i
        for i in range(start - 1, end - len(old) + 1)
        if all(_norm_line(src[i + k]) == _norm(o) for k, o in enumerate(old))
    ]
    if not hits:
        raise LookupError(f"the removed lines are not in {'.'.join(mutant.qualname)}")
    i = hits[0]
    indent = re.match(r"\s*", src[i]).group(0)  # type: ignore[union-attr]
    src[i : i + len(old)] = [indent + n + "\n" for n in new]
    text = "".join(src)
    compile(text, str(path), "exec")  # a mutant must still be Python: mutmut's are
    path.write_text(text)


def _norm(line: str) -> str:
    return re.sub(r"\s+", " ", line.strip())


def _failures(out: str) -> str:
    """The failures section of a pytest run's output (what the tail loses behind the warnings summary)."""
    m = re.search(
        r"^=+ (?:FAILURES|ERRORS) =+$(.*?)(?=^=+ (?:warnings summary|short test summary)|\Z)", out, re.M | re.S
    )
    return m.group(1).strip()[-3000:] if m else ""


def _run_tests(tree: Path, env: dict[str, str], first: str | None = None) -> dict:
    """Each suite in turn, in a fresh process, stopping at the first failure (the mutant is then killed).
    `first`, the test that killed this mutant in an earlier pass, runs alone before them: a mutant it kills
    again dies in seconds instead of after every test ahead of it in the suites; one it does not kill goes on
    through every suite (about three minutes on the H200 with twelve mutants at a time)."""
    t0 = time.monotonic()
    summaries = []
    suites = ([([], [first])] if first else []) + SUITES
    for n, (extra, files) in enumerate(suites):
        left = MUTANT_TIMEOUT_S - (time.monotonic() - t0)
        try:
            p = subprocess.run(
                [sys.executable, *PYTEST, *extra, *files],
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
                timeout=max(left, 1),
            )
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            return {"rc": None, "seconds": round(time.monotonic() - t0, 1), "tail": out[-1500:], "timeout": True}
        out = p.stdout + p.stderr
        summaries.append(
            (re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|deselected).*?)\s*=*$", out, re.M) or [""])[-1]
        )
        if first and n == 0 and p.returncode != 1:  # the earlier test is gone or errs: only the suites decide
            continue
        if p.returncode != 0:
            failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
            return {
                "rc": p.returncode,
                "seconds": round(time.monotonic() - t0, 1),
                "first_failure": failed[0] if failed else None,
                "summary": summaries,
                "tail": out[-1500:],
                "failures": _failures(out),
            }
    return {"rc": 0, "seconds": round(time.monotonic() - t0, 1), "first_failure": None, "summary": summaries}


def _copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".venv*", *SKIP)
    shutil.copytree(ROOT, dest, ignore=ignore)


def cmd_run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("the GPU pass needs a CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mutants = selected()
    if args.limit:
        mutants = mutants[: args.limit]
    known: dict[str, dict] = {}
    previous: dict = {}
    hints: dict[str, str] = {}  # the test that killed a mutant in the earlier pass: it runs first this time
    if args.previous:  # an earlier, cut-off pass: keep each verdict that names its test; run the rest first
        previous = json.loads(Path(args.previous).read_text())
        hints = {
            f"{r['function']}\n{r['change']}": r["first_failure"] for r in previous["mutants"] if r.get("first_failure")
        }
        # a test the unmutated tree failed there killed nothing: those mutants run again
        void = (previous.get("clean") or {}).get("first_failure")
        for rec in previous["mutants"]:
            if not (void and rec.get("first_failure") == void):
                rec.setdefault("gpu", previous["machine"]["gpu"])  # a verdict says which card gave it
                known[f"{rec['function']}\n{rec['change']}"] = rec
    # kept: a kill that names its test. A survival always runs again: tests written since may kill it (a kept
    # survival once outlived the GPU tests written for it, which then never ran against it)
    keep = [
        known[m.key]
        for m in mutants
        if m.key in known and not known[m.key].get("provisional") and known[m.key].get("first_failure")
    ]
    # never run first; then the earlier survivors (a full run of every suite each: the longest jobs start first, so a
    # pass stopped at its limit has the verdicts the tests written since were for); then the kills to confirm
    mutants.sort(key=lambda m: (m.key in known, m.key in known and known[m.key]["status"] != "survived"))
    mutants = [m for m in mutants if not (m.key in known and known[m.key] in keep)]
    work = Path(tempfile.mkdtemp(prefix="gpu-pass-"))
    gpu = torch.cuda.get_device_name(0)
    log = open(out / f"mutation_gpu-{gpu_tag(gpu)}.log", "w", buffering=1)
    results: dict = {
        "machine": {"gpu": gpu, "torch": torch.__version__, "python": sys.version.split()[0]},
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tests": [" ".join(PYTEST[1:] + e + f) for e, f in SUITES],
        "clean": None,
        "mutants": list(keep),
    }

    def env_for(tree: Path) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(tree)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
        )
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        # one CPU thread per test process: 14 processes of 16 threads each on 16 cores ran 4x slower
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("MKL_NUM_THREADS", "1")
        return env

    def one(i: int, m: Mutant | None) -> dict:
        tree = work / (f"m{i}" if m is not None else "clean")
        _copy_tree(tree)
        rec: dict = {"function": m.function, "change": m.change, "gpu": gpu} if m else {}
        if m is not None:
            try:
                apply(m, tree)
            except (LookupError, SyntaxError) as exc:
                rec.update(status="not applied", why=str(exc))
                return rec
        res = _run_tests(tree, env_for(tree), hints.get(m.key) if m is not None else None)
        shutil.rmtree(tree, ignore_errors=True)
        if res.get("timeout"):
            status = "killed (timeout)"
        else:
            status = "survived" if res["rc"] == 0 else "killed"
        rec.update(status=status, **{k: v for k, v in res.items() if k not in ("tail", "failures")})
        if res.get("rc") not in (0, 1) or (m is None and res.get("rc") != 0):
            rec["tail"] = res.get("tail", "")
        if m is None and res.get("failures"):  # why the unmutated tree failed
            rec["failures"] = res["failures"]
        return rec

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        clean = pool.submit(one, -1, None)
        futs = [clean] + [pool.submit(one, i, m) for i, m in enumerate(mutants)]
        for f in cf.as_completed(futs):
            rec = f.result()
            if f is clean:  # written as soon as it is known: a pass stopped later still has it
                results["clean"] = rec
                log.write(f"clean run: {rec}\n")
            else:
                results["mutants"].append(rec)
                log.write(
                    f"{rec['status']:>16}  {rec['function'].rsplit('.', 1)[1]}  {rec['change']!r}  "
                    f"{rec.get('first_failure') or rec.get('summary') or rec.get('why', '')}  "
                    f"{rec.get('seconds', '')}s\n"
                )
            (out / "gpu_pass.json").write_text(json.dumps(results, indent=1) + "\n")
    results["seconds"] = round(time.monotonic() - t0)
    results["mutants"].sort(key=lambda r: (r["function"], r["change"]))
    (out / "gpu_pass.json").write_text(json.dumps(results, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if results["clean"].get("rc") == 0 else 1


def gpu_tag(name: str) -> str:
    """A card's short name for a file name: "NVIDIA H100 80GB HBM3" -> "h100"."""
    hit = re.search(r"\b([A-Z]+\d{2,4}[A-Z]?)\b", name)
    return (hit.group(1) if hit else re.sub(r"\W+", "-", name)).lower()


def cmd_list(args: argparse.Namespace) -> int:
    ms = selected()
    for m in ms:
        try:
            with tempfile.TemporaryDirectory() as d:
                dest = Path(d) / m.module_path
                dest.parent.mkdir(parents=True)
                shutil.copy2(ROOT / m.module_path, dest)
                apply(m, Path(d))
            ok = "applies"
        except (LookupError, SyntaxError) as exc:
            ok = f"DOES NOT APPLY: {exc}"
        print(f"{m.function.rsplit('.', 1)[1]}: {m.change!r}: {ok}")
    print(len(ms), "mutants")
    return 0


LINE = re.compile(r"^- `(?P<fn>[^`]+)` #(?P<num>\d+) \((?P<status>[^)]+)\): `")
SCOPE_LINE = re.compile(r"^\* `(?P<fn>[^`]+)` #(?P<num>\d+) \((?P<status>[^)]+)\): `")  # another scope's survivor


def cmd_report(args: argparse.Namespace) -> int:
    """Rewrite what the GPU pass decides in docs/mutation.md and tests/mutation/survivors.json, in place: the lines
    of the survivors only a CUDA host tells apart, the survivors' counts, and the GPU section. (`mutate.py report`
    writes the same from the full run's workspace, which this does not need.)"""
    gpu = mutate.gpu_pass()
    equiv = mutate.equivalents()
    everything = selected()
    wanted = [m for m in everything if m.scope == "main"]
    scoped = [m for m in everything if m.scope != "main"]
    out, rewritten = [], 0
    for line in mutate.REPORT.read_text().splitlines():
        hit = LINE.match(line) or SCOPE_LINE.match(line)
        if hit and line.startswith("* "):  # another scope's survivor: its reason, then the GPU pass's verdict
            for m in scoped:
                fn, old, new = mutate._readable(m.function, m.change)
                head = f"* `{fn}` #{hit['num']} ({hit['status']}): `{old}` → `{new}`: "
                if _norm(line[: len(head)]) == _norm(head) and line[len(head) :].startswith(m.reason):
                    line = head + mutate.scope_gpu_reason(m.reason, m.function, m.change, gpu)
                    rewritten += 1
                    break
            hit = None
        for m in wanted if hit else []:
            head = mutate.survivor_line(m.function, hit["num"], hit["status"], m.change, None, gpu)
            head = head.removesuffix("**unexplained**")
            cut = line.index("`: ", line.index("` → `")) + 3  # where the reason starts (_md keeps ` out of the change)
            if _norm(line[:cut]) == _norm(head):  # the same function, number and change
                why = mutate.equivalent_reason(equiv, m.function, m.change)
                line = line[:cut] + mutate.survivor_reason(m.function, m.change, why, gpu)
                rewritten += 1
                break
        out.append(line)
    text = "\n".join(out) + "\n"
    data = json.loads(mutate.SURVIVORS.read_text())
    needs = {(m.function, m.change) for m in wanted}
    for s in data["survivors"]:
        if (s["function"], s["change"]) in needs:
            s["equivalent"], s["needs_cuda"] = False, True
    summary = data["summary"]
    unexplained = summary["unexplained"]
    summary["needs_cuda"] = len(needs)
    summary["equivalent"] = summary["survived"] - unexplained - len(needs)
    text = re.sub(
        r"^- survivors explained as equivalent: .*$",
        "\n".join(mutate.summary_lines(summary["survived"], len(needs), unexplained)),
        text,
        count=1,
        flags=re.M,
    )
    text = re.sub(
        r"^<!-- mutation-summary: .* -->$",
        f"<!-- mutation-summary: {json.dumps(summary, sort_keys=True)} -->",
        text,
        count=1,
        flags=re.M,
    )
    by_scope = dict(collections.Counter(m.scope for m in everything))
    section = "\n".join(mutate.gpu_section(gpu, sorted(needs) + [(m.function, m.change) for m in scoped], by_scope))
    start, end = mutate.GPU_SECTION
    if start in text:
        text = text[: text.index(start)] + section + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    mutate.REPORT.write_text(text)
    mutate.SURVIVORS.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"{rewritten} survivor lines rewritten, {len(everything)} mutants told apart only on a CUDA host")
    return 0 if rewritten >= len(everything) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list")
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--jobs", type=int, default=8)
    r.add_argument("--limit", type=int, default=0)
    r.add_argument("--previous", help="an earlier pass's gpu_pass.json: its named verdicts are kept")
    sub.add_parser("report")
    args = ap.parse_args()
    return {"list": cmd_list, "run": cmd_run, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
