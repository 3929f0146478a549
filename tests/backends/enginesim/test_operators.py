"""The kernel-by-kernel step model (backends/enginesim/operators.py, docs/gpu-truth.md): each term against its
formula worked out by hand, where it applies, a fit on synthetic kernel times with known terms recovering them,
and the h100 preset against the measured H100 operator times (Vidur's profiling data, in the shared folder; the
test skips when it is absent). No timing of this machine is involved anywhere."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import numpy as np
import pytest
from kvbench.backends.enginesim.operators import OperatorModel, applies, mlp_width
from kvbench.backends.enginesim.roofline import LatencyModel

from kvbench.models import GEMM_TILES, HARDWARE, MODELS
from tests.conftest import REPO, SHARED

H100 = HARDWARE["h100"]
LLAMA8, LLAMA70 = MODELS["llama3-8b"], MODELS["llama3-70b"]
VIDUR = SHARED / "reference" / "vidur-h100"


def test_a_one_token_gemm_reads_its_weights_once_past_a_kernel_floor():
    ops = OperatorModel(LLAMA8, H100)
    n, k = ops.gemms["mlp_up"]
    assert (n, k) == (2 * 14336, 4096)
    weights = (1 * k + k * n + 1 * n) * 2 / (H100.hbm_bw * H100.gemm_mbu)
    assert ops.gemm_s(1, n, k) == pytest.approx(H100.gemm_floor_s + weights, rel=1e-12)


def test_compute_is_counted_in_whole_tiles_and_waves():
    ops = OperatorModel(LLAMA8, H100)
    n, k = 4096, 4096  # o_proj at TP 1
    # 4096 tokens: every tile shape divides both sides; the cheapest wastes nothing, one tile per SM per wave
    best = min(math.ceil((4096 // tm) * (4096 // tn) / H100.sms) * tm * tn for tm, tn in GEMM_TILES)
    assert ops.gemm_s(4096, n, k) == pytest.approx(
        H100.gemm_floor_s + best * 2 * k * H100.sms / (H100.flops * H100.gemm_mfu), rel=1e-12
    )
    # N = 132 tiles of 128 wide: at 1,024 tokens the 64 × 128 tiles fill 16 waves exactly; one token more needs a
    # 17th row of tiles and so a 17th wave: a step of 1/16, not a slope, and flat until the next multiple of 64
    n = 128 * H100.sms
    step = (ops.gemm_s(1025, n, k) - H100.gemm_floor_s) / (ops.gemm_s(1024, n, k) - H100.gemm_floor_s)
    assert step == pytest.approx(17 / 16, rel=1e-12)
    assert ops.gemm_s(1088, n, k) == ops.gemm_s(1025, n, k) < ops.gemm_s(1089, n, k)


def test_memory_bound_kernels_pay_a_floor_and_their_bytes_at_their_kinds_rate():
    ops = OperatorModel(LLAMA8, H100)
    layer = ops.layer_ops_s(1000)
    assert layer["add"] == pytest.approx(H100.eltwise_floor_s + 1000 * 3 * 4096 * 2 / (H100.hbm_bw * H100.add_mbu))
    assert layer["input_norm"] == layer["post_attention_norm"]
    assert layer["rope"] == pytest.approx(
        H100.eltwise_floor_s + 1000 * 2 * (32 + 8) * 128 * 2 / (H100.hbm_bw * H100.rope_mbu)
    )
    assert set(layer) == {"qkv_proj", "o_proj", "mlp_up", "mlp_down", "input_norm", "post_attention_norm", "rope",
                          "mlp_act", "add"}  # fmt: skip
    assert ops.linear_s(1000) == pytest.approx(32 * sum(layer.values()))
    assert ops.layer_ops_s(0) == dict.fromkeys(layer, 0.0)


def test_an_all_reduce_is_a_fixed_cost_ring_hops_and_its_bytes_at_the_bus_rate():
    for tp in (2, 4, 8):
        ops = OperatorModel(LLAMA70, H100, tp)
        fixed = H100.collective_latency_s + 2 * (tp - 1) * H100.link_latency_s
        assert ops.all_reduce_s(0) == pytest.approx(fixed)
        assert ops.all_reduce_s(1e6) - ops.all_reduce_s(0) == pytest.approx(1e6 * 2 * (tp - 1) / tp / H100.allreduce_bw)
        fixed_step, per_token = ops.comm_terms()  # two per layer, of hidden × bf16 per token
        assert fixed_step == pytest.approx(2 * 80 * fixed)
        assert per_token == pytest.approx(2 * 80 * 8192 * 2 * 2 * (tp - 1) / tp / H100.allreduce_bw)
    assert OperatorModel(LLAMA70, H100, 1).all_reduce_s(1e6) == 0.0


def test_a_step_sums_its_kernels_attention_and_all_reduces():
    lat = LatencyModel(LLAMA70, H100, tp=4)
    ops = lat._ops
    cost = lat.step_cost([(512, 0)], [1000] * 8)
    tokens, seqs = 512 + 8, 1 + 8
    pairs = 512 * 513 / 2 + 8 * 1001
    kv = (0 + 8000 + 512 + 8) * (LLAMA70.kv_bytes_per_token() / 4) / (H100.hbm_bw * lat.mbu)
    attn = max(pairs * 4 * 80 * 64 * 128 / 4 / (H100.flops * lat.mfu), kv)
    assert cost.compute_s == pytest.approx(
        ops.linear_s(tokens) + ops.lm_head_s(seqs) + 80 * H100.eltwise_floor_s + attn
    )
    assert cost.memory_s == 0.0
    fixed, per_token = ops.comm_terms()
    assert cost.comm_s == pytest.approx(fixed + tokens * per_token)
    assert ops.lm_head == (128256 // 4, 8192)  # logits over the vocabulary, split four ways


def test_the_kernel_model_applies_to_measured_dense_bf16_tp_inside_a_server():
    assert applies(LLAMA8, H100, "bf16", 1) and applies(LLAMA70, HARDWARE["h200"], "bf16", 8)
    assert not applies(LLAMA8, HARDWARE["a100"], "bf16", 1)  # no measured kernels: the datasheet roofline
    assert not applies(LLAMA8, H100, "fp8", 1)  # fp8 GEMMs were not measured
    assert not applies(MODELS["deepseek-v3"], H100, "bf16", 8)  # MoE and MLA run other kernels
    assert not applies(MODELS["llama3-405b"], H100, "bf16", 16)  # a TP group over the network
    assert LatencyModel(LLAMA8, HARDWARE["a100"])._ops is None
    # the MLP width: the config's, or what the parameter count leaves, which gives the config's back
    for m in (LLAMA8, LLAMA70, MODELS["mistral-7b"], MODELS["kvbench-tiny"]):
        assert mlp_width(dataclasses.replace(m, intermediate=0)) == m.intermediate


def _gpu_truth():
    spec = importlib.util.spec_from_file_location("gpu_truth", REPO / "benchmarks" / "gpu_truth.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fit_recovers_known_terms_from_synthetic_kernel_times():
    """Kernel times generated by the model itself from known terms, noised 2% (seed drawn per run, printed), in
    the layout of the measured files: the benchmark's fit must give the terms back."""
    gt = _gpu_truth()
    seed = int(os.environ.get("KVBENCH_TEST_SEED") or np.random.SeedSequence().entropy % 100_000)
    print(f"noise seed {seed} (replay: KVBENCH_TEST_SEED={seed})")
    rng = np.random.default_rng(seed)
    true = dataclasses.replace(H100, gemm_floor_s=4e-6, gemm_mfu=0.6, gemm_mbu=0.8, eltwise_floor_s=2e-6,
                               norm_mbu=0.5, rope_mbu=0.6, act_mbu=0.7, add_mbu=0.8)  # fmt: skip
    geometry = {"n_embd": 4096, "n_head": 32, "n_kv_head": 32, "n_expanded_embd": 11008, "vocab_size": 32000}
    rows = []
    for tp in (1, 2, 4):
        model = gt.geometry("synthetic-7b", geometry)
        for tokens in (1, 8, 32, 64, 128, 200, 256, 512, 777, 1024, 2048, 4096):
            ops = OperatorModel(model, true, tp).layer_ops_s(tokens)
            measured = {k: v * (1 + 0.02 * rng.standard_normal()) for k, v in ops.items()}
            rows.append({"model": "synthetic-7b", "geometry": model, "tp": tp, "tokens": tokens, "measured": measured})
    import polars as pl

    sizes = np.array([2048, 65536, 1 << 20, 8 << 20, 32 << 20, 64 << 20] * 3)
    workers = np.repeat([2, 4, 8], 6)
    net_true = dataclasses.replace(H100, collective_latency_s=2e-5, link_latency_s=1e-6, allreduce_bw=3e11)
    t = [OperatorModel(gt._probe(), net_true, int(n)).all_reduce_s(float(s)) for s, n in zip(sizes, workers)]
    net = pl.DataFrame({"num_workers": workers, "size": sizes, "time_stats.all_reduce.median": np.array(t) * 1e3})
    got = gt.fit(rows, net, H100)
    for key in ("gemm_mfu", "gemm_mbu", "norm_mbu", "rope_mbu", "act_mbu", "add_mbu"):
        assert got[key] == pytest.approx(getattr(true, key), rel=0.05), key
    assert got["gemm_floor_s"] == pytest.approx(4e-6, abs=1e-6)
    assert got["eltwise_floor_s"] == pytest.approx(2e-6, abs=0.5e-6)
    assert got["allreduce_bw"] == pytest.approx(3e11, rel=0.02)
    assert got["collective_latency_s"] + 14 * got["link_latency_s"] == pytest.approx(2e-5 + 14e-6, rel=0.02)


@pytest.mark.skipif(not (VIDUR / "compute").is_dir(), reason=f"{VIDUR} not present (the measured H100 data)")
def test_the_h100_preset_meets_its_targets_on_the_measured_operator_times():
    gt = _gpu_truth()
    rows, net = gt.load_compute(VIDUR), gt.load_network(VIDUR)
    linear = gt.linear_report(rows, H100)
    assert linear["rows"] == 2088
    assert linear["ge64"] <= gt.TARGETS["linear_ge64"] and linear["lt64"] <= gt.TARGETS["linear_lt64"]
    assert gt.allreduce_report(net["h100_dgx"], H100)["mape"] <= gt.TARGETS["allreduce"]
