"""`kvbench calibrate` (kvbench/calibrate/): the fits on synthetic points, the measurement against the fake
server whose inter-token time is known, the file it writes (loads into engine-sim, holds no secret), the CLI."""

from __future__ import annotations

import math
import tomllib

import numpy as np
import pytest
from click.testing import CliRunner
from kvbench.backends.enginesim.roofline import Calibration

from kvbench import calibrate as C
from kvbench.cli import main
from kvbench.errors import KvbenchError
from kvbench.fakeserver import FakeServer
from kvbench.pacing import Outcome

from .live.conftest import RunningServer, free_port

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


# --- fits on synthetic points ----------------------------------------------------------------------------------


def test_least_squares_recovers_a_line_exactly():
    x = np.array([1.0, 2.0, 5.0, 9.0])
    fit = C.least_squares({"a": np.ones(4), "b": x}, 0.5 + 0.25 * x)
    assert fit.coef["a"] == pytest.approx(0.5) and fit.coef["b"] == pytest.approx(0.25)
    assert fit.r2 == pytest.approx(1.0) and fit.n == 4


def test_least_squares_weighs_relative_error():
    # one long point off by 10 %: a relative fit follows the three short ones, a plain fit is pulled to the long one
    x = np.array([1.0, 2.0, 3.0, 100.0])
    y = 0.01 * x * np.array([1, 1, 1, 1.1])
    rel = C.least_squares({"b": x}, y)
    plain = C.least_squares({"b": x}, y, relative=False)
    assert abs(rel.coef["b"] - 0.01) < abs(plain.coef["b"] - 0.01)


def test_least_squares_drops_a_negative_slope():
    # step times that shrink as KV grows are noise: the slope becomes 0 and the base their mean
    fit = C.least_squares({"a": np.ones(3), "b": np.array([1.0, 2.0, 3.0])}, np.array([0.012, 0.011, 0.010]))
    assert fit.coef["b"] == 0.0 and fit.coef["a"] == pytest.approx(0.011, rel=0.02)


def _decode_points(base, per_kv, per_seq=0.0):
    pts = []
    for b in (1, 2, 4, 8, 16):
        for ctx in (128, 1024):
            kv = b * (ctx + 32)
            pts.append(C.DecodePoint(b, ctx, kv, base + per_kv * kv + per_seq * b, [], 64))
    return pts


def test_decode_fit_recovers_base_and_slope():
    line, full = C.fit_decode(_decode_points(0.009, 4e-7))
    assert line.coef["base_s"] == pytest.approx(0.009) and line.coef["s_per_kv_token"] == pytest.approx(4e-7)
    assert line.r2 == pytest.approx(1.0)
    line, full = C.fit_decode(_decode_points(0.006, 2e-7, per_seq=7e-4))
    assert full.coef["s_per_seq"] == pytest.approx(7e-4) and full.coef["s_per_kv_token"] == pytest.approx(2e-7)
    assert full.r2 == pytest.approx(1.0) and line.r2 < 1.0  # the Calibration's line cannot see the per-sequence term


def _prefill_points(overhead, per_token, per_pair):
    pts = []
    for cached, new in [(0, n) for n in (32, 128, 512, 2048, 4096)] + [(1024, 64), (2048, 1024)]:
        p = C.PrefillPoint(cached, new, 0.0, [])
        p.ttft_s = overhead + per_token * new + per_pair * p.pairs
        pts.append(p)
    return pts


def test_physical_prefill_fit_recovers_overhead_tokens_and_pairs():
    fit = C.fit_prefill_physical(_prefill_points(0.03, 1e-4, 5e-8))
    assert fit.coef["overhead_s"] == pytest.approx(0.03)
    assert fit.coef["s_per_token"] == pytest.approx(1e-4)
    assert fit.coef["s_per_pair"] == pytest.approx(5e-8)


def test_prefill_rate_is_exact_when_the_engine_is_what_the_simulator_models():
    pts = [C.PrefillPoint(0, n, n / 5000.0, []) for n in (256, 512, 1024, 4096)]
    rate, r2 = C.fit_prefill_rate(pts, base_s=0.001, per_kv_s=0.0)
    assert rate == pytest.approx(5000.0, rel=1e-4) and r2 == pytest.approx(1.0)


def test_prefill_rate_folds_an_overhead_in_between_short_and_long_prompts():
    pts = _prefill_points(0.03, 2e-4, 0.0)
    rate, _ = C.fit_prefill_rate(pts, base_s=0.005, per_kv_s=0.0)
    # slower than the marginal 5,000 tok/s (it carries the 30 ms), faster than the shortest prompt's average
    assert 32 / pts[0].ttft_s < rate < 5000.0


def test_prefill_line_is_the_issues_straight_fit_on_fresh_prompts():
    pts = [C.PrefillPoint(0, n, 0.02 + n / 8000.0, []) for n in (128, 512, 2048)] + [C.PrefillPoint(1024, 64, 9.0, [])]
    line = C.fit_prefill_line(pts)
    assert line.coef["intercept_s"] == pytest.approx(0.02) and 1 / line.coef["s_per_token"] == pytest.approx(8000.0)


def test_plan_is_bounded_by_the_server_context():
    plan = C.Plan(prompt_lengths=(128, 4096, 8192), context_lengths=(1024, 4000), context_new_tokens=(256,))
    b = plan.bounded(max_model_len=2048)
    cap = 2048 - plan.decode_tokens - 1
    assert b.max_prompt_tokens == cap and max(b.prompt_lengths) == cap and b.context_lengths == (1024,)
    with pytest.raises(KvbenchError, match="max-prompt-tokens"):
        plan.bounded(max_model_len=40)


def test_a_batch_that_never_ran_together_is_refused():
    def o(chunks):
        out = Outcome(row=0, chunk_s=list(chunks), completion_tokens=len(chunks))
        return out

    together = [o(np.arange(0.1, 1.0, 0.01)), o(np.arange(0.12, 1.02, 0.01))]
    step, kv, steps = C._decode_step(together, 100)
    assert step == pytest.approx(0.01) and steps >= C.MIN_WINDOW_STEPS and kv > 200
    apart = [o(np.arange(0.0, 0.5, 0.01)), o(np.arange(0.6, 1.0, 0.01))]
    assert C._decode_step(apart, 100) is None


def test_host_port_keeps_nothing_else():
    assert C.host_port("http://user:secret@example.com:8000/v1?key=abc") == "example.com:8000"
    assert C.host_port("https://api.example.com") == "api.example.com:443"


# --- against the fake server -------------------------------------------------------------------------------------


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


def test_fake_server_decode_step_is_its_inter_token_time(fake, tmp_path):
    srv = fake(itl_ms=20)
    result = C.measure(srv.url, SMALL)
    cal = C.fit(result)
    # the fake server sleeps 20 ms between tokens whatever the batch and context: base ≈ 20 ms, no KV slope
    assert cal.decode_step_base_s == pytest.approx(0.020, abs=0.004)
    most_kv = max(p.kv_tokens for p in result.decode)
    assert cal.decode_s_per_kv_token * most_kv < 0.004
    assert all(p.step_s == pytest.approx(0.020, abs=0.005) for p in result.decode)
    # the context points were served from its prefix cache, the fresh ones were not
    assert {p.server_cached_tokens for p in result.prefill if p.cached_tokens} == {64}
    assert {p.server_cached_tokens for p in result.prefill if not p.cached_tokens} == {0}
    assert result.server == {"prefix_cache_reset": True} and result.url == f"127.0.0.1:{srv.port}"
    assert result.model == "fake" and result.plan.seed == 7


def test_the_file_loads_into_engine_sim_and_holds_no_secret(fake, tmp_path):
    from kvbench.backends.enginesim import EngineSimBackend, _calibration

    srv = fake(itl_ms=5)
    result = C.measure(srv.url, SMALL, api_key="sk-very-secret")
    path = C.write(tmp_path / "calib.toml", result, C.fit(result), "kvbench calibrate --url …")
    text = path.read_text()
    assert "sk-very-secret" not in text and "http://" not in text
    data = tomllib.loads(text)
    assert set(data["calibration"]) == {"prefill_tokens_per_s", "decode_step_base_s", "decode_s_per_kv_token"}
    assert isinstance(_calibration(str(path)), Calibration)
    m = data["measurements"]
    assert m["url"] == f"127.0.0.1:{srv.port}" and len(m["prefill"]) == 4 and len(m["decode"]) == 2
    assert {"decode_line", "prefill_physical", "prefill_rate", "prefill_line"} <= set(m["fits"])
    assert "r2" in m["fits"]["decode_line"] and "request_overhead_s" in m["proposed"]
    assert "--calibration" in text.split("[calibration]")[0]  # the header says how to use it
    backend = EngineSimBackend(hardware="cpu", model="kvbench-tiny", calibration=str(path))
    assert backend.latency.calibration.decode_step_base_s == pytest.approx(data["calibration"]["decode_step_base_s"])


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


def test_cli_writes_the_file_and_says_what_next(fake, tmp_path):
    srv = fake(itl_ms=2)
    out = tmp_path / "c.toml"
    args = ["calibrate", "--url", srv.url, "-o", str(out), "--repeats", "1", "--prompt-lengths", "16,64,256"]
    args += ["--context-lengths", "64", "--context-new-tokens", "32", "--batch-sizes", "1,2", "--decode-contexts", "32"]
    args += ["--decode-tokens", "16", "--api-key-env", "KVB_TEST_KEY"]
    res = CliRunner().invoke(main, args, env={"KVB_TEST_KEY": "sk-do-not-store"})
    assert res.exit_code == 0, res.output
    assert "--calibration" in res.output and "wrote" in res.output
    assert "sk-do-not-store" not in out.read_text()
    cal = tomllib.loads(out.read_text())["calibration"]
    assert all(math.isfinite(v) and v >= 0 for v in cal.values())


def test_cli_keeps_credentials_in_the_url_out_of_the_file(fake, tmp_path, monkeypatch):
    srv = fake(itl_ms=2)
    secret_url = srv.url.replace("http://", "http://user:hunter2@")
    out = tmp_path / "c.toml"
    args = ["calibrate", "--url", secret_url, "-o", str(out), "--repeats", "1", "--prompt-lengths", "16,64"]
    args += ["--context-lengths", "64", "--context-new-tokens", "32", "--batch-sizes", "1,2", "--decode-contexts", "32"]
    args += ["--decode-tokens", "16"]
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


def test_help_gives_units():
    res = CliRunner().invoke(main, ["calibrate", "--help"])
    assert res.exit_code == 0
    for word in ("tokens", "seconds", "sequences", "--calibration"):
        assert word in res.output
