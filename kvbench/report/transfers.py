"""The report section of backends that move real KV blocks (`torch`): what moved between tiers, at what rate,
and how that rate compares with a plain contiguous copy in the same process and with the datasheet peak."""

from __future__ import annotations

from kvbench.report.page import Figure, Section, Table, num, pct, svg

TITLE = "KV transfers"


def _gb(x) -> str:
    return "–" if x is None else f"{x:.3g}"


def transfer_section(summary: dict) -> Section:
    points = [p for p in summary["points"] if p.get("torch")]
    if not points:
        return Section(TITLE)
    facts = points[0]["torch"]
    setup = (
        f"Device {facts['device']}, model geometry {facts['model']} ({facts['kv_dtype']}, {facts['layout']}), "
        f"{facts['block_tokens']} tokens = {facts['block_bytes']:,} B per block, copy mode {facts['copy_mode']}, "
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
                    num(d["blocks"]),
                    _gb(d["bytes"] / 1e9),
                    num(d["copies"]),
                    num(d["seconds"]),
                    _gb(d["gb_per_s"]),
                    _gb(d.get("baseline_gb_per_s")),
                    pct(d.get("vs_baseline")),
                    _gb(d.get("peak_gb_per_s")),
                    pct(d.get("vs_peak")),
                ]
            )
        b = t["blocks"]
        check = t.get("verify")
        blocks.append(
            [
                p["name"],
                num(b["hbm_hits"]),
                num(b["dram_hits"]),
                num(b["ssd_hits"]),
                num(b["evictions"]),
                num(t["prefill_tokens"]),
                "–" if check is None else f"{check['checked']:,} checked, {check['mismatches']:,} bad",
            ]
        )
    items: list = [setup]
    fig = _rates_figure(points[0])
    if fig is not None:
        items.append(fig)
    header = ["point", "direction", "blocks", "GB", "copies", "seconds", "GB/s", "baseline GB/s", "of baseline"]
    items.append(Table([*header, "peak GB/s", "of peak"], rows) if rows else "No block left HBM or came back.")
    items.append(
        Table(["point", "HBM hits", "DRAM hits", "SSD hits", "HBM evictions", "prefill tokens", "checksums"], blocks)
    )
    return Section(TITLE, items)


def _rates_figure(point: dict) -> Figure | None:
    import matplotlib.pyplot as plt
    import numpy as np

    moved = {k: v for k, v in point["torch"]["transfers"].items() if v.get("gb_per_s")}
    if not moved:
        return None
    names = list(moved)
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(7, 3))
    for i, (key, label) in enumerate((("gb_per_s", "measured"), ("baseline_gb_per_s", "contiguous copy"),
                                      ("peak_gb_per_s", "datasheet peak"))):  # fmt: skip
        ax.bar(x + (i - 1) * 0.27, [moved[n].get(key) or 0 for n in names], 0.27, label=label)
    ax.set_xticks(x, names)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=8)
    return Figure(svg(fig), f"Transfer rate per direction, point {point['name']} (log scale)")
