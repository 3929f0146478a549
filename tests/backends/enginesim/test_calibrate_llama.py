"""The step model's structure and fit for llama.cpp's llama-server (kvbench/live/servers.py): synthetic points
generated from a Calibration with known terms, with the server's chunking (n_batch) and slots, plus seeded noise
(the seed drawn per run and printed; KVBENCH_TEST_SEED=N replays it). The fit must recover the terms within stated
tolerances. No timing of any real server is asserted here (tests/integration/test_calibrate_llama.py runs one)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from kvbench.backends.enginesim import calibrate as C

from kvbench.engines import base
from kvbench.engines import llama_cpp as L
from kvbench.live import servers

# llama.cpp-like terms: attention pairs dominate long prefills, a decode query reads its KV at a high rate
TRUE = {"request_overhead_s": 2e-3, "step_overhead_s": 2e-4, "s_per_seq": 1e-4, "s_per_token": 9e-6,
        "s_per_pair": 3e-8, "s_per_kv_token": 5e-7}  # fmt: skip
NOISE = 0.01  # relative, per point


@pytest.fixture
def rng():
    seed = int(os.environ.get("KVBENCH_TEST_SEED") or np.random.SeedSequence().entropy % 100_000)
    print(f"noise seed {seed} (replay: KVBENCH_TEST_SEED={seed})")
    return np.random.default_rng(seed)


def synthetic(terms: dict, n_batch: int, batches, rng, noise=NOISE, contexts=(512, 1024, 2048)) -> C.Result:
    """A run's medians as a server with `terms` chunking prefills at `n_batch` would give them (times noised)."""
    beta = np.array([terms[t] for t in C.TERMS])
    plan = C.Plan(batch_sizes=tuple(batches), max_num_batched_tokens=n_batch, seed=0)
    result = C.Result("127.0.0.1:8012", "kvbench-tiny", "completions", 8191, plan)
    lengths = [(0, n) for n in (32, 64, 128, 256, 512, 1024, 2048, 4096, 8000)]
    lengths += [(p, n) for p in contexts for n in (64, 256, 1024)]
    for p, n in lengths:
        t = float(C.prefill_row(n, p, n_batch) @ beta) * (1 + noise * rng.standard_normal())
        result.prefill.append(C.PrefillPoint(p, n, t, [t], p))
    for b in batches:
        for ctx in (128, 1024):
            kv = b * (ctx + 32.0)
            t = float(C.decode_row(b, kv) @ beta) * (1 + noise * rng.standard_normal())
            result.decode.append(C.DecodePoint(b, ctx, kv, t, [t], 64))
    return result


@pytest.mark.parametrize("n_batch", [2048, 512])
def test_fit_recovers_llama_terms_with_its_chunking(rng, n_batch):
    """Two slots (llama-server --parallel 2: decode batches of 1 and 2) and prefills chunked at n_batch; 1% noise.
    Tolerances: 10% on the terms that carry most of the time (pairs, tokens, request, KV read), 50% on the
    per-step and per-sequence terms, which are a few percent of any point."""
    fitted = C.fit_terms(synthetic(TRUE, n_batch, (1, 2), rng))
    for term in ("s_per_pair", "s_per_token", "request_overhead_s", "s_per_kv_token"):
        assert fitted.terms[term] == pytest.approx(TRUE[term], rel=0.10), term
    for term in ("step_overhead_s", "s_per_seq"):
        assert fitted.terms[term] == pytest.approx(TRUE[term], rel=0.5, abs=5e-5), term
    assert fitted.r2_prefill > 0.99 and fitted.r2_decode > 0.99 and not fitted.folded


def test_noise_free_fit_is_exact(rng):
    fitted = C.fit_terms(synthetic(TRUE, 2048, (1, 2, 4), rng, noise=0.0))
    for term in C.TERMS:
        assert fitted.terms[term] == pytest.approx(TRUE[term], rel=1e-6), term


def test_one_slot_folds_s_per_seq_into_step_overhead(rng):
    """llama-server --parallel 1 never runs two sequences in a step: every row's sequence count equals its step
    count, so s_per_seq cannot be told apart; it is fixed at 0 and step_overhead_s carries both (what such a server
    pays per step), instead of the identifiability error."""
    fitted = C.fit_terms(synthetic(TRUE, 2048, (1,), rng, noise=0.0))
    assert fitted.folded == ("s_per_seq",) and fitted.terms["s_per_seq"] == 0.0
    assert fitted.terms["step_overhead_s"] == pytest.approx(TRUE["step_overhead_s"] + TRUE["s_per_seq"], rel=1e-6)
    assert fitted.quality()["folded"] == ["s_per_seq"] and fitted.stderr["s_per_seq"] == 0.0
    for term in ("request_overhead_s", "s_per_token", "s_per_pair", "s_per_kv_token"):
        assert fitted.terms[term] == pytest.approx(TRUE[term], rel=1e-6), term


def test_prefill_rows_chunk_at_n_batch():
    """A prompt longer than n_batch takes one step per n_batch tokens, each attending what came before (llama-server
    fills one batch per iteration); the pairs add up to one causal prefill of the whole prompt."""
    row = C.prefill_row(4096 + 100, 0, 2048)
    assert row[C.TERMS.index("step_overhead_s")] == 3 and row[C.TERMS.index("s_per_seq")] == 3
    n = 4196
    assert row[C.TERMS.index("s_per_pair")] == pytest.approx(n * (n + 1) / 2)
    assert row[C.TERMS.index("s_per_kv_token")] == 2048 + 4096  # each chunk reads the chunks before it


def test_llama_batching_from_engine_arguments():
    assert servers.llama_batching(None, 8192) == {"n_batch": 2048, "n_ubatch": 512,
                                                  "batching_from": "llama-server defaults"}  # fmt: skip
    got = servers.llama_batching("--parallel 2 -b 1024 --ubatch-size=256", 8192)
    assert (got["n_batch"], got["n_ubatch"], got["batching_from"]) == (1024, 256, "engine arguments")
    assert servers.llama_batching("-b 4096 -ub 4096", 2048)["n_batch"] == 2048  # clamped to the context
    assert servers.llama_batching("-b 256", None)["n_ubatch"] == 256  # n_ubatch at most n_batch


def test_server_limits_for_the_plan():
    llama = {"engine": "llama.cpp", "slots": 2, "context_tokens": 4096, "n_batch": 1024}
    assert servers.step_budget(None, llama) == 1024 and servers.step_budget(512, llama) == 512
    assert servers.step_budget(None, {}) == servers.VLLM_MAX_NUM_BATCHED_TOKENS
    assert servers.max_decode_batch(llama) == 2 and servers.max_decode_batch({}) is None
    assert servers.request_context(None, llama) == 4095  # a prompt of n_ctx tokens is refused
    assert servers.request_context(8192, llama) == 8192
    plan = C.Plan().bounded(4095, max_batch=2)
    assert plan.batch_sizes == (1, 2) and max(plan.prompt_lengths) <= 4095 - plan.decode_tokens - 1
    assert C.Plan(batch_sizes=(4, 8)).bounded(None, max_batch=2).batch_sizes == (2,)


def test_cpus_option_pins_the_server_with_one_thread_per_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(L, "_marker", lambda: tmp_path / "marker.json")
    (tmp_path / "marker.json").write_text('{"binary": "/bin/llama-server"}')
    cpu = min(os.sched_getaffinity(0))
    s = L.settings(cpus=str(cpu), engine_args="--parallel 2")
    argv, _, _, _ = L.command(s)
    assert argv[:3] == ["taskset", "--cpu-list", str(cpu)] and argv[3] == "/bin/llama-server"
    assert argv[argv.index("--threads") + 1] == "1" and argv[-2:] == ["--parallel", "2"]
    argv, _, _, _ = L.command(L.settings(cpus=str(cpu), engine_args="-t 3"))
    assert "--threads" not in argv and argv[-2:] == ["-t", "3"]  # the user's thread count wins
    assert L.command(L.settings())[0][0] == "/bin/llama-server"  # not pinned by default
    assert L.settings()["cpus"] is None
    with pytest.raises(base.EngineError, match="taskset"):
        L.settings(cpus="one")
    with pytest.raises(base.EngineError, match="not available"):
        L.settings(cpus="4096")
