"""The serving sections of a run report: a live run's failure section (classes, first messages, a timeline), and
engine-sim's Latency, Engine model and Timeline sections for every point, in units that suit the values (no
scientific notation, no empty panels)."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest

from kvbench.metrics.latency import error_class
from kvbench.report.serving import engine_section, server_section, value_text
from kvbench.report.timing import latency_sections
from kvbench.run.runner import run_replay
from kvbench.testing.fakeserver import FakeServer, fault_plan
from tests.conftest import CHAT
from tests.unit.live.conftest import RunningServer

FAULTS = ["3:http500", "7:cut", "11:malformed", "15:error", "every=13:http429"]


def _section(md: str, title: str) -> str:
    """The Markdown of one report section, up to the next one."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", md, re.S | re.M)
    assert match, f"no section {title!r}"
    return match.group(1)


def _live(tmp_path, faults, n=40):
    srv = RunningServer(FakeServer(16, 0.001, fault_plan(faults)))
    try:
        opts = {"url": srv.url, "mode": "rate", "rate": 100.0, "max_requests": n, "timeout_s": 5.0}
        run_dir, summary = run_replay(CHAT, "openai", opts, out=tmp_path / "live", report=True)
    finally:
        srv.stop()
    return run_dir, summary


@pytest.fixture(scope="module")
def engine_sim(tmp_path_factory):
    out = tmp_path_factory.mktemp("es") / "run"
    return run_replay(CHAT, "engine-sim", {"policy": "vllm,lru"}, out=out, report=True)


def test_live_report_counts_failures_by_class_with_each_first_message(tmp_path):
    run_dir, summary = _live(tmp_path, FAULTS)
    md = (run_dir / "report.md").read_text()
    failures = _section(md, "Requests and failures")
    rows = pq.read_table(run_dir / "requests.parquet").to_pylist()
    failed = sorted((r for r in rows if r["status"] != "ok"), key=lambda r: r["actual_send_s"])
    assert failed, "the injected faults failed no request"
    classes = {}
    for r in failed:
        classes.setdefault(error_class(r["error"]), []).append(r["error"])
    assert {"http 500", "stream cut", "malformed event", "error event", "http 429"} <= set(classes)
    for cls, messages in classes.items():
        # the class, how many, and its first message (by send time) on one row
        assert re.search(
            rf"^\| {re.escape(cls)} \| {len(messages)} \|.*\| {re.escape(messages[0][:60])}", failures, re.M
        )
    f = summary["points"][0]["failures"]
    assert f"| live | {f['requests']} | {f['ok']} | {f['failed']} |" in failures
    html = (run_dir / "report.html").read_text()
    assert "answered (grey) and failed, by error class" in html  # the timeline of failures
    assert "e+" not in md


def test_a_live_run_without_failures_says_so_in_one_line(tmp_path):
    run_dir, _ = _live(tmp_path, [], n=12)
    failures = _section((run_dir / "report.md").read_text(), "Requests and failures")
    assert failures.strip() == "No failures: every one of the 12 requests sent was answered."


def test_engine_sim_sections_cover_every_point(engine_sim):
    run_dir, summary = engine_sim
    md = (run_dir / "report.md").read_text()
    names = [p["name"] for p in summary["points"]]
    assert len(names) == 2
    for title in ("Latency", "Engine model"):
        for name in names:
            assert name in _section(md, title), (title, name)
    engine = _section(md, "Engine model")
    # named facts with units, not a key dump
    assert "queue_s" not in engine and "tier_bytes" not in engine and "[" not in engine
    assert "| queue wait, mean |" in engine and "| requests per instance | 2,000 | 2,000 |" in engine
    html = (run_dir / "report.html").read_text()
    assert all(n in html.split("id='timeline'")[1] for n in names)  # the timeline draws every point
    # engine-sim measures no inter-token latency: no ITL panel is drawn empty
    assert "TTFT (ms)" in html and "ITL (" not in html
    assert "e+" not in md


def test_times_are_scaled_to_their_unit():
    """A saturated deployment's 42,291,158 ms TTFT reads as hours, in every cell of its table."""
    d = {"mean_ms": 4.2e7, "p50_ms": 42_291_158.0, "p90_ms": 5e7, "p95_ms": 6e7, "p99_ms": 7e7, "max_ms": 8e7}
    lat = {
        "requests": {"sent": 10, "ok": 10, "failed": 0, "not_sent": 0, "warmup": 0},
        "duration_s": 250_000.0,
        "request_throughput": 4e-05,
        "output_throughput": 0.5,
        "ttft": {**d, "count": 10},
    }
    summary = {"points": [{"name": "vllm/1instances", "policy": "vllm", "latency": lat}]}
    from kvbench.report.page import render_markdown

    md = render_markdown("t", latency_sections(summary, None))
    assert "| TTFT | 11.7 h | 11.7 h |" in md and "2.89 d" in md and "e+" not in md and "e-" not in md


def test_server_counters_and_engine_facts_read_alike():
    checks = {"prompt_tokens": {"server": 490816.0, "requests": 490816, "agree": True}}
    table = server_section({"points": [{"name": "live", "server_counters": {"available": True, "checks": checks}}]})
    assert table.items[1].rows == [["prompt_tokens", "490,816", "490,816", "yes"]]
    assert value_text("tier_bytes", 1.106e11) == "103 GiB"
    assert value_text("requests_per_instance", [935, 1065]) == "935, 1,065"
    assert value_text("queue_s.mean", 4.248e04) == "11.8 h"
    engine = {"queue_s": {"mean": 4.248e04}, "tier_bytes": {"loaded": {"dram": 1.106e11}, "written": {}}}
    rows = engine_section({"points": [{"name": "a", "engine": engine}, {"name": "b", "engine": engine}]}).items[0]
    assert ["queue wait, mean", "11.8 h", "11.8 h"] in rows.rows
    assert ["KV loaded from DRAM", "103 GiB", "103 GiB"] in rows.rows
    assert json.dumps(rows.rows).count("e+") == 0
