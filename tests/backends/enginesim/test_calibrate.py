"""`kvbench calibrate` (backends/enginesim/calibrate/): the step
model's rows against engine-sim's own arithmetic, the joint fit
on synthetic points made by that model (exact, with noise, non-negative, unidentifiable, poor), the file (loads
into engine-sim, which then charges what the fit modeled), the measurement against the fake server whose
inter-token time is known, and the CLI. No test asserts a timing of this machine."""

from __future__ import annotations

import math
import tomllib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from kvbench.backends.enginesim import calibrate as C
from kvbench.backends.enginesim.roofline import Calibration, LatencyModel

from kvbench.cli import main
from kvbench.errors import KvbenchError
from kvbench.models import HARDWARE, MODELS
from kvbench.run.pacing import Outcome
from kvbench.testing.fakeserver import FakeServer
from tests.unit.live.conftest import RunningServer, free_port

SMALL = C.Plan(
    prompt_lengths=(16, 64, 256),
    context_lengths=(64,),
    context_new_tokens=(32,),
    batch_sizes=(1, 4),
    decode_contexts=(32,),
    decode_tokens=24,
    repeats=1,
    seed=7,
)
# Terms of the order the vLLM CPU engine shows, each one a visible part of some points' time.
TRUTH = {
    "request_overhead_s": 0.012,
    "step_overhead_s": 0.004,
    "s_per_seq": 3e-4,
    "s_per_token": 4e-5,
    "s_per_pair": 1.5e-8,
    "s_per_kv_token": 6e-7,
}
CHUNK = 2048
FRESH = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8000)  # 4096 and 8000 tokens take 2 and 4 chunks
AFTER_CONTEXT = [(p, n) for p in (512, 1024, 2048) for n in (64, 256, 1024)] + [(1024, 3000)]  # the last: 2 chunks


def _true_s(row: np.ndarray, terms: dict) -> float:
    return float(row @ np.array([terms[t] for t in C.TERMS]))


def synthetic(terms=TRUTH, noise=0.0, seed=0, decode_noise=None) -> C.Result:
    """A run whose medians are what the step model says for `terms`, times (1 + noise·N(0, 1))."""
    rng = np.random.default_rng(seed)

    def jitter(scale):
        return 1.0 + scale * rng.standard_normal()

    plan = C.Plan(max_num_batched_tokens=CHUNK, seed=seed)
    result = C.Result("127.0.0.1:8011", "kvbench-tiny", "completions", 8192, plan, server={"block_size": 32})
    for cached, new in [(0, n) for n in FRESH] + AFTER_CONTEXT:
        ttft = _true_s(C.prefill_row(new, cached, CHUNK), terms) * jitter(noise)
        result.prefill.append(C.PrefillPoint(cached, new, ttft, [ttft], cached))
    for ctx in (128, 1024):
        for b in (1, 2, 4, 8, 16):
            kv = b * (ctx + 32)
            step = _true_s(C.decode_row(b, kv), terms) * jitter(noise if decode_noise is None else decode_noise)
            result.decode.append(C.DecodePoint(b, ctx, kv, step, [step], 64))
    return result


# --- the step model's rows -------------------------------------------------------------------------------------


def test_a_long_prefill_is_chunks_whose_context_grows():
    assert C.prefill_chunks(5000, 100, 2048) == [(2048, 100), (2048, 2148), (904, 4196)]
    assert C.prefill_chunks(2048, 0, 2048) == [(2048, 0)]
    row = C.prefill_row(5000, 100, 2048)
    request, steps, seqs, tokens, pairs, kv_read = row
    assert (request, steps, seqs, tokens, kv_read) == (1, 3, 3, 5000, 100 + 2148 + 4196)
    assert pairs == 5000 * 100 + 5000 * 5001 / 2  # causal pairs do not depend on the chunking
    assert list(C.decode_row(4, 1000)) == [0, 1, 4, 4, 1004, 1000]


def test_rows_charge_what_engine_sim_charges():
    cal = Calibration(**TRUTH)
    lm = LatencyModel(MODELS["kvbench-tiny"], HARDWARE["cpu"], calibration=cal)
    for b, ctx in [(1, 0), (4, 1000), (16, 300)]:
        assert _true_s(C.decode_row(b, b * ctx), TRUTH) == pytest.approx(lm.step_s([], [ctx] * b), rel=1e-12)
    for new, cached in [(32, 0), (5000, 100), (3000, 1024)]:
        steps = sum(lm.prefill_s(n, p) for n, p in C.prefill_chunks(new, cached, CHUNK))
        ttft = lm.request_overhead_s + steps
        assert _true_s(C.prefill_row(new, cached, CHUNK), TRUTH) == pytest.approx(ttft, rel=1e-12)


# --- the fit -----------------------------------------------------------------------------------------------------


def test_the_fit_recovers_the_terms_of_points_the_model_made():
    cal = C.fit(synthetic())
    for t in C.TERMS:
        assert cal.terms[t] == pytest.approx(TRUTH[t], rel=1e-6), t
    assert cal.r2 == pytest.approx(1.0) and cal.r2_prefill == pytest.approx(1.0) and cal.r2_decode == pytest.approx(1)
    assert max(abs(r) for r in cal.residual) < 1e-9 and not cal.forced
    assert sum(cal.share.values()) == pytest.approx(1.0) and all(s > 0 for s in cal.share.values())
    assert all(e < 1e-6 * cal.terms[t] for t, e in cal.stderr.items())  # no residual, no uncertainty
    assert cal.n_prefill == len(FRESH) + len(AFTER_CONTEXT) and "(4 chunks)" in cal.labels[len(FRESH) - 1]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_with_5_percent_noise_the_terms_come_back_close(seed):
    cal = C.fit(synthetic(noise=0.05, seed=seed))
    for t in C.TERMS:
        # within 4 standard errors, and the standard errors small: no term is lost in the noise
        assert abs(cal.terms[t] - TRUTH[t]) < 4 * cal.stderr[t], (t, cal.terms[t], cal.stderr[t])
        assert cal.terms[t] == pytest.approx(TRUTH[t], rel=0.35) and cal.stderr[t] < 0.15 * TRUTH[t], t
    for t in ("request_overhead_s", "step_overhead_s", "s_per_token"):  # the best-determined terms
        assert cal.terms[t] == pytest.approx(TRUTH[t], rel=0.15), t
    assert cal.r2_prefill > 0.98 and cal.r2_decode > 0.9 and cal.median_error_prefill < 0.06


def test_standard_errors_match_the_scatter_of_the_terms():
    # over many noisy runs, (fitted − true) / stderr should scatter like a standard normal if the errors are right
    fits = [C.fit_terms(synthetic(noise=0.05, seed=s)) for s in range(100, 160)]
    z = np.array([[(cal.terms[t] - TRUTH[t]) / cal.stderr[t] for t in C.TERMS] for cal in fits])
    assert np.all((z.std(axis=0) > 0.6) & (z.std(axis=0) < 1.5)), z.std(axis=0)


def test_terms_never_go_negative():
    # step times that shrink as batches grow: the free fit would take a negative per-sequence cost
    shrinking = dict(TRUTH, s_per_seq=0.0)
    result = synthetic(shrinking)
    for p in result.decode:
        p.step_s *= 1.0 - 0.02 * math.log2(p.batch)
    cal = C.fit_terms(result)
    assert all(v >= 0 for v in cal.terms.values()) and cal.terms["s_per_seq"] == 0.0
    free = np.linalg.lstsq(C.Design.of(result).x / C.Design.of(result).y[:, None], np.ones(len(cal.residual)))[0]
    assert free.min() < 0  # what the bound prevented


def test_points_that_cannot_tell_terms_apart_are_refused():
    result = synthetic()
    result.prefill = [p for p in result.prefill if not p.cached_tokens and p.new_tokens <= CHUNK]
    result.decode = [p for p in result.decode if p.context_tokens == 128]  # KV grows with the batch alone
    with pytest.raises(KvbenchError, match="cannot tell apart.*s_per_kv_token.*--decode-contexts"):
        C.fit(result)
    result.decode = []
    with pytest.raises(KvbenchError, match="no decode point"):
        C.fit(result)


def test_a_poor_fit_is_an_error_that_says_what_to_do_unless_forced(tmp_path):
    result = synthetic(noise=0.02, decode_noise=0.5, seed=4)  # decode steps all over the place
    with pytest.raises(KvbenchError) as err:
        C.fit(result)
    msg = str(err.value)
    assert "decode rows fit badly" in msg and "prefill rows" not in msg and "worst: decode step of" in msg
    assert "--repeats" in msg and "--force" in msg and "nothing else runs" in msg
    cal = C.fit(result, force=True)
    assert cal.forced and cal.warnings and "decode rows fit badly" in cal.warnings[0]
    text = C.write(tmp_path / "forced.toml", result, cal).read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any(line.startswith("# FORCED (--force)") for line in header)  # a reader sees it before the numbers
    data = tomllib.loads(text)
    assert data["measurements"]["forced"] is True and data["measurements"]["fit"]["forced"] is True
    assert "decode rows fit badly" in data["measurements"]["fit_warnings"][0]
    assert set(data["calibration"]) == {*C.TERMS, "join_window_s"}
    # the thresholds are the user's: a lenient one lets the same points through
    assert not C.fit(result, min_r2=-100, max_median_error=10).forced


# --- the file ------------------------------------------------------------------------------------------------------


def test_the_file_round_trips_into_engine_sim(tmp_path):
    from kvbench.backends.enginesim import EngineSimBackend, _calibration

    result = synthetic()
    cal = C.fit(result)
    path = C.write(tmp_path / "calib.toml", result, cal, "kvbench calibrate --url http://127.0.0.1:8011 -o …")
    text = path.read_text()
    data = tomllib.loads(text)
    assert list(data["calibration"]) == [*C.TERMS, "join_window_s"]
    loaded = Calibration.from_mapping(data["calibration"], str(path))
    assert _calibration(str(path)) == loaded
    for t in C.TERMS:
        assert getattr(loaded, t) == pytest.approx(TRUTH[t], rel=1e-5)
    m = data["measurements"]
    assert m["url"] == "127.0.0.1:8011" and m["model"] == "kvbench-tiny" and m["server"] == {"block_size": 32}
    assert m["plan"]["max_num_batched_tokens"] == CHUNK and m["plan"]["repeats"] == 3 and m["forced"] is False
    assert m["fit"]["r2"] == pytest.approx(1.0) and {"r2_prefill", "r2_decode"} <= set(m["fit"])
    assert set(m["terms"]) == set(C.TERMS) and set(m["terms"]["s_per_pair"]) == {"value", "unit", "share", "stderr"}
    long = next(p for p in m["prefill"] if p["new_tokens"] == 8000)
    assert long["chunks"] == 4 and long["modeled_s"] == pytest.approx(long["ttft_s"], rel=1e-5)
    assert all("residual" in p and "modeled_s" in p for p in m["decode"])
    assert "proposed" not in m and "--calibration" in text.split("[calibration]")[0]
    # the backend charges exactly what the fit modeled
    backend = EngineSimBackend(hardware="cpu", model="kvbench-tiny", calibration=str(path))
    lm = backend.latency
    assert lm.calibration == loaded
    point = m["decode"][-1]
    assert lm.decode_step_s(point["batch"], point["kv_tokens"]) == pytest.approx(point["modeled_s"], rel=1e-5)


def test_engine_sim_replays_a_long_prompt_in_the_modeled_ttft(tmp_path):
    """One 5000-token request alone: engine-sim cuts it into 2048-token chunks as the server does, and its TTFT
    is the request overhead plus the chunks' steps, as the fit's prefill row says."""
    from kvbench.run.runner import run_replay
    from kvbench.trace.files import new_meta, write_trace

    result = synthetic()
    path = C.write(tmp_path / "calib.toml", result, C.fit(result))
    row = {"request_id": "r0", "arrival_s": 0.0, "input_tokens": 5000, "output_tokens": 1}
    row["block_hashes"] = list(range(1, 5000 // 16 + 2))
    trace = tmp_path / "one.parquet"
    write_trace(pa.Table.from_pylist([row]), trace, new_meta(16, {"test": "calibrate"}))
    opts = {"hardware": "cpu", "model": "kvbench-tiny", "max_num_batched_tokens": CHUNK, "calibration": str(path)}
    run_dir, _ = run_replay(trace, "engine-sim", {**opts, "policy": "lru"}, out=tmp_path / "run", report=False)
    ttft = pq.read_table(run_dir / "requests.parquet").to_pydict()["ttft_s"][0]
    assert ttft == pytest.approx(_true_s(C.prefill_row(5000, 0, CHUNK), TRUTH), rel=1e-5)


# --- measuring -----------------------------------------------------------------------------------------------------


def test_plan_is_bounded_by_the_server_context():
    plan = C.Plan(prompt_lengths=(128, 4096, 8192), context_lengths=(1024, 4000), context_new_tokens=(256,))
    b = plan.bounded(max_model_len=2048)
    cap = 2048 - plan.decode_tokens - 1
    assert b.max_prompt_tokens == cap and max(b.prompt_lengths) == cap and b.context_lengths == (1024,)
    with pytest.raises(KvbenchError, match="max-prompt-tokens"):
        plan.bounded(max_model_len=40)
    with pytest.raises(KvbenchError, match="max-num-batched-tokens"):
        C.Plan(max_num_batched_tokens=0)


def test_a_batch_that_never_ran_together_is_refused():
    def o(chunks):
        return Outcome(row=0, chunk_s=list(chunks), completion_tokens=len(chunks))

    together = [o(np.arange(0.1, 1.0, 0.01)), o(np.arange(0.12, 1.02, 0.01))]
    step, kv, steps = C.decode_step(together, 100)
    assert step == pytest.approx(0.01) and steps >= C.MIN_WINDOW_STEPS and kv > 200
    apart = [o(np.arange(0.0, 0.5, 0.01)), o(np.arange(0.6, 1.0, 0.01))]
    assert C.decode_step(apart, 100) is None


def test_host_port_keeps_nothing_else():
    assert C.host_port("http://user:secret@example.com:8000/v1?key=abc") == "example.com:8000"
    assert C.host_port("https://api.example.com") == "api.example.com:443"


@pytest.fixture
def fake():
    servers = []

    def start(itl_ms):
        srv = RunningServer(FakeServer(block_size=16, itl_s=itl_ms / 1000.0))
        servers.append(srv)
        return srv

    yield start
    for s in servers:
        s.stop()


def test_fake_server_decode_step_is_its_inter_token_time(fake):
    srv = fake(itl_ms=20)
    plan = C.Plan(**{**vars(SMALL), "repeats": 2})
    result = C.measure(srv.url, plan)
    # the fake server sleeps 20 ms between tokens whatever the batch and context: never a shorter step (how much
    # longer depends on this machine's load, so there is no upper bound)
    assert all(math.isfinite(p.step_s) and p.step_s >= 0.015 for p in result.decode)
    assert all(len(p.samples_s) == 2 for p in result.prefill + result.decode)
    # the context points were served from its prefix cache (64 tokens skipped), the fresh ones were not
    assert [(p.cached_tokens, p.new_tokens) for p in result.prefill if p.server_cached_tokens] == [(64, 32)]
    assert {p.server_cached_tokens for p in result.prefill if not p.cached_tokens} == {0}
    assert result.server == {"prefix_cache_reset": True} and result.url == f"127.0.0.1:{srv.port}"
    assert result.model == "fake" and result.plan.seed == 7
    cal = C.fit_terms(result)  # its TTFTs are not a prefill's: whether the fit is good is not this test's matter
    assert all(math.isfinite(v) and v >= 0 for v in cal.terms.values())


def test_repeated_prompts_served_from_cache_are_refused():
    from aiohttp import web

    server = FakeServer(block_size=16, itl_s=0.002)

    async def no_reset(request):  # a server whose prefix cache cannot be reset
        return web.Response(status=404)

    server.reset = no_reset
    srv = RunningServer(server)
    try:
        C.measure(srv.url, SMALL)
        with pytest.raises(KvbenchError, match="prefix cache"):
            C.measure(srv.url, SMALL)  # the same seed: the same prompts, now cached
    finally:
        srv.stop()


def test_batches_that_never_run_together_fail_with_what_to_do(fake):
    srv = fake(itl_ms=0)  # streams every answer at once: no two requests are ever decoding together
    with pytest.raises(KvbenchError, match="lower --batch-sizes") as err:
        C.measure(srv.url, SMALL)
    assert "left out" in str(err.value) and "chunks each" in str(err.value)


# --- the command -----------------------------------------------------------------------------------------------


def _small_args(url, out):
    args = ["calibrate", "--url", url, "-o", str(out), "--repeats", "1", "--prompt-lengths", "16,64,256"]
    args += ["--context-lengths", "64", "--context-new-tokens", "32", "--batch-sizes", "1,2", "--decode-contexts", "32"]
    return args + ["--decode-tokens", "16"]


def test_cli_writes_the_file_and_says_what_next(fake, tmp_path):
    srv = fake(itl_ms=2)
    out = tmp_path / "c.toml"
    # the fake server's TTFTs are no prefill's, so its fit may be poor: --force writes the file anyway
    args = _small_args(srv.url, out) + ["--api-key-env", "KVB_TEST_KEY", "--force", "--max-num-batched-tokens", "64"]
    res = CliRunner().invoke(main, args, env={"KVB_TEST_KEY": "sk-do-not-store"})
    assert res.exit_code == 0, res.output
    assert "--calibration" in res.output and "wrote" in res.output and "R²" in res.output
    assert all(t in res.output for t in C.TERMS)
    text = out.read_text()
    assert "sk-do-not-store" not in text and "http://" not in text
    data = tomllib.loads(text)
    assert set(data["calibration"]) == {*C.TERMS, "join_window_s"}
    assert all(math.isfinite(v) and v >= 0 for v in data["calibration"].values())
    m = data["measurements"]
    assert m["plan"]["max_num_batched_tokens"] == 64 and isinstance(m["forced"], bool)
    assert [p["chunks"] for p in m["prefill"] if p["new_tokens"] == 256] == [4]


def test_cli_refuses_a_poor_fit_and_leaves_no_file(tmp_path, monkeypatch):
    poor = synthetic(noise=0.02, decode_noise=0.5, seed=4)
    monkeypatch.setattr(C, "measure", lambda url, plan, **kw: poor)  # the measurements, not the endpoint, matter here
    out = tmp_path / "c.toml"
    res = CliRunner().invoke(main, ["calibrate", "--url", "http://127.0.0.1:1", "-o", str(out)])
    assert res.exit_code != 0 and not out.exists() and not list(tmp_path.iterdir())
    assert "decode rows fit badly" in res.output and "--force" in res.output and "s_per_pair" in res.output
    res = CliRunner().invoke(main, ["calibrate", "--url", "http://127.0.0.1:1", "-o", str(out), "--force"])
    assert res.exit_code == 0 and "warning (forced)" in res.output
    assert tomllib.loads(out.read_text())["measurements"]["forced"] is True


def test_cli_keeps_credentials_in_the_url_out_of_the_file(fake, tmp_path, monkeypatch):
    srv = fake(itl_ms=2)
    secret_url = srv.url.replace("http://", "http://user:hunter2@")
    out = tmp_path / "c.toml"
    args = _small_args(secret_url, out) + ["--force"]
    monkeypatch.setattr("sys.argv", ["kvbench", *args])
    res = CliRunner().invoke(main, args)
    text = out.read_text()
    assert res.exit_code == 0, res.output
    assert "hunter2" not in text and f"--url http://127.0.0.1:{srv.port} " in text and "hunter2" not in res.output


def test_cli_errors_say_what_to_do(tmp_path):
    res = CliRunner().invoke(main, ["calibrate", "--url", f"http://127.0.0.1:{free_port()}", "-o", str(tmp_path / "x")])
    assert res.exit_code == 2 and "is the server up" in res.output
    res = CliRunner().invoke(main, ["calibrate", "--url", "http://u:pw@h:1/?k=v", "-o", str(tmp_path / "x")])
    assert res.exit_code == 2 and "no query" in res.output and "pw" not in res.output
    res = CliRunner().invoke(main, ["calibrate", "--url", "http://x", "-o", "y", "--batch-sizes", "1,a"])
    assert res.exit_code == 2 and "not a whole number" in res.output


def test_help_gives_every_option_a_unit():
    res = CliRunner().invoke(main, ["calibrate", "--help"])
    assert res.exit_code == 0
    for word in ("tokens", "seconds", "sequences", "fraction", "count", "--calibration", "--force", "R²"):
        assert word in res.output
    for option in ("--max-num-batched-tokens", "--min-r2", "--max-median-error", "--repeats"):
        assert option in res.output
