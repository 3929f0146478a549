"""Multi-device instances in engine-sim (backends/enginesim/parallel.py, parallel_model.py, docs/parallelism.md):
memory per device against arithmetic from each model's published config, the time model's terms against their
formulas, a published vLLM figure for Llama-3-70B on 4 × H100, every refusal, and a one-device run unchanged."""

from __future__ import annotations

import dataclasses
import math

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from kvbench.backends.enginesim import EngineSimBackend
from kvbench.backends.enginesim.parallel_model import ParallelLatencyModel, all_reduce_s
from kvbench.backends.enginesim.roofline import LatencyModel

from kvbench.cli import main
from kvbench.errors import KvbenchError
from kvbench.models import DEPLOYMENTS, HARDWARE, MODELS
from kvbench.run.runner import run_replay

GB = 1e9
UTIL = 0.9  # --gpu-memory-utilization's default


# --- hand arithmetic from the published config.json of each model -------------------------------------------
def llama_params(vocab, hidden, inter, layers, heads, kv_heads, head_dim):
    """A Llama: embedding and untied LM head; per layer Q and O (hidden × heads·head_dim), K and V
    (hidden × kv_heads·head_dim), gate/up/down (3 × hidden × inter), two RMSNorms; the final RMSNorm."""
    attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    return 2 * vocab * hidden + layers * (attn + 3 * hidden * inter + 2 * hidden) + hidden


# meta-llama/Meta-Llama-3-70B: vocab 128256, hidden 8192, intermediate 28672, 80 layers, 64 heads, 8 KV heads
LLAMA70 = dict(vocab=128256, hidden=8192, inter=28672, layers=80, heads=64, kv_heads=8, head_dim=128)
# meta-llama/Llama-3.1-405B: vocab 128256, hidden 16384, intermediate 53248, 126 layers, 128 heads, 8 KV heads
LLAMA405 = dict(vocab=128256, hidden=16384, inter=53248, layers=126, heads=128, kv_heads=8, head_dim=128)


def llama_per_device(cfg, hbm, tp, pp, weight_bytes):
    """(weight bytes per device, KV bytes per token per device, KV tokens per instance) of a Llama on tp × pp
    devices: weights split evenly; each device keeps its stage's layers (pp divides the layers here) and
    kv_heads / tp KV heads (at least one: a head is copied when tp > kv_heads)."""
    weights = llama_params(**cfg) * weight_bytes / (tp * pp)
    heads_here = max(1, cfg["kv_heads"] // tp)
    kv = (cfg["layers"] // pp) * 2 * heads_here * cfg["head_dim"] * 2  # K and V, bf16
    return weights, kv, int((hbm * UTIL - weights) / kv)


# deepseek-ai/DeepSeek-V3 config.json and card: 671B parameters; 61 layers, the first 3 dense; 256 routed
# experts of intermediate 2048 over hidden 7168; MLA caches kv_lora_rank 512 + rope 64 = 576 values per layer
def deepseek_per_device(hbm, tp, dp, weight_bytes):
    hidden, inter = 7168, 2048
    experts = 58 * 256 * 3 * hidden * inter
    q = hidden * 1536 + 1536 + 1536 * 128 * (128 + 64)  # q_a, its norm, q_b (nope 128 + rope 64 per head)
    kv = hidden * (512 + 64) + 512 + 512 * 128 * (128 + 128)  # kv_a (latent + rope key), its norm, kv_b (K, V)
    attention = 61 * (q + kv + 128 * 128 * hidden)  # + o_proj
    rest = 671_000_000_000 - experts - attention
    weights = (attention / (tp // dp) + (experts + rest) / tp) * weight_bytes
    kv_token = 61 * 576 * 2  # bf16 latent, whole on every attention rank
    return weights, kv_token, int(dp * (hbm * UTIL - weights) / kv_token)


HAND = {
    "llama3-70b-4xh100": lambda: llama_per_device(LLAMA70, 80 * GB, 4, 1, 2),
    "llama3-70b-8xh100": lambda: llama_per_device(LLAMA70, 80 * GB, 8, 1, 2),
    "llama3-70b-2xh200": lambda: llama_per_device(LLAMA70, 141 * GB, 2, 1, 2),
    "llama3-405b-8xh100-fp8": lambda: llama_per_device(LLAMA405, 80 * GB, 8, 1, 1),
    "llama3-405b-2x8xh100": lambda: llama_per_device(LLAMA405, 80 * GB, 8, 2, 2),
    "deepseek-v3-8xh200": lambda: deepseek_per_device(141 * GB, 8, 8, 1),
    "deepseek-v3-2x8xh200": lambda: deepseek_per_device(141 * GB, 16, 16, 1),
    "deepseek-v3-8xb200": lambda: deepseek_per_device(180 * GB, 8, 8, 1),
}


def test_every_preset_has_its_hand_computation():
    assert set(HAND) == set(DEPLOYMENTS)


@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_memory_per_device_of_each_preset_equals_the_hand_computation(name):
    lat = EngineSimBackend(deployment=name).latency
    weights, kv_token, tokens = HAND[name]()
    assert isinstance(lat, ParallelLatencyModel)
    assert lat.weight_bytes_per_device == pytest.approx(weights, rel=1e-9)
    assert lat.kv_bytes_per_token_per_device == pytest.approx(kv_token, rel=1e-12)
    assert abs(lat.kv_capacity_tokens(UTIL) - tokens) <= 1  # (rounding of the last token)
    assert lat.weight_bytes_per_device + lat.kv_bytes_per_token_per_device * tokens / lat.dp_attention <= (
        lat.hw.hbm_bytes * UTIL + kv_token
    )


def test_the_llama_param_counts_of_the_presets_match_the_config_arithmetic():
    assert MODELS["llama3-70b"].params == llama_params(**LLAMA70)
    assert MODELS["llama3-405b"].params == llama_params(**LLAMA405)


def test_mla_latent_is_copied_on_every_tp_rank_unless_attention_is_data_parallel():
    ds, h200 = MODELS["deepseek-v3"], HARDWARE["h200"]
    copied = ParallelLatencyModel(ds, h200, weight_dtype="fp8", tp=16, ep=16)
    sharded = ParallelLatencyModel(ds, h200, weight_dtype="fp8", tp=16, ep=16, dp_attention=16)
    assert copied.kv_bytes_per_token_per_device == sharded.kv_bytes_per_token_per_device == 61 * 576 * 2
    # the DP copy holds its requests only: 16 groups' worth of tokens, less the 15 extra attention-weight copies
    extra_attention = 61 * 187_107_328 * (1 - 1 / 16)
    assert sharded.weight_bytes_per_device - copied.weight_bytes_per_device == pytest.approx(extra_attention)
    free = h200.hbm_bytes * UTIL - sharded.weight_bytes_per_device
    assert sharded.kv_capacity_tokens() == int(16 * free / (61 * 576 * 2))
    assert sharded.kv_capacity_tokens() > 10 * copied.kv_capacity_tokens()


# --- time model ---------------------------------------------------------------------------------------------
def test_a_tp2_decode_step_adds_two_ring_all_reduces_per_layer():
    m, h100 = MODELS["llama3-8b"], dataclasses.replace(HARDWARE["h100"], gemm_mfu=0.0)  # the datasheet roofline
    lat = ParallelLatencyModel(m, h100, tp=2)
    cost = lat.step_cost([], [500] * 10)
    payload = 10 * 4096 * 2  # 10 tokens × hidden × bf16
    one = 2 * (2 - 1) * h100.link_latency_s + 2 * (2 - 1) / 2 * payload / h100.nvlink_bw
    assert all_reduce_s(2, payload, h100.nvlink_bw, h100.link_latency_s) == pytest.approx(one)
    assert cost.comm_s == pytest.approx(32 * 2 * one)  # after attention and after the MLP, 32 layers
    single = LatencyModel(m, h100).step_cost([], [500] * 10)
    assert cost.memory_s == pytest.approx(single.memory_s / 2)  # weights and KV heads halve per device


def test_a_tp_group_wider_than_a_server_runs_its_collectives_over_the_network():
    m, h100 = MODELS["llama3-405b"], HARDWARE["h100"]
    within, across = ParallelLatencyModel(m, h100, tp=8), ParallelLatencyModel(m, h100, tp=16)
    payload = 64 * 16384 * 2
    assert across.step_cost([], [100] * 64).comm_s == pytest.approx(
        126 * 2 * all_reduce_s(16, payload, h100.net_bw, h100.net_latency_s)
    )
    assert across.step_cost([], [100] * 64).comm_s > 5 * within.step_cost([], [100] * 64).comm_s


def test_pipeline_step_is_fill_then_one_bottleneck_stage_per_micro_batch():
    m, h100 = MODELS["llama3-70b"], HARDWARE["h100"]
    # 8 sequences in 4 micro-batches of 2; a micro-batch's send: 2 tokens' activations, a quarter per tp rank
    send = h100.link_latency_s + 2 * 8192 * 2 / 4 / h100.nvlink_bw
    # one micro-batch of 2 through both stages: 2 stages + 1 send, whence one stage's time
    stage = (ParallelLatencyModel(m, h100, tp=4, pp=2, micro_batches=1).step_s([], [1000] * 2) - send) / 2
    piped = ParallelLatencyModel(m, h100, tp=4, pp=2, micro_batches=4)
    assert piped.step_s([], [1000] * 8) == pytest.approx(2 * stage + send + 3 * max(stage, send))
    assert piped.bubble_share(8) == pytest.approx(1 / 5)  # (pp − 1)/(m + pp − 1)


def test_pipeline_sends_between_servers_use_the_network():
    m, h100 = MODELS["llama3-405b"], HARDWARE["h100"]
    lat = ParallelLatencyModel(m, h100, tp=8, pp=2)
    (send,) = lat._send_s(16)
    assert send == pytest.approx(h100.net_latency_s + 16 * 16384 * 2 / 8 / h100.net_bw)


def test_expert_imbalance_slows_only_expert_parallel_steps():
    ds, h200 = MODELS["deepseek-v3"], HARDWARE["h200"]
    kw = dict(weight_dtype="fp8", tp=8, ep=8, dp_attention=8)
    even = ParallelLatencyModel(ds, h200, **kw).step_s([(4096, 0)], [])
    hot = ParallelLatencyModel(ds, h200, expert_imbalance=1.5, **kw).step_s([(4096, 0)], [])
    assert hot > 1.2 * even
    no_ep = {**kw, "ep": 1}
    assert ParallelLatencyModel(ds, h200, expert_imbalance=1.5, **no_ep).step_s([(4096, 0)], []) == (
        ParallelLatencyModel(ds, h200, **no_ep).step_s([(4096, 0)], [])
    )


def test_kv_moves_per_device_share_over_each_devices_own_link():
    m, h100 = MODELS["llama3-70b"], HARDWARE["h100"]
    lat = ParallelLatencyModel(m, h100, tp=4, pp=2)
    assert lat.transfer_s(8e9, 25e9) == pytest.approx(8e9 / 8 / 25e9)  # 4 KV-head shards × 2 stages
    mla = ParallelLatencyModel(MODELS["deepseek-v3"], HARDWARE["h200"], weight_dtype="fp8", tp=8)
    assert mla.transfer_s(8e9, 25e9) == pytest.approx(8e9 / 25e9)  # every rank holds the whole latent


def test_at_one_device_the_parallel_model_is_the_one_device_roofline():
    for name in ("llama3-8b", "qwen3-32b"):
        one, par = LatencyModel(MODELS[name], HARDWARE["h100"]), ParallelLatencyModel(MODELS[name], HARDWARE["h100"])
        for prefills, decodes in (([(2048, 0)], []), ([], [1000] * 64), ([(512, 1024)], [3000] * 8)):
            a, b = one.step_cost(prefills, decodes), par.step_cost(prefills, decodes)
            assert b.total == pytest.approx(a.total, rel=1e-12)
            assert (b.compute_s, b.memory_s, b.comm_s) == pytest.approx((a.compute_s, a.memory_s, a.comm_s))
        assert par.kv_capacity_tokens() == one.kv_capacity_tokens()


# --- published figures (docs/gpu-truth.md; benchmarks/published_figures.py replays them whole) ---------------------
# LambdaLabsML/vllm-benchmark, benchmark_v0.md (github.com/LambdaLabsML/vllm-benchmark/blob/main/benchmark_v0.md):
# Llama 3.1 70B, tp=4 on H100-80GB-SXM, vLLM, rps=inf, 5000 prompts, max-num-seq 256, max-seq-len 2048: median
# TPOT 61.10 (v0.6.0, 10 scheduler steps) to 125.78 ms (v0.5.4). Those include the prefills the engine
# interleaves and its CPU time (the page shows scheduling alone moving TPOT from 103 to 61 ms on the same GPUs); a
# decode step's kernels have neither, so the step must come out below the smallest of them and not by more than 3×.
PUBLISHED_70B_TP4_MS = (61.10, 125.78)


@pytest.mark.parametrize("context", [1024, 2048])
def test_70b_tp4_h100_decode_step_against_the_published_vllm_figures(context):
    lat = EngineSimBackend(deployment="llama3-70b-4xh100").latency
    assert lat._ops is not None  # the kernel-by-kernel model: the h100's kernels were measured
    step_ms = lat.decode_step_s(256, 256 * context) * 1e3
    low, high = PUBLISHED_70B_TP4_MS
    assert low / 3 < step_ms < low < high


# vLLM's nightly performance benchmark, "Latency tests" (buildkite.com/vllm/performance-benchmark/builds/9515):
# latency_llama70B_tp4 on H200, 32 input and 128 output tokens, a fixed batch of 8: mean 2077.53 ms per batch.
VLLM_NIGHTLY_70B_TP4_H200_MS = 2077.53


def test_70b_tp4_h200_latency_benchmark_against_vllms_nightly_figure():
    """The same work step by step: one prefill of 8 × 32 tokens, then 127 decode steps of 8 sequences whose context
    grows by one token each. Target ±15 % (issue 34); the bounds are that target. The engine's CPU time per step,
    which the kernel model lacks, is a few percent at batch 8 (docs/gpu-truth.md: 0.93 of the figure)."""
    lat = EngineSimBackend(model="llama3-70b", hardware="h200", tp=4).latency
    total = lat.step_s([(32, 0)] * 8, [])
    total += sum(lat.decode_step_s(8, 8 * (32 + i)) for i in range(1, 128))
    assert 0.85 < total * 1e3 / VLLM_NIGHTLY_70B_TP4_H200_MS < 1.15
    # the datasheet roofline alone (no kernel floors, no measured collectives) was 0.64 of it
    roofline = ParallelLatencyModel(MODELS["llama3-70b"], dataclasses.replace(HARDWARE["h200"], gemm_mfu=0.0), tp=4)
    alone = roofline.step_s([(32, 0)] * 8, []) + sum(roofline.decode_step_s(8, 8 * (32 + i)) for i in range(1, 128))
    assert alone < 0.7 * total


# --- refusals -------------------------------------------------------------------------------------------------
def test_no_room_names_the_smallest_tp_pp_and_weight_dtype_that_fit():
    # 70.55e9 bf16 parameters = 141.1 GB > 0.9 × 141 GB; halves: 70.6 GB fit (tp 2, pp 2, or fp8 on one)
    with pytest.raises(KvbenchError) as e:
        EngineSimBackend(model="llama3-70b", hardware="h200").pool_blocks(16)
    text = str(e.value)
    assert "no room for KV on 1 × h200" in text and "--tp 2" in text and "--pp 2" in text
    assert "--weight-dtype fp8" in text and "--deployment llama3-70b-2xh200" in text


def test_deepseek_v3_on_one_b200_names_tp_16_or_pp_9():
    # 1342 GB of bf16: tp 8 leaves 167.75 GB per device > 162 usable, tp 16 fits; pp: ⌈61/pp⌉/61 × 1342 GB
    # ≤ 162 GB needs ⌈61/pp⌉ ≤ 7, first at pp 9
    assert 1342e9 / 8 > 180e9 * UTIL > 1342e9 / 16
    assert math.ceil(61 / 8) * 1342e9 / 61 > 162e9 > math.ceil(61 / 9) * 1342e9 / 61
    with pytest.raises(KvbenchError, match=r"--tp 16, or --pp 9.*--ep"):
        EngineSimBackend(model="deepseek-v3", hardware="b200").pool_blocks(16)


def test_a_pd_pool_that_does_not_fit_is_named_by_its_own_option(sample_head, tmp_path):
    opts = dict(model="llama3-70b", hardware="h100", instances=2, disagg="pd", tp=4, decode_tp=1)
    with pytest.raises(KvbenchError, match=r"--decode-tp 2"):
        run_replay(sample_head("chat", 20), "engine-sim", opts, out=tmp_path / "pd", report=False)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(model="llama3-70b", tp=3), r"--tp 3: llama3-70b has 64 attention heads.*1, 2, 4, 8"),
        (dict(model="llama3-70b", tp=4, pp=81), r"--pp 81: .* 80 layers"),
        (dict(model="llama3-70b", tp=4, ep=2), r"--ep 2: llama3-70b has no routed experts"),
        (dict(model="deepseek-v3", tp=8, ep=3), r"--ep 3 must divide --tp 8"),
        (dict(model="deepseek-v3", tp=8, dp_attention=16), r"--dp-attention 16 must divide --tp 8"),
        (dict(deployment="llama3-70b-4xh100", model="qwen3-8b"), r"--deployment llama3-70b-4xh100 .*drop --model"),
        (dict(model="llama3-70b", decode_tp=4), r"--decode-tp apply to the pools of --disagg pd"),
    ],
)
def test_each_refusal_names_its_option(kwargs, pattern):
    with pytest.raises(KvbenchError, match=pattern):
        EngineSimBackend(**kwargs)


def test_calibration_and_parallelism_are_refused_together(tmp_path):
    cal = tmp_path / "cal.toml"
    cal.write_text("[calibration]\nstep_overhead_s = 0.001\n")
    with pytest.raises(KvbenchError, match="--calibration .* --tp"):
        EngineSimBackend(model="llama3-70b", tp=4, calibration=str(cal))


def test_the_command_line_refusal_is_a_message_not_a_traceback(sample_head):
    result = CliRunner().invoke(
        main, ["replay", str(sample_head("chat", 20)), "--backend", "engine-sim", "--no-report",
               "--model", "llama3-70b", "--hardware", "h200"],
    )  # fmt: skip
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "--tp 2" in result.output


# --- one device: the run it was ---------------------------------------------------------------------------------
def test_a_one_device_run_equals_the_run_with_every_degree_1_given(sample_head, tmp_path):
    trace = sample_head("multi-tenant", 300)
    runs = {}
    for name, opts in (("default", {}), ("explicit", dict(tp=1, pp=1, ep=1, dp_attention=1, weight_dtype="bf16"))):
        run_dir, summary = run_replay(trace, "engine-sim", opts, out=tmp_path / name, report=False)
        runs[name] = (pq.read_table(run_dir / "requests.parquet"), summary["points"][0])
    (a, pa_), (b, pb) = runs["default"], runs["explicit"]
    assert a.equals(b)
    assert pa_["latency"] == pb["latency"] and pa_["engine"] == pb["engine"]
    assert type(EngineSimBackend(tp=1).latency) is LatencyModel  # the compiled loop's model, as before
    assert "deployment" not in pa_["engine"]  # no terminal line for one device
