"""`kvfsm check` and `kvfsm replay`: plain functions returning an exit code (the CLI registers them).

check  -- explore every interleaving of engine events for a bounded SimEngine; print states, depth, time,
          peak memory and transition coverage; on a violation print the shortest event trace and write it
          as a runnable pytest file (exit 1).
replay -- check a recorded transition trace (the manager's trace_path JSON lines) against the spec; print
          the first illegal step with its line number (exit 1) or a summary (exit 0).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from kvfsm.codegen import runtime_mismatch
from kvfsm.spec import SpecInvalid, load_spec
from kvfsm.spec.locations import packaged_spec
from kvfsm.verify.coverage import report
from kvfsm.verify.explorer import BoundInvalid, ExplorerConfig, counterexample_test, explore
from kvfsm.verify.replay import check_trace

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

UNREACHED = 3  # exit code of `check --require-all` when the bound leaves a transition unreached


def check(requests: int = 3, slots: int = 16, page_size: int = 2, stride: int = 2, host_slots: int = 8,
          max_depth: Optional[int] = None, out_test: Optional[Path] = None, *, decodes: int = 1, readmits: int = 0,
          backup_queue: int = 1, prompt_len: int = 3, speculative: int = 0, quiet: bool = False,
          spec_path: Optional[Path] = None, require_all: bool = False) -> int:
    """Bounded exhaustive exploration of the implementation; 0 when no invariant fails, 1 on a violation,
    2 on a bound that means nothing or a spec the runtime's machine was not generated from, and 3 with
    `require_all` when the bound leaves a transition unreached (a green result about half the spec misleads)."""
    spec_path = Path(spec_path or packaged_spec())
    try:
        mismatch = runtime_mismatch(spec_path)
    except SpecInvalid as exc:
        for e in exc.errors:
            err.print(str(e), markup=False)
        return 2
    if mismatch is not None:
        err.print(mismatch, markup=False)
        return 2
    if max_depth is not None and max_depth < 1:
        err.print(f"max_depth={max_depth}: must be at least 1", markup=False)
        return 2
    try:
        cfg = ExplorerConfig(requests=requests, slots=slots, page_size=page_size, stride=stride,
                             host_slots=host_slots, backup_queue=backup_queue, prompt_len=prompt_len,
                             decodes=decodes, readmits=readmits, speculative=speculative,
                             max_context=max(16, prompt_len + decodes + speculative + page_size))
    except BoundInvalid as exc:
        err.print(f"meaningless bound: {exc}", markup=False)
        return 2
    bound = cfg.describe() + (f", max_depth={max_depth}" if max_depth is not None else "")
    out.print(Text.assemble(("exploring ", "bold"), bound))
    t0 = time.perf_counter()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=out,
                  transient=True, disable=quiet) as progress:
        task = progress.add_task("depth 0", total=None)

        def level(depth: int, states: int, frontier: int) -> None:
            progress.update(task, description=f"depth {depth}: {states} states, frontier {frontier}")
            if not quiet:
                progress.console.print(f"  depth {depth:3d}: {states:8d} states, frontier {frontier:7d}  "
                                       f"({time.perf_counter() - t0:6.1f} s)", markup=False)

        res = explore(cfg, max_depth=max_depth, on_level=level)
    cov = report({"explorer": res.coverage}, load_spec(spec_path))
    tab = Table(show_header=False, box=None)
    for k, v in (("states", f"{res.states}"), ("edges (events run)", f"{res.edges}"),
                 ("depth", f"{res.depth}"),
                 ("complete", "yes" if res.complete else "stopped at the first violation" if res.violation
                  else f"no (max_depth {max_depth})"), ("seconds", f"{res.seconds:.1f}"),
                 ("peak RSS", f"{res.peak_rss_mib:.0f} MiB"),
                 ("branching", res.mode + (f" (copying failed: {res.fallback})" if res.fallback else "")),
                 ("transitions reached", cov.fraction())):
        tab.add_row(k, v)
    out.print(tab)
    if res.violation is None:
        scope = "" if res.complete else f" up to depth {res.depth}"
        if cov.missing:
            out.print(f"[yellow]not reached at this bound ({len(cov.missing)} of {len(cov.spec.transitions)} "
                      f"transitions): the claim below says nothing about them[/yellow]")
            for t in cov.missing:
                out.print(f"  T{t.id}: {t.label}", markup=False)
            out.print(f"no invariant violated{scope} in the {cov.fraction()} transitions reached", markup=False)
            if require_all:
                err.print(f"--require-all: {len(cov.missing)} transitions not reached at this bound", markup=False)
                return UNREACHED
            return 0
        out.print(f"[green]no invariant violated{scope}; every transition reached ({cov.fraction()})[/green]")
        return 0
    cx = res.violation
    out.print(Text.assemble(("violation ", "bold red"), f"{cx.name}: {cx.detail}"))
    out.print(f"shortest trace ({len(cx.events)} events):", markup=False)
    for line in cx.lines():
        out.print(line, markup=False)
    if out_test is not None:
        out_test = Path(out_test)
        out_test.parent.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"\W", "_", out_test.stem.removeprefix("test_")) or "counterexample"
        out_test.write_text(counterexample_test(cfg, cx, name if name.isidentifier() else f"cx_{name}"))
        out.print(f"wrote {out_test} (fails while the bug exists)", markup=False)
    return 1


def replay(trace: Path, spec_path: Optional[Path] = None) -> int:
    """Check a recorded trace against the spec: 0 when every step is legal, 1 at the first illegal one."""
    trace = Path(trace)
    if not trace.exists():
        err.print(f"{trace}: no such file", markup=False)
        return 2
    try:
        spec = load_spec(spec_path or packaged_spec())
    except SpecInvalid as exc:
        for e in exc.errors:
            err.print(str(e), markup=False)
        return 2
    res = check_trace(trace, spec)
    if res.error is not None:
        e = res.error
        who = f" (request {e.request})" if e.request else ""
        err.print(f"{trace}:{e.line}: illegal step{who}: {e.message}", markup=False)
        if e.record is not None:
            err.print(f"  {e.record}", markup=False)
        return 1
    out.print(f"{trace}: ok: {res.steps} steps ({res.ignored} declared no-ops) of {res.requests} requests, "
              f"{len([t for t in res.transitions if t >= 0])} distinct transitions, spec sha256 {res.spec_sha256[:12]}",
              markup=False)
    if res.final_states:
        out.print("final states: " + ", ".join(f"{s} {n}" for s, n in sorted(res.final_states.items())), markup=False)
    return 0


__all__ = ["check", "replay"]
