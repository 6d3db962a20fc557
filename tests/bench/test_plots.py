"""bench/plots.py renders the committed bench/results/*.json into figures a reader can use: checked on
matplotlib's object model (titles, labels, limits, legend entries and where the legend sits), not on
pixels. It renders into a temp dir, so the committed docs/ is untouched."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from matplotlib.transforms import Bbox

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
UNIT = re.compile(r"\([^)]*[A-Za-z/][^)]*\)")  # "(GB/s)", "(tokens, log scale)", "(ms, log scale)"
# where a quantity is a bandwidth or a ratio, its axis must start at zero (a y label naming one of these)
ZERO_BASED = re.compile(r"GB/s|\bratio\b|\bshare\b|\bfraction\b", re.I)


@pytest.fixture(scope="module")
def plots():
    sys.path.insert(0, str(BENCH))
    try:
        import plots as module
    finally:
        sys.path.remove(str(BENCH))
    return module


@pytest.fixture(scope="module")
def rendered(plots, tmp_path_factory):
    out = tmp_path_factory.mktemp("plots")
    # rendered as docs/ is: a probe's quick JSON among the committed results stays off the page
    text, figures = plots.render(RESULTS, out, close=False, allow_quick=False)
    yield out, text, figures
    import matplotlib.pyplot as plt

    for fig in figures.values():
        plt.close(fig)


def _machines(pattern: str) -> set[str]:
    names = set()
    for path in RESULTS.glob(pattern):
        m = json.loads(path.read_text()).get("machine", {})
        names.add(m.get("gpu") or m.get("cpu") or m.get("cpu_model"))
    return names


def _titles(fig) -> str:
    parts = [fig._suptitle.get_text() if fig._suptitle else ""] + [ax.get_title() for ax in fig.axes]
    return " | ".join(parts)


def _legend_labels(fig) -> list[str]:
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    return [t.get_text() for leg in legends for t in leg.get_texts()]


def test_every_plot_is_written_with_its_markdown(rendered):
    out, text, figures = rendered
    assert {"bandwidth.png", "event_cost.png", "manager_time.png", "serving_loop.png"} <= set(figures)
    for name in figures:
        assert (out / name).stat().st_size > 10_000
        assert f"]({name})" in text  # results.md shows it
    assert (out / "results.md").read_text() == text


def test_every_figure_has_a_title_naming_its_machine(rendered):
    _, _, figures = rendered
    sources = {
        "bandwidth.png": "offload_bandwidth-*.json",
        "event_cost.png": "event_runtime-*.json",
        "manager_time.png": "manager_overhead-*.json",
        "serving_loop.png": "serving_loop-*.json",
    }
    for name, fig in figures.items():
        assert fig._suptitle is not None and fig._suptitle.get_text().strip(), f"{name} has no title"
        titles = _titles(fig)
        machines = _machines(sources[name])
        assert any(m and m in titles for m in machines), f"{name}: no machine of {machines} in {titles!r}"


def test_every_axis_is_labelled_with_units(rendered):
    _, _, figures = rendered
    for name, fig in figures.items():
        for ax in fig.axes:
            # a y axis shared with its row's first plot may leave the label to that one
            ylabel = ax.get_ylabel() or next(
                (o.get_ylabel() for o in ax.get_shared_y_axes().get_siblings(ax) if o.get_ylabel()), ""
            )
            xlabel = ax.get_xlabel() or next(
                (o.get_xlabel() for o in ax.get_shared_x_axes().get_siblings(ax) if o.get_xlabel()), ""
            )
            assert UNIT.search(ylabel), f"{name}: y label {ylabel!r} names no unit"
            assert UNIT.search(xlabel), f"{name}: x label {xlabel!r} names no unit"


def test_bandwidth_and_ratio_axes_start_at_zero(rendered):
    _, _, figures = rendered
    checked = 0
    for name, fig in figures.items():
        for ax in fig.axes:
            ylabel = ax.get_ylabel() or next(
                (o.get_ylabel() for o in ax.get_shared_y_axes().get_siblings(ax) if o.get_ylabel()), ""
            )
            if ZERO_BASED.search(ylabel):
                assert ax.get_yscale() == "linear", f"{name}: {ylabel!r} on a {ax.get_yscale()} axis"
                assert ax.get_ylim()[0] == 0, f"{name}: {ylabel!r} starts at {ax.get_ylim()[0]}"
                checked += 1
    assert checked >= 4  # the four panels of bandwidth.png at least


def test_the_bandwidth_ceiling_is_labelled(rendered):
    _, _, figures = rendered
    labels = _legend_labels(figures["bandwidth.png"])
    assert any("D2H ceiling" in t for t in labels) and any("H2D ceiling" in t for t in labels), labels


def test_legend_labels_are_unique(rendered):
    _, _, figures = rendered
    for name, fig in figures.items():
        labels = _legend_labels(fig)
        assert labels, f"{name} has no legend"
        dupes = sorted({t for t in labels if labels.count(t) > 1})
        assert not dupes, f"{name}: legend labels repeat: {dupes}"


def test_no_legend_covers_data(rendered):
    """Every legend's box is clear of every visible data point and bar (display coordinates after a draw;
    what lies outside its axes is clipped, so only the part inside counts)."""
    _, _, figures = rendered
    for name, fig in figures.items():
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
        for leg in legends:
            box = leg.get_window_extent(renderer)
            for ax in fig.axes:
                area = ax.get_window_extent(renderer)
                for line in ax.get_lines():
                    xy = ax.transData.transform(line.get_xydata())
                    covered = [(x, y) for x, y in xy if area.contains(x, y) and box.contains(x, y)]
                    assert not covered, f"{name}: the legend covers points of {line.get_label()!r}"
                for patch in ax.patches:
                    visible = Bbox.intersection(patch.get_window_extent(renderer), area)
                    assert visible is None or not box.overlaps(visible), (
                        f"{name}: the legend covers a bar of {patch.get_label()!r}"
                    )


def test_quick_results_never_reach_docs(plots, tmp_path):
    """A quick run's JSON renders into a quick folder, never into docs/ (plots.py skips it there)."""
    quick = tmp_path / "quick"
    quick.mkdir()
    doc = json.loads((RESULTS / "event_runtime-cpu.json").read_text())
    (quick / "event_runtime-quick-cpu.json").write_text(json.dumps({**doc, "quick": True}))
    text, figures = plots.render(quick, tmp_path / "plots")
    assert "event_cost.png" in figures and "Quick runs" in text
    page = plots.Page(quick, plots.DOCS)  # what a render into docs/ would read from that folder
    assert page.load("*.json") == []


def test_main_takes_an_output_dir(plots, tmp_path):
    assert plots.main(["--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").exists() and (tmp_path / "bandwidth.png").exists()


def test_the_committed_results_page_is_fresh(rendered):
    """docs/results.md is what plots.py renders from the committed JSON (docs/benchmarks.md's figures are checked
    against it: tests/docs/test_readme_numbers.py)."""
    _, text, _ = rendered
    assert (ROOT / "docs" / "results.md").read_text() == text, "docs/results.md is stale: run python bench/plots.py"
    for name in ("bandwidth.png", "event_cost.png", "manager_time.png", "serving_loop.png"):
        assert (ROOT / "docs" / name).exists(), f"docs/{name} is missing: run python bench/plots.py"


def test_the_transformers_section_lists_every_comparison(plots, rendered, tmp_path):
    """Every committed transformers_offload result renders one row per mode with its host-time ratio to the
    engine's (as the JSON's summary has it); a summary without a ratio (an engine time of 0) renders "-"."""
    _, text, _ = rendered
    for path in RESULTS.glob("transformers_offload-*.json"):
        summary = json.loads(path.read_text())["summary"]
        for mode in ("kvfsm", "kvfsm_fenced"):
            if mode in summary:
                ratio = summary[f"{mode}_vs_engine_time_in_offload"]
                assert re.search(
                    rf"\| `{re.escape(path.name)}` \| [^|]+ \| {mode} \| .* \| {ratio:.2f}x \| yes \|", text
                )
    doc = json.loads((RESULTS / "transformers_offload-h200.json").read_text())
    doc["summary"]["kvfsm_vs_engine_time_in_offload"] = None
    (tmp_path / "transformers_offload-x.json").write_text(json.dumps(doc))
    text, _ = plots.render(tmp_path, tmp_path / "plots")
    assert re.search(r"\| `transformers_offload-x\.json` \| [^|]+ \| kvfsm \| .* \| - \| yes \|", text)
