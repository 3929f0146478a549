"""The report section of backends that move real KV blocks (`torch`): what moved between tiers, at what rate,
and how that rate compares with a plain contiguous copy in the same process and with the datasheet peak."""

from __future__ import annotations

from kvbench.report.page import Figure, Section, Table, pct, svg
from kvbench.report.sections import section_at
from kvbench.report.style import FULL_WIDTH, SMALL_MULTIPLE, duration, plain, size

TITLE = "KV transfers"
MAX_PANELS = 6  # points drawn side by side in the rate plot; the table below has every point


def _rate(x) -> str:
    """GB/s (decimal, as datasheets give it) with three significant digits, never 1.1e+02."""
    return "–" if x is None else plain(x, 3)


@section_at(150, "summary", per_point=True)
def transfer_section(summary: dict) -> Section:
    points = [p for p in summary["points"] if p.get("torch")]
    if not points:
        return Section(TITLE)
    facts = points[0]["torch"]
    setup = (
        f"Device {facts['device']}, model geometry {facts['model']} ({facts['kv_dtype']}, {facts['layout']}), "
        f"{facts['block_tokens']} tokens = {size(facts['block_bytes'])} per block, copy mode {facts['copy_mode']}, "
        f"{'write-through' if facts['write_through'] else 'write-back'}. Baseline: one contiguous copy of the "
        "mean batch size between the same memories, in the same process; peak: the hardware datasheet."
    )
    rows, blocks = [], []
    for p in points:
        t = p["torch"]
        for direction, d in t["transfers"].items():
            rows.append(
                [
                    p["name"],
                    direction,
                    plain(d["blocks"]),
                    size(d["bytes"]),
                    plain(d["copies"]),
                    duration(d["seconds"]),
                    _rate(d["gb_per_s"]),
                    _rate(d.get("baseline_gb_per_s")),
                    pct(d.get("vs_baseline")),
                    _rate(d.get("peak_gb_per_s")),
                    pct(d.get("vs_peak")),
                ]
            )
        b = t["blocks"]
        check = t.get("verify")
        blocks.append(
            [
                p["name"],
                plain(b["hbm_hits"]),
                plain(b["dram_hits"]),
                plain(b["ssd_hits"]),
                plain(b["evictions"]),
                plain(t["prefill_tokens"]),
                "–" if check is None else f"{check['checked']:,} checked, {check['mismatches']:,} bad",
            ]
        )
    items: list = [setup]
    fig = _rates_figure(points)
    if fig is not None:
        items.append(fig)
    header = ["point", "direction", "blocks", "moved", "copies", "time copying", "GB/s", "baseline GB/s", "of baseline"]
    items.append(Table([*header, "peak GB/s", "of peak"], rows) if rows else "No block left HBM or came back.")
    items.append(
        Table(["point", "HBM hits", "DRAM hits", "SSD hits", "HBM evictions", "prefill tokens", "checksums"], blocks)
    )
    return Section(TITLE, items)


def _rates_figure(points: list[dict]) -> Figure | None:
    """Measured, baseline and peak rate per direction: one panel per point (up to MAX_PANELS) on one log scale,
    so points compare at a glance."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import FuncFormatter, NullFormatter

    drawn = [(p, {k: v for k, v in p["torch"]["transfers"].items() if v.get("gb_per_s")}) for p in points]
    drawn = [(p, moved) for p, moved in drawn if moved][:MAX_PANELS]
    if not drawn:
        return None
    width = min(FULL_WIDTH, max(SMALL_MULTIPLE * len(drawn), 7))
    fig, axes = plt.subplots(1, len(drawn), figsize=(width, 3), sharey=True, squeeze=False, layout="constrained")
    bars = (("gb_per_s", "measured"), ("baseline_gb_per_s", "contiguous copy"), ("peak_gb_per_s", "datasheet peak"))
    for ax, (point, moved) in zip(axes[0], drawn):
        names = list(moved)
        x = np.arange(len(names))
        for i, (key, label) in enumerate(bars):
            ax.bar(x + (i - 1) * 0.27, [moved[n].get(key) or 0 for n in names], 0.27, label=label)
        ax.set_xticks(x, [n.replace("->", "→") for n in names], fontsize=7, rotation=30)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: plain(v, 3)))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(point["name"], fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("GB/s")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside upper center", ncol=3, fontsize=8)
    more = f", the first {len(drawn)} of {len(points)} points (the table has all)" if len(points) > len(drawn) else ""
    return Figure(svg(fig), f"Transfer rate per direction and point (log scale){more}")
