"""`kvbench fidelity` end to end against the fake OpenAI-compatible server (a real aiohttp server, real Parquet
files, the real engine-sim): the run directory, the error table and its report, and that an existing run is
never overwritten. Against the real vLLM engine: tests/integration/test_live_vllm.py."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvbench.cli import main
from kvbench.testing.fakeserver import FakeServer

from ...conftest import REPO
from .conftest import RunningServer

CALIBRATION = """[calibration]
request_overhead_s = 0.002
step_overhead_s = 0.001
s_per_seq = 0.0001
s_per_token = 0.00001
s_per_pair = 0.0
s_per_kv_token = 0.0
"""


def test_fidelity_runs_live_and_modeled_and_reports_the_errors(tmp_path):
    calib = tmp_path / "calib.toml"
    calib.write_text(CALIBRATION)
    server = RunningServer(FakeServer(block_size=32, itl_s=0.001))
    try:
        out = tmp_path / "fid"
        args = ["fidelity", str(REPO / "traces/samples/chat.parquet"), "--url", server.url, "--calibration",
                str(calib), "--block-size", "32", "--hbm-capacity", "1000000", "--requests", "12",
                "--max-output-tokens", "4", "--concurrency", "2", "--out", str(out)]  # fmt: skip
        done = CliRunner().invoke(main, args)
        assert done.exit_code == 0, done.output
        summary = json.loads((out / "summary.json").read_text())
        overall = summary["fidelity"]["overall"]
        assert summary["complete"] and overall["requests"] == 12 - 2  # the first two sent are left out
        # the fake server caches like vLLM with an unbounded pool: the vllm rule predicts every request
        assert overall["cached_tokens"]["exact"] == overall["cached_tokens"]["requests"] == 10
        assert overall["cached_tokens"]["measured"] > 0
        for metric in ("ttft", "tpot", "e2el"):
            assert overall[metric]["requests"] == 10 and overall[metric]["mape"] >= 0
        assert (out / "live" / "requests.parquet").exists() and (out / "modeled" / "requests.parquet").exists()
        assert "Model vs measurement" in (out / "report.md").read_text() and "| all |" in done.output
        # the modeled run held at most two requests in flight, as the live client did
        assert json.loads((out / "modeled" / "summary.json").read_text())["config"]["max_concurrency"] == 2
        # an existing run is never overwritten
        before = (out / "summary.json").read_text()
        again = CliRunner().invoke(main, args)
        assert again.exit_code != 0 and "already holds a fidelity run" in again.output
        assert (out / "summary.json").read_text() == before
    finally:
        server.stop()
