"""Prompts checked against the engine's context before anything is sent, the same cut for a prediction, the
output cap applied to every backend, what engines publish of their settings, and the warnings `kvbench compare`
gives when a prediction was made with other settings (docs/fidelity.md, Engine settings; docs/semantics.md, Prompts
longer than the context)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvbench.errors import KvbenchError
from kvbench.live.engine_settings import from_llama, from_vllm, vllm_cache_config
from kvbench.run.like import options_like
from kvbench.run.limits import RequestLimits
from kvbench.run.runner import run_replay
from kvbench.run.settingcheck import warnings
from kvbench.trace.context import ContextOverflow, fit_to_context
from kvbench.trace.files import new_meta, read_trace, write_trace

from ...conftest import CHAT
from .conftest import fake_server  # noqa: F401  (the fixture)

CONTEXT = 2048


@pytest.fixture(scope="module")
def chat():
    table, meta = read_trace(CHAT)
    return table.slice(0, 60), meta.block_size


def test_refused_before_anything_is_sent(fake_server, tmp_path):  # noqa: F811
    srv = fake_server(max_model_len=CONTEXT)
    opts = {"url": srv.url, "mode": "rate", "rate": 1000.0, "max_requests": 60}
    with pytest.raises(ContextOverflow) as err:
        run_replay(CHAT, "openai", opts, out=tmp_path / "r", report=False, limits=RequestLimits(max_output_tokens=4))
    table, _ = read_trace(CHAT)
    sent = table.slice(0, 60)
    over = sent.column("input_tokens").to_numpy() + 4 > CONTEXT
    message = str(err.value)
    assert f"{int(over.sum())} of 60 requests" in message and f"{CONTEXT}-token context" in message
    assert f"longest prompt has {int(sent.column('input_tokens').to_numpy()[over].max())} tokens" in message
    assert "--fit-context truncate" in message and "published by vllm" in message
    assert srv.server.received == 0 and not (tmp_path / "r").exists()  # nothing sent, no run directory


@pytest.mark.parametrize("mode", ["truncate", "skip"])
def test_live_and_prediction_cut_alike(fake_server, chat, tmp_path, mode):  # noqa: F811
    srv = fake_server(max_model_len=CONTEXT)
    table, bs = chat
    trace = write_trace(table, tmp_path / "chat60.parquet", new_meta(bs, {"test": "first 60 of the chat sample"}))
    limits = RequestLimits(max_output_tokens=4, fit_context=mode)
    opts = {"url": srv.url, "mode": "rate", "rate": 1000.0, "max_concurrency": 1}
    live, summary = run_replay(trace, "openai", opts, out=tmp_path / "live", report=False, limits=limits)
    assert summary["limits"]["context_tokens"] == CONTEXT and summary["limits"]["over"] > 0
    assert summary["engine_settings"] == {"engine": "vllm", "context_tokens": CONTEXT}
    rows = pq.read_table(live / "requests.parquet")
    assert set(rows.column("status").to_pylist()) == {"ok"}  # every request sent fit
    assert max(rows.column("input_tokens").to_pylist()) + 4 <= CONTEXT
    # the prediction, told the same context, replays the same requests
    sim_limits = RequestLimits(max_output_tokens=4, context=CONTEXT, fit_context=mode)
    sim_opts = {"policy": "vllm", "capacity": str(10**8), "bound": False}
    pred, psum = run_replay(trace, "sim", sim_opts, out=tmp_path / "sim", report=False, limits=sim_limits)
    sim_rows = pq.read_table(pred / "requests.parquet")
    n = rows.num_rows
    assert psum["limits"]["over"] == summary["limits"]["over"]
    assert psum["trace"]["fingerprint"] == summary["trace"]["fingerprint"]  # the same requests, cut alike
    assert sim_rows.column("request_id").to_pylist() == rows.column("request_id").to_pylist()
    assert sim_rows.column("input_tokens").to_pylist() == rows.column("input_tokens").to_pylist()
    if mode == "skip":
        assert n == 60 - summary["limits"]["skipped"]


def test_truncate_keeps_leading_whole_blocks_and_skip_clears_references(chat):
    table, bs = chat
    cut, record = fit_to_context(table, CONTEXT, bs, "truncate", "chat", "--context")
    tokens, out = cut.column("input_tokens").to_numpy(), np.maximum(cut.column("output_tokens").to_numpy(), 1)
    long = table.column("input_tokens").to_numpy() + np.maximum(table.column("output_tokens").to_numpy(), 1) > CONTEXT
    assert record["cut"] == int(long.sum()) > 0 and (tokens + out <= CONTEXT).all()
    before, after = table.column("block_hashes").to_pylist(), cut.column("block_hashes").to_pylist()
    for b, a, t, was_long in zip(before, after, tokens, long):
        assert a == (b[: t // bs] if was_long else b) and (not was_long or t % bs == 0)
    kept, record = fit_to_context(table, CONTEXT, bs, "skip", "chat", "--context")
    ids = set(kept.column("request_id").to_pylist())
    assert kept.num_rows == table.num_rows - int(long.sum()) == table.num_rows - record["skipped"]
    assert all(p is None or p in ids for p in kept.column("parent_id").to_pylist())


def test_output_cap_reaches_the_prediction(chat, tmp_path):
    capped = {"policy": "llama-slot", "capacity": "128", "bound": False}
    cap = RequestLimits(max_output_tokens=4)
    _, one = run_replay(CHAT, "sim", capped, out=tmp_path / "a", report=False, limits=cap)
    _, full = run_replay(CHAT, "sim", capped, out=tmp_path / "b", report=False)
    # a slot keeps the tokens it generated: 4 of them or the trace's hundreds change which slot a prompt takes
    assert one["limits"]["max_output_tokens"] == 4
    assert one["points"][0]["hit_tokens"] != full["points"][0]["hit_tokens"]


def test_engine_settings_as_published():
    metrics = (
        '# HELP vllm:cache_config_info x\nvllm:cache_config_info{block_size="32",cache_dtype="auto",'
        'enable_prefix_caching="True",num_gpu_blocks="1234"} 1.0\n'
    )
    assert vllm_cache_config(metrics)["num_gpu_blocks"] == 1234
    got = from_vllm({"data": [{"id": "m", "max_model_len": 8192}]}, metrics)
    assert got == {"engine": "vllm", "context_tokens": 8192, "block_size": 32, "num_gpu_blocks": 1234,
                   "prefix_caching": True}  # fmt: skip
    # llama-server shows 4 slots of one n_ctx whether they share it (its default) or split it (--parallel 4):
    # the arguments kvbench started it with say which; a server of unknown arguments is taken as the default
    props = {"total_slots": 4, "default_generation_settings": {"n_ctx": 2048}}
    slots = [{"id": i, "n_ctx": 2048} for i in range(4)]
    unknown, unified = from_llama(props, slots), from_llama(props, slots, "")
    split = from_llama(props, slots, "--parallel 4 --cache-reuse 256")
    assert unknown["unified_kv"] is None and unknown["cache_reuse"] is None and unknown["total_context_tokens"] == 2048
    assert unified["unified_kv"] is True and unified["cache_reuse"] == 0 and unified["context_tokens"] == 2048
    assert split["unified_kv"] is False and split["total_context_tokens"] == 8192 and split["cache_reuse"] == 256
    # --like: llama-server's default is no --slots; a split context names them; what the user gave wins
    assert options_like(unified, 16, {}) == {"policy": "llama-slot", "capacity": "128", "vocab": 4096}
    assert options_like(split, 16, {"capacity": "100", "vocab": 1000}) == {
        "policy": "llama-slot", "slots": 4, "cache_reuse": 256,
    }  # fmt: skip
    assert options_like(got, 32, {}) == {"policy": "vllm", "capacity": "1234"}
    assert options_like(got, 32, {}, "engine-sim") == {"policy": "vllm", "hbm_capacity": "1234"}
    with pytest.raises(KvbenchError, match="engine-sim models vLLM"):
        options_like(unified, 16, {}, "engine-sim")
    with pytest.raises(KvbenchError, match="trace rebase TRACE --block-size 32"):
        options_like(got, 16, {})


def test_compare_names_settings_that_differ():
    live = {"_label": "live", "limits": {"max_output_tokens": 4, "over": 0}, "trace": {"block_size": 16},
            "engine_settings": {"engine": "llama.cpp", "slots": 4, "unified_kv": True, "total_context_tokens": 8192}}
    pred = {"_label": "pred", "limits": {"max_output_tokens": None, "over": 0}, "trace": {"block_size": 16},
            "config": {"policy_options": {"slots": 4}},
            "points": [{"policy": "llama-slot", "name": "llama-slot/512blocks", "capacity_blocks": 512}]}  # fmt: skip
    said = warnings([live, pred])
    assert "max_output_tokens: live 4, pred None" in said
    assert any(w.startswith("llama.cpp slots: live 4 sharing one context, pred 4") for w in said)
    assert not any("context (tokens)" in w for w in said)  # 512 blocks of 16 is the engine's 8192
    pred["limits"]["max_output_tokens"], pred["config"]["policy_options"] = 4, {}
    assert warnings([live, pred]) == []
