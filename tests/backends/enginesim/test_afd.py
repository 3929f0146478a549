"""Attention/FFN disaggregation on multi-device deployments (backends/enginesim/afd.py): the pipeline of one
step against its formula, what each side holds, and the refusal naming the smallest FFN side that fits."""

from __future__ import annotations

import math

import pytest
from kvbench.backends.enginesim.afd import AfdDeployment

from kvbench.errors import KvbenchError
from kvbench.models import HARDWARE, MODELS


def test_one_micro_batch_runs_attention_link_ffn_link_every_layer():
    d = AfdDeployment(MODELS["llama3-70b"], HARDWARE["h100"], 4, 4, micro_batches=1)
    step, s = d.decode_step_s(32, 2048)
    assert s["micro_batches"] == 1
    assert step == pytest.approx(80 * (s["attention_s"] + s["ffn_s"] + 2 * s["link_s"]))
    # one crossing: 32 sequences' activations from one attention device vs 128 tokens into each FFN device
    hw = HARDWARE["h100"]
    assert s["link_s"] == pytest.approx(hw.link_latency_s + 128 * 8192 * 2 / hw.nvlink_bw)


def test_attention_devices_hold_the_kv_and_a_copy_of_the_attention_weights():
    m, hw = MODELS["llama3-70b"], HARDWARE["h100"]
    d = AfdDeployment(m, hw, 4, 4)
    # Q, O: 8192 × 64·128 each; K, V: 8192 × 8·128 each; 80 layers; bf16
    attention = 80 * 8192 * (2 * 64 * 128 + 2 * 8 * 128) * 2
    kv_token = 80 * 2 * 8 * 128 * 2
    assert d.kv_tokens_per_attention_device() == int((80e9 * 0.9 - attention) / kv_token)
    point = d.point(2048)
    assert point["batch_per_attention_device"] == d.kv_tokens_per_attention_device() // 2048
    assert point["tokens_per_s_per_device"] == pytest.approx(point["tokens_per_s"] / 8)


def test_an_ffn_side_too_small_names_the_smallest_that_fits():
    m, h200 = MODELS["deepseek-v3"], HARDWARE["h200"]
    ffn_bytes = 671_000_000_000 - 61 * 187_107_328  # fp8: one byte each
    need = math.ceil(ffn_bytes / (141e9 * 0.9))
    with pytest.raises(KvbenchError, match=f"smallest FFN device count that fits is {need}"):
        AfdDeployment(m, h200, 12, need - 1, weight_dtype="fp8")
    AfdDeployment(m, h200, 12, need, weight_dtype="fp8")


def test_more_attention_devices_feed_the_ffn_side_bigger_batches():
    m, h200 = MODELS["deepseek-v3"], HARDWARE["h200"]
    points = [AfdDeployment(m, h200, a, 16 - a, weight_dtype="fp8", micro_batches=3).point(4096) for a in (2, 8)]
    assert points[1]["tokens_per_s_per_device"] > 2 * points[0]["tokens_per_s_per_device"]
    assert points[1]["tpot_ms"] > points[0]["tpot_ms"]  # the FFN side's work grows with the tokens it gets


def test_the_attn_ffn_experiment_writes_the_curve_and_keeps_earlier_runs(tmp_path):
    """`kvbench experiment attn-ffn`: one point per split of --devices, the splits whose FFN side cannot hold
    the weights kept with why, the best split the one with most tokens/s per device, a colocated reference;
    the JSON and plot land in --out, and a second run there is refused instead of overwriting it."""
    import json

    from click.testing import CliRunner

    from kvbench.cli import main

    out = tmp_path / "afd"
    args = ["experiment", "attn-ffn", "--model", "llama3-70b", "--hardware", "h100", "--devices", "8",
            "--context", "2048", "--out", str(out)]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    case = json.loads((out / "attn_ffn.json").read_text())["cases"][0]
    assert (out / "attn_ffn.png").stat().st_size > 0
    splits = [(p["attention_devices"], p["ffn_devices"]) for p in case["points"]]
    assert splits == [(a, 8 - a) for a in range(1, 8)]
    # bf16 70B: the FFN/MLP weights alone are ~2 × 8192 × 28672 × 3 × 80 bytes ≈ 113 GB: not on one H100
    assert not next(p for p in case["points"] if p["ffn_devices"] == 1)["fits"]
    fitting = [p for p in case["points"] if p["fits"]]
    assert case["best"] == max(fitting, key=lambda p: p["tokens_per_s_per_device"])
    assert case["colocated"]["tp"] == 8 and case["colocated"]["ep"] == 1
    assert f"best: {case['best']['attention_devices']}:{case['best']['ffn_devices']}" in r.output
    again = CliRunner().invoke(main, args)
    assert again.exit_code != 0 and "already holds" in again.output
    bad = CliRunner().invoke(main, [*args[:-2], "--devices", "1", "--out", str(tmp_path / "x")])
    assert bad.exit_code != 0 and "--devices 1" in bad.output
