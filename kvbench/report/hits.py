"""Hit-rate sections of a run report: per point and tier, and the hit-rate-vs-capacity curves with the optimal
bound. The per-group sections (tenant, workload, modality, fairness) are in tenants.py, re-exported here."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.report.answer import bytes_per_block
from kvbench.report.page import Figure, Section, Table, pct, svg
from kvbench.report.sections import section_at
from kvbench.report.style import FULL_WIDTH, INFINITE_STYLE, count, line_style, log_ticks, plain, size
from kvbench.report.tenants import MAX_GROUPS, breakdown_sections, fairness_section

__all__ = ["MAX_GROUPS", "breakdown_sections", "curve_section", "fairness_section", "points_section", "tier_section"]

TIERS = ("hbm", "dram", "ssd", "global")


@section_at(40, "summary")
def points_section(summary: dict) -> Section:
    def rates(p: dict) -> list[str]:
        if p.get("cached_tokens_reported") is False:  # a 0 % hit rate would be a guess, not a measurement
            return ["n/a"] * 4
        hr = p["hit_rate"]
        return [
            pct(hr["token"]["all"]),
            pct(hr["token"]["steady"]),
            pct(hr["block"]["all"]),
            pct(hr["block"]["steady"]),
        ]

    # Jain's index over tenants says nothing with fewer than two of them (it is 1 by definition): the column is
    # left out of a run without tenants, and reads n/a at a point with one
    tenants = any((p.get("fairness") or {}).get("tenants", 0) >= 2 for p in summary["points"])

    def jain(p: dict) -> list[str]:
        if not tenants:
            return []
        f = p.get("fairness") or {}
        if f.get("tenants", 0) < 2:
            return [f"n/a ({f.get('tenants', 0)} tenant)"]
        return [plain(f["jain"]["hit_rate"], 3)]

    rows = [
        [p["name"], *rates(p), plain(p.get("evictions")), *jain(p), "yes" if p.get("underfilled") else ""]
        for p in summary["points"]
    ]
    header = ["point", "token all", "token steady", "block all", "block steady", "evictions"]
    header += ["Jain (tenants)"] * tenants + ["underfilled"]
    inf = summary["infinite_cache"]["token"]
    note = (
        f"Infinite-cache bound (every block ever seen stays cached): {pct(inf['all'])} of all tokens, "
        f"{pct(inf['steady'])} in the steady state (after the warm-up share of requests)."
    )
    if any(p.get("cached_tokens_reported") is False for p in summary["points"]):
        note += " n/a: the server reported no cached tokens (no usage.prompt_tokens_details), so nothing is known."
    return Section("Hit rate per point", [Table(header, rows), note] if rows else [note])


@section_at(50, "requests")
def tier_section(requests: pa.Table | None) -> Section:
    """Share of input tokens served from each tier, per point (only backends with tiers fill these columns)."""
    lower = TIERS[1:]  # a single-tier backend fills only hbm: the table would say nothing the others don't
    if requests is None or all(requests.column(f"hit_tokens_{t}").null_count == requests.num_rows for t in lower):
        return Section("Hit rate by tier")
    rows = []
    for point in pc.unique(requests.column("point")).to_pylist():
        sub = requests.filter(pc.equal(requests.column("point"), point))
        total = pc.sum(sub.column("input_tokens")).as_py() or 1
        row = [point]
        for t in TIERS:
            row.append(pct((pc.sum(sub.column(f"hit_tokens_{t}")).as_py() or 0) / total))
        row.append(pct((pc.sum(sub.column("hit_tokens")).as_py() or 0) / total))
        rows.append(row)
    return Section("Hit rate by tier", [Table(["point", "HBM", "DRAM", "SSD", "global pool", "all tiers"], rows)])


@section_at(60, "summary")
def curve_section(summary: dict) -> Section:
    """Hit rate vs capacity: the one-pass curves, the swept points per policy (in the curve's colour), Belady
    (optimal with bypass) as the bound a real policy can approach, and the infinite cache as the bound nothing
    passes."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, PercentFormatter

    by_policy: dict[str, list] = {}
    for p in summary["points"]:
        if "capacity_blocks" in p and "policy" in p:
            by_policy.setdefault(p["policy"], []).append((p["capacity_blocks"], p["hit_rate"]["token"]["steady"]))
    curves = summary.get("curves") or []
    if not curves and not any(len(v) > 1 for v in by_policy.values()):
        return Section("Hit rate vs capacity")
    # constrained: the saved SVG is cropped to what is drawn, so default margins would shrink the plot
    fig, ax = plt.subplots(figsize=(FULL_WIDTH, 4.8), layout="constrained")
    with_curve = {c["policy"] for c in curves}
    for c in curves:
        ax.plot(c["capacity_blocks"], c["token_steady"], label=f"{c['policy']} (one-pass curve)",
                linewidth=1.5, **line_style(c["policy"]))  # fmt: skip
    for name, pts in sorted(by_policy.items()):
        pts.sort()
        # a policy with a curve: its swept points sit on the curve as dots of the same colour, no second line
        line = {"linestyle": "none"} if name in with_curve else {}
        label = f"{name} (replayed points)" if name in with_curve else name
        style = {**line_style(name), **line}
        ax.plot([c for c, _ in pts], [h for _, h in pts], marker="o", markersize=4, label=label, **style)
    ax.axhline(summary["infinite_cache"]["token"]["steady"], label="infinite cache", **INFINITE_STYLE)
    ax.set_xscale("log")
    log_ticks(ax)
    lo, hi = ax.get_xlim()
    if hi / lo < 100:  # a sweep within two decades has one or two labelled decades: label 2× and 5× as well
        ax.xaxis.set_minor_formatter(plt.FuncFormatter(lambda v, _: count(v)))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("token hit rate (steady state)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    ax.grid(alpha=0.1, which="minor")
    per_block = bytes_per_block(summary)
    if per_block:
        # the bottom axis's labelled ticks in bytes along the top, so a capacity can be read as memory to buy
        steps = (1, 2, 5) if hi / lo < 100 else (1,)
        top = ax.secondary_xaxis("top", functions=(lambda b: b * per_block, lambda x: x / per_block))
        exponents = range(int(np.floor(np.log10(lo))), int(np.ceil(np.log10(hi))) + 1)
        ticks = [m * 10.0**k for k in exponents for m in steps if lo <= m * 10.0**k <= hi]
        top.xaxis.set_major_locator(FixedLocator([t * per_block for t in ticks]))
        top.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: size(v)))
        top.xaxis.set_minor_locator(NullLocator())
        top.set_xlabel(f"capacity ({summary['config']['model']}, {size(per_block)} per block)")
    bound = "; belady is the optimal bound" if "belady" in by_policy else ""
    items = [Figure(svg(fig), f"Steady-state token hit rate against cache capacity{bound}")]
    for c in curves:
        pairs = list(zip(c["capacity_blocks"], c["token_steady"]))[:: max(1, len(c["capacity_blocks"]) // 10)]
        header = ["capacity (blocks)"] + (["capacity (bytes)"] if per_block else []) + [f"{c['policy']} steady"]
        rows = [[plain(a)] + ([size(a * per_block)] if per_block else []) + [pct(b)] for a, b in pairs]
        items.append(Table(header, rows))
    return Section("Hit rate vs capacity", items)
