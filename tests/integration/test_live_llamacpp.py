"""The live suite against llama.cpp's server (`kvbench engine up llama-cpp`), where its features allow.

llama.cpp keeps one token sequence per slot and reuses its longest common prefix token by token, not a block
pool: the `llama-slot` policy (with `--vocab`, the tokens kvbench sends) must predict every request's
cached_tokens exactly at concurrency 1. It ignores cache_salt, which the isolation audit must report.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from kvbench import engines
from kvbench.cli.demo_run import live_subset
from kvbench.live.audit import audit_isolation
from kvbench.run.limits import RequestLimits
from kvbench.run.runner import run_replay
from kvbench.trace import generators
from kvbench.trace.files import read_trace, write_trace
from kvbench.trace.schema import cap_outputs

from ..conftest import CHAT, SAMPLES, fresh_seeds
from .conftest import FRESH_KINDS, FRESH_REQUESTS, cached_mismatches, kvbench_cli

pytestmark = pytest.mark.engine

REQUESTS = 30  # per trace and server setting: each a fresh server, one request at a time
OUTPUT_TOKENS = 4  # generated tokens stay in the slot (and are unknown offline): a few are enough to test that


def test_prompts_and_cache_reporting(llama, tmp_path):
    opts = {
        "url": llama.url,
        "mode": "rate",
        "rate": 1000.0,
        "max_concurrency": 1,
        "max_requests": 20,
    }
    run_dir, summary = run_replay(
        CHAT, "openai", opts, out=tmp_path / "r", report=False, limits=RequestLimits(max_output_tokens=1)
    )
    rows = pq.read_table(run_dir / "requests.parquet")
    assert set(rows.column("status").to_pylist()) == {"ok"}, rows.column("error").to_pylist()
    assert rows.column("server_prompt_tokens").to_pylist() == rows.column("input_tokens").to_pylist()
    cached = rows.column("cached_tokens").to_pylist()
    assert all(c is not None for c in cached) and sum(cached) > 0  # consecutive turns share their prefix
    checks = summary["points"][0]["server_counters"].get("checks", {})
    if "cached_tokens" not in checks:
        pytest.skip("this llama.cpp build exports no prompt_tokens_cached counter on /metrics")
    assert checks["cached_tokens"]["server"] == sum(cached)


def test_audit_reports_that_salts_are_ignored(llama):
    result = audit_isolation(llama.url)
    assert result["passed"] is False and "salts are ignored" in result["verdict"], result
    assert "one llama-server per tenant" in result["verdict"]


@pytest.fixture(scope="module")
def restartable(llama):
    """The engine, restarted by the tests below with other --parallel settings; put back as it was after."""
    yield llama
    engines.down("llama-cpp")
    engines.up("llama-cpp", restart=True, **llama.settings)


def _fitted(kind: str, per_slot_ctx: int, out_dir) -> tuple:
    """The first REQUESTS requests of a sample, prompts cut to fit one slot's context, outputs capped."""
    table, meta = read_trace(SAMPLES / f"{kind}.parquet")
    sub, _ = live_subset(table, per_slot_ctx - OUTPUT_TOKENS - 8, REQUESTS, meta.block_size)
    sub = cap_outputs(sub, OUTPUT_TOKENS)
    return write_trace(sub, out_dir / f"{kind}.parquet", meta), meta.block_size


@pytest.mark.parametrize("slots", [1, 4, None], ids=["parallel-1", "parallel-4", "auto-unified"])
@pytest.mark.parametrize("kind", ["chat", "agent", "multi-tenant"])
def test_llama_slot_predicts_every_cached_token(restartable, tmp_path, kind, slots):
    """llama-slot's hit_tokens equal the server's cached_tokens request by request, for explicit --parallel 1
    and 4 (a context each of ctx/N) and for the default (4 slots sharing one unified context)."""
    ctx = int(restartable.settings.get("ctx_size") or 8192)
    args = "" if slots is None else f"--parallel {slots}"
    engines.down("llama-cpp")  # a fresh server: empty slots and prompt cache, as the prediction starts
    info = engines.up("llama-cpp", restart=True, ctx_size=ctx, engine_args=args)
    trace, bs = _fitted(kind, ctx if slots is None else ctx // slots, tmp_path)
    live_opts = {"url": info.url, "mode": "rate", "rate": 1000.0, "max_concurrency": 1}
    live, _ = run_replay(trace, "openai", live_opts, out=tmp_path / "live", report=False)
    sim_opts = {"policy": "llama-slot", "capacity": str(ctx // bs), "bound": False, "vocab": 4096}
    if slots is not None:
        sim_opts["slots"] = slots
    sim, _ = run_replay(trace, "sim", sim_opts, out=tmp_path / "sim", report=False)
    measured = pq.read_table(live / "requests.parquet")
    assert set(measured.column("status").to_pylist()) == {"ok"}, measured.column("error").to_pylist()
    got = measured.column("cached_tokens").to_pylist()
    want = pq.read_table(sim / "requests.parquet").column("hit_tokens").to_pylist()
    assert len(got) == REQUESTS and sum(got) > 0
    mismatched = [(i, w, g) for i, (w, g) in enumerate(zip(want, got)) if w != g]
    assert not mismatched, f"(request, predicted, measured): {mismatched}"


# --- exact on any seed, with the settings read from the engine ----------------------------------------------
# Fresh traces of every kind at 3 seeds drawn per run (printed: replay a failure with KVBENCH_TEST_SEEDS=a,b,c),
# each against a fresh server; the prediction is set up by `replay --like URL` from what the server publishes
# and the arguments `kvbench engine up` started it with (how slots share the context, --cache-reuse: not
# published), with the live run's own --max-output-tokens and --fit-context. Prompts that do not fit a slot are
# cut alike on both sides.
SEEDS = fresh_seeds()
print(f"test_live_llamacpp seeds: {','.join(map(str, SEEDS))}")
SETTINGS = {"default": "", "parallel-4": "--parallel 4", "cache-reuse-256": "--cache-reuse 256"}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_llama_slot_exact_on_fresh_seeds_from_the_engines_settings(restartable, tmp_path, setting):
    ctx = int(restartable.settings.get("ctx_size") or 8192)
    mismatched, total = {}, 0
    for kind in FRESH_KINDS:
        for seed in SEEDS:
            table, meta = generators.registry()[kind].run(FRESH_REQUESTS, seed=seed)
            trace = write_trace(table.slice(0, FRESH_REQUESTS), tmp_path / f"{kind}-{seed}.parquet", meta)
            engines.down("llama-cpp")
            info = engines.up("llama-cpp", restart=True, ctx_size=ctx, engine_args=SETTINGS[setting])
            common = ["--max-output-tokens", str(OUTPUT_TOKENS), "--fit-context", "truncate", "--no-report"]
            live = tmp_path / f"live-{kind}-{seed}"
            pace = ["--mode", "rate", "--rate", "1000", "--max-concurrency", "1"]
            kvbench_cli("replay", trace, "--backend", "openai", "--url", info.url, *pace, *common, "--out", live)
            pred = tmp_path / f"pred-{kind}-{seed}"
            kvbench_cli("replay", trace, "--like", info.url, "--no-bound", *common, "--out", pred)
            bad, n = cached_mismatches(live, pred)
            total += n
            if bad:
                mismatched[kind, seed] = bad
    assert not mismatched, f"seeds {SEEDS}, {setting}: (request, predicted, measured) {mismatched} of {total}"
