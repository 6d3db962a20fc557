"""`kvfsm check` and `kvfsm replay`: plain functions returning an exit code (the CLI registers them).

check  -- explore every interleaving of engine events for a bounded SimEngine (a named bound of
          kvfsm.verify.bounds, a union of sub-bounds, or the one given by bound options); print states,
          depth, time, peak memory and transition coverage, and with --report the bound's section of the
          coverage page; on a violation print the shortest event trace and write it as a runnable pytest
          file (exit 1).
replay -- check a recorded transition trace (the manager's trace_path JSON lines) against the spec; print
          the first illegal step with its line number (exit 1) or a summary (exit 0).
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from kvfsm.codegen import runtime_mismatch
from kvfsm.errors import InputRejected
from kvfsm.input_limits import TRACE_LIMITS
from kvfsm.spec import CompiledSpec, SpecInvalid, load_spec
from kvfsm.spec.locations import packaged_spec
from kvfsm.verify.bounds import BOUNDS, Bound, SubBound
from kvfsm.verify.coverage import report as report_coverage
from kvfsm.verify.coverage_page import render_page, render_section
from kvfsm.verify.explorer import BoundInvalid, ExplorerConfig, ExploreResult, counterexample_test, explore
from kvfsm.verify.replay import check_trace

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

UNREACHED = 3  # exit code of `check --require-all` when the bound leaves a transition unreached
_BOUND_FIELDS = (
    "requests",
    "slots",
    "page_size",
    "stride",
    "host_slots",
    "backup_queue",
    "prompt_len",
    "decodes",
    "readmits",
    "speculative",
)


def check(
    requests: Optional[int] = None,
    slots: Optional[int] = None,
    page_size: Optional[int] = None,
    stride: Optional[int] = None,
    host_slots: Optional[int] = None,
    max_depth: Optional[int] = None,
    out_test: Optional[Path] = None,
    *,
    decodes: Optional[int] = None,
    readmits: Optional[int] = None,
    backup_queue: Optional[int] = None,
    prompt_len: Optional[int] = None,
    speculative: Optional[int] = None,
    quiet: bool = False,
    spec_path: Optional[Path] = None,
    require_all: bool = False,
    bound: Optional[str] = None,
    jobs: int = 1,
    report: Optional[Path] = None,
) -> int:
    """Bounded exhaustive exploration of the implementation; 0 when no invariant fails, 1 on a violation,
    2 on a bound that means nothing or a spec the runtime's machine was not generated from, and 3 with
    `require_all` when the bound leaves a transition unreached (a green result about half the spec misleads).

    Without bound options it explores a named bound (`bound`, default "default": kvfsm.verify.bounds), a
    union of sub-bounds each explored exhaustively; with any, the one bound they give (the others at their
    ExplorerConfig defaults). `report` rewrites the named bound's section of the coverage page."""
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
    if jobs < 1:
        err.print(f"jobs={jobs}: must be at least 1", markup=False)
        return 2
    given = {
        k: v
        for k, v in zip(
            _BOUND_FIELDS,
            (requests, slots, page_size, stride, host_slots, backup_queue, prompt_len, decodes, readmits, speculative),
        )
        if v is not None
    }
    if given and bound is not None:
        err.print(f"a named bound ({bound}) or bound options ({', '.join(sorted(given))}), not both", markup=False)
        return 2
    if given:
        if report is not None:
            err.print("--report documents a named bound (--bound ci|default), not bound options", markup=False)
            return 2
        try:
            chosen = Bound("custom", "kvfsm check", (SubBound("custom", _custom_config(given), "the bound given"),))
        except BoundInvalid as exc:
            err.print(f"meaningless bound: {exc}", markup=False)
            return 2
    elif (bound or "default") in BOUNDS:
        chosen = BOUNDS[bound or "default"]
    else:
        err.print(f"unknown bound {bound!r}: one of {', '.join(BOUNDS)}", markup=False)
        return 2
    spec = load_spec(spec_path)
    union = len(chosen.parts) > 1
    if union:
        out.print(
            Text.assemble(
                (f"exploring the {chosen.name} bound", "bold"),
                f": {len(chosen.parts)} sub-bounds, each exhaustively, their coverage unioned"
                + (f" (max_depth={max_depth})" if max_depth is not None else ""),
            )
        )
    results = []
    for n, part in enumerate(chosen.parts, 1):
        res = _explore_one(
            part, f"[{n}/{len(chosen.parts)}] {part.name}: " if union else "", max_depth, jobs, quiet, spec
        )
        results.append(res)
        if union:
            cov = report_coverage({part.name: res.coverage}, spec)
            out.print(
                f"  {res.states} states, {res.edges} events run, depth {res.depth}, "
                f"{'complete' if res.complete else 'INCOMPLETE'}, {res.seconds:.1f} s, "
                f"{cov.fraction()} transitions",
                markup=False,
            )
        if res.violation is not None:
            return _violation(part.config, res, out_test)
    cov = report_coverage({p.name: r.coverage for p, r in zip(chosen.parts, results)}, spec)
    if union:
        tab = Table(show_header=False, box=None)
        for k, v in (
            ("sub-bounds", f"{len(results)}"),
            ("states", f"{sum(r.states for r in results)}"),
            ("edges (events run)", f"{sum(r.edges for r in results)}"),
            ("complete", "yes" if all(r.complete for r in results) else f"no (max_depth {max_depth})"),
            ("seconds", f"{sum(r.seconds for r in results):.1f}"),
            ("transitions reached", cov.fraction()),
        ):
            tab.add_row(k, v)
        out.print(tab)
    if report is not None:
        _write_report(Path(report), chosen, results, spec)
    complete = all(r.complete for r in results)
    scope = "" if complete else f" up to depth {max(r.depth for r in results)}"
    if cov.missing:
        out.print(
            f"[yellow]not reached at this bound ({len(cov.missing)} of {len(cov.spec.transitions)} "
            f"transitions): the claim below says nothing about them[/yellow]"
        )
        for t in cov.missing:
            out.print(f"  T{t.id}: {t.label}", markup=False)
        out.print(f"no invariant violated{scope} in the {cov.fraction()} transitions reached", markup=False)
        if require_all:
            err.print(f"--require-all: {len(cov.missing)} transitions not reached at this bound", markup=False)
            return UNREACHED
        return 0
    out.print(f"[green]no invariant violated{scope}; every transition reached ({cov.fraction()})[/green]")
    return 0


def _custom_config(given: dict[str, int]) -> ExplorerConfig:
    base = ExplorerConfig()
    fields = {k: given.get(k, getattr(base, k)) for k in _BOUND_FIELDS}
    fields["max_context"] = max(
        16, fields["prompt_len"] + fields["decodes"] + fields["speculative"] + fields["page_size"]
    )
    return ExplorerConfig(**fields)


def _explore_one(
    part: SubBound, prefix: str, max_depth: Optional[int], jobs: int, quiet: bool, spec: CompiledSpec
) -> ExploreResult:
    cfg = part.config
    bound = cfg.describe() + (f", max_depth={max_depth}" if max_depth is not None else "")
    out.print(Text.assemble((f"{prefix}exploring ", "bold"), bound))
    t0 = time.perf_counter()
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=out,
        transient=True,
        disable=quiet,
    ) as progress:
        task = progress.add_task("depth 0", total=None)

        def level(depth: int, states: int, frontier: int) -> None:
            progress.update(task, description=f"depth {depth}: {states} states, frontier {frontier}")
            if not quiet:
                progress.console.print(
                    f"  depth {depth:3d}: {states:8d} states, frontier {frontier:7d}  "
                    f"({time.perf_counter() - t0:6.1f} s)",
                    markup=False,
                )

        res = explore(cfg, max_depth=max_depth, on_level=level, jobs=jobs)
    if not prefix:  # one bound: its table, as before
        cov = report_coverage({"explorer": res.coverage}, spec)
        tab = Table(show_header=False, box=None)
        for k, v in (
            ("states", f"{res.states}"),
            ("edges (events run)", f"{res.edges}"),
            ("depth", f"{res.depth}"),
            (
                "complete",
                "yes"
                if res.complete
                else "stopped at the first violation"
                if res.violation
                else f"no (max_depth {max_depth})",
            ),
            ("seconds", f"{res.seconds:.1f}"),
            ("states/s", f"{res.states_per_second:.0f}"),
            ("peak RSS", f"{res.peak_rss_mib:.0f} MiB"),
            ("branching", res.mode + (f" (copying failed: {res.fallback})" if res.fallback else "")),
            ("reductions", _reductions(res)),
            ("transitions reached", cov.fraction()),
        ):
            tab.add_row(k, v)
        out.print(tab)
    return res


def _reductions(res: ExploreResult) -> str:
    done = []
    if res.symmetry:
        done.append("request symmetry" + (f" ({res.mirrored} mirrored events)" if res.orbits else ""))
    if res.por:
        done.append(f"sleep sets ({res.pruned} events asleep, {res.reexpanded} re-expansions)")
    return ", ".join(done) or "none"


def _violation(cfg: ExplorerConfig, res: ExploreResult, out_test: Optional[Path]) -> int:
    cx = res.violation
    assert cx is not None  # called on a violation
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


def _write_report(path: Path, bound: Bound, results: list[ExploreResult], spec: CompiledSpec) -> None:
    import kvfsm.generated.decode_offload as gen

    section = render_section(bound, results, spec, gen.SPEC_SHA256)
    current = path.read_text() if path.exists() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_page(current, bound, section))
    out.print(f"wrote the {bound.name} bound's section of {path}", markup=False)


def replay(trace: Path, spec_path: Optional[Path] = None, max_bytes: Optional[int] = None) -> int:
    """Check a recorded trace against the spec: 0 when every step is legal, 1 at the first illegal one, 2 on
    a trace or spec that cannot be read (past a bound of kvfsm.input_limits, not UTF-8, not a file).
    `max_bytes` raises (or lowers) the trace's size bound, TRACE_LIMITS.max_bytes."""
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
    limits = TRACE_LIMITS if max_bytes is None else replace(TRACE_LIMITS, max_bytes=max_bytes)
    try:
        res = check_trace(trace, spec, limits=limits)
    except InputRejected as exc:
        err.print(f"{exc}: not replayed", markup=False)
        return 2
    except OSError as exc:
        err.print(f"{trace}: cannot read trace: {exc.strerror or exc}", markup=False)
        return 2
    if res.error is not None:
        bad = res.error
        who = f" (request {bad.request})" if bad.request else ""
        err.print(f"{trace}:{bad.line}: illegal step{who}: {bad.message[:2000]}", markup=False)
        if bad.record is not None:
            err.print(f"  {str(bad.record)[:2000]}", markup=False)
        return 1
    out.print(
        f"{trace}: ok: {res.steps} steps ({res.ignored} declared no-ops) of {res.requests} requests, "
        f"{len([t for t in res.transitions if t >= 0])} distinct transitions, spec sha256 {res.spec_sha256[:12]}",
        markup=False,
    )
    if res.final_states:
        out.print("final states: " + ", ".join(f"{s} {n}" for s, n in sorted(res.final_states.items())), markup=False)
    return 0


__all__ = ["check", "replay"]
