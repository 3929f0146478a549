"""`kvbench calibrate` against the real llama.cpp engine (`@pytest.mark.engine`, the `llama` fixture: skipped when
none runs unless KVBENCH_REQUIRE_ENGINES is set). The file it writes must describe llama-server as calibration
read it (its slots, per-slot context, n_batch as the prefill chunk, decode batches inside its slots) and hold six
finite terms ≥ 0, the fitted ones positive. How large they are, and how well they fit, is this machine's timing:
not asserted (tests/backends/enginesim/test_calibrate_llama.py checks the fit on synthetic points). A small plan:
seconds on the tiny model; --force, so that a noisy moment cannot fail the structure checks."""

from __future__ import annotations

import math
import subprocess
import tomllib

import pytest

pytestmark = pytest.mark.engine


def test_calibrate_llama_writes_its_facts_and_terms(llama, tmp_path):
    out = tmp_path / "calib.toml"
    cmd = ["kvbench", "calibrate", "--url", llama.url, "-o", str(out), "--repeats", "2", "--force"]
    cmd += ["--prompt-lengths", "64,256,1024,2048,3000", "--context-lengths", "1024", "--context-new-tokens", "64,512"]
    cmd += ["--batch-sizes", "1,2,4,8,16", "--decode-contexts", "128,512", "--decode-tokens", "32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = tomllib.loads(out.read_text())
    cal, m = data["calibration"], data["measurements"]
    server = m["server"]
    assert server["engine"] == "llama.cpp" and server["slots"] >= 1 and server["context_tokens"] > 0
    assert m["max_model_len"] == server["context_tokens"] - 1  # llama-server refuses a prompt of n_ctx tokens
    assert m["plan"]["max_num_batched_tokens"] == server["n_batch"]  # prefills chunked at n_batch
    assert max(m["plan"]["batch_sizes"]) <= server["slots"]  # larger batches cannot decode together
    if server["slots"] < 16:
        assert any("left out" in w for w in m.get("warnings", []))
    assert all(math.isfinite(v) and v >= 0 for v in cal.values())
    folded = set(m["fit"].get("folded", []))
    assert folded <= {"s_per_seq"} and (folded == {"s_per_seq"}) == (server["slots"] == 1)
    for term in ("request_overhead_s", "s_per_token", "s_per_pair"):  # what any prefill must pay
        assert cal[term] > 0, term
    # the cached context was served from the slot, token by token; fresh prompts were not
    assert {p["server_cached_tokens"] for p in m["prefill"] if p["cached_tokens"]} == {1024}
    assert {p["server_cached_tokens"] for p in m["prefill"] if not p["cached_tokens"]} <= {0, 1}
    assert [p["chunks"] for p in m["prefill"] if p["new_tokens"] == 3000] == [-(-3000 // server["n_batch"])]
    assert {p["batch"] for p in m["decode"]} == set(m["plan"]["batch_sizes"])
    # pairs sent a set offset apart, each offset measured (a pair streams text within its tries); the window
    # they give is part of the request overhead
    assert [j["offset_s"] for j in m["join"]] == m["plan"]["join_offsets_s"] and all(j["pairs"] >= 1 for j in m["join"])
    assert all(j["joined"] <= j["pairs"] == len(j["gaps_s"]) for j in m["join"])
    assert 0 <= cal["join_window_s"] <= cal["request_overhead_s"]
    assert "kvbench fidelity" in proc.stdout
