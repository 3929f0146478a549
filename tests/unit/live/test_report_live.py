"""A live run's report: latency table and CDFs, per-tenant latency, server counters, and the timeline with
the engine's KV usage gauge polled during the run (fake server)."""

from __future__ import annotations

import re

import numpy as np
import pyarrow.parquet as pq

from kvbench.run.limits import RequestLimits
from kvbench.run.runner import run_replay

from ...conftest import REPO


def test_live_report_shows_latency_counters_and_kv_timeline(fake_server, tmp_path):
    srv = fake_server(itl_ms=2)
    opts = {"url": srv.url, "mode": "rate", "rate": 40.0, "max_requests": 120}
    run_dir, summary = run_replay(
        REPO / "traces/samples/multi-tenant.parquet", "openai", opts, out=tmp_path / "live",
        limits=RequestLimits(max_output_tokens=4),
    )
    timeline = summary["points"][0]["server_timeline"]
    # polled about once a second over a ~3 s run: the fake cache only grows
    assert len(timeline["t_s"]) >= 2 and np.all(np.diff(timeline["kv_usage"]) >= 0)
    assert max(timeline["running"]) >= 0 and set(timeline) == {"t_s", "kv_usage", "running", "waiting"}
    html = (run_dir / "report.html").read_text()
    heads = re.findall(r"<h2 id='[^']*'>([^<]+)</h2>", html)
    for title in ("Latency", "Latency by tenant", "Server counters", "Timeline", "Trace characterisation"):
        assert title in heads, (title, heads)
    assert "engine KV usage (%)" in html
    md = (run_dir / "report.md").read_text()
    ttft = summary["points"][0]["latency"]["ttft"]
    assert f"| TTFT | {ttft['mean_ms']:,.2f} | {ttft['p50_ms']:,.2f} |" in md
    assert pq.read_table(run_dir / "requests.parquet").num_rows == 120
