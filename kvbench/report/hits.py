"""Hit-rate sections of a run report: per point and tier, by tenant / workload / modality, the
hit-rate-vs-capacity curves with the optimal bound, and tenant fairness (Jain, max/min, evictor × victim)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.report.page import Figure, Section, Table, num, pct, svg

TIERS = ("hbm", "dram", "ssd", "global")
MAX_GROUPS = 30  # bars and table rows per breakdown: beyond that a plot is unreadable


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

    rows = [
        [
            p["name"],
            *rates(p),
            num(p.get("evictions")),
            num(p["fairness"]["jain"]["hit_rate"]),
            "yes" if p.get("underfilled") else "",
        ]
        for p in summary["points"]
    ]
    header = [
        "point",
        "token all",
        "token steady",
        "block all",
        "block steady",
        "evictions",
        "Jain (tenants)",
        "underfilled",
    ]
    inf = summary["infinite_cache"]["token"]
    note = (
        f"Infinite-cache bound (every block ever seen stays cached): {pct(inf['all'])} of all tokens, "
        f"{pct(inf['steady'])} in the steady state (after the warm-up share of requests)."
    )
    if any(p.get("cached_tokens_reported") is False for p in summary["points"]):
        note += " n/a: the server reported no cached tokens (no usage.prompt_tokens_details), so nothing is known."
    return Section("Hit rate per point", [Table(header, rows), note] if rows else [note])


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


def breakdown_sections(summary: dict) -> list[Section]:
    import matplotlib.pyplot as plt

    points = summary["points"]
    out = []
    for key, title in (("by_tenant", "tenant"), ("by_workload", "workload"), ("by_modality", "modality")):
        if not points or not points[0].get(key):
            out.append(Section(f"Hit rate by {title}"))
            continue
        shown = points[:8]
        names = [g["name"] for g in points[0][key]][:MAX_GROUPS]
        rows = []
        for name in names:
            row = [name]
            for p in shown:
                g = next((g for g in p.get(key) or [] if g["name"] == name), None)
                row.append(pct(g["hit_rate"]) if g else "–")
            rows.append(row)
        items = [Table([title] + [p["name"] for p in shown], rows)]
        if len(names) > 1:
            fig, ax = plt.subplots(figsize=(7, 0.28 * len(names) * min(len(shown), 3) + 1.2))
            y = np.arange(len(names))
            height = 0.8 / min(len(shown), 3)
            for k, p in enumerate(shown[:3]):
                rates = {g["name"]: g["hit_rate"] for g in p.get(key) or []}
                ax.barh(y + k * height, [rates.get(n, 0) or 0 for n in names], height, label=p["name"])
            ax.set_yticks(y + height * (min(len(shown), 3) - 1) / 2, names, fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel("token hit rate (all requests)")
            ax.legend(fontsize=7)
            ax.grid(axis="x", alpha=0.3)
            items.insert(0, Figure(svg(fig), f"Token hit rate by {title}, first {min(len(shown), 3)} point(s)"))
        out.append(Section(f"Hit rate by {title}", items))
    return out


def curve_section(summary: dict) -> Section:
    """Hit rate vs capacity: the one-pass curves, the swept points per policy, Belady (optimal with bypass)
    as the bound a real policy can approach, and the infinite cache as the bound nothing passes."""
    import matplotlib.pyplot as plt

    by_policy: dict[str, list] = {}
    for p in summary["points"]:
        if "capacity_blocks" in p and "policy" in p:
            by_policy.setdefault(p["policy"], []).append((p["capacity_blocks"], p["hit_rate"]["token"]["steady"]))
    curves = summary.get("curves") or []
    if not curves and not any(len(v) > 1 for v in by_policy.values()):
        return Section("Hit rate vs capacity")
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for c in curves:
        ax.plot(c["capacity_blocks"], c["token_steady"], label=f"{c['policy']} (one-pass curve)")
    for name, pts in sorted(by_policy.items()):
        pts.sort()
        style = dict(color="black", linestyle="--") if name == "belady" else {}
        ax.plot([c for c, _ in pts], [h for _, h in pts], marker="o", markersize=3, label=name, **style)
    ax.axhline(summary["infinite_cache"]["token"]["steady"], color="grey", linestyle=":", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("token hit rate (steady state)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    items = [Figure(svg(fig), "Steady-state token hit rate against cache capacity; belady is the optimal bound")]
    for c in curves:
        pairs = list(zip(c["capacity_blocks"], c["token_steady"]))[:: max(1, len(c["capacity_blocks"]) // 10)]
        items.append(
            Table(["capacity (blocks)", f"{c['policy']} steady hit rate"], [[num(a), pct(b)] for a, b in pairs])
        )
    return Section("Hit rate vs capacity", items)


def fairness_section(summary: dict) -> Section:
    import matplotlib
    import matplotlib.pyplot as plt

    point = summary["points"][0] if summary["points"] else None
    if point is None or not point.get("by_tenant") or len(point["by_tenant"]) < 2:
        return Section("Tenant fairness")
    f = point["fairness"]
    rows = [
        [
            p["name"],
            num(p["fairness"]["jain"]["hit_rate"]),
            num((p["fairness"].get("max_min_ratio") or {}).get("hit_rate")),
            num(p["fairness"].get("tenants")),
        ]
        for p in summary["points"]
    ]
    items: list = [Table(["point", "Jain's index (hit rate)", "max/min ratio", "tenants"], rows)]
    ev = f.get("evictor_victim")
    if ev and len(ev["tenants"]) > 1 and np.asarray(ev["matrix"]).sum() > 0:
        m = np.asarray(ev["matrix"], dtype=float)[:MAX_GROUPS, :MAX_GROUPS]
        fig, ax = plt.subplots(figsize=(6, 5))
        # log scale: one heavy tenant would otherwise paint every other cell the same colour
        im = ax.imshow(m + 1, cmap="viridis", norm=matplotlib.colors.LogNorm(vmin=1, vmax=max(m.max() + 1, 2)))
        names = ev["tenants"][:MAX_GROUPS]
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
        ax.set_yticks(range(len(names)), names, fontsize=6)
        ax.set_xlabel("victim tenant")
        ax.set_ylabel("evicting tenant")
        fig.colorbar(im, label="blocks evicted + 1 (log scale)")
        items.append(Figure(svg(fig), f"Evictor × victim: whose insertions evicted whose blocks ({point['name']})"))
    return Section("Tenant fairness", items)
