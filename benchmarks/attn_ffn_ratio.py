"""Attention/FFN disaggregation: decode tokens/s per device and TPOT against the attention:FFN device ratio, for
a fixed number of devices (backends/enginesim/afd.py; docs/parallelism.md, Attention/FFN disaggregation).

Two deployments, every split of their devices whose FFN side holds the FFN weights:

- deepseek-v3 (MoE, fp8 weights) on 16 × H200 (two servers: the two sides talk over the network), context 4096;
- llama3-70b (dense, bf16) on 8 × H100 (one server: NVLink), context 2048.

Each attention device runs as many sequences as its KV holds at that context (at most 256), in 3 ping-pong
micro-batches. For reference, the same devices as one colocated instance (engine-sim's --tp/--ep/--dp-attention
roofline, parallel_model.py) at the same per-device batch cap.

    python benchmarks/attn_ffn_ratio.py [--micro-batches 3]

Writes benchmarks/results/attn_ffn_ratio.json and attn_ffn_ratio.png, and prints the curve. Analytical: no trace
is replayed (each point is one decode step at a steady batch), so it runs in about a second.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from kvbench.backends.enginesim.afd import AfdDeployment
from kvbench.backends.enginesim.parallel_model import ParallelLatencyModel

from kvbench.errors import KvbenchError
from kvbench.hardware import HARDWARE, MODELS

RESULTS = Path(__file__).parent / "results"
CASES = [
    # name, model, hardware, devices, weight dtype, context, colocated degrees (tp, ep, dp_attention)
    ("deepseek-v3 on 16 x h200, fp8, context 4096", "deepseek-v3", "h200", 16, "fp8", 4096, (16, 16, 16)),
    ("llama3-70b on 8 x h100, bf16, context 2048", "llama3-70b", "h100", 8, "bf16", 2048, (8, 1, 1)),
]
MAX_BATCH = 256  # sequences per attention device (vLLM's default max_num_seqs), or per colocated DP group


def colocated(model, hw, dtype, context, degrees) -> dict:
    tp, ep, dp = degrees
    lat = ParallelLatencyModel(model, hw, weight_dtype=dtype, tp=tp, ep=ep, dp_attention=dp)
    batch = min(MAX_BATCH * dp, lat.kv_capacity_tokens() // context)
    step = lat.decode_step_s(batch, batch * context)
    return {"tp": tp, "ep": ep, "dp_attention": dp, "batch": batch, "tpot_ms": step * 1e3,
            "tokens_per_s_per_device": batch / step / tp}  # fmt: skip


def run(micro_batches: int) -> dict:
    out = []
    for name, model_name, hw_name, devices, dtype, context, degrees in CASES:
        model, hw = MODELS[model_name], HARDWARE[hw_name]
        points = []
        for n_attn in range(1, devices):
            try:
                afd = AfdDeployment(model, hw, n_attn, devices - n_attn, weight_dtype=dtype,
                                    micro_batches=micro_batches, max_batch=MAX_BATCH)  # fmt: skip
            except KvbenchError as e:  # the FFN side cannot hold its weights: no point, say why
                points.append({"attention_devices": n_attn, "ffn_devices": devices - n_attn, "fits": False,
                               "why": str(e)})  # fmt: skip
                continue
            points.append(afd.point(context))
        best = max((p for p in points if p["fits"]), key=lambda p: p["tokens_per_s_per_device"])
        out.append({"case": name, "model": model_name, "hardware": hw_name, "devices": devices,
                    "weight_dtype": dtype, "context": context, "points": points, "best": best,
                    "colocated": colocated(model, hw, dtype, context, degrees)})  # fmt: skip
    return {
        "benchmark": "attn_ffn_ratio",
        "micro_batches": micro_batches,
        "max_batch_per_attention_device": MAX_BATCH,
        "machine": platform.platform(),
        "notes": "Analytical decode step per split (backends/enginesim/afd.py): each attention device at the "
        "largest batch its KV holds (≤ 256); tokens/s per device counts both sides' devices. 'colocated' is the "
        "same devices as one engine-sim instance (--tp/--ep/--dp-attention), the same batch cap per DP group.",
        "cases": out,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for case in result["cases"]:
        pts = [p for p in case["points"] if p["fits"]]
        ratio = [p["attention_devices"] / p["ffn_devices"] for p in pts]
        axes[0].plot(ratio, [p["tokens_per_s_per_device"] for p in pts], marker="o", label=case["case"])
        axes[1].plot(ratio, [p["tpot_ms"] for p in pts], marker="o", label=case["case"])
        col = case["colocated"]
        axes[0].axhline(col["tokens_per_s_per_device"], ls=":", color=axes[0].lines[-1].get_color())
        axes[1].axhline(col["tpot_ms"], ls=":", color=axes[1].lines[-1].get_color())
    for ax, label in zip(axes, ("decode tokens/s per device", "TPOT (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("attention : FFN devices")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_title("throughput per device (dotted: colocated instance)", fontsize=10)
    axes[1].set_title("time per output token (dotted: colocated instance)", fontsize=10)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--micro-batches", type=int, default=3, help="ping-pong micro-batches per step (count)")
    args = ap.parse_args()
    result = run(args.micro_batches)
    RESULTS.mkdir(exist_ok=True)
    tmp = RESULTS / "attn_ffn_ratio.json.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(RESULTS / "attn_ffn_ratio.json")
    plot(result, RESULTS / "attn_ffn_ratio.png")
    for case in result["cases"]:
        print(case["case"])
        print(f"  {'attn:ffn':>9} {'batch':>6} {'TPOT ms':>8} {'tok/s/dev':>10}  bottleneck")
        for p in case["points"]:
            split = f"{p['attention_devices']}:{p['ffn_devices']}"
            if not p["fits"]:
                print(f"  {split:>9}  FFN weights do not fit" if "why" in p else f"  {split:>9}  no KV room")
                continue
            print(f"  {split:>9} {p['batch_per_attention_device']:>6} {p['tpot_ms']:>8.1f} "
                  f"{p['tokens_per_s_per_device']:>10.0f}  {p['bottleneck']}")  # fmt: skip
        c = case["colocated"]
        print(f"  colocated (tp {c['tp']}, ep {c['ep']}, dp-attention {c['dp_attention']}): batch {c['batch']}, "
              f"TPOT {c['tpot_ms']:.1f} ms, {c['tokens_per_s_per_device']:.0f} tok/s/device")  # fmt: skip
    print(f"wrote {RESULTS / 'attn_ffn_ratio.json'} and attn_ffn_ratio.png")


if __name__ == "__main__":
    main()
