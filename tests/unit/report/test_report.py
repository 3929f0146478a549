"""Run reports: every section a sim run should show, the same tables in Markdown, no machine paths, and
`kvbench report` rewriting them; the shared page layout; `kvbench demo`."""

from __future__ import annotations

import json
import re
import subprocess

from kvbench.report.page import Figure, Links, Section, Table, render_html, render_markdown
from kvbench.run.runner import run_replay
from tests.conftest import SAMPLES

MACHINE_PATHS = re.compile(r"(/work/|/tmp/|/root/|/home/)")


def _headings(html: str) -> list[str]:
    return re.findall(r"<h2 id='[^']*'>([^<]+)</h2>", html)


def test_page_renders_every_item_kind_in_html_and_markdown():
    sections = [
        Section("Numbers", [Table(["a", "b|c"], [["1", "<2>"]]), "a note"]),
        Section("Plot", [Figure("<svg xmlns='http://www.w3.org/2000/svg'><rect width='1' height='1'/></svg>", "cap")]),
        Section("Links", [Links([("run", "runs/x/report.html")])]),
        Section("Empty"),
    ]
    html = render_html("T & co", sections)
    assert "<title>T &amp; co</title>" in html and "&lt;2&gt;" in html and "<rect" in html
    assert _headings(html) == ["Numbers", "Plot", "Links"]  # an empty section is left out
    assert "href='runs/x/report.html'" in html
    md = render_markdown("T", sections)
    assert "| a | b\\|c |" in md and "| 1 | <2> |" in md and "[run](runs/x/report.html)" in md
    assert "## Empty" not in md


def test_sim_sweep_report_has_curves_breakdowns_fairness_timeline_and_trace(tmp_path):
    opts = {"policy": "lru,s3fifo", "capacity": "300,3000", "curve": True}
    run_dir, _ = run_replay(SAMPLES / "multi-tenant.parquet", "sim", opts, out=tmp_path / "run")
    html = (run_dir / "report.html").read_text()
    heads = _headings(html)
    for title in (
        "Run",
        "Hit rate per point",
        "Hit rate vs capacity",
        "Hit rate by tenant",
        "Hit rate by workload",
        "Tenant fairness",
        "Timeline",
        "Trace characterisation",
    ):
        assert title in heads, (title, heads)
    assert html.count("<svg") >= 5
    # self-contained: no script, and every URL in it is an XML namespace, never something to fetch
    assert "<script" not in html and set(re.findall(r"https?://[^\s\"'<>]+", html)) <= {
        "http://www.w3.org/2000/svg",
        "http://www.w3.org/1999/xlink",
    }
    md = (run_dir / "report.md").read_text()
    # the same tables in Markdown: the per-point table has a row per point, with its hit rates
    for p in json.loads((run_dir / "summary.json").read_text())["points"]:
        assert f"| {p['name']} | {100 * p['hit_rate']['token']['all']:.2f}% |" in md
    assert not MACHINE_PATHS.search(html) and not MACHINE_PATHS.search(md)


def test_agent_run_shows_the_task_view(tmp_path):
    run_dir, _ = run_replay(SAMPLES / "agent.parquet", "sim", {"policy": "lru", "capacity": "2000"}, out=tmp_path / "a")
    html = (run_dir / "report.html").read_text()
    assert "Agent tasks" in _headings(html)
    assert "Hit rate by call depth" in html


def test_kvbench_report_rewrites_the_reports(tmp_path):
    run_dir, _ = run_replay(
        SAMPLES / "chat.parquet", "sim", {"policy": "lru", "capacity": "500"}, out=tmp_path / "r", report=False
    )
    assert not (run_dir / "report.html").exists()
    r = subprocess.run(["kvbench", "report", str(run_dir)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "Trace characterisation" in _headings((run_dir / "report.html").read_text())
    r = subprocess.run(["kvbench", "report", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode != 0 and "no summary.json" in r.stderr and "Traceback" not in r.stderr


def test_demo_writes_an_index_of_every_workload(tmp_path):
    from kvbench.trace import generators

    out = tmp_path / "demo"
    r = subprocess.run(["kvbench", "demo", "-n", "300", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    index = (out / "index.html").read_text()
    for kind in generators.registry():
        assert re.search(rf"<td[^>]*>{kind}</td>", index)  # a word: left-aligned (class t)
        assert (out / "runs" / f"{kind}-sim" / "report.html").exists()
    for href in re.findall(r"<a href='([^'#][^']*)'", index):
        assert (out / href).exists(), href
    assert index.count("<svg") >= 1 and not MACHINE_PATHS.search(index)
