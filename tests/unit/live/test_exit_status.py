"""Exit codes and terminal lines tell the truth about a live run: failures are counted by class and fail the
command beyond --max-failure-rate (exit 3, results kept), a server without cached-token accounting shows
"n/a" rather than a 0% hit rate, and an interrupted run exits 130 saying how to resume it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from kvbench.cli import main
from kvbench.run.results import read_requests

from .conftest import free_port

CHAT = str(Path(__file__).resolve().parents[3] / "traces" / "samples" / "chat.parquet")
N = 20


def _replay(url: str, out: Path, *extra: str):
    args = ["replay", CHAT, "--backend", "openai", "--url", url, "--mode", "rate", "--rate", "200",
            "--max-requests", str(N), "--timeout", "3", "--no-report", "--out", str(out), *extra]  # fmt: skip
    return CliRunner().invoke(main, args)


def test_a_clean_run_exits_0_and_counts_its_requests(fake_server, tmp_path):
    done = _replay(fake_server().url, tmp_path / "ok")
    assert done.exit_code == 0, done.output
    assert f"{N} requests: {N} ok, 0 failed (0 timeout), 0 not sent" in done.output
    failures = json.loads((tmp_path / "ok" / "summary.json").read_text())["points"][0]["failures"]
    assert failures["ok"] == N and failures["failure_rate"] == 0 and failures["top_errors"] == []


def test_failures_beyond_the_allowed_share_exit_3_and_keep_the_results(fake_server, tmp_path):
    url = fake_server(faults=["every=4:http500", "1:cut"]).url  # requests 0, 4, 8, 12, 16 and 1 fail
    done = _replay(url, tmp_path / "default")
    assert done.exit_code == 3, done.output
    assert f"{N} requests: {N - 6} ok, 6 failed (0 timeout), 0 not sent; http 500 ×5, stream cut ×1" in done.output
    assert "more than --max-failure-rate 0 allows" in done.output
    rows = read_requests(tmp_path / "default", columns=["status"])  # the results are there all the same
    assert rows.num_rows == N and rows.column("status").to_pylist().count("ok") == N - 6
    # the report shows the same counts and classes
    assert CliRunner().invoke(main, ["report", str(tmp_path / "default")]).exit_code == 0
    report = (tmp_path / "default" / "report.md").read_text()
    assert "## Requests" in report and "| http 500 | 5 |" in report and "| stream cut | 1 |" in report
    # a share the user allows is fine
    assert _replay(url, tmp_path / "allowed", "--max-failure-rate", "0.5").exit_code == 0


def test_a_run_where_every_request_failed_is_not_a_success(fake_server, tmp_path):
    done = _replay(fake_server(faults=["every=1:html"]).url, tmp_path / "html", "--max-failure-rate", "1")
    assert done.exit_code == 3 and "no request succeeded" in done.output and "not an event stream ×20" in done.output


def test_no_cached_token_accounting_is_na_not_zero(fake_server, tmp_path):
    done = _replay(fake_server(faults=["every=1:nodetails"]).url, tmp_path / "nodetails")
    assert done.exit_code == 0, done.output
    assert "token hit rate n/a (the server reports no cached tokens)" in done.output
    assert "0.0000" not in done.output
    assert CliRunner().invoke(main, ["report", str(tmp_path / "nodetails")]).exit_code == 0
    assert "n/a: the server reported no cached tokens" in (tmp_path / "nodetails" / "report.md").read_text()


def test_an_interrupted_run_exits_130_and_says_how_to_resume(tmp_path):
    port = free_port()
    fake = subprocess.Popen([sys.executable, "-m", "kvbench.testing.fakeserver", "--port", str(port), "--itl-ms", "2"])
    try:
        out = tmp_path / "run"
        cmd = ["kvbench", "replay", CHAT, "--backend", "openai", "--url", f"http://127.0.0.1:{port}", "--mode",
               "rate", "--rate", "5", "--max-requests", "400", "--no-report", "--out", str(out)]  # fmt: skip
        time.sleep(1.0)  # the fake server binds its port
        run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(out.glob("requests*")):
            time.sleep(0.2)
        time.sleep(4.0)  # a few requests answered
        run.send_signal(signal.SIGINT)
        stdout, stderr = run.communicate(timeout=60)
        assert run.returncode == 130, stderr
        assert f"interrupted: resume with: kvbench replay {CHAT}" in stderr and f"--out {out} --resume" in stderr
        summary = json.loads((out / "summary.json").read_text())
        assert summary["interrupted"] is True and summary["points"][0]["failures"]["ok"] >= 1
    finally:
        fake.terminate()
        fake.wait(10)
