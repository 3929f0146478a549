"""How close a twin is to its trace, drawn: what kvbench/run/twin.py measured (infinite-cache and radix-lru hit
rates) beside the distributions the model fits, written as report.md and report.html."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from kvbench.report.page import Figure, Section, Table, num, pct, render_html, render_markdown, svg
from kvbench.run.twin import POLICY
from kvbench.trace.fit.model import arrival_model, session_stats, sessions_of


def _cdf(ax, values, label, style):
    v = np.sort(np.asarray(values, dtype=np.float64))
    v = v[np.isfinite(v)]
    if v.size:
        ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label, **style)


ORIG_STYLE = {"color": "#1f77b4"}
TWIN_STYLE = {"color": "#d62728", "linestyle": "--"}


def figures(orig: pa.Table, twin: pa.Table, st_orig: dict, st_twin: dict, fid: dict | None) -> list[Figure]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvbench.report.style import FULL_WIDTH, SMALL_MULTIPLE

    out = []
    if fid is not None:
        fig, ax = plt.subplots(figsize=(FULL_WIDTH * 0.6, SMALL_MULTIPLE))
        caps = [r["capacity_blocks"] for r in fid["curve"]]
        ax.plot(caps, [r["original"]["steady"] for r in fid["curve"]], marker="o", label="original", **ORIG_STYLE)
        ax.plot(caps, [r["twin"]["steady"] for r in fid["curve"]], marker="x", label="twin", **TWIN_STYLE)
        ax.set_xscale("log")
        ax.set_xlabel("capacity (blocks of the original; a K-times twin gets K times as many)")
        ax.set_ylabel("token hit rate (steady state)")
        ax.set_ylim(0, 1)
        ax.legend()
        out.append(Figure(svg(fig), f"{POLICY} hit rate vs capacity, original and twin"))
    fig, axes = plt.subplots(1, 3, figsize=(FULL_WIDTH, SMALL_MULTIPLE))
    for ax, column, label in ((axes[0], "input_tokens", "prompt tokens"), (axes[1], "output_tokens", "output tokens")):
        _cdf(ax, orig.column(column).to_numpy(), "original", ORIG_STYLE)
        _cdf(ax, twin.column(column).to_numpy(), "twin", TWIN_STYLE)
        ax.set_xscale("symlog")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests ≤ x")
    _cdf(axes[2], st_orig["lag_s"], "original", ORIG_STYLE)
    _cdf(axes[2], st_twin["lag_s"], "twin", TWIN_STYLE)
    axes[2].set_xscale("symlog", linthresh=1e-3)
    axes[2].set_xlabel("reuse distance (s to the latest request sharing the prefix)")
    axes[2].set_ylabel("fraction of reusing requests ≤ x")
    axes[0].legend()
    out.append(Figure(svg(fig), "distributions (CDF): prompt and output lengths, reuse distance"))
    return out


def _kind_shares(st: dict) -> list[str]:
    kind = st["kind"]
    return [pct(float(np.mean(kind == k))) for k in range(3)]


def write(out_dir: Path, title: str, params: dict, orig, twin, st_orig, st_twin, fid: dict | None) -> list[Path]:
    """report.md and report.html in `out_dir`."""
    sections = []
    if fid is not None:
        inf = fid["infinite_cache"]
        rows = [["infinite cache", pct(inf["original"]["steady"]), pct(inf["twin"]["steady"]), num(inf["gap_steady"])]]
        for r in fid["curve"]:
            o, t = r["original"]["steady"], r["twin"]["steady"]
            cap = f"{POLICY} {r['capacity_blocks']:,} blocks"
            rows.append([cap, pct(o), pct(t), num(abs(o - t))])
        sections.append(
            Section(
                "Fidelity",
                [
                    f"Token hit rates after the warm-up share, original vs twin (scale {fid['scale']:g}). "
                    f"Largest gap on the curve: {num(fid['max_curve_gap_steady'])}; "
                    f"infinite cache: {num(inf['gap_steady'])}.",
                    Table(["cache", "original", "twin", "|gap|"], rows),
                ],
            )
        )
    if fid is not None and "statistics" in fid:
        stat_rows = [
            [group, name, num(v["ks"]), num(v["critical"]), "off" if v["off"] else "ok"]
            for group, g in fid["statistics"].items()
            for name, v in g["statistics"].items()
        ]
        sections.append(
            Section(
                "Self-check",
                [
                    "Each fitted statistic, trace against twin: two-sample Kolmogorov-Smirnov distance and its "
                    "critical value at the 1% level for these sample sizes (above it: more than sampling noise).",
                    Table(["group", "statistic", "KS distance", "1% critical value", ""], stat_rows),
                ],
            )
        )
    sections.append(Section("Overlays", figures(orig, twin, st_orig, st_twin, fid)))
    twin_arrival = arrival_model(st_twin["arrival_s"])
    twin_sessions = session_stats(sessions_of(st_twin["kind"], st_twin["parent"])[0], st_twin["arrival_s"])
    structure_rows = [
        ["requests", num(orig.num_rows), num(twin.num_rows)],
        ["fresh / extend / branch", " / ".join(_kind_shares(st_orig)), " / ".join(_kind_shares(st_twin))],
        ["arrival rate (req/s)", num(params["arrival"]["rate_per_s"]), num(twin_arrival["rate_per_s"])],
        ["gap CV after the rate curve", num(params["arrival"]["gap_cv"]), num(twin_arrival["gap_cv"])],
        ["mean turns per session (from block ids)", num(params["sessions"]["inferred"]["mean_turns"]),
         num(twin_sessions["mean_turns"])],
        ["median stack distance of a reuse (blocks)", num(_median(st_orig["distance_blocks"])),
         num(_median(st_twin["distance_blocks"]))],
        ["units (conversations, task trees)", num(params["units"]["units"]), num(params["placement"]["units"])],
        ["units at another unit's start", "–", pct(params["placement"]["moved_share"])],
        ["root prefixes (distinct first blocks)", num(_roots(st_orig)[0]), num(_roots(st_twin)[0])],
        ["requests under the most used root", pct(_roots(st_orig)[1]), pct(_roots(st_twin)[1])],
    ]  # fmt: skip
    sections.append(Section("Structure", [Table(["", "original", "twin"], structure_rows)]))
    out_dir.mkdir(parents=True, exist_ok=True)
    md, html = out_dir / "report.md", out_dir / "report.html"
    md.write_text(render_markdown(title, sections))
    html.write_text(render_html(title, sections))
    return [md, html]


def _median(values: np.ndarray) -> float:
    """Median of the finite values; NaN (shown as such) for a trace in which no request reuses anything."""
    finite = values[np.isfinite(values)]
    return float(np.median(finite)) if finite.size else float("nan")


def _roots(st: dict) -> tuple[int, float]:
    """Distinct root prefixes and the share of requests under the most used one."""
    _, counts = np.unique(st["first_block"], return_counts=True)
    return int(counts.size), float(counts.max() / counts.sum()) if counts.size else 0.0
