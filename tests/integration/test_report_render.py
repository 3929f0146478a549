"""Every kvbench report renders in headless Chromium without console errors, uncaught page errors or requests
(report.html is self-contained), and its plots are there and drawn (`@pytest.mark.browser`).

Skipped without Chromium or playwright (tests/browser.py), failed instead when KVBENCH_REQUIRE_BROWSER is set
(.ci/run). Only generic properties are asserted here, never section titles: what a report says is tested with
the report code.
"""

from __future__ import annotations

import pytest

from kvbench.live.fakeserver import FakeServer, fault_plan
from kvbench.run.runner import run_replay

from ..browser import browser_required, check_page  # noqa: F401  (browser_required: a fixture, used below)
from ..conftest import CHAT
from ..unit.live.conftest import RunningServer

# browser_required is session-scoped, so a missing browser skips before the module-scoped replays run.
pytestmark = [pytest.mark.browser, pytest.mark.usefixtures("browser_required")]


def assert_renders_cleanly(check):
    assert check.title.strip(), f"no <title>\n{check}"
    assert not check.problems, str(check)
    assert check.svg_total >= 1, f"no plot\n{check}"
    assert check.svg_nonempty == check.svg_total, f"an empty plot\n{check}"
    assert check.canvas_nonempty == check.canvas_total, f"an empty canvas\n{check}"


@pytest.fixture(scope="module")
def sim_report(tmp_path_factory):
    """Three policies × three capacities with the Belady bound, and the one-pass curves."""
    out = tmp_path_factory.mktemp("sim") / "run"
    run_replay(
        CHAT,
        "sim",
        {"policy": "lru,radix-lru,vllm", "capacity": "200,1000,5000", "curve": True},
        out=out,
        report=True,
    )
    return out / "report.html"


@pytest.fixture(scope="module")
def live_report(tmp_path_factory):
    """A live replay against the fake server with a few injected faults (failed requests in the report)."""
    srv = RunningServer(FakeServer(16, 0.001, fault_plan(["3:http500", "7:cut", "11:malformed", "15:error"])))
    try:
        out = tmp_path_factory.mktemp("live") / "run"
        opts = {"url": srv.url, "mode": "rate", "rate": 100.0, "max_requests": 60, "timeout_s": 3.0}
        run_replay(CHAT, "openai", opts, out=out, report=True)
    finally:
        srv.stop()
    return out / "report.html"


def test_sim_report_renders(sim_report):
    assert_renders_cleanly(check_page(sim_report))


def test_live_report_renders(live_report):
    assert_renders_cleanly(check_page(live_report))


def test_screenshot_is_written(sim_report, tmp_path):
    png = tmp_path / "report.png"
    check = check_page(sim_report, screenshot=png)
    assert check.screenshot == png
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000, f"{len(data)} bytes: a blank page?"


def test_the_check_sees_what_is_wrong(tmp_path):
    """The checker itself: an error, an uncaught exception, a fetch, an empty plot and no title are all seen."""
    page = tmp_path / "bad.html"
    page.write_text(
        "<!doctype html><html><head><script src='http://127.0.0.1:9/plot.js'></script></head><body>"
        "<svg width='100' height='50'><path d='M0 0L100 50' stroke='black'/></svg>"
        "<svg width='100' height='50'><defs><path id='p' d='M0 0L9 9'/></defs></svg>"
        "<canvas width='0' height='0'></canvas>"
        "<script>console.error('boom'); console.warn('hmm'); null.x;</script></body></html>"
    )
    check = check_page(page)
    assert check.title == ""
    assert any("boom" in m for m in check.console_errors) and any("hmm" in m for m in check.console_warnings)
    assert len(check.page_errors) == 1
    assert [r.split(": ")[0] for r in check.failed_requests] == ["http://127.0.0.1:9/plot.js"]
    assert (check.svg_total, check.svg_nonempty, check.canvas_total, check.canvas_nonempty) == (2, 1, 1, 0)
    assert len(check.problems) >= 3


def test_demo_index_and_every_demo_report_render(tmp_path):
    """`kvbench demo` (small traces): the index shows every workload's curves, and each run's report renders."""
    import subprocess

    from kvbench.trace import generators

    out = tmp_path / "demo"
    r = subprocess.run(["kvbench", "demo", "-n", "300", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    png = tmp_path / "index.png"
    index = check_page(out / "index.html", screenshot=png)
    assert_renders_cleanly(index)
    assert png.stat().st_size > 10_000
    from kvbench.run.demo import demo_backends

    reports = sorted(out.glob("runs/*/report.html"))
    assert len(reports) == len(generators.registry()) * len(demo_backends())
    for report in reports:
        assert_renders_cleanly(check_page(report))
