"""Render bench/results/*.json into PNG plots and docs/results.md (each figure names its machine).

Every number on the page is read from a result file; nothing is typed in by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs"


def _load(pattern: str) -> list[tuple[Path, dict]]:
    return [(p, json.loads(p.read_text())) for p in sorted(RESULTS.glob(pattern))]


def _machine(doc: dict) -> str:
    m = doc.get("machine", {})
    return m.get("gpu") or m.get("cpu") or m.get("hostname", "?")


def _gbps(r: dict | None) -> float:
    return r["GBps_median"] if r and "GBps_median" in r else float("nan")


def _ratio(r: dict | None) -> str:
    return f"{r['ratio_median']:.3f}" if r and "ratio_median" in r else "-"


def bandwidth(lines: list[str]) -> None:
    runs = [(p, d) for p, d in _load("offload_bandwidth-*.json") if d.get("cases") and not d.get("smoke")
            and "sweep" not in p.name]
    if not runs:
        return
    path, doc = runs[-1]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    lines += ["## Offload bandwidth", "", f"From `{path.relative_to(ROOT)}`, machine: {_machine(doc)}. Llama-3-8B-like "
              f"KV ({doc['kv']['layers']} layers, {doc['kv']['kv_heads']} KV heads, head dim {doc['kv']['head_dim']}, "
              f"bf16), {doc['bytes_per_batch'] / 2**30:.0f} GiB per batch; ratios against the same run's contiguous "
              "pinned ceilings. *End to end*: CUDA events from before `submit()` on an idle GPU to completion, so "
              "host-side planning counts. *Behind compute*: the same copy submitted while the caller's stream is "
              "busy (as after a decode step), timed from the end of that work: the copy's own GPU time, as the "
              "ceilings are timed.", "",
              "| layout | page | direction | Triton kernel | CUDA engine (auto), end to end | CUDA engine (auto), "
              "behind compute | best engine setting, behind compute | torch via contiguous pinned | target |",
              "|---|---|---|---|---|---|---|---|---|"]
    for ax, direction, key in ((axes[0], "offload", "d2h"), (axes[1], "loadback", "h2d")):
        ceiling = doc["ceilings"][key]["GBps_best"]
        for layout, style in (("page_first", "-o"), ("layer_first", "--s")):
            cases = sorted((c for c in doc["cases"] if c["layout"] == layout), key=lambda c: c["page_size"])
            ps = [c["page_size"] for c in cases]
            ax.plot(ps, [_gbps(c[direction].get("triton")) for c in cases], style, label=f"Triton kernel, {layout}")
            ax.plot(ps, [_gbps(c[direction].get("ours")) for c in cases], style, alpha=0.5,
                    label=f"CUDA engine (auto), {layout}")
            for c in cases:
                d = c[direction]
                torch_path = d.get("torch_gather_pinned") or d.get("torch_pinned_scatter")
                chose = f" ({d['ours']['chose']})" if (d.get("ours") or {}).get("chose") else ""
                best = d.get("best_engine_behind_compute") or {}
                best_cell = f"{best['ratio_median']:.3f} ({best['engine']})" if best else "-"
                lines.append(f"| {layout} | {c['page_size']} | {direction} | {_ratio(d.get('triton'))} | "
                             f"{_ratio(d.get('ours'))}{chose} | {_ratio((d.get('ours') or {}).get('behind_compute'))} | "
                             f"{best_cell} | {_ratio(torch_path)} | {d['target']} |")
        ax.axhline(ceiling, color="k", lw=1, label=f"contiguous pinned {key.upper()} ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("page size (tokens)")
        ax.set_title(f"{direction} ({_machine(doc)})")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s (median)")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(DOCS / "bandwidth.png", dpi=110)
    plt.close(fig)
    lines += ["", "![bandwidth](bandwidth.png)", ""]


def event_cost(lines: list[str]) -> None:
    runs = _load("event_runtime-*.json")
    if not runs:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names, gen, ref = [], [], []
    lines += ["## Per-event cost: generated machine vs the `transitions` reference", "",
              "| machine | generated us/event | reference us/event | speedup | construct us (generated / reference) |",
              "|---|---|---|---|---|"]
    for path, d in runs:
        names.append(_machine(d)[:28])
        gen.append(d["generated_us_per_event"])
        ref.append(d["reference_us_per_event"])
        lines.append(f"| {_machine(d)} (`{path.name}`) | {d['generated_us_per_event']:.3f} | "
                     f"{d['reference_us_per_event']:.2f} | {d['speedup_vs_reference']:.0f}x | "
                     f"{d['generated_construct_us']:.2f} / {d['reference_construct_us']:.0f} |")
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], gen, 0.4, label="generated")
    ax.bar([i + 0.2 for i in x], ref, 0.4, label="transitions reference")
    ax.set_yscale("log")
    ax.set_xticks(list(x), names, fontsize=7)
    ax.set_ylabel("microseconds per event")
    ax.legend()
    fig.tight_layout()
    fig.savefig(DOCS / "event_cost.png", dpi=110)
    plt.close(fig)
    lines += ["", "![event cost](event_cost.png)", ""]


def manager_time(lines: list[str]) -> None:
    runs = [(p, d) for p, d in _load("manager_overhead-*.json") if any("mode" in r for r in d["runs"])]
    if not runs:
        return
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    lines += ["## Manager time per scheduler iteration", "",
              "One offload per live request (a loop of `offload(req)`, or one `offload_batch` with the engine's "
              "batch arrays) plus one progress check, after a simulated 20 ms decode step; bytes moved excluded "
              "(copies: `step` = performed during the next simulated step, as a GPU does; `inline` = the CPU "
              "engine copies in submit and that time is subtracted). "
              "The step is waited out asleep (`sleep`) or busy (`spin`); `floor` is bench/iteration_floor.py's "
              "bare iteration (the same operations with no kvfsm code, no checks, no lifecycle), timed in the "
              "same run and regime. "
              "Target: <= 400 us at 4096 live requests (2% of a 20 ms step).", "",
              "| result file | machine | page/stride | live requests | chunks/iteration | mode | copies | step | "
              "mean us/iteration | p90 us | share of 20 ms | floor us | x floor |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path, d in runs:
        rows = d["runs"]
        series: dict[tuple[str, int, int], list[dict]] = {}
        for r in rows:
            copies = r.get("copy_model", "inline")  # results before the step model copied inline
            if r.get("step_wait", "sleep") == "sleep":  # the plot shows the verdict's regime
                series.setdefault((r["mode"], r["page_size"], r["stride"], copies), []).append(r)
            lines.append(f"| `{path.name}` | {_machine(d)} | {r['page_size']}/{r['stride']} | {r['live_requests']} | "
                         f"{r['chunks_per_iteration_mean']:.0f} | {r['mode']} | {copies} | "
                         f"{r.get('step_wait', 'sleep')} | {r['manager_us_per_iteration_mean']:.0f} | "
                         f"{r['manager_us_per_iteration_p90']:.0f} | {r['share_of_20ms_step']:.1%} | "
                         + (f"{r['floor_us_per_iteration_mean']:.0f} | {r['over_floor']:.1f}x |"
                            if "over_floor" in r else "- | - |"))
        for (mode, page, stride, copies), rs in sorted(series.items()):
            ax.plot([r["live_requests"] for r in rs], [r["manager_us_per_iteration_mean"] for r in rs],
                    "-o" if mode == "batch" else "--s",
                    label=f"{mode} {page}/{stride} {copies} ({_machine(d)[:16]})")
    ax.axhline(400, color="k", lw=1, label="target at 4096")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("live requests")
    ax.set_ylabel("us per iteration (mean)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(DOCS / "manager_time.png", dpi=110)
    plt.close(fig)
    lines += ["", "![manager time](manager_time.png)", ""]


def cold_calls(lines: list[str]) -> None:
    runs = _load("cold_call_probe-*.json")
    if not runs:
        return
    lines += ["## One call right after a simulated step", "",
              "bench/probes/cold_call_probe.py: each primitive of the manager's hot path timed as the first call after "
              "a simulated 20 ms step (cold) and right after that (warm), median over samples. Issue 4's budget is "
              "spent in this regime.", "",
              "| result file | machine | primitive | cold us | warm us | cold / warm |", "|---|---|---|---|---|---|"]
    for path, d in runs:
        for r in d["rows"]:
            lines.append(f"| `{path.name}` | {_machine(d)} | {r['primitive']} | {r['cold_us_median']:.1f} | "
                         f"{r['warm_us_median']:.1f} | {r['cold_over_warm']:.0f}x |")
    lines.append("")


def main() -> int:
    DOCS.mkdir(exist_ok=True)
    lines = ["<!-- GENERATED by bench/plots.py from bench/results/*.json; do not edit. -->", "# Results", ""]
    for render in (bandwidth, event_cost, manager_time, cold_calls):
        render(lines)
    (DOCS / "results.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {DOCS / 'results.md'} and plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
