"""The `kvfsm` command line: spec tools first; runtime tools register themselves below."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer
from rich.console import Console

from kvfsm.codegen import generate
from kvfsm.docsgen import diagram as render_diagram
from kvfsm.docsgen import markdown
from kvfsm.spec import CompiledSpec, SpecInvalid, load_spec

app = typer.Typer(no_args_is_help=True, add_completion=False, help="A formally specified KV-cache offload lifecycle.")
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

INVALID = 2


def _load(spec: Path) -> CompiledSpec:
    try:
        return load_spec(spec)
    except SpecInvalid as exc:
        for e in exc.errors:
            err.print(str(e), markup=False)
        raise typer.Exit(INVALID) from None


@app.command()
def validate(spec: Path) -> None:
    """Check a spec; print one `file:line: element: message` per error and exit 2 when invalid."""
    s = _load(spec)
    out.print(f"{spec}: ok: {len(s.states)} states, {len(s.events)} events, {len(s.transitions)} transitions, "
              f"{len(s.outcomes)} declared no-ops/errors, sha256 {s.sha256[:12]}", markup=False)


@app.command()
def gen(spec: Path, out_dir: Path = typer.Option(Path("generated"), "--out", help="Where generated modules go."),
        check: bool = typer.Option(False, "--check", help="Exit 1 when the generated code is stale; write nothing.")) -> None:
    """Generate the runtime machine for SPEC into generated/."""
    try:
        result = generate(spec, out_dir, check=check)
    except SpecInvalid as exc:
        for e in exc.errors:
            err.print(str(e), markup=False)
        raise typer.Exit(INVALID) from None
    if check and result.changed:
        err.print(f"{result.path} is stale: run `kvfsm gen {spec}`", markup=False)
        raise typer.Exit(1)
    out.print(f"{result.path}: {'written' if result.changed else 'up to date'}", markup=False)


class DiagramFormat(str, Enum):
    mermaid = "mermaid"
    dot = "dot"


SCHEMA_PATH = Path("spec/kvfsm-spec.schema.json")


@app.command()
def schema(output: Path = typer.Option(SCHEMA_PATH, "--out", help="Where the JSON Schema goes."),
           check: bool = typer.Option(False, "--check", help="Exit 1 when the file is stale; write nothing.")) -> None:
    """Export the spec format's JSON Schema (from the pydantic models) for editors and other tools."""
    from kvfsm.spec.model import json_schema_text
    text = json_schema_text()
    current = output.read_text() if output.exists() else None
    if check:
        if current != text:
            err.print(f"{output} is stale: run `kvfsm schema`", markup=False)
            raise typer.Exit(1)
        out.print(f"{output}: up to date", markup=False)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    out.print(f"{output}: written", markup=False)


@app.command()
def diagram(spec: Path, fmt: DiagramFormat = typer.Option(DiagramFormat.mermaid, "--format")) -> None:
    """Print the state diagram (Mermaid or Graphviz dot)."""
    out.print(render_diagram(_load(spec), fmt.value), end="", markup=False)


@app.command()
def docs(spec: Path, output: Path = typer.Option(None, "--out", help="Write here instead of stdout.")) -> None:
    """Render the auditor's Markdown reference for SPEC."""
    text = markdown(_load(spec), spec.as_posix())
    if output is None:
        out.print(text, end="", markup=False)
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
        out.print(f"{output}: written", markup=False)


@app.command()
def demo(workdir: Path = typer.Option(None, "--dir", help="Where the store, trace and docs go (default: a temp dir)."),
         requests: int = typer.Option(48, help="How many requests to serve."),
         json_out: Path = typer.Option(None, "--json", help="Also write the report as JSON here.")) -> None:
    """Validate and generate the spec, then serve a decode workload with and without offload and compare."""
    from kvfsm.demo import main as run
    run(workdir, requests, json_out)


@app.command()
def bench(quick: bool = typer.Option(False, help="Small sizes: checks the scripts, not the numbers.")) -> None:
    """Run bench/ (bandwidth on CUDA, per-event runtime, manager overhead), write JSON, render docs/ plots."""
    import subprocess
    import sys

    import torch

    root = Path.cwd()
    if not (root / "bench" / "plots.py").exists():
        err.print("run `kvfsm bench` from the repository root (bench/ holds the scripts)")
        raise typer.Exit(INVALID)
    runs = [["event_runtime.py"] + (["--cycles", "2000"] if quick else []),
            ["manager_overhead.py"] + (["--live", "64", "256", "--iterations", "8"] if quick else []),
            ["hash_throughput.py"] + (["--tokens", "65536", "--reps", "1"] if quick else [])]
    if torch.cuda.is_available():
        runs.append(["offload_bandwidth.py"] + (["--gib", "0.125"] if quick else []))
    else:
        out.print("no CUDA here: skipping bench/offload_bandwidth.py (its GPU results are in bench/results/)")
    for script, *args in runs:
        out.print(f"$ python bench/{script} {' '.join(args)}", markup=False)
        subprocess.run([sys.executable, str(root / "bench" / script), *args], check=True)
    subprocess.run([sys.executable, str(root / "bench" / "plots.py")], check=True)


@app.command()
def check(requests: int = typer.Option(3, help="Requests in the bounded world."),
          slots: int = typer.Option(16, help="Device slots."),
          page_size: int = typer.Option(2), stride: int = typer.Option(2),
          host_slots: int = typer.Option(8, help="Host pool slots."),
          backup_queue: int = typer.Option(1, help="Backups outstanding at once."),
          decodes: int = typer.Option(1, help="Decode steps per request."),
          readmits: int = typer.Option(0, help="Retract-and-readmit cycles per request."),
          max_depth: int = typer.Option(None, help="Stop exploring below this depth."),
          out_test: Path = typer.Option(None, "--out-test", help="Where to write a counterexample as a pytest.")) -> None:
    """Explore every interleaving of engine events over the real manager and pools; exit 1 on a violation."""
    from kvfsm.verify import commands
    raise typer.Exit(commands.check(requests, slots, page_size, stride, host_slots, max_depth, out_test,
                                    decodes=decodes, readmits=readmits, backup_queue=backup_queue))


@app.command()
def replay(trace: Path) -> None:
    """Check a recorded transition trace (JSON lines) against the spec; exit 1 at the first illegal step."""
    from kvfsm.verify import commands
    raise typer.Exit(commands.replay(trace))


if __name__ == "__main__":
    app()
