"""The `kvbench experiment kv-quant` report: KV formats by capacity gained and attention error
(docs/kv-quantization.md). Sections: the trade-off table (format × bytes per token × blocks that fit × hit rate ×
attention error), the error by decode position, the key-age sensitivity, the plot of both, the generative
assumption and the settings; rendered by `kvbench.report.page` as report.html and report.md."""

from __future__ import annotations

from pathlib import Path

from kvbench.report.page import Figure, Links, Section, Table, num, pct, render_html, render_markdown, svg

TITLE = "KV quantization: capacity gained vs accuracy lost"
ASSUMPTION = (
    "There is no trained model here: K/V follow a seeded generative assumption (docs/kv-quantization.md). Keys: a "
    "per-channel mean with a few outlier channels (several times larger, as KIVI and KVQuant measure in real key "
    "caches) plus per-token noise, then RoPE at the token's position; values: per-channel and per-token scales, no "
    "outlier channels; queries: partly aligned with the key mean, so RoPE makes near keys score higher. Each "
    "prompt block's K/V are seeded by its block hash (a shared prefix gives identical K/V), decode tokens by the "
    "request. The errors compare formats under that assumption; they are not a model's accuracy on a task."
)


def _error(x) -> str:
    return "–" if x is None else f"{100 * x:.3g}%"


def _bytes(x: float) -> str:
    return f"{x:,.1f}".rstrip("0").rstrip(".")  # 40,960 or 25,125.9


def rows(result: dict) -> list[dict]:
    """One row per format measured, then the mixed policy: name, bytes per token, blocks, hit rate, errors."""
    out = []
    for r in result["table"]:
        err = result["errors"]["mixed" if r.get("mixed") else "formats"]
        out.append({**r, "error": err if r.get("mixed") else err[r["format"]]})
    return out


def trade_off_table(result: dict) -> Table:
    header = ["format", "bytes/token", "vs bf16", "blocks in memory", "token hit rate", "attn error mean",
              "attn error p95"]  # fmt: skip
    body = []
    for r in rows(result):
        body.append([
            r["label"], _bytes(r["bytes_per_token"]), f"{r['capacity_gain']:.2f}×", num(r["blocks"]),
            pct(r["hit_rate"]), _error(r["error"]["mean"]), _error(r["error"]["p95"]),
        ])  # fmt: skip
    return Table(header, body)


def bucket_table(result: dict) -> Table:
    edges = result["errors"]["bucket_edges_decode_tokens"]
    header = ["format"] + [f"decode {lo}–{hi}" for lo, hi in zip(edges[:-1], edges[1:], strict=True)]
    return Table(header, [[r["label"], *map(_error, r["error"]["by_bucket"])] for r in rows(result)])


def age_table(result: dict) -> Table | None:
    age = result["errors"].get("age_sensitivity")
    if not age:
        return None
    n = age["parts"]
    header = ["slice of the context in " + age["format"]] + [f"{100 * p // n}–{100 * (p + 1) // n}%" for p in range(n)]
    return Table(header, [["attention error, latest queries", *map(_error, age["mean_error"])]])


FLOOR = 1e-4  # where bf16's zero error is drawn on a log axis


def _figure(result: dict) -> Figure:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = result["errors"]["bucket_edges_decode_tokens"]
    mids = [(lo + hi) / 2 for lo, hi in zip(edges[:-1], edges[1:], strict=True)]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for r in rows(result):
        ys = r["error"]["by_bucket"]
        line = ax.plot([m for m, y in zip(mids, ys) if y], [y for y in ys if y], marker="o", label=r["label"])
        color = line[0].get_color() if line else None
        x = max(r["error"]["mean"], FLOOR)
        bx.scatter(x, r["hit_rate"], color=color)
        bx.annotate(r["label"], (x, r["hit_rate"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("log"), ax.set_xlabel("decode position (tokens after the prompt)")
    ax.set_ylabel("attention output relative error"), ax.grid(alpha=0.3)
    bx.set_xscale("log"), bx.set_xlabel("mean attention error (bf16 drawn at 1e-4)")
    bx.set_ylabel("token hit rate at the memory's blocks"), bx.grid(alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return Figure(
        svg(fig),
        "Left: error by decode position (bf16, zero, not drawn). Right: what each format buys "
        "(hit rate) against what it costs (attention error).",
    )


def sections(result: dict, plots: bool = True) -> list[Section]:
    s = result["settings"]
    explain = (
        f"{s['memory']} of KV for {s['model']} ({s['block_tokens']}-token blocks): blocks = ⌊memory / (bytes per "
        "token × block tokens)⌋, bytes per token counting each group's fp16 scale (and zero point for integer "
        f"formats) at groups of {s['group_size']} elements. Hit rate: the sim backend, policy {s['policy']}, at "
        "each format's blocks, on the whole trace. Attention error: ||o_q − o_bf16|| / ||o_bf16|| per query "
        "(all query heads of a layer), mean and 95th percentile over the measured queries."
    )
    if result.get("mixed_note"):
        explain += " " + result["mixed_note"]
    out = [Section(TITLE, [explain, trade_off_table(result)]),
           Section("Attention error by decode position", [bucket_table(result)])]  # fmt: skip
    age = age_table(result)
    if age is not None:
        out.append(Section("Which part of a long context tolerates compression", [
            "Only one slice of each latest query's context (earliest first) stored in the low-bit format, the rest "
            "bf16: a lower error for a slice means that slice tolerates compression better.", age,
        ]))  # fmt: skip
    if plots:
        out.append(Section("Plots", [_figure(result)]))
    measured = result["errors"]["requests_measured"]
    settings = [[k, str(v)] for k, v in s.items()]
    shown = [f"{m['request_id']} ({m['prompt_tokens']}+{m['decode_tokens_measured']} tok)" for m in measured]
    settings.append(["requests measured", ", ".join(shown)])
    settings.append(["layers measured", ", ".join(map(str, result["errors"]["layers_measured"]))])
    out += [Section("What the K/V are", [ASSUMPTION]),
            Section("Settings", [f"`{result['command']}`", Table(["setting", "value"], settings)]),
            Section("Runs", [Links([("hit-rate run (sim)", "sim/report.html")])])]  # fmt: skip
    return out


def markdown_table(result: dict) -> str:
    """The trade-off table alone in Markdown (what the command prints)."""
    return render_markdown("", [Section("t", [trade_off_table(result)])]).split("## t", 1)[1].strip() + "\n"


def write_reports(run_dir: Path, result: dict, plots: bool = True) -> None:
    title = f"kvbench kv-quant: {result['settings']['model']} on {Path(result['trace']).name}"
    secs = sections(result, plots)
    (run_dir / "report.html").write_text(render_html(title, secs))
    (run_dir / "report.md").write_text(render_markdown(title, secs).rstrip("\n") + "\n")
