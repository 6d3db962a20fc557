"""Render bench/results/*.json into PNG plots and docs/results.md (each figure names its machine).

Every number on the page is read from a result file; nothing is typed in by hand, and nothing is
measured here: the plots of the committed docs/ come from the committed JSON.

    python bench/plots.py                                   # bench/results/ -> docs/
    python bench/plots.py --out /tmp/plots                  # the same figures elsewhere
    python bench/plots.py --results bench/results/quick --out bench/results/quick/plots   # a quick run's

A quick run's JSON (`"quick": true`, bench/results/quick/) is never rendered into docs/. Every figure has a
title naming its machine(s) and result file, labelled axes with units, y from zero where bandwidth or a
ratio is shown, unique legend labels, and its legend outside the axes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FixedLocator, NullLocator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs"
DPI = 110


class Page:
    """What one rendering produces: the Markdown lines and the figures by file name."""

    def __init__(self, results: Path, out: Path, allow_quick: bool | None = None) -> None:
        self.results, self.out = results, out
        # quick numbers never reach the committed docs, whatever folder they are read from
        self.allow_quick = out.resolve() != DOCS.resolve() if allow_quick is None else allow_quick
        self.lines: list[str] = []
        self.figures: dict[str, Figure] = {}

    def load(self, pattern: str) -> list[tuple[Path, dict]]:
        runs = [(p, json.loads(p.read_text())) for p in sorted(self.results.glob(pattern))]
        return [(p, d) for p, d in runs if self.allow_quick or not d.get("quick")]

    def figure(self, name: str, fig: Figure, alt: str) -> None:
        self.figures[name] = fig
        self.lines += ["", f"![{alt}]({name})", ""]


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return path.name


def _machine(doc: dict) -> str:
    m = doc.get("machine", {})
    return m.get("gpu") or m.get("cpu") or m.get("cpu_model") or m.get("hostname", "?")


def _gbps(r: dict | None) -> float:
    return r["GBps_median"] if r and "GBps_median" in r else float("nan")


def _ratio(r: dict | None) -> str:
    return f"{r['ratio_median']:.3f}" if r and "ratio_median" in r else "-"


def _legend_outside(fig: Figure, axes: Iterable[Any], loc: str = "outside right upper", **kw: Any) -> None:
    """One figure legend outside the axes, each label once (the first handle that carries it)."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    fig.legend(list(seen.values()), list(seen), loc=loc, fontsize=8, **kw)


def _log2_ticks(ax: Any, values: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(values))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(v) for v in values])


# --- offload bandwidth --------------------------------------------------------------------------------


def bandwidth(page: Page) -> None:
    runs = [
        (p, d)
        for p, d in page.load("offload_bandwidth-*.json")
        if d.get("cases") and not d.get("smoke") and "sweep" not in p.name
    ]
    if not runs:
        return
    path, doc = runs[-1]
    machine = _machine(doc)
    page.lines += [
        "## Offload bandwidth",
        "",
        f"From `{_rel(path)}`, machine: {machine}. Llama-3-8B-like "
        f"KV ({doc['kv']['layers']} layers, {doc['kv']['kv_heads']} KV heads, head dim {doc['kv']['head_dim']}, "
        f"bf16), {doc['bytes_per_batch'] / 2**30:.0f} GiB per batch; ratios against the same run's contiguous "
        "pinned ceilings. *End to end*: CUDA events from before `submit()` on an idle GPU to completion, so "
        "host-side planning counts. *Behind compute*: the same copy submitted while the caller's stream is "
        "busy (as after a decode step), timed from the end of that work: the copy's own GPU time, as the "
        "ceilings are timed.",
        "",
        "| layout | page | direction | Triton kernel | CUDA engine (auto), end to end | CUDA engine (auto), "
        "behind compute | best engine setting, behind compute | torch via contiguous pinned | target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    # top row: bandwidth from zero with the ceiling; bottom row: the same points as their gap to that ceiling
    # (also from zero), where the differences between paths are visible
    fig, grid = plt.subplots(
        2, 2, figsize=(12, 7.6), sharex=True, sharey="row", layout="constrained", height_ratios=[1, 1]
    )
    pages_seen: set[int] = set()
    top = gap_top = 0.0
    paths = (
        ("Triton kernel", "o", "tab:blue", lambda d: d.get("triton")),
        ("CUDA engine (auto), end to end", "s", "tab:orange", lambda d: d.get("ours")),
        ("CUDA engine (auto), behind compute", "^", "tab:green", lambda d: (d.get("ours") or {}).get("behind_compute")),
    )
    for col, direction, key in ((0, "offload", "d2h"), (1, "loadback", "h2d")):
        ax, gap_ax = grid[0][col], grid[1][col]
        ceiling = doc["ceilings"][key]["GBps_best"]
        top = max(top, ceiling)
        target = None
        for layout, style in (("page_first", "-"), ("layer_first", "--")):
            cases = sorted((c for c in doc["cases"] if c["layout"] == layout), key=lambda c: c["page_size"])
            ps = [c["page_size"] for c in cases]
            pages_seen.update(ps)
            for name, marker, color, pick in paths:
                gbps = [_gbps(pick(c[direction])) for c in cases]
                ax.plot(ps, gbps, style, marker=marker, color=color, label=f"{name}, {layout}")
                gap = [ceiling - g for g in gbps]
                gap_top = max([gap_top] + [g for g in gap if g == g])
                gap_ax.plot(ps, gap, style, marker=marker, color=color, label=f"{name}, {layout}")
            for c in cases:
                d = c[direction]
                target = d["target"]
                torch_path = d.get("torch_gather_pinned") or d.get("torch_pinned_scatter")
                chose = f" ({d['ours']['chose']})" if (d.get("ours") or {}).get("chose") else ""
                best = d.get("best_engine_behind_compute") or {}
                best_cell = f"{best['ratio_median']:.3f} ({best['engine']})" if best else "-"
                page.lines.append(
                    f"| {layout} | {c['page_size']} | {direction} | {_ratio(d.get('triton'))} | "
                    f"{_ratio(d.get('ours'))}{chose} | {_ratio((d.get('ours') or {}).get('behind_compute'))} | "
                    f"{best_cell} | {_ratio(torch_path)} | {d['target']} |"
                )
        label = "offload (device to host)" if direction == "offload" else "load-back (host to device)"
        ax.axhline(
            ceiling,
            color="k",
            lw=1.2,
            label=f"{key.upper()} ceiling: contiguous pinned copy, this run ({ceiling:.1f} GB/s)",
        )
        ax.annotate(
            f"{key.upper()} ceiling {ceiling:.1f} GB/s",
            (0.01, ceiling),
            xycoords=("axes fraction", "data"),
            xytext=(0, 3),
            textcoords="offset points",
            fontsize=8,
        )
        if target is not None:
            name = "offload" if direction == "offload" else "load-back"
            gap_ax.axhline(
                ceiling * (1 - target),
                color="grey",
                lw=1,
                ls=":",
                label=f"{name} target: within {1 - target:.2f} x {key.upper()} ceiling "
                f"({ceiling * (1 - target):.1f} GB/s below it)",
            )
        ax.set_title(f"{label}: bandwidth", fontsize=10)
        gap_ax.set_title(f"{label}: gap to the {key.upper()} ceiling (lower is better)", fontsize=10)
        gap_ax.set_xlabel("page size (tokens, log scale)")
        for a in (ax, gap_ax):
            a.grid(alpha=0.3)
    for row in grid:
        for ax in row:
            _log2_ticks(ax, sorted(pages_seen))
    grid[0][0].set_ylabel("bandwidth, median (GB/s)")
    grid[0][0].set_ylim(0, top * 1.08)
    grid[1][0].set_ylabel("ceiling minus bandwidth (GB/s)")
    grid[1][0].set_ylim(0, gap_top * 1.15)
    fig.suptitle(
        f"Scattered KV offload and load-back vs the contiguous pinned ceiling, {machine} "
        f"({path.name}, {doc['bytes_per_batch'] / 2**30:.0f} GiB per batch)",
        fontsize=11,
    )
    _legend_outside(fig, [a for row in grid for a in row], loc="outside lower center", ncols=3)
    page.figure("bandwidth.png", fig, "bandwidth")


# --- per-event cost -----------------------------------------------------------------------------------


def event_cost(page: Page) -> None:
    runs = page.load("event_runtime-*.json")
    if not runs:
        return
    page.lines += [
        "## Per-event cost: generated machine vs the `transitions` reference",
        "",
        "| machine | generated us/event | reference us/event | speedup | construct us (generated / reference) |",
        "|---|---|---|---|---|",
    ]
    fig, ax = plt.subplots(figsize=(7.5, 4), layout="constrained")
    names, gen, ref = [], [], []
    for path, d in runs:
        names.append(f"{_machine(d)[:28]}\n({path.name})")
        gen.append(d["generated_us_per_event"])
        ref.append(d["reference_us_per_event"])
        page.lines.append(
            f"| {_machine(d)} (`{path.name}`) | {d['generated_us_per_event']:.3f} | "
            f"{d['reference_us_per_event']:.2f} | {d['speedup_vs_reference']:.0f}x | "
            f"{d['generated_construct_us']:.2f} / {d['reference_construct_us']:.0f} |"
        )
    x = list(range(len(names)))
    ax.bar([i - 0.2 for i in x], gen, 0.4, label="generated machine (generated/)")
    ax.bar([i + 0.2 for i in x], ref, 0.4, label="transitions reference (kvfsm/reference)")
    for i, (g, r) in enumerate(zip(gen, ref)):
        ax.annotate(f"{r / g:.0f}x faster", (i, r), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(min(gen) / 2, max(ref) * 3)
    ax.set_xticks(x, names, fontsize=8)
    ax.set_xlabel("machine (result file)")
    ax.set_ylabel("time per event (microseconds, log scale)")
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        "Per-event cost: generated machine vs the transitions reference\n"
        f"({', '.join(dict.fromkeys(_machine(d) for _, d in runs))})",
        fontsize=11,
    )
    _legend_outside(fig, [ax], loc="outside lower center", ncols=2)
    page.figure("event_cost.png", fig, "event cost")


# --- manager time per scheduler iteration (CPU step engine) ---------------------------------------------


def manager_time(page: Page) -> None:
    runs = [(p, d) for p, d in page.load("manager_overhead-*.json") if any("mode" in r for r in d["runs"])]
    if not runs:
        return
    page.lines += [
        "## Manager time per scheduler iteration",
        "",
        "One offload per live request (a loop of `offload(req)`, or one `offload_batch` with the engine's "
        "batch arrays) plus one progress check, after a simulated 20 ms decode step; bytes moved excluded "
        "(copies: `step` = performed during the next simulated step, as a GPU does; `inline` = the CPU "
        "engine copies in submit and that time is subtracted). "
        "The step is waited out asleep (`sleep`) or busy (`spin`); `floor` is bench/iteration_floor.py's "
        "bare iteration (the same operations with no kvfsm code, no checks, no lifecycle), timed in the "
        "same run and regime. This is the CPU regression guard, not the verdict (that is the serving loop "
        "above). Target: <= 400 us at 4096 live requests (2% of a 20 ms step). The plot shows each "
        "machine's newest result file in the verdict's regime (`step` copies, `sleep`).",
        "",
        "| result file | machine | page/stride | live requests | chunks/iteration | mode | copies | step | "
        "mean us/iteration | p90 us | share of 20 ms | floor us | x floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    newest: dict[str, tuple[Path, dict]] = {}
    for path, d in runs:
        for r in d["runs"]:
            copies = r.get("copy_model", "inline")  # results before the step model copied inline
            page.lines.append(
                f"| `{path.name}` | {_machine(d)} | {r['page_size']}/{r['stride']} | {r['live_requests']} | "
                f"{r['chunks_per_iteration_mean']:.0f} | {r['mode']} | {copies} | "
                f"{r.get('step_wait', 'sleep')} | {r['manager_us_per_iteration_mean']:.0f} | "
                f"{r['manager_us_per_iteration_p90']:.0f} | {r['share_of_20ms_step']:.1%} | "
                + (
                    f"{r['floor_us_per_iteration_mean']:.0f} | {r['over_floor']:.1f}x |"
                    if "over_floor" in r
                    else "- | - |"
                )
            )
        m = _machine(d)
        if m not in newest or d.get("utc", "") > newest[m][1].get("utc", ""):
            newest[m] = (path, d)
    panels = sorted(newest.items())
    fig, axes = plt.subplots(
        1, len(panels), figsize=(5.5 * len(panels), 5.2), sharey=True, squeeze=False, layout="constrained"
    )
    colors = {"64/64": "tab:blue", "16/64": "tab:orange", "16/16": "tab:green"}
    lives: set[int] = set()
    for ax, (machine, (path, d)) in zip(axes[0], panels):
        verdict_copies = d.get("verdict_copy_model", "step")
        series: dict[tuple[str, str], list[dict]] = {}
        for r in d["runs"]:
            if r.get("copy_model", "inline") == verdict_copies and r.get("step_wait", "sleep") == "sleep":
                series.setdefault((r["mode"], f"{r['page_size']}/{r['stride']}"), []).append(r)
        for (mode, ps), rs in sorted(series.items()):
            rs.sort(key=lambda r: r["live_requests"])
            xs = [r["live_requests"] for r in rs]
            lives.update(xs)
            color = colors.get(ps, "tab:grey")
            ax.plot(
                xs,
                [r["manager_us_per_iteration_mean"] for r in rs],
                "-o" if mode == "batch" else "--s",
                color=color,
                label=f"kvfsm, {mode} calls, page/stride {ps}",
            )
            if mode == "batch" and all("floor_us_per_iteration_mean" in r for r in rs):
                ax.plot(
                    xs,
                    [r["floor_us_per_iteration_mean"] for r in rs],
                    ":",
                    marker="x",
                    color=color,
                    label=f"bare iteration floor, page/stride {ps}",
                )
        ax.axhline(400, color="k", lw=1, label="target: 400 us at 4096 live (2% of a 20 ms step)")
        ax.set_yscale("log")
        ax.set_title(f"{machine} ({path.name}, {verdict_copies} copies)", fontsize=9)
        ax.set_xlabel("live requests (log scale)")
        ax.grid(alpha=0.3)
    for ax in axes[0]:
        _log2_ticks(ax, sorted(lives))
    axes[0][0].set_ylabel("manager time per iteration, mean (us, log scale)")
    fig.suptitle("Manager time per scheduler iteration, CPU step engine (bench/manager_overhead.py)", fontsize=11)
    _legend_outside(fig, axes[0], loc="outside lower center", ncols=3)
    page.figure("manager_time.png", fig, "manager time")


# --- the verdict: the serving loop on a GPU -----------------------------------------------------------


def _ms(x: float) -> str:
    return f"{x:.3f}"


def serving_loop(page: Page) -> None:
    runs = [(p, d) for p, d in page.load("serving_loop-*.json") if d.get("rows") and "before" not in p.name]
    if not runs:
        return
    path, doc = runs[-1]
    machine, s = _machine(doc), doc.get("settings", {})
    rows = doc["rows"]
    first = s.get("tables", ["cuda"])[0]

    def row(algo: str, live: int, page_: int, stride: int, table: str | None = None) -> dict | None:
        return next(
            (
                r
                for r in rows
                if r["algo"] == algo
                and r["live"] == live
                and r["page"] == page_
                and r["stride"] == stride
                and (table is None or r["table"] == table)
            ),
            None,
        )

    page.lines += [
        "## The verdict: the manager in a serving loop",
        "",
        f"From `{_rel(path)}`, machine: {machine}. bench/serving_loop.py: an overlap-scheduled decode loop "
        f"({s.get('step_ms', '?'):g} ms step of matmuls on the compute stream, then the manager's calls while "
        f"it runs, GC on, {s.get('iterations', '?')} timed iterations after {s.get('warmup', '?')} warm-up), "
        f"Llama-3-8B-shaped rows ({s.get('layers', '?')} of the 32 layers), the real CudaCopyEngine, "
        f"FileStorage on {s.get('store_root', '?')}. Scheduler-thread time per iteration, in ms; kvfsm with the "
        f"request table on the `{first}` device; *seed* is bench/seed_baseline.py (the seed's per-request "
        "algorithm), *bare floor* is bench/bare_offload.py (selection, one copy, host frees, nothing else: the "
        "floor of any manager), both in the same run. This floor is not bench/iteration_floor.py's (the "
        "manager-time table below): that one is a CPU step engine's.",
        "",
        "| live | page/stride | kvfsm median / p99 / max ms | seed median ms | bare floor median ms | "
        "kvfsm vs seed | kvfsm / floor | MiB offloaded per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    configs = sorted({(r["live"], r["page"], r["stride"]) for r in rows}, key=lambda c: (-c[0], -c[1]))
    labels, series = [], {"kvfsm": [], "seed": [], "bare": []}
    p99s: dict[str, list[float]] = {k: [] for k in series}
    for live, pg, st in configs:
        k, sd, bare = row("kvfsm", live, pg, st, first), row("seed", live, pg, st), row("bare", live, pg, st)
        if k is None:
            continue
        t = k["total"]
        page.lines.append(
            f"| {live} | {pg}/{st} | {_ms(t['median'])} / {_ms(t['p99'])} / {_ms(t['max'])} | "
            f"{_ms(sd['total']['median']) if sd else '-'} | {_ms(bare['total']['median']) if bare else '-'} | "
            + (f"{sd['total']['median'] / t['median']:.2f}x faster" if sd else "-")
            + " | "
            + (f"{t['median'] / bare['total']['median']:.2f}" if bare else "-")
            + " | "
            f"{k['bytes_offloaded_per_step'] / 2**20:.2f} |"
        )
        labels.append(f"{live} live\n{pg}/{st}")
        for name, r in (("kvfsm", k), ("seed", sd), ("bare", bare)):
            series[name].append(r["total"]["median"] if r else float("nan"))
            p99s[name].append(r["total"]["p99"] if r else float("nan"))
    targets = [t for t in doc.get("targets") or [] if "name" in t]
    if targets:
        page.lines += ["", "Targets checked by the run:", "", "| target | value | limit | met |", "|---|---|---|---|"]
        page.lines += [
            f"| {t['name']} | {t['value']:.3g} | {t['limit']} | {'yes' if t['met'] else 'no'} |"
            if isinstance(t["value"], (int, float))
            else f"| {t['name']} | - | {t['limit']} | no |"
            for t in targets
        ]
    others = page.load("serving_loop_probes-*.json")
    for ppath, pdoc in others:
        page.lines += [
            "",
            f"Probes (`{_rel(ppath)}`): " + str(pdoc.get("note", "")),
            "",
            "| probe | algo | live | page/stride | median ms | p99 ms |",
            "|---|---|---|---|---|---|",
        ]
        for pname, prun in pdoc.get("runs", {}).items():
            for r in prun.get("rows", []):
                page.lines.append(
                    f"| {pname} | {r['algo']} | {r['live']} | {r['page']}/{r['stride']} | "
                    f"{_ms(r['total']['median'])} | {_ms(r['total']['p99'])} |"
                )
    fig, ax = plt.subplots(figsize=(8.5, 5), layout="constrained")
    x = list(range(len(labels)))
    legend = {
        "kvfsm": f"kvfsm (request table on {first})",
        "seed": "seed algorithm (bench/seed_baseline.py)",
        "bare": "bare floor (bench/bare_offload.py)",
    }
    for i, name in enumerate(series):
        xs = [v + (i - 1) * 0.27 for v in x]
        ax.bar(xs, series[name], 0.27, label=f"{legend[name]}, median")
        ax.plot(xs, p99s[name], "k_", markersize=10, mew=1.5, label="p99 of the bar's series" if i == 0 else None)
    ax.set_yscale("log")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_xlabel("live requests and page/stride (tokens)")
    ax.set_ylabel("scheduler-thread time per iteration (ms, log scale)")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"{s.get('iterations', '?')} timed iterations, {s.get('step_ms', '?'):g} ms decode step", fontsize=9)
    fig.suptitle(f"The manager in an overlap-scheduled serving loop, {machine} ({path.name})", fontsize=11)
    _legend_outside(fig, [ax], loc="outside lower center", ncols=2)
    page.figure("serving_loop.png", fig, "serving loop")


# --- one call right after a step -------------------------------------------------------------------------


def cold_calls(page: Page) -> None:
    runs = page.load("cold_call_probe-*.json")
    if not runs:
        return
    page.lines += [
        "## One call right after a simulated step",
        "",
        "bench/probes/cold_call_probe.py: each primitive of the manager's hot path timed as the first call "
        "after a simulated 20 ms step (cold) and right after that (warm), median over samples. The "
        "manager's per-iteration budget is spent in this regime.",
        "",
        "| result file | machine | primitive | cold us | warm us | cold / warm |",
        "|---|---|---|---|---|---|",
    ]
    for path, d in runs:
        for r in d["rows"]:
            page.lines.append(
                f"| `{path.name}` | {_machine(d)} | {r['primitive']} | {r['cold_us_median']:.1f} | "
                f"{r['warm_us_median']:.1f} | {r['cold_over_warm']:.0f}x |"
            )
    page.lines.append("")


def explorer_speed(page: Page) -> None:
    runs = page.load("explorer_speed-*.json")
    if not runs:
        return
    page.lines += [
        "## The bounded explorer: states per CPU second, technique by technique",
        "",
        "bench/explorer_speed.py: `kvfsm check`'s search over the real manager and pools, the search "
        "techniques added one at a time on the same bounds (every step reaches the same states). "
        "Speed-up is CPU time against the step before; the first step is the search with request symmetry only.",
        "",
    ]
    for path, d in runs:
        bounds = list(d["ladder"][0]["bounds"])
        page.lines += [
            f"From `{_rel(path)}`, machine: {_machine(d)}.",
            "",
            "| step | " + " | ".join(f"{b} states/CPU s (events)" for b in bounds) + " | CPU s, all | speed-up |",
            "|---|" + "---|" * len(bounds) + "---|---|",
        ]
        before = None
        for step in d["ladder"]:
            cpu = sum(r["cpu_s"] for r in step["bounds"].values())
            cells = [f"{r['states_per_cpu_s']:.0f} ({r['edges']})" for r in step["bounds"].values()]
            gain = "-" if before is None else f"{before / cpu:.2f}x"
            page.lines.append(f"| {step['step']} | " + " | ".join(cells) + f" | {cpu:.1f} | {gain} |")
            before = cpu
        first, last = d["ladder"][0]["bounds"], d["ladder"][-1]["bounds"]
        total = sum(r["cpu_s"] for r in first.values()) / sum(r["cpu_s"] for r in last.values())
        page.lines += [
            "",
            f"All techniques together: {total:.2f}x less CPU for the same states.",
            "",
            "Request symmetry (merging states that differ only by which request is which), off against on:",
            "",
            "| bound | states off | states on | states factor | CPU speed-up |",
            "|---|---|---|---|---|",
        ]
        for b, r in d["symmetry"].items():
            page.lines.append(
                f"| {b} | {r['off']['states']} | {r['on']['states']} | {r['states_factor']:.2f}x | "
                f"{r['cpu_speedup']:.2f}x |"
            )
        page.lines += [
            "",
            "The named bounds as `kvfsm check` explores them (wall seconds on this machine):",
            "",
            "| command | sub-bounds | states | events | wall s | CPU s |",
            "|---|---|---|---|---|---|",
        ]
        for b in d["named_bounds"].values():
            t = b["total"]
            page.lines.append(
                f"| `{b['command']}` | {len(b['parts'])} | {t['states']} | {t['edges']} | "
                f"{t['wall_s']:.1f} | {t['cpu_s']:.1f} |"
            )
        jobs = d.get("jobs") or []
        if len(jobs) > 1:
            page.lines += [
                "",
                f"`--jobs` on `{d['jobs_bound']}`: "
                + ", ".join(f"{j['jobs']} job(s) {j['wall_s']:.1f} s wall" for j in jobs)
                + f" (this machine has {d['machine'].get('cpu_count', '?')} cores).",
            ]
    page.lines.append("")


def transformers_offload(page: Page) -> None:
    runs = [(p, d) for p, d in page.load("transformers_offload-*.json") if d.get("summary")]
    if not runs:
        return
    page.lines += [
        "## transformers' continuous batching: swaps through kvfsm against the engine's own offloading",
        "",
        "bench/transformers_offload.py: a random-weight Llama whose paged cache is far smaller than the "
        "requests need, so the engine preempts and restores requests all along; the same workload with "
        "transformers' own OffloadingManager (*engine*) and with kvfsm installed (*kvfsm*: deferred "
        "release, *kvfsm_fenced*: fenced, the default). Host time in offload is the wall time inside the "
        "offloading manager's offload_requests and restore_scheduled_requests; the last repeat of each "
        "mode is shown.",
        "",
        "| result file | machine | mode | tok/s | host time in offload ms | vs engine | outputs identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for path, d in runs:
        summary = d["summary"]
        for mode in ("engine", "kvfsm", "kvfsm_fenced", "soft_reset"):
            m = summary.get(mode)
            if m is None:
                continue
            r = summary.get(f"{mode}_vs_engine_time_in_offload")
            ratio = "-" if r is None else f"{r:.2f}x"  # none for the engine itself, or an engine time of 0
            page.lines.append(
                f"| `{path.name}` | {_machine(d)} | {mode} | {m['throughput_tok_s']:.0f} | "
                f"{m['time_in_offload_s'] * 1e3:.1f} | {ratio} | "
                f"{'yes' if summary.get('outputs_identical_across_modes') else 'no'} |"
            )
    page.lines.append("")
    # the verdict over repeats: the cold first repeat of each mode left out (warm_repeats in the benchmark)
    for path, d in runs:
        for mode in ("kvfsm", "kvfsm_fenced"):
            w = d["summary"].get(f"{mode}_vs_engine_warm")
            if not w or not w.get("time_in_offload_ratios"):
                continue
            host = ", ".join(f"{r:.2f}x" for r in w["time_in_offload_ratios"])
            tput = ", ".join(f"{r:.2f}x" for r in w["throughput_ratios"])
            page.lines.append(
                f"- `{path.name}`, {mode} against the engine in the warm repeats {w['repeats']} (each "
                f"ratio from one repeat's pair of runs): host time in offload {host} (median "
                f"{w['time_in_offload_ratio_median']:.2f}x), throughput {tput} (median "
                f"{w['throughput_ratio_median']:.2f}x)."
            )
    if page.lines[-1] != "":
        page.lines.append("")


RENDERERS = (serving_loop, bandwidth, event_cost, manager_time, cold_calls, explorer_speed, transformers_offload)


def render(
    results: Path = RESULTS, out: Path = DOCS, *, close: bool = True, allow_quick: bool | None = None
) -> tuple[str, dict[str, Figure]]:
    """Render every section from `results` into `out` (results.md and the PNGs); return the Markdown and the
    figures (closed unless `close=False`, for a caller that inspects them). Quick runs are shown only outside
    docs/ unless `allow_quick` says otherwise (a render into a temp dir that stands for docs/ passes False)."""
    page = Page(Path(results), Path(out), allow_quick)
    quick = page.allow_quick and any(d.get("quick") for _, d in page.load("*.json"))
    source = _rel(Path(results)) + "/*.json"
    page.lines = [f"<!-- GENERATED by bench/plots.py from {source}; do not edit. -->", "# Results", ""]
    if quick:
        page.lines += ["**Quick runs**: these check the scripts, not the numbers.", ""]
    for renderer in RENDERERS:
        renderer(page)
    page.out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(page.lines) + "\n"
    (page.out / "results.md").write_text(text)
    for name, fig in page.figures.items():
        fig.savefig(page.out / name, dpi=DPI)
        if close:
            plt.close(fig)
    return text, page.figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the result JSON is (default bench/results/)")
    ap.add_argument("--out", type=Path, default=DOCS, help="where results.md and the PNGs go (default docs/)")
    args = ap.parse_args(argv)
    _, figures = render(args.results, args.out)
    print(f"wrote {args.out / 'results.md'} and {', '.join(figures) or 'no plots'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
