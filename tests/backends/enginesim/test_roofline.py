"""The roofline latency model (backends/enginesim/roofline.py) and the specs it reads (kvbench/models/hardware.py):
published numbers in, latencies that scale the way the two bounds say."""

import dataclasses
from pathlib import Path

import pytest
from kvbench.backends.enginesim.roofline import Calibration, LatencyModel

from kvbench.errors import KvbenchError
from kvbench.models import HARDWARE, MODELS, ModelGeometry, load_specs, resolve_hardware, resolve_model

LLAMA8 = MODELS["llama3-8b"]
# The datasheet roofline: the h100 preset without its measured kernel terms (test_operators.py tests those)
H100 = dataclasses.replace(HARDWARE["h100"], gemm_mfu=0.0)
H200 = dataclasses.replace(HARDWARE["h200"], gemm_mfu=0.0)


def test_kv_bytes_per_token_of_llama3_8b_and_fp8_halves_it():
    assert LatencyModel(LLAMA8, H100).kv_bytes_per_token == 131072  # 32 layers × 8 heads × 128 × (K, V) × 2 B
    assert LatencyModel(LLAMA8, H100, kv_dtype="fp8").kv_bytes_per_token == 65536


def test_weight_bytes_follow_the_parameter_count():
    assert LatencyModel(LLAMA8, H100).weight_bytes == 2 * 8_030_261_248
    assert LatencyModel(LLAMA8, H100, weight_dtype="fp8").weight_bytes == 8_030_261_248


def test_llama3_8b_decode_at_batch_1_on_h100_reads_the_weights_once():
    # 16.06 GB of bf16 weights through 3.35 TB/s × mbu 0.8 ≈ 6.0 ms
    step = LatencyModel(LLAMA8, H100).decode_step_s(1, 0)
    assert 5e-3 < step < 7e-3
    assert step == pytest.approx(16.06e9 / (3.35e12 * 0.8), rel=1e-3)


def test_prefill_time_scales_with_uncached_tokens_when_compute_bound():
    lm = LatencyModel(LLAMA8, H100)
    cost = lm.step_cost([(2048, 0)], [])
    assert cost.compute_s > cost.memory_s  # the regime the scaling claim is about
    ratio = lm.prefill_s(4096, 0) / lm.prefill_s(2048, 0)
    assert 1.95 < ratio < 2.15  # linear in tokens, plus a little quadratic attention
    # a cached prefix is not recomputed: 1024 new tokens after 3072 cached cost about a quarter of 4096 new
    hit = lm.prefill_s(1024, 3072)
    assert 0.24 < hit / lm.prefill_s(4096, 0) < 0.35
    assert lm.prefill_s(0, 3072) == 0.0


def test_decode_step_grows_with_the_batch_kv():
    lm = LatencyModel(LLAMA8, H100)
    steps = [lm.decode_step_s(32, 32 * ctx) for ctx in (0, 1000, 4000, 16000)]
    assert steps == sorted(steps) and steps[-1] > 2 * steps[0]
    # each cached token read costs its KV bytes through HBM
    per_token = (steps[2] - steps[1]) / (32 * 3000)
    assert per_token == pytest.approx(131072 / (3.35e12 * 0.8), rel=1e-6)


def test_doubling_hbm_bandwidth_halves_a_memory_bound_decode_step():
    fast = dataclasses.replace(H100, hbm_bw=2 * H100.hbm_bw)
    slow_step = LatencyModel(LLAMA8, H100).step_cost([], [2000] * 16)
    fast_step = LatencyModel(LLAMA8, fast).step_cost([], [2000] * 16)
    assert fast_step.memory_s > fast_step.compute_s
    assert fast_step.total == pytest.approx(slow_step.total / 2, rel=1e-9)


def test_a_mixed_step_costs_at_least_its_parts_and_reads_weights_once():
    lm = LatencyModel(LLAMA8, H100)
    mixed = lm.step_s([(512, 1024)], [3000] * 8)
    assert mixed >= max(lm.prefill_s(512, 1024), lm.decode_step_s(8, 24000))
    assert mixed < lm.prefill_s(512, 1024) + lm.decode_step_s(8, 24000)
    assert lm.step_s([], []) == 0.0
    assert lm.decode_step_s(8, 24000) == pytest.approx(lm.step_s([], [3000] * 8))


def test_moe_decode_reads_active_weights_alone_and_nearly_all_in_a_large_batch():
    ds = MODELS["deepseek-v3"]
    assert (ds.params, ds.active_params) == (671_000_000_000, 37_000_000_000)
    lm = LatencyModel(ds, HARDWARE["h200"], weight_dtype="fp8", tp=8)
    alone = lm.step_cost([], [0]).memory_s
    assert alone == pytest.approx(37e9 / 8 / (4.8e12 * 0.8), rel=0.01)
    batch = lm.step_cost([], [0] * 512).memory_s
    assert batch == pytest.approx(671e9 / 8 / (4.8e12 * 0.8), rel=0.01)  # (1 − 37/671)^512 ≈ 0: every expert


def test_tensor_parallelism_splits_the_work_and_adds_all_reduces():
    m70 = MODELS["llama3-70b"]
    one, four = LatencyModel(m70, H200), LatencyModel(m70, H200, tp=4)
    c1, c4 = one.step_cost([], [1000] * 32), four.step_cost([], [1000] * 32)
    assert c4.memory_s == pytest.approx(c1.memory_s / 4)
    assert c1.comm_s == 0 < c4.comm_s < c4.memory_s
    with pytest.raises(KvbenchError, match="no room"):
        LatencyModel(MODELS["llama3-405b"], H100).kv_capacity_tokens()
    assert LatencyModel(LLAMA8, H100).kv_capacity_tokens() == int((80e9 * 0.9 - 2 * 8_030_261_248) / 131072)


def test_a_calibration_replaces_the_roofline_with_a_sum_of_its_terms():
    cal = Calibration(
        request_overhead_s=0.02,
        step_overhead_s=0.005,
        s_per_seq=1e-4,
        s_per_token=2e-5,
        s_per_pair=1e-8,
        s_per_kv_token=1e-7,
    )
    lm = LatencyModel(MODELS["kvbench-tiny"], HARDWARE["cpu"], calibration=cal)
    # decode of 4 sequences holding 1000 tokens each: 4 seqs, 4 tokens, 4 × 1001 pairs, 4000 KV tokens read
    # 0.005 + 4e-4 + 8e-5 + 4.004e-5 + 4e-4 = 0.00592004
    assert lm.decode_step_s(4, 4000) == pytest.approx(0.00592004, rel=1e-12)
    assert lm.step_s([], [1000] * 4) == pytest.approx(0.00592004, rel=1e-12)
    # prefill of 100 new tokens after 50 cached: 1 seq, 100 tokens, 100·50 + 100·101/2 = 10,050 pairs, 50 read
    # 0.005 + 1e-4 + 2e-3 + 1.005e-4 + 5e-6 = 0.0072055
    assert lm.prefill_s(100, 50) == pytest.approx(0.0072055, rel=1e-12)
    # both in one step: one step overhead, 5 seqs, 104 tokens, 10,050 + 4004 pairs, 4050 read
    # 0.005 + 5e-4 + 2.08e-3 + 1.4054e-4 + 4.05e-4 = 0.00812554
    assert lm.step_s([(100, 50)], [1000] * 4) == pytest.approx(0.00812554, rel=1e-12)
    assert lm.step_s([], []) == 0.0  # no work, no step
    assert lm.request_overhead_s == 0.02 and LatencyModel(LLAMA8, H100).request_overhead_s == 0.0
    with pytest.raises(KvbenchError, match="calib.toml: unknown calibration key 'slope'"):
        Calibration.from_mapping({"slope": 1.0}, "calib.toml")
    with pytest.raises(KvbenchError, match="calib.toml: calibration: s_per_pair must be a finite number ≥ 0"):
        Calibration.from_mapping({"s_per_pair": -1e-9}, "calib.toml")


def _tiny_llama_config() -> tuple[dict, int]:
    """The LlamaConfig keywords kvbench/engines/_tiny_llama.py writes the model with, and its default vocab,
    read from its source (running it needs transformers and torch, which the vLLM engine's venv has)."""
    import ast

    import kvbench.engines._tiny_llama as tiny_llama

    tree = ast.parse(Path(tiny_llama.__file__).read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "LlamaConfig"]
    (config,) = calls
    kwargs = {k.arg: k.value.value for k in config.keywords if isinstance(k.value, ast.Constant)}  # not the args
    (vocab,) = [
        ast.literal_eval(next(k.value for k in n.keywords if k.arg == "default"))
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "add_argument" and n.args[0].value == "--vocab"
    ]
    return kwargs, vocab


def test_tiny_model_matches_the_vllm_cpu_engine():
    """MODELS["kvbench-tiny"] describes the model _tiny_llama.py writes for the vLLM CPU engine."""
    cfg, vocab = _tiny_llama_config()
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    h, layers, heads, kv_heads = (cfg[k] for k in keys)
    head_dim = h // heads
    tiny = MODELS["kvbench-tiny"]
    assert (tiny.hidden, tiny.layers, tiny.heads, tiny.kv_heads) == (h, layers, heads, kv_heads)
    assert tiny.head_dim == head_dim
    # a Llama's parameters: embedding and (untied) LM head, per layer q/o (h × h), k/v (h × kv_heads·head_dim),
    # gate/up/down (3 × h × intermediate) and two RMSNorms (h each), and a final RMSNorm
    assert cfg["tie_word_embeddings"] is False
    per_layer = 2 * h * h + 2 * h * kv_heads * head_dim + 3 * h * cfg["intermediate_size"] + 2 * h
    assert tiny.params == 2 * vocab * h + layers * per_layer + h
    assert tiny.kv_bytes_per_token("bf16") == layers * kv_heads * head_dim * 2 * 2  # (K, V) × 2 B


def test_every_model_has_what_the_roofline_needs():
    for m in MODELS.values():
        assert 0 < m.active_params <= m.params and m.heads and m.hidden, m.name
        LatencyModel(m, HARDWARE["b200"], weight_dtype="fp8", tp=8).decode_step_s(8, 8000)


def test_toml_overrides_a_preset_and_adds_entries(tmp_path):
    path = tmp_path / "specs.toml"
    path.write_text(
        "[hardware.h100]\nhbm_bw = 2.0e12\n\n"
        "[hardware.mi300x]\nhbm_bytes = 192e9\nhbm_bw = 5.3e12\nflops = 1307e12\npcie_bw = 64e9\n\n"
        "[model.llama3-8b]\nparams = 9000000000\n"
    )
    specs = load_specs(path)
    h100 = resolve_hardware("h100", specs)
    assert h100.hbm_bw == 2.0e12 and h100.flops == H100.flops and h100.hbm_bytes == H100.hbm_bytes
    assert resolve_hardware("mi300x", path).nvlink_bw == 0.0
    assert resolve_model("llama3-8b", specs).active_params == 9_000_000_000  # dense: follows params
    assert HARDWARE["h100"].hbm_bw == 3.35e12  # the presets themselves are untouched
    with pytest.raises(KvbenchError, match="no hardware given.*h100"):
        resolve_hardware(None, specs)  # two tables in the file: which one is meant is unclear


def test_toml_unknown_key_names_the_file_and_the_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[hardware.h100]\nhbm_bandwidth = 2e12\n")
    with pytest.raises(KvbenchError, match=r"bad\.toml.*hbm_bandwidth"):
        load_specs(path)
    path.write_text("[model.new-7b]\nlayers = 32\n")
    with pytest.raises(KvbenchError, match=r"bad\.toml.*new-7b.*needs kv_heads, head_dim"):
        load_specs(path)
    path.write_text("[gpu.h100]\nhbm_bw = 1\n")
    with pytest.raises(KvbenchError, match=r"bad\.toml.*unknown table \[gpu\]"):
        load_specs(path)


def test_resolving_an_unknown_name_lists_the_choices(tmp_path):
    with pytest.raises(KvbenchError, match="unknown hardware 'h300'.*h100, h200, b200, a100, l40s, cpu"):
        resolve_hardware("h300")
    with pytest.raises(KvbenchError, match="unknown model 'gpt-5'.*llama3-8b.*kvbench-tiny"):
        resolve_model("gpt-5")
    assert resolve_hardware("H100") is HARDWARE["h100"]
    path = tmp_path / "one.toml"
    path.write_text("[model.tiny2]\nlayers = 2\nkv_heads = 2\nhead_dim = 32\nparams = 1e6\nheads = 4\nhidden = 128\n")
    assert resolve_model(None, path).name == "tiny2"  # a file that describes one model needs no name


def test_a_model_without_parameter_counts_is_refused_for_latency():
    bare = ModelGeometry("bare", layers=2, kv_heads=2, head_dim=32)
    with pytest.raises(KvbenchError, match="lacks params, heads"):
        LatencyModel(bare, H100)
