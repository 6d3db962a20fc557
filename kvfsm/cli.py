"""The `kvfsm` command line: spec tools first; runtime tools register themselves below.

Exit codes (kvfsm/cli_errors.py): 0 success, 1 a failed check, 2 input a command cannot use, 3 `check
--require-all` with a transition unreached, 70 an internal error (one line, never a traceback)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console

from kvfsm.cli_errors import INVALID, GuardedGroup

# Each command imports what it uses when it runs, so `kvfsm --help` builds no spec model, code generator or
# torch, and the spec tools import neither torch nor numpy (tests/cli/test_import_footprint.py).
if TYPE_CHECKING:
    from kvfsm.spec import CompiledSpec

app = typer.Typer(
    cls=GuardedGroup,
    no_args_is_help=True,
    add_completion=False,
    help="A formally specified KV-cache offload lifecycle.",
)
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


# Every command that reads a spec takes `--spec`; the spec tools also take it as their first argument.
# Without either, they use the shipped spec (installed or in a checkout, from any directory).
SPEC_ARG = typer.Argument(None, show_default=False, help="The spec (default: the shipped decode_offload spec).")
SPEC_OPT = typer.Option(None, "--spec", show_default=False, help="The spec (default: the shipped decode_offload spec).")


def _spec_path(positional: Optional[Path], option: Optional[Path]) -> Path:
    if positional is not None and option is not None and positional != option:
        err.print(f"two different specs given: {positional} and --spec {option}", markup=False)
        raise typer.Exit(INVALID)
    return option or positional or _packaged_spec()


def _packaged_spec() -> Path:
    from kvfsm.spec.locations import packaged_spec

    return packaged_spec()


def _load(spec: Path) -> CompiledSpec:
    from kvfsm.spec import SpecInvalid, load_spec

    try:
        return load_spec(spec)
    except SpecInvalid as exc:
        for e in exc.errors:
            err.print(str(e), markup=False)
        raise typer.Exit(INVALID) from None


def render_diagram(spec: CompiledSpec, fmt: str) -> str:
    """The state diagram of `spec` (kvfsm.docsgen.diagram)."""
    from kvfsm.docsgen import diagram

    return diagram(spec, fmt)


def _version(value: bool) -> None:
    if not value:
        return
    import kvfsm
    import kvfsm.generated.cb_swap as cb
    import kvfsm.generated.decode_offload as do
    import kvfsm.generated.offload_chunk as oc

    out.print(
        f"kvfsm {kvfsm.__version__}; generated from {do.SPEC_PATH} sha256 {do.SPEC_SHA256[:16]}, "
        f"{cb.SPEC_PATH} sha256 {cb.SPEC_SHA256[:16]}, {oc.SPEC_PATH} sha256 {oc.SPEC_SHA256[:16]}",
        markup=False,
    )
    raise typer.Exit(0)


@app.callback()
def main(
    version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,
        callback=_version,
        help="Print the version and the hashes of the specs the runtime was generated from.",
    ),
) -> None:
    """A formally specified KV-cache offload lifecycle."""


@app.command()
def validate(spec_arg: Optional[Path] = SPEC_ARG, spec_opt: Optional[Path] = SPEC_OPT) -> None:
    """Check a spec; print one `file:line: element: message` per error and exit 2 when invalid."""
    spec = _spec_path(spec_arg, spec_opt)
    s = _load(spec)
    out.print(
        f"{spec}: ok: {len(s.states)} states, {len(s.events)} events, {len(s.transitions)} transitions, "
        f"{len(s.outcomes)} declared no-ops/errors, sha256 {s.sha256[:12]}",
        markup=False,
    )


@app.command()
def gen(
    spec_arg: Optional[Path] = SPEC_ARG,
    spec_opt: Optional[Path] = SPEC_OPT,
    out_dir: Optional[Path] = typer.Option(
        None,
        "--out",
        show_default=False,
        help="Where generated modules go (default: the generated/ beside the spec's folder).",
    ),
    check: bool = typer.Option(False, "--check", help="Exit 1 when the generated code is stale; write nothing."),
) -> None:
    """Generate the spec's machines into its generated/ (the same from any directory): the per-request machine
    and the struct-of-arrays batch machine (`<machine>_rows.py`)."""
    from kvfsm.codegen import generate
    from kvfsm.codegen.rows import RowsUnsupported
    from kvfsm.spec import SpecInvalid

    spec = _spec_path(spec_arg, spec_opt)
    try:
        result = generate(spec, out_dir, check=check)
    except SpecInvalid as exc:
        for e in exc.errors:
            err.print(str(e), markup=False)
        raise typer.Exit(INVALID) from None
    except RowsUnsupported as exc:
        err.print(str(exc), markup=False)
        raise typer.Exit(INVALID) from None
    if check and result.changed:
        for path in result.stale:
            err.print(f"{path} is stale: run `kvfsm gen {spec}`", markup=False)
        raise typer.Exit(1)
    for path, changed in result.files:
        out.print(f"{path}: {'written' if changed else 'up to date'}", markup=False)


class DiagramFormat(str, Enum):
    mermaid = "mermaid"
    dot = "dot"


@app.command()
def schema(
    output: Optional[Path] = typer.Option(
        None,
        "--out",
        show_default=False,
        help="Where the JSON Schema goes (default: the shipped one beside the specs).",
    ),
    check: bool = typer.Option(False, "--check", help="Exit 1 when the file is stale; write nothing."),
) -> None:
    """Export the spec format's JSON Schema (from the pydantic models) for editors and other tools."""
    from kvfsm.spec.locations import schema_path
    from kvfsm.spec.model import json_schema_text

    output = output or schema_path()
    text = json_schema_text()
    current = _current_schema(output)
    if check:
        if current != text:
            err.print(f"{output} is stale: run `kvfsm schema`", markup=False)
            raise typer.Exit(1)
        out.print(f"{output}: up to date", markup=False)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    out.print(f"{output}: written", markup=False)


def _current_schema(path: Path) -> Optional[str]:
    """The schema file's text as it is, or None when it is missing or cannot be the schema (past
    SCHEMA_LIMITS.max_bytes, not UTF-8): either way `--check` calls it stale. Not a regular file:
    InputRejected (exit 2)."""
    from kvfsm.errors import InputBoundExceeded
    from kvfsm.input_limits import SCHEMA_LIMITS, read_bounded

    if not path.exists():
        return None
    try:
        return read_bounded(path, SCHEMA_LIMITS, "schema").decode("utf-8")
    except (InputBoundExceeded, UnicodeDecodeError):
        return None


@app.command()
def diagram(
    spec_arg: Optional[Path] = SPEC_ARG,
    spec_opt: Optional[Path] = SPEC_OPT,
    fmt: DiagramFormat = typer.Option(DiagramFormat.mermaid, "--format"),
) -> None:
    """Print the state diagram (Mermaid or Graphviz dot)."""
    out.print(render_diagram(_load(_spec_path(spec_arg, spec_opt)), fmt.value), end="", markup=False)


@app.command()
def docs(
    spec_arg: Optional[Path] = SPEC_ARG,
    spec_opt: Optional[Path] = SPEC_OPT,
    output: Path = typer.Option(None, "--out", help="Write here instead of stdout."),
) -> None:
    """Render the auditor's Markdown reference for the spec."""
    from kvfsm.docsgen import markdown
    from kvfsm.spec.locations import spec_stamp

    spec = _spec_path(spec_arg, spec_opt)
    text = markdown(_load(spec), spec_stamp(spec))
    if output is None:
        out.print(text, end="", markup=False)
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
        out.print(f"{output}: written", markup=False)


@app.command()
def demo(
    workdir: Path = typer.Option(None, "--dir", help="Where the store, trace and docs go (default: a temp dir)."),
    requests: int = typer.Option(48, min=1, help="How many requests to serve."),
    json_out: Path = typer.Option(None, "--json", help="Also write the report as JSON here."),
    spec: Optional[Path] = SPEC_OPT,
) -> None:
    """Validate the spec and check the runtime's machine is generated from it, then serve a decode workload
    with and without offload and compare."""
    from kvfsm.demo import main as run

    run(workdir, requests, json_out, spec_path=spec or _packaged_spec())


@app.command()
def bench(
    quick: bool = typer.Option(
        False,
        help="Small sizes: checks the scripts, not the numbers. Writes only under "
        "bench/results/quick/ (its plots in bench/results/quick/plots/).",
    ),
) -> None:
    """Run bench/ (bandwidth on CUDA, per-event runtime, manager overhead, hashing), write JSON, render the plots.

    A full run writes bench/results/<name>-<machine>.json and renders docs/results.md and its plots from
    bench/results/. A quick run writes bench/results/quick/ (git-ignored; JSON marked "quick": true) and
    renders its plots there, so nothing committed changes."""
    import os
    import subprocess
    import sys

    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    root = Path.cwd()
    if not (root / "bench" / "plots.py").exists():
        err.print("run `kvfsm bench` from the repository root (bench/ holds the scripts)")
        raise typer.Exit(INVALID)
    q = ["--quick"] if quick else []
    runs = [
        ["event_runtime.py", *q] + (["--cycles", "2000"] if quick else []),
        ["manager_overhead.py", *q] + (["--live", "64", "256", "--iterations", "8"] if quick else []),
        ["hash_throughput.py", *q] + (["--tokens", "65536", "--reps", "1"] if quick else []),
    ]
    if torch.cuda.is_available():
        runs.append(["offload_bandwidth.py", *q] + (["--gib", "0.125"] if quick else []))
    elif quick:
        runs.append(["offload_bandwidth.py", "--smoke"])  # the script's CPU path; smoke results are quick results
    else:
        out.print("no CUDA here: skipping bench/offload_bandwidth.py (its GPU results are in bench/results/)")
    quick_dir = root / "bench" / "results" / "quick"
    runs.append(["plots.py"] + (["--results", str(quick_dir), "--out", str(quick_dir / "plots")] if quick else []))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with Progress(
        TextColumn("[bold]kvfsm bench[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=out,
    ) as progress:
        task = progress.add_task("", total=len(runs))
        for script, *args in runs:
            progress.update(task, description=f"bench/{script}")
            progress.console.print(f"$ python bench/{script} {' '.join(args)}", markup=False, highlight=False)
            proc = subprocess.Popen(
                [sys.executable, str(root / "bench" / script), *args],
                cwd=root,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
            )
            assert proc.stdout is not None
            for line in proc.stdout:  # through the progress console, so the bar stays below the output
                progress.console.print(line.rstrip("\n"), markup=False, highlight=False)
            if proc.wait():
                err.print(f"bench/{script} exited with {proc.returncode}", markup=False)
                raise typer.Exit(proc.returncode)
            progress.advance(task)
        progress.update(task, description="done")
    # after the bar, not in it: a long path in the bar's last frame squeezes its count out at 80 columns
    where = f"results and plots in {quick_dir}" if quick else "results in bench/results/, plots in docs/"
    out.print(f"kvfsm bench: {len(runs)}/{len(runs)} scripts done; {where}", markup=False, highlight=False)


class BoundName(str, Enum):
    ci = "ci"
    default = "default"


@app.command()
def check(
    requests: Optional[int] = typer.Option(
        None,
        help="Requests in the bounded world (bound options explore "
        "one bound; unset ones take ExplorerConfig's defaults).",
    ),
    slots: Optional[int] = typer.Option(None, help="Device slots."),
    page_size: Optional[int] = typer.Option(None),
    stride: Optional[int] = typer.Option(None),
    host_slots: Optional[int] = typer.Option(None, help="Host pool slots."),
    backup_queue: Optional[int] = typer.Option(None, help="Backups outstanding at once."),
    decodes: Optional[int] = typer.Option(None, help="Decode steps per request."),
    readmits: Optional[int] = typer.Option(None, help="Retract-and-readmit cycles per request."),
    speculative: Optional[int] = typer.Option(None, help="Extra slots a speculative decode over-allocates."),
    bound: Optional[BoundName] = typer.Option(
        None,
        "--bound",
        help="A named bound: a union of sub-bounds, each explored exhaustively (the default without bound options).",
    ),
    ci: bool = typer.Option(False, "--ci", help="The CI bound (--bound ci): what .ci/run explores."),
    jobs: int = typer.Option(1, "--jobs", help="Worker processes expanding each BFS level."),
    report: Optional[Path] = typer.Option(
        None, "--report", help="Rewrite this named bound's section of the coverage page (docs/explorer-coverage.md)."
    ),
    max_depth: int = typer.Option(None, help="Stop exploring below this depth."),
    out_test: Path = typer.Option(None, "--out-test", help="Where to write a counterexample as a pytest."),
    spec: Optional[Path] = SPEC_OPT,
    require_all: bool = typer.Option(
        False, "--require-all", help="Exit 3 when the bound leaves a spec transition unreached."
    ),
) -> None:
    """Explore every interleaving of engine events over the real manager and pools; exit 1 on a violation,
    2 on a meaningless bound or a spec the runtime was not generated from, 3 with --require-all when a
    transition is unreached."""
    from kvfsm.verify import commands

    if ci and bound is not None and bound is not BoundName.ci:
        err.print(f"--ci and --bound {bound.value} name different bounds", markup=False)
        raise typer.Exit(INVALID)
    name = "ci" if ci else bound.value if bound is not None else None
    raise typer.Exit(
        commands.check(
            requests,
            slots,
            page_size,
            stride,
            host_slots,
            max_depth,
            out_test,
            decodes=decodes,
            readmits=readmits,
            backup_queue=backup_queue,
            speculative=speculative,
            spec_path=spec or _packaged_spec(),
            require_all=require_all,
            bound=name,
            jobs=jobs,
            report=report,
        )
    )


@app.command()
def replay(
    trace: Path,
    spec: Optional[Path] = SPEC_OPT,
    max_bytes: Optional[int] = typer.Option(
        None, "--max-bytes", min=1, show_default=False, help="The trace's size bound (default 16 GiB)."
    ),
) -> None:
    """Check a recorded transition trace (JSON lines) against the spec; exit 1 at the first illegal step, 2 on
    a trace that cannot be read within its bounds (kvfsm.input_limits.TRACE_LIMITS)."""
    from kvfsm.verify import commands

    raise typer.Exit(commands.replay(trace, spec_path=spec or _packaged_spec(), max_bytes=max_bytes))


if __name__ == "__main__":
    app()
