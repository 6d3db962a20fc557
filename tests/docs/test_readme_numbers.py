"""Every figure docs/benchmarks.md states equals the value in docs/results.md (which bench/plots.py renders
from bench/results/*.json) and in the JSON it came from, at the precision the page states it. The test
finds the figures itself: every number on the page must be claimed by a check below or be named in
NOT_FIGURES with the reason it is not a measurement, so a figure added to the page later cannot escape it.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE_PATH = "docs/benchmarks.md"
PAGE = (ROOT / PAGE_PATH).read_text()
RESULTS_MD = (ROOT / "docs" / "results.md").read_text()

# a number as the page writes one: 3.50, 19.7x, 64/64, 20-170 (a page/stride or a range is one figure)
NUMBER = re.compile(r"(?<![\w.-])\d+(?:\.\d+)?(?:[/-]\d+(?:\.\d+)?)?x?(?![\w])")  # not the 3 of Llama-3-8B
NOT_FIGURES: dict[str, str] = {}  # regex over the page -> why its numbers are not benchmark figures


def _section(text: str, title: str) -> tuple[int, str]:
    """The page's text from its `# title` heading on: every figure below the title is checked."""
    start = text.index(f"# {title}\n")
    return start, text[start:]


BENCH_AT, BENCH = _section(PAGE, "Benchmarks")


def _code_spans(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(r"`[^`]*`", text)]


def _decimals(figure: str) -> int:
    return len(figure.split(".")[1]) if "." in figure else 0


def _close(figure: str, value: float, extra: float = 0.0) -> bool:
    """`figure` (as written) is `value` rounded to the figure's own precision."""
    return abs(float(figure.rstrip("x")) - value) <= 0.5 * 10 ** -_decimals(figure) + extra + 1e-9


def _table(md: str, header_start: str) -> list[list[str]]:
    """The body rows of the first Markdown table whose header row starts with `header_start`."""
    lines = md.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[i + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


class Claims:
    """The spans of the section's numbers that a check has compared."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []

    def match(self, pattern: str, flags: int = re.S) -> re.Match:
        m = re.search(pattern, BENCH, flags)
        assert m, f"{PAGE_PATH} no longer says {pattern!r}: update this test with it"
        self.spans += [m.span(g) for g in range(1, (m.lastindex or 0) + 1) if m.group(g) is not None]
        return m

    def claim_table_row(self, line: str) -> None:
        at = BENCH.index(line)
        self.spans.append((at, at + len(line)))


CLAIMS = Claims()
JSON_PATH = CLAIMS.match(r"On the\s+H200 \(`(bench/results/serving_loop-h200\.json)`").group(1)
SERVING = json.loads((ROOT / JSON_PATH).read_text())
SETTINGS = SERVING["settings"]


def _row(algo: str, live: int, page: int, stride: int, table: str | None = None) -> dict:
    return next(
        r
        for r in SERVING["rows"]
        if (r["algo"], r["live"], r["page"], r["stride"]) == (algo, live, page, stride)
        and (table is None or r["table"] == table)
    )


def test_the_serving_loop_table_matches_results_md_and_the_json() -> None:
    page_rows = _table(BENCH, "| live | page/stride | kvfsm median")
    assert page_rows, f"{PAGE_PATH}'s serving-loop table is gone"
    ours = {(int(r[0]), r[1]): r for r in _table(RESULTS_MD, "| live | page/stride | kvfsm median")}
    table = "cuda" if "request table on the GPU" in BENCH else SETTINGS["tables"][0]
    for cells in page_rows:
        live, ps = int(cells[0]), cells[1]
        page, stride = (int(x) for x in ps.split("/"))
        k, seed, bare = (
            _row("kvfsm", live, page, stride, table),
            _row("seed", live, page, stride),
            _row("bare", live, page, stride),
        )
        median, p99, mx = re.findall(r"[\d.]+", cells[2])
        expect = {
            "kvfsm median": (median, k["total"]["median"], 2, 0),
            "kvfsm p99": (p99, k["total"]["p99"], 2, 1),
            "kvfsm max": (mx, k["total"]["max"], 2, 2),
            "seed median": (re.search(r"[\d.]+", cells[3]).group(), seed["total"]["median"], 3, 0),
            "bare floor median": (re.search(r"[\d.]+", cells[4]).group(), bare["total"]["median"], 4, 0),
            "kvfsm vs seed": (
                re.search(r"[\d.]+", cells[5]).group(),
                seed["total"]["median"] / k["total"]["median"],
                5,
                0,
            ),
            "kvfsm / floor": (cells[6], k["total"]["median"] / bare["total"]["median"], 6, 0),
        }
        mine = ours[(live, ps)]
        for what, (figure, value, col, part) in expect.items():
            assert _close(figure, value), f"{PAGE_PATH} {live} {ps} {what}: {figure}, the JSON says {value:.4g}"
            shown = re.findall(r"[\d.]+", mine[col])[part]
            assert _close(figure, float(shown), 0.5 * 10 ** -_decimals(shown)), (
                f"{PAGE_PATH} {live} {ps} {what}: {figure}, docs/results.md says {shown}"
            )
        CLAIMS.claim_table_row("| " + " | ".join(cells) + " |")


def test_the_loop_settings_are_the_recorded_runs() -> None:
    m = CLAIMS.match(r"a (\d+) ms step of matmuls.*?GC on, (\d+) timed iterations")
    assert float(m.group(1)) == SETTINGS["step_ms"] and int(m.group(2)) == SETTINGS["iterations"]
    m = CLAIMS.match(
        r"rows \((\d+) of the (\d+) layers,\s+so that (\d+) requests fit the GPU: (\d+) MiB offloaded per "
        r"step at (\d+) live\)"
    )
    from kvfsm.dataplane import KVCacheConfig

    assert int(m.group(1)) == SETTINGS["layers"] and int(m.group(2)) == KVCacheConfig.llama3_8b().num_layers
    assert int(m.group(3)) == max(SETTINGS["live"]) == int(m.group(5))
    mib = {
        ps: float(r[7])
        for (live, ps), r in (((int(r[0]), r[1]), r) for r in _table(RESULTS_MD, "| live | page/stride | kvfsm median"))
        if live == int(m.group(5))
    }
    assert mib and all(_close(m.group(4), v) for v in mib.values()), (m.group(4), mib)
    assert all(
        _close(m.group(4), r["bytes_offloaded_per_step"] / 2**20)
        for r in SERVING["rows"]
        if r["live"] == int(m.group(5))
    )


def test_the_store_writers_are_the_scripts_and_the_librarys() -> None:
    m = CLAIMS.match(r"\((\d+) writer threads, `--store-writers`; the library default is (\d+)")
    source = (ROOT / "bench" / "serving_loop.py").read_text()
    script_default = int(re.search(r'"--store-writers",\s*type=int,\s*default=(\d+)', source).group(1))
    assert int(m.group(1)) == SETTINGS.get("store_writers", script_default)  # the recorded run predates the key
    from kvfsm.dataplane.storage import FileStorage

    assert int(m.group(2)) == inspect.signature(FileStorage).parameters["writers"].default


def test_the_targets_are_the_runs() -> None:
    m = CLAIMS.match(
        r"\(median ([\d.]+) ms at (\d+) live and (\d+/\d+), p99 ([\d.]+) ms, max ([\d.]+) ms; ([\d.]+) ms at "
        r"(\d+/\d+)\)"
    )
    targets: dict[str, set] = {}
    for t in SERVING["targets"]:
        got = re.fullmatch(r"(median|p99|max) ms, (\d+) live (\d+/\d+), table \w+", t["name"])
        if got:
            targets.setdefault(got.group(1), set()).add((float(t["limit"]), int(got.group(2)), got.group(3)))
    live = int(m.group(2))
    assert (float(m.group(1)), live, m.group(3)) in targets["median"]
    assert (float(m.group(4)), live, m.group(3)) in targets["p99"]
    assert (float(m.group(5)), live, m.group(3)) in targets["max"]
    assert (float(m.group(6)), live, m.group(7)) in targets["median"]


def test_the_floor_is_the_bare_floor_of_results_md() -> None:
    m = CLAIMS.match(r"the floor\s+of any CPython manager in this regime is already ([\d.]+) ms at (\d+)/(\d+)")
    live = max(SETTINGS["live"])  # "this regime": the targets' 4096 live
    ours = {(int(r[0]), r[1]): r for r in _table(RESULTS_MD, "| live | page/stride | kvfsm median")}
    shown = ours[(live, f"{m.group(2)}/{m.group(3)}")][4]
    assert _close(m.group(1), float(shown), 0.0005), f"{PAGE_PATH} floor {m.group(1)} ms, docs/results.md {shown} ms"
    assert _close(m.group(1), _row("bare", live, int(m.group(2)), int(m.group(3)))["total"]["median"])


def test_the_cold_call_range_is_the_probes() -> None:
    m = CLAIMS.match(
        r"one\s+numpy or torch call costs (\d+(?:\.\d+)?)-(\d+(?:\.\d+)?) us against (\d+(?:\.\d+)?)-"
        r"(\d+(?:\.\d+)?) us warm \(`bench/probes/cold_call_probe\.py`\)"
    )
    rows = [
        r
        for r in _table(RESULTS_MD, "| result file | machine | primitive | cold us")
        if r[2].startswith(("np_", "torch_"))
    ]
    assert rows, "docs/results.md has no cold-call rows for numpy or torch"
    cold, warm = [float(r[3]) for r in rows], [float(r[4]) for r in rows]
    probe = json.loads((ROOT / "bench" / "results" / rows[0][0].strip("`")).read_text())
    raw = [r for r in probe["rows"] if r["primitive"].startswith(("np_", "torch_"))]
    for figure, shown, value, what in (
        (m.group(1), min(cold), min(r["cold_us_median"] for r in raw), "cold, fastest"),
        (m.group(2), max(cold), max(r["cold_us_median"] for r in raw), "cold, slowest"),
        (m.group(3), min(warm), min(r["warm_us_median"] for r in raw), "warm, fastest"),
        (m.group(4), max(warm), max(r["warm_us_median"] for r in raw), "warm, slowest"),
    ):
        assert _close(figure, shown, 0.05), f"{PAGE_PATH} {what}: {figure} us, docs/results.md {shown} us"
        assert _close(figure, value), f"{PAGE_PATH} {what}: {figure} us, the JSON {value:.2f} us"


def test_the_probe_medians_are_the_probes() -> None:
    m = CLAIMS.match(
        r"\(`(bench/results/serving_loop_probes-h200\.json)`:\s+writing nothing took the (\d+)-live median "
        r"from ([\d.]+) to ([\d.]+) ms\)"
    )
    rows = {(r[0], r[1], int(r[2]), r[3]): float(r[4]) for r in _table(RESULTS_MD, "| probe | algo | live |")}
    live = int(m.group(2))
    probes = json.loads((ROOT / m.group(1)).read_text())["runs"]
    for figure, probe in ((m.group(3), "file"), (m.group(4), "none")):
        shown = rows[(probe, "kvfsm", live, "64/64")]
        assert _close(figure, shown, 0.0005), f"{PAGE_PATH} {probe} median {figure} ms, docs/results.md {shown} ms"
        raw = next(r for r in probes[probe]["rows"] if r["algo"] == "kvfsm" and r["live"] == live and r["page"] == 64)
        assert _close(figure, raw["total"]["median"])


def test_every_number_of_the_section_is_checked() -> None:
    """Runs last (pytest keeps file order): the checks above have claimed their figures."""
    if not CLAIMS.spans or len(CLAIMS.spans) < 20:
        pytest.skip("run with the whole file: the checks above claim the figures")
    allowed = list(CLAIMS.spans) + _code_spans(BENCH)
    for pattern in NOT_FIGURES:
        allowed += [m.span() for m in re.finditer(pattern, BENCH)]
    unchecked = []
    for m in NUMBER.finditer(BENCH):
        parts = [(m.start() + p.start(), m.start() + p.end()) for p in re.finditer(r"\d+(?:\.\d+)?", m.group())]
        if not all(any(a <= s and e <= b for a, b in allowed) for s, e in parts):
            line = BENCH.count("\n", 0, m.start()) + PAGE.count("\n", 0, BENCH_AT) + 1
            unchecked.append(f"{PAGE_PATH}:{line}: {m.group()!r}")
    assert not unchecked, f"figures {PAGE_PATH} states that no check compares with docs/results.md: " + ", ".join(
        unchecked
    )
