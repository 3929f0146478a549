"""`kvbench calibrate` against the real vLLM CPU engine (`@pytest.mark.engine`): the file it writes describes the
engine and the plan, its six terms are finite and ≥ 0 with the fit's R² reported, and it loads into engine-sim,
which then runs on its terms. What the terms are, and how well they fit, is this machine's timing: on a shared or
loaded machine it can be anything, so no test asserts it (tests/backends/enginesim/test_calibrate.py checks the fit
itself on synthetic points with known terms). The run passes --force, and when the fit was poor the file must
say so. This test keeps to a small plan (about a minute on 2 cores)."""

from __future__ import annotations

import math
import subprocess
import tomllib

import pytest

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def calib(vllm, tmp_path_factory):
    out = tmp_path_factory.mktemp("calib") / "calib.toml"
    cmd = ["kvbench", "calibrate", "--url", vllm.url, "-o", str(out), "--repeats", "2", "--force"]
    cmd += ["--prompt-lengths", "64,256,1024,2048,4096", "--context-lengths", "1024", "--context-new-tokens", "64,512"]
    cmd += ["--batch-sizes", "1,4,8", "--decode-contexts", "128,512", "--decode-tokens", "32"]
    cmd += ["--max-num-batched-tokens", "2048"]  # the engine's (vLLM's CPU default)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "--calibration" in proc.stdout and "R²" in proc.stdout
    return out, proc.stdout + proc.stderr


def test_calibration_file_describes_the_engine(vllm, calib):
    path, output = calib
    data = tomllib.loads(path.read_text())
    cal, m = data["calibration"], data["measurements"]
    assert set(cal) == {
        "request_overhead_s",
        "step_overhead_s",
        "s_per_seq",
        "s_per_token",
        "s_per_pair",
        "s_per_kv_token",
        "join_window_s",  # measured apart from the fit, by pairs of prompts sent a set offset apart
    }
    assert all(math.isfinite(v) and v >= 0 for v in cal.values())  # the fit never makes a term negative
    assert cal["join_window_s"] <= cal["request_overhead_s"]  # the window is part of the overhead
    assert [j["offset_s"] for j in m["join"]] == m["plan"]["join_offsets_s"]
    assert all(0 <= j["joined"] <= j["pairs"] == len(j["gaps_s"]) for j in m["join"])
    assert m["url"] == f"127.0.0.1:{vllm.port}" and m["model"] == vllm.model and m["max_model_len"] == 8192
    assert m["server"]["block_size"] == vllm.block_size and m["server"]["num_gpu_blocks"] > 0
    assert m["server"]["prefix_cache_reset"] is True
    assert m["plan"]["max_num_batched_tokens"] == 2048 and m["plan"]["repeats"] == 2
    # context points were served from the prefix cache, fresh ones were not; 4096 tokens took two chunks
    assert {p["server_cached_tokens"] for p in m["prefill"] if p["cached_tokens"]} == {1024}
    assert {p["server_cached_tokens"] for p in m["prefill"] if not p["cached_tokens"]} == {0}
    assert [p["chunks"] for p in m["prefill"] if p["new_tokens"] == 4096] == [2]
    # the fit's figures are there (how good they are depends on the machine's load, not on kvbench)
    fit = m["fit"]
    assert all(fit[k] <= 1 for k in ("r2", "r2_prefill", "r2_decode"))
    assert all(math.isfinite(p["modeled_s"]) and p["modeled_s"] >= 0 for p in m["prefill"] + m["decode"])
    assert sum(t["share"] for t in m["terms"].values()) == pytest.approx(1.0, rel=1e-4)
    # a poor fit was written only because of --force, and the file says so
    poor = fit["r2_prefill"] < 0.9 or fit["r2_decode"] < 0.9
    poor = poor or max(fit["median_abs_residual_prefill"], fit["median_abs_residual_decode"]) > 0.15
    assert m["forced"] is poor and fit["forced"] is poor
    if poor:
        assert m["fit_warnings"] and "fit badly" in m["fit_warnings"][0] and "warning (forced)" in output
        header = [line for line in path.read_text().splitlines() if line.startswith("#")]
        assert any(line.startswith("# FORCED (--force)") for line in header)


def test_calibration_loads_into_engine_sim(calib, sample_head, tmp_path):
    calib, _ = calib
    sub = sample_head("chat", 20)
    import pyarrow.parquet as pq

    from kvbench.run.runner import run_replay

    opts = {"hardware": "cpu", "model": "kvbench-tiny", "max_num_batched_tokens": 2048, "max_num_seqs": 128}
    _, calibrated = run_replay(sub, "engine-sim", {**opts, "calibration": str(calib)}, out=tmp_path / "c", report=False)
    _, roofline = run_replay(sub, "engine-sim", opts, out=tmp_path / "r", report=False)
    assert calibrated["config"]["calibration"] == tomllib.loads(calib.read_text())["calibration"]
    assert roofline["config"].get("calibration") is None
    assert math.isfinite(calibrated["latency"]["ttft"]["mean_ms"])  # its size is the fitted timing: not asserted
    assert pq.read_table(tmp_path / "c" / "requests.parquet").num_rows == 20
