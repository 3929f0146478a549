"""`kvbench experiment attn-ffn --model deepseek-v3 --hardware h200 --devices 16`: the attention/FFN
disaggregation trade-off as a curve (docs/parallelism.md, Attention/FFN disaggregation). For a fixed number of
devices, every split into attention devices (which hold KV) and FFN/expert devices (which hold weights) whose FFN
side fits: decode tokens/s per device and TPOT at the largest batch the attention side's KV holds, with the
bottleneck of each, against the same devices as one colocated instance. Analytical (`afd.py`): one steady decode
step per split, no trace, so it runs in about a second. Writes attn_ffn.json and attn_ffn.png into a fresh run
directory (never over an earlier one)."""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path

import click

from kvbench import options
from kvbench.errors import KvbenchError
from kvbench.models import HARDWARE, MODELS, weight_split
from kvbench.run.rundir import RunDir, stamp

MAX_BATCH = 256  # sequences per attention device (vLLM's default max_num_seqs), or per colocated DP group


def colocated(model, hw, dtype: str, context: int, devices: int, max_batch: int) -> dict:
    """The same devices as one instance: TP over all of them, and for a MoE model EP and data-parallel
    attention over all of them too (the layout SGLang and vLLM use for DeepSeek-class models)."""
    from kvbench.backends.enginesim.parallel_model import ParallelLatencyModel

    ep = dp = devices if weight_split(model).moe else 1
    lat = ParallelLatencyModel(model, hw, weight_dtype=dtype, tp=devices, ep=ep, dp_attention=dp)
    batch = min(max_batch * dp, lat.kv_capacity_tokens() // context)
    if batch < 1:
        raise KvbenchError(f"--context {context}: not one sequence fits the colocated instance's KV; lower it")
    step = lat.decode_step_s(batch, batch * context)
    return {"tp": devices, "ep": ep, "dp_attention": dp, "batch": batch, "tpot_ms": step * 1e3,
            "tokens_per_s_per_device": batch / step / devices}  # fmt: skip


def curve(model_name: str, hw_name: str, devices: int, dtype: str, context: int, micro_batches: int,
          max_batch: int = MAX_BATCH) -> dict:  # fmt: skip
    """Every attention:FFN split of `devices`; a split whose FFN side cannot hold its weights is kept, with why."""
    from kvbench.backends.enginesim.afd import AfdDeployment

    if model_name not in MODELS:
        raise KvbenchError(f"--model {model_name!r}: unknown; choose one of {', '.join(MODELS)}")
    if hw_name not in HARDWARE:
        raise KvbenchError(f"--hardware {hw_name!r}: unknown; choose one of {', '.join(HARDWARE)}")
    if devices < 2:
        raise KvbenchError(f"--devices {devices}: a split needs at least 2 devices (1 attention, 1 FFN)")
    model, hw = MODELS[model_name], HARDWARE[hw_name]
    points = []
    for n_attn in range(1, devices):
        try:
            afd = AfdDeployment(model, hw, n_attn, devices - n_attn, weight_dtype=dtype,
                                micro_batches=micro_batches, max_batch=max_batch)  # fmt: skip
        except KvbenchError as e:
            points.append({"attention_devices": n_attn, "ffn_devices": devices - n_attn, "fits": False,
                           "why": str(e)})  # fmt: skip
            continue
        points.append(afd.point(context))
    fitting = [p for p in points if p["fits"]]
    if not fitting:
        raise KvbenchError(
            f"no split of {devices} × {hw_name} holds {model_name} ({dtype}) at context {context}: "
            "raise --devices, use a smaller --weight-dtype or lower --context"
        )
    return {"model": model_name, "hardware": hw_name, "devices": devices, "weight_dtype": dtype,
            "context": context, "micro_batches": micro_batches, "max_batch_per_attention_device": max_batch,
            "points": points, "best": max(fitting, key=lambda p: p["tokens_per_s_per_device"]),
            "colocated": colocated(model, hw, dtype, context, devices, max_batch)}  # fmt: skip


def table(case: dict) -> str:
    lines = [f"{'attn:ffn':>9} {'batch':>6} {'TPOT ms':>8} {'tok/s/dev':>10}  bottleneck"]
    for p in case["points"]:
        split = f"{p['attention_devices']}:{p['ffn_devices']}"
        if not p["fits"]:
            lines.append(f"{split:>9}  does not fit" + (" (FFN weights)" if "why" in p else " (no KV room)"))
            continue
        lines.append(f"{split:>9} {p['batch_per_attention_device']:>6} {p['tpot_ms']:>8.1f} "
                     f"{p['tokens_per_s_per_device']:>10.0f}  {p['bottleneck']}")  # fmt: skip
    c = case["colocated"]
    lines.append(f"colocated (tp {c['tp']}, ep {c['ep']}, dp-attention {c['dp_attention']}): batch {c['batch']}, "
                 f"TPOT {c['tpot_ms']:.1f} ms, {c['tokens_per_s_per_device']:.0f} tok/s/device")  # fmt: skip
    return "\n".join(lines)


def plot(cases: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for case in cases:
        label = (f"{case['model']} on {case['devices']} × {case['hardware']}, {case['weight_dtype']}, "
                 f"ctx {case['context']}")  # fmt: skip
        pts = [p for p in case["points"] if p["fits"]]
        ratio = [p["attention_devices"] / p["ffn_devices"] for p in pts]
        for ax, key in zip(axes, ("tokens_per_s_per_device", "tpot_ms"), strict=True):
            line = ax.plot(ratio, [p[key] for p in pts], marker="o", label=label)[0]
            ax.axhline(case["colocated"][key], ls=":", color=line.get_color())
    for ax, label in zip(axes, ("decode tokens/s per device", "TPOT (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("attention : FFN devices")
        ax.set_ylabel(label)
        ax.set_title(f"{label} (dotted: colocated instance)", fontsize=10)
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(path: Path, cases: list[dict], command: str) -> None:
    """attn_ffn.json (written whole: renamed into place) and attn_ffn.png beside it."""
    tmp = path / "attn_ffn.json.tmp"
    tmp.write_text(json.dumps({"experiment": "attn-ffn", "command": command, "cases": cases}, indent=2) + "\n")
    tmp.replace(path / "attn_ffn.json")
    plot(cases, path / "attn_ffn.png")


@dataclasses.dataclass(frozen=True)
class AttnFfnOptions:
    """The options of `attn_ffn`."""

    model: str | None = options.option(
        None,
        "model preset (kvbench.models.MODELS), e.g. deepseek-v3",
        unit="name",
        required=True,
    )
    hardware: str | None = options.option(None, "device preset, e.g. h200", unit="name", required=True)
    devices: int | None = options.option(
        None,
        "devices split between the two sides",
        unit="devices",
        type=int,
        required=True,
    )
    weight_dtype: str = options.option("bf16", "weight format", unit="name", type=click.Choice(["bf16", "fp8", "int4"]))
    context: int = options.option(4096, "tokens each sequence holds", unit="tokens", type=int)
    micro_batches: int = options.option(
        3,
        "ping-pong micro-batches per step, which hide the link behind compute",
        unit="count",
        type=click.IntRange(1),
    )
    max_batch: int = options.option(
        MAX_BATCH,
        "most sequences per attention device (vLLM's max_num_seqs)",
        unit="sequences",
        type=click.IntRange(1),
    )
    out: str | None = options.option(
        None,
        "run directory [default: reports/<time>-attn-ffn]",
        unit="path",
        type=click.Path(file_okay=False),
    )
    overwrite: bool = options.option(False, "empty --out first if it holds an earlier run", unit="on/off", is_flag=True)


@click.command("attn-ffn")
@options.command_options(AttnFfnOptions)
def attn_ffn(model, hardware, devices, weight_dtype, context, micro_batches, max_batch, out, overwrite):
    """Attention/FFN disaggregation: decode tokens/s per device and TPOT for every attention:FFN split of
    --devices, against one colocated instance (docs/parallelism.md)."""
    if context < 1:
        raise KvbenchError(f"--context {context}: give a positive number of tokens")
    case = curve(model, hardware, devices, weight_dtype, context, micro_batches, max_batch)
    run_dir = RunDir.claim(out, Path("reports") / f"{stamp()}-attn-ffn", overwrite=overwrite,
                           what="attn-ffn run", resumable=False)  # fmt: skip
    write(run_dir.path, [case], "kvbench " + shlex.join(sys.argv[1:]))
    click.echo(table(case))
    best = case["best"]
    click.echo(f"best: {best['attention_devices']}:{best['ffn_devices']}, "
               f"{best['tokens_per_s_per_device']:.0f} tok/s/device at {best['tpot_ms']:.1f} ms TPOT")  # fmt: skip
    click.echo(f"run: {run_dir.path}")
