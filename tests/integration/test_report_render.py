"""Every kind of kvbench report renders in headless Chromium without console errors, uncaught page errors or
requests (report.html is self-contained), its plots are there and drawn, each per-point section of a run report
names every point, and `kvbench report --screenshot` pictures it (`@pytest.mark.browser`).

Skipped without Chromium or playwright (tests/browser.py), failed instead when KVBENCH_REQUIRE_BROWSER is set
(.ci/run). Only generic properties are asserted here, never section titles: what a report says is tested with
the report code. Every page is also screenshotted (full page, 1400 px wide) into a folder pytest keeps
(pytest-of-$USER/…/screenshots*); KVBENCH_SCREENSHOTS=DIR copies them to DIR, to look at in a review.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from click.testing import CliRunner

from kvbench.report.screenshot import WIDTH
from kvbench.run.runner import run_replay
from kvbench.testing.fakeserver import FakeServer, fault_plan

from ..browser import browser_required, check_pages, points_missing_by_section, table_rows  # noqa: F401  (fixture)
from ..conftest import CHAT
from ..unit.live.conftest import RunningServer

# browser_required is session-scoped, so a missing browser skips before the module-scoped replays run.
pytestmark = [pytest.mark.browser, pytest.mark.usefixtures("browser_required")]

RUN_KINDS = ["sim", "engine-sim", "torch", "live"]  # run directories: report.html, report.md and summary.json
PAGE_KINDS = ["compare", "sweep"]  # pages made of several runs


def assert_renders_cleanly(check):
    assert check.title.strip(), f"no <title>\n{check}"
    assert 0 < check.page_width, f"nothing laid out\n{check}"
    assert not check.problems, str(check)
    assert check.svg_total >= 1, f"no plot\n{check}"
    assert check.svg_nonempty == check.svg_total, f"an empty plot\n{check}"
    assert check.canvas_nonempty == check.canvas_total, f"an empty canvas\n{check}"


@pytest.fixture(scope="session")
def shots(tmp_path_factory):
    """Where the screenshots go; `keep(png)` also copies one to $KVBENCH_SCREENSHOTS when that is set."""
    folder = tmp_path_factory.mktemp("screenshots")

    def keep(png):
        if os.environ.get("KVBENCH_SCREENSHOTS"):
            review = os.path.abspath(os.environ["KVBENCH_SCREENSHOTS"])
            os.makedirs(review, exist_ok=True)
            shutil.copy(png, review)
        return png

    keep.folder = folder
    return keep


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sample_head):
    """One run directory of each kind, replayed once for the module: {kind: run directory}."""
    made = {}
    base = tmp_path_factory.mktemp("runs")
    # sim: three policies × three capacities with the Belady bounds, and the one-pass curves
    made["sim"] = run_replay(
        CHAT, "sim", {"policy": "lru,radix-lru,vllm", "capacity": "200,1000,5000", "curve": True},
        out=base / "sim", report=True,
    )[0]  # fmt: skip
    small = sample_head("chat", 300)  # the modeled and real engines: a short trace keeps them quick
    made["engine-sim"] = run_replay(small, "engine-sim", {"policy": "lru,vllm"}, out=base / "engine-sim")[0]
    if _has_torch():
        opts = {"policy": "lru,vllm", "capacity": "400,1500", "dram_capacity": "600"}
        made["torch"] = run_replay(small, "torch", opts, out=base / "torch")[0]
    # live: the fake server with a few injected faults, so the report has failed requests
    srv = RunningServer(FakeServer(16, 0.001, fault_plan(["3:http500", "7:cut", "11:malformed", "15:error"])))
    try:
        opts = {"url": srv.url, "mode": "rate", "rate": 100.0, "max_requests": 60, "timeout_s": 3.0}
        made["live"] = run_replay(CHAT, "openai", opts, out=base / "live", report=True)[0]
    finally:
        srv.stop()
    return made


def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


@pytest.fixture(scope="module")
def pages(runs, sample_head, tmp_path_factory):
    """The pages made of several runs: {kind: html}; compare: the live run beside its models."""
    from kvbench import api

    base = tmp_path_factory.mktemp("pages")
    api.compare(runs["live"], runs["engine-sim"], runs["sim"], out=base / "compare")
    api.sweep(trace=sample_head("chat", 300), backend="sim", policy="lru,vllm", capacity="400,1500", out=base / "sweep")
    return {"compare": base / "compare" / "compare.html", "sweep": base / "sweep" / "index.html"}


def _run(runs, kind):
    if kind not in runs:
        pytest.skip(f"{kind}: not installed here")
    return runs[kind]


@pytest.mark.parametrize("kind", RUN_KINDS)
def test_run_report_renders_and_is_pictured(runs, shots, kind):
    run = _run(runs, kind)
    (check,) = check_pages([(run / "report.html", shots.folder / f"{kind}.png")])
    assert_renders_cleanly(check)
    assert check.page_width <= WIDTH, f"wider than the window: a horizontal scroll bar\n{check}"
    assert_is_a_picture(shots(check.screenshot))


@pytest.mark.parametrize("kind", PAGE_KINDS)
def test_page_of_several_runs_renders_and_is_pictured(pages, shots, kind):
    (check,) = check_pages([(pages[kind], shots.folder / f"{kind}.png")])
    assert_renders_cleanly(check)
    assert_is_a_picture(shots(check.screenshot))


def assert_is_a_picture(png):
    """The full-page screenshot is the window's width, taller than one screen, and drawn on: a share of its
    pixels is ink (text, lines, bars) and it holds the colours of the plots, not only the page's greys."""
    import numpy as np
    from PIL import Image

    with Image.open(png) as img:
        rgb = np.asarray(img.convert("RGB"))
    height, width, _ = rgb.shape
    assert width == WIDTH and height > 600, f"{png}: {width}x{height} px"
    ink = float((rgb.min(axis=2) < 160).mean())  # darker than a light grey in every channel
    assert 0.005 < ink < 0.5, f"{png}: {ink:.2%} of the page drawn: blank (or one block of colour)?"
    spread = rgb.max(axis=2).astype(int) - rgb.min(axis=2)
    assert (spread > 60).sum() > 1000, f"{png}: hardly a coloured pixel: the plots did not draw"


def _missing_points(run):
    """Per-point sections of the run's report.md that leave points out: {section: points}."""
    names = [p["name"] for p in json.loads((run / "summary.json").read_text())["points"]]
    return points_missing_by_section((run / "report.md").read_text(), names)


@pytest.mark.parametrize("kind", RUN_KINDS)
def test_every_per_point_section_names_every_point(runs, kind):
    missing = _missing_points(_run(runs, kind))
    assert not missing, f"per-point sections that leave points out: {missing}"


def _failed_shown(md: str) -> dict[str, int]:
    """The failed-request count of each point in report.md's tables that have `point` and `failed` columns
    (a cell such as '5 (http 500 ×1, …)' counts as 5; '–' is no count)."""
    shown = {}
    for row in table_rows(md):
        count = re.match(r"[\d,]+", row.get("failed") or "")
        if row.get("point") and count:
            shown.setdefault(row["point"], set()).add(int(count.group().replace(",", "")))
    return shown


@pytest.mark.parametrize("kind", RUN_KINDS)
def test_failure_counts_are_those_of_summary_json(runs, kind):
    """A report never shows more (or fewer) failed requests than summary.json records; an offline backend
    answers every request, so its points record none."""
    run = _run(runs, kind)
    points = json.loads((run / "summary.json").read_text())["points"]
    recorded = {p["name"]: ((p.get("latency") or {}).get("requests") or {}).get("failed", 0) for p in points}
    shown = _failed_shown((run / "report.md").read_text())
    if kind == "live":  # its faults must be shown; a run with no failure may say so in a sentence instead
        assert shown, "no table with a point and a failed column"
    assert {name: counts for name, counts in shown.items() if counts != {recorded.get(name)}} == {}


def test_sweep_index_names_every_point(pages):
    index = pages["sweep"]
    names = [p["name"] for p in json.loads((index.parent / "sweep.json").read_text())["points"]]
    assert not points_missing_by_section((index.parent / "index.md").read_text(), names)


def test_the_point_check_sees_a_point_left_out():
    md = "# t\n\n## Run\n\n| key | value |\n|---|---|\n| a | b |\n\n## Per point\n\n| point | x |\n|---|---:|\n"
    md += "| radix-lru/1 | 1 |\n\n## By tenant\n\n| tenant | lru/1 | radix-lru/1 |\n|---|---|---|\n| t | 1 | 2 |\n"
    assert points_missing_by_section(md, ["lru/1", "radix-lru/1"]) == {"Per point": ["lru/1"]}


def test_report_command_takes_screenshots(runs, pages):
    """`kvbench report RUN COMPARE_DIR SWEEP_DIR --screenshot`: the run is rendered again, every page pictured."""
    from kvbench.cli import main

    run, compare_dir, sweep_dir = runs["engine-sim"], pages["compare"].parent, pages["sweep"].parent
    r = CliRunner().invoke(main, ["report", str(run), str(compare_dir), str(sweep_dir), "--screenshot"])
    assert r.exit_code == 0, r.output
    pngs = [run / "screenshots/report.png", compare_dir / "screenshots/compare.png"]
    pngs.append(sweep_dir / "screenshots/index.png")
    for png in pngs:
        assert str(png) in r.output
        assert_is_a_picture(png)
    first = pngs[0].stat().st_mtime_ns
    r = CliRunner().invoke(main, ["report", str(run), "--screenshot"])  # a picture of the same page: replaced
    assert r.exit_code == 0 and pngs[0].stat().st_mtime_ns > first
    assert "replaced" in CliRunner().invoke(main, ["report", "--help"]).output


@pytest.mark.parametrize("lacking", ["chromium", "playwright"])
def test_report_command_without_a_browser_still_writes_the_report(runs, monkeypatch, lacking):
    import sys

    from kvbench.cli import main

    run = runs["live"]
    (run / "report.html").unlink()
    if lacking == "chromium":
        monkeypatch.setenv("KVBENCH_CHROMIUM", "")  # an empty path hides Chromium
    else:  # None in sys.modules makes `import playwright…` fail as if it were not installed
        monkeypatch.setitem(sys.modules, "playwright", None)
        monkeypatch.setitem(sys.modules, "playwright.sync_api", None)
    r = CliRunner().invoke(main, ["report", str(run), "--screenshot"])
    assert r.exit_code != 0
    assert "apt install chromium" in r.output and "kvbench[screenshot]" in r.output
    assert (run / "report.html").exists() and not (run / "screenshots").exists()


def test_report_command_refuses_a_page_folder_without_screenshot(pages):
    from kvbench.cli import main

    r = CliRunner().invoke(main, ["report", str(pages["compare"].parent)])
    assert r.exit_code != 0 and "kvbench compare --out" in r.output


def test_the_check_sees_what_is_wrong(tmp_path):
    """The checker itself: an error, an uncaught exception, a fetch, an empty plot and no title are all seen."""
    page = tmp_path / "bad.html"
    page.write_text(
        "<!doctype html><html><head><script src='http://127.0.0.1:9/plot.js'></script></head><body>"
        "<svg width='100' height='50'><path d='M0 0L100 50' stroke='black'/></svg>"
        "<svg width='100' height='50'><defs><path id='p' d='M0 0L9 9'/></defs></svg>"
        "<canvas width='0' height='0'></canvas><div style='width: 3000px'>a table too wide</div>"
        "<script>console.error('boom'); console.warn('hmm'); null.x;</script></body></html>"
    )
    (check,) = check_pages([(page, None)])
    assert check.title == ""
    assert any("boom" in m for m in check.console_errors) and any("hmm" in m for m in check.console_warnings)
    assert len(check.page_errors) == 1
    assert [r.split(": ")[0] for r in check.failed_requests] == ["http://127.0.0.1:9/plot.js"]
    assert (check.svg_total, check.svg_nonempty, check.canvas_total, check.canvas_nonempty) == (2, 1, 1, 0)
    assert len(check.problems) >= 3
    assert check.page_width >= 3000  # the default window is narrower: a horizontal scroll bar


@pytest.fixture(scope="module")
def demo(tmp_path_factory, shots):
    """The demo (small traces, offline), every page checked in one browser: (its run reports, their checks).
    The index and the multi-tenant workload's reports (the longest) are pictured."""
    from kvbench.cli.demo_run import run_demo

    made = run_demo(tmp_path_factory.mktemp("demo") / "demo", n=200, step=lambda _: None)
    reports = sorted(made.out.glob("runs/*/report.html"))
    wanted = [(made.out / "index.html", shots.folder / "demo-index.png")]
    wanted += [
        (r, shots.folder / f"demo-{r.parent.name}.png" if r.parent.name.startswith("multi-tenant-") else None)
        for r in reports
    ]
    return reports, check_pages(wanted)


def test_demo_index_and_every_demo_report_render(demo, shots):
    from kvbench.cli.demo_run import demo_backends
    from kvbench.trace import generators

    reports, checks = demo
    assert len(reports) == len(generators.registry()) * len(demo_backends())
    for check in checks:
        assert_renders_cleanly(check)
        if check.screenshot is not None:
            assert_is_a_picture(shots(check.screenshot))
    # the demo's grids have the most points (multi-tenant: every policy × capacity, and the bounds)
    missing = {r.parent.name: _missing_points(r.parent) for r in reports}
    assert not {run: m for run, m in missing.items() if m}, f"per-point sections that leave points out: {missing}"


def test_demo_pages_fit_the_window(demo):
    _, checks = demo
    too_wide = [str(c) for c in checks if c.page_width > WIDTH]
    assert not too_wide, "wider than the window (a horizontal scroll bar):\n" + "\n".join(too_wide)


def _figure(text: str) -> float:
    """A figure as the page shows it ('67.95%', '1,234', '3.21') as a number (a percentage as a fraction)."""
    value = float(re.sub(r"[^\d.\-]", "", text.split(" ")[0]))
    return value / 100 if text.split(" ")[0].endswith("%") else value


@pytest.mark.parametrize("kind", RUN_KINDS)
def test_the_answer_shows_what_summary_json_says(runs, kind):
    """The Answer's table as the browser shows it, cell by cell against summary.json: per capacity the best
    policy and its steady hit rate beside Belady's (offline), per point the throughput, the failures and the
    saturation verdict (timed runs)."""
    run = _run(runs, kind)
    summary = json.loads((run / "summary.json").read_text())
    (check,) = check_pages([(run / "report.html", None)])
    assert check.answer, f"no table in the Answer section\n{check}"
    header, *body = check.answer[-1]
    timed = [p for p in summary["points"] if p.get("latency")]
    if not timed:
        swept = {p["capacity_blocks"] for p in summary["points"] if p.get("policy") not in (None, "belady")}
        assert len(body) == len(swept)
        for row in body:
            cap = int(row[0].split(" blocks")[0].replace(",", ""))
            at = [p for p in summary["points"] if p.get("capacity_blocks") == cap]
            steady = {p["policy"]: p["hit_rate"]["token"]["steady"] for p in at}
            best = max((k for k in steady if k != "belady"), key=steady.get)
            assert row[1] == best and _figure(row[2]) == pytest.approx(steady[best], abs=5e-5)
            if "belady" in steady:
                assert _figure(row[3]) == pytest.approx(steady["belady"], abs=5e-5)
        return
    assert [r[0] for r in body] == [p["name"] for p in timed]
    for row, p in zip(body, timed):
        cell = dict(zip(header, row))
        assert _figure(cell["requests/s"]) == pytest.approx(p["latency"]["request_throughput"], rel=5e-3)
        if "failed" in header:
            failed = (p.get("failures") or {}).get("failed", 0)
            assert cell["failed"] == "none" if failed == 0 else _figure(cell["failed"]) == failed
        verdict = p.get("saturation")
        assert (
            cell["saturated"] == "not assessed"
            if verdict is None
            else (cell["saturated"].startswith("saturated") == verdict["saturated"])
        )
