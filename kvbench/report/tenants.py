"""Per-group sections of a run report, for every point of the run: hit rate by tenant / workload / modality
(a dot plot per capacity, one colour per policy, and the full tables) and tenant fairness (Jain, max/min with
the reason when it is undefined, evictor × victim heat maps)."""

from __future__ import annotations

import numpy as np

from kvbench.report.fairness_views import views_items
from kvbench.report.page import Figure, Section, Table, pct, svg
from kvbench.report.sections import section_at
from kvbench.report.style import FULL_WIDTH, SMALL_MULTIPLE, colour, plain
from kvbench.trace.hitsums import NO_LABEL

MAX_GROUPS = 30  # tenants (or workloads) per plot and table: beyond that a row label is unreadable
MAX_PANELS = 6  # small multiples per figure: two rows at full width
FEW_GROUPS = 6  # up to this many groups, one table with a row per point and a column per group
MAX_COLUMNS = 6  # points per table: with longer names (belady/21200blocks) wider tables overflow the page
MAX_HEAT_PANELS = 12  # evictor × victim matrices drawn: every policy of a large sweep at one capacity
MAX_HEAT = 12  # tenants named on a heat map's axes; the rest are summed into one 'other' row and column
BREAKDOWNS = (
    ("by_tenant", "tenant", "tenant"),
    ("by_workload", "workload", "workload"),
    ("by_modality", "modality", None),
)  # fmt: skip  (summary key, title, requests.parquet column)


def point_groups(points: list[dict]) -> list[tuple[str, list[dict]]]:
    """The points split for side-by-side reading: one group per capacity that a policy other than the
    optimal bound was run at (the sweep's capacities, policies compared at equal size), then the rest
    (Belady's bound-only capacities, engine-sim's instance counts) in groups of MAX_COLUMNS."""
    swept: dict[int, list[dict]] = {}
    for p in points:
        if "capacity_blocks" in p and p.get("policy") not in (None, "belady"):
            swept.setdefault(p["capacity_blocks"], [])
    rest = []
    for p in points:
        if p.get("capacity_blocks") in swept:
            swept[p["capacity_blocks"]].append(p)
        else:
            rest.append(p)
    groups = [(f"{plain(c)} blocks", swept[c]) for c in sorted(swept)]
    title = "other points" if groups else "every point" if len(rest) <= MAX_COLUMNS else "points"
    parts = range(0, len(rest), MAX_COLUMNS)
    numbered = len(parts) > 1
    groups += [(f"{title} ({k + 1} of {len(parts)})" if numbered else title, rest[i : i + MAX_COLUMNS])
               for k, i in enumerate(parts)]  # fmt: skip
    return groups


def chosen_group(groups: list[tuple[str, list[dict]]]) -> tuple[str, list[dict]]:
    """The capacity to look at first: the one with the most distinct policies, the middle one of equals (the
    smallest is often all misses and the largest all hits, where policies do not differ)."""

    def policies(group: list[dict]) -> int:
        return len({_series(p) for p in group})

    most = max(policies(g) for _, g in groups)
    best = [g for g in groups if policies(g[1]) == most]
    return best[len(best) // 2]


def _series(p: dict) -> str:
    return p.get("policy") or p["name"]


def _names(points: list[dict], key: str) -> list[str]:
    """Every group seen at any point, the largest (most input tokens at the first point holding it) first."""
    size: dict[str, int] = {}
    for p in points:
        for g in p.get(key) or []:
            size.setdefault(g["name"], g.get("input_tokens") or g.get("tokens") or 0)
    return sorted(size, key=lambda n: -size[n])


def _rates(p: dict, key: str) -> dict[str, float]:
    return {g["name"]: g["hit_rate"] for g in p.get(key) or []}


def _cut_note(total: int, shown: int, what: str, key: str, column: str | None) -> str:
    where = f"summary.json (points[].{key})"
    if column:
        where += f" and requests.parquet (column {column})"
    return (
        f"{total:,} {what}s: the {shown:,} with the most input tokens are shown; the remaining {total - shown:,} "
        f"are in {where}."
    )


@section_at(70, "summary")
def breakdown_sections(summary: dict) -> list[Section]:
    points = summary["points"]
    out = []
    for key, title, column in BREAKDOWNS:
        names = _names(points, key)
        if not names:
            out.append(Section(f"Hit rate by {title}"))
            continue
        if len(names) == 1:  # a table of one column would repeat 'Hit rate per point'
            one = f"one {title}, {names[0]}" if names[0] != NO_LABEL else f"no {title} (the trace names none)"
            items = [f"Every request belongs to {one}: its hit rates are those of 'Hit rate per point'."]
            out.append(Section(f"Hit rate by {title}", items))
            continue
        # cut only when it saves something: hiding the last two of 32 tenants would cost more than it spares
        shown = names if len(names) <= MAX_GROUPS + 5 else names[:MAX_GROUPS]
        groups = point_groups(points)
        items: list = []
        if len(names) > 1:
            items.append(_dot_figure(groups, key, shown, title))
        if len(names) > len(shown):
            items.append(_cut_note(len(names), len(shown), title, key, column))
        first = {g["name"]: g for g in points[0].get(key) or []} if points else {}
        if len(names) <= FEW_GROUPS:
            # a few groups (workloads, modalities): one row per point reads best, every point in one table
            rows = [[p["name"], *(pct(_rates(p, key).get(n)) for n in names)] for p in points]
            items.append(f"Token hit rate (all requests) by {title}, every point:")
            items.append(Table(["point", *names], rows))
            out.append(Section(f"Hit rate by {title}", items))
            continue
        for label, whole in groups:
            parts = range(0, len(whole), MAX_COLUMNS)
            for i in parts:  # a capacity swept with many policies: its table in parts that fit the page
                group = whole[i : i + MAX_COLUMNS]
                part = f" ({i // MAX_COLUMNS + 1} of {len(parts)})" if len(parts) > 1 else ""
                rows = []
                for name in shown:
                    requests = (first.get(name) or {}).get("requests")
                    row = [name, plain(requests) if requests is not None else "–"]
                    row += [pct(_rates(p, key).get(name)) for p in group]
                    rows.append(row)
                items.append(f"Token hit rate (all requests) by {title}, {label}{part}:")
                items.append(Table([title, "requests", *(p["name"] for p in group)], rows))
        out.append(Section(f"Hit rate by {title}", items))
    return out


def _dot_figure(groups: list[tuple[str, list[dict]]], key: str, names: list[str], title: str) -> Figure:
    """One panel per capacity, one row per group, one dot per policy in its colour: the policies' hit rates
    for a tenant side by side, and the tenants a policy starves stand out at the left."""
    import matplotlib.pyplot as plt

    # the capacities policies were compared at; the leftovers (Belady's bound-only capacities) in the tables
    swept = [g for g in groups if len({_series(p) for p in g[1]}) > 1]
    panels = (swept or groups)[:MAX_PANELS]
    cols = _columns(len(panels))
    rows = -(-len(panels) // cols)
    height = 0.22 * len(names) + 1.4
    fig, axes = plt.subplots(
        rows, cols, figsize=(FULL_WIDTH if cols > 1 else SMALL_MULTIPLE * 2, height * rows), sharey=True,
        squeeze=False, layout="constrained",
    )  # fmt: skip
    y = np.arange(len(names))
    seen: dict[str, object] = {}
    # one x range for all panels, from the tenth below the lowest rate drawn: rates bunched at 60-90 % would
    # otherwise share a third of an axis that starts at 0
    drawn = [r for _, g in panels for p in g for n, r in _rates(p, key).items() if n in names and r is not None]
    low = np.floor(min(drawn, default=0.0) * 10) / 10
    for ax, (label, group) in zip(axes.flat, panels):
        for k, p in enumerate(group):
            rates = _rates(p, key)
            x = [rates.get(n, np.nan) for n in names]
            mark = "D" if p.get("policy") == "belady" else "o"
            # each policy a little lower in the row than the one before: policies with equal rates (common
            # when neither evicts a tenant's blocks) would otherwise hide each other's dots
            dodge = 0.4 * (k / max(len(group) - 1, 1) - 0.5)  # within ±0.2 of the row, clear of the next
            seen[_series(p)] = ax.scatter(x, y + dodge, s=22, marker=mark, color=colour(_series(p)), zorder=3)
        ax.set_title(label, fontsize=9)
        ax.set_xlim(low - 0.02, 1.02)
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    axes[0][0].set_yticks(y, names)
    axes[0][0].set_ylim(len(names) - 0.5, -0.5)  # largest group on top; rows keep their dodged dots inside
    for ax in axes[-1]:
        ax.set_xlabel("token hit rate (all requests)", fontsize=8)
    fig.legend(seen.values(), seen.keys(), loc="outside upper center", ncol=min(len(seen), 9), fontsize=8)
    more = " (the capacities policies were compared at; the tables below have every point)"
    more = more if len(groups) > len(panels) else ""
    per = "one panel per capacity, " if any("capacity_blocks" in p for _, g in panels for p in g) else ""
    return Figure(svg(fig), f"Token hit rate by {title}, {per}one colour per policy{more}")


def _columns(panels: int) -> int:
    """Panels per row: three at most, two for four panels (a 2 × 2 grid, not three and a lone one)."""
    return 2 if panels == 4 else min(panels, 3)


def _zero_tenants(p: dict) -> list[dict]:
    return [g for g in p.get("by_tenant") or [] if not g["hit_rate"]]


def _ratio_cell(p: dict) -> tuple[str, str]:
    """(max/min over all tenants, max/min over the tenants with hits): the first is undefined as soon as one
    tenant has no hit, which says less than how unequal the others are, so both are shown."""
    ratio = (p["fairness"].get("max_min_ratio") or {}).get("hit_rate")
    rates = [g["hit_rate"] for g in p.get("by_tenant") or [] if g["hit_rate"]]
    among = plain(max(rates) / min(rates), 3) if len(rates) > 1 else "n/a"
    if ratio is not None:
        return plain(ratio, 3), among
    zero = len(_zero_tenants(p))
    return (f"undefined ({zero} at 0%)" if zero else "undefined"), among


@section_at(80, "summary")
def fairness_section(summary: dict) -> Section:
    points = [p for p in summary["points"] if (p.get("fairness") or {}).get("tenants", 0) >= 2]
    if not points:
        return Section("Tenant fairness")
    rows = []
    for p in points:
        tenants = sorted(p["by_tenant"], key=lambda g: g["hit_rate"])
        # the tenants at 0 % are counted in their own column (mostly one-request tenants, see the note): the
        # worst among the others is the one a policy change could help
        worst = next((g for g in tenants if g["hit_rate"]), tenants[0])
        ratio, among = _ratio_cell(p)
        rows.append(
            [
                p["name"],
                plain(p["fairness"]["jain"]["hit_rate"], 3),
                ratio,
                among,
                plain(p["fairness"]["tenants"]),
                plain(len(_zero_tenants(p))),
                f"{worst['name']} ({pct(worst['hit_rate'])}, {plain(worst['requests'])} req.)",
            ]
        )
    # short headers: the table has a row per point and must fit the page without wrapping its cells
    header = ["point", "Jain's index", "max/min", "max/min with hits", "tenants", "at 0%", "worst-served with hits"]
    items: list = [
        "Jain's index is 1 when every tenant has the same hit rate and 1/n when one tenant takes all. The max/min "
        "ratio divides the best tenant's hit rate by the worst's.",
        Table(header, rows),
    ]
    zero = [(p["name"], _zero_tenants(p)) for p in points if _zero_tenants(p)]
    if zero:
        sample = zero[0][1]
        few = sum(1 for g in sample if g["requests"] <= 1)
        # the usual cause: a tenant's only request finds none of its tenant's blocks cached before it
        why = f", {few} of them with a single request, which finds none of its tenant's blocks cached" if few else ""
        items.append(
            f"max/min ratio undefined: at {len(zero)} of {len(points)} points a tenant has a 0% hit rate (at "
            f"{zero[0][0]}: {len(sample)} tenant(s){why}), and no ratio divides by 0. 'max/min with hits' leaves "
            "those tenants out; summary.json's by_tenant lists every tenant with its requests and hit rate."
        )
    items += views_items(points)
    items += heat_maps(points)
    return Section("Tenant fairness", items)


def heat_maps(points: list[dict]) -> list:
    """Evictor × victim matrices: one panel per policy at the chosen capacity, and for every point a row of
    what the matrix says (self-evictions, the heaviest pair), so no point is left out."""
    have = [p for p in points if _matrix(p) is not None]
    if not have:
        tracked = any((p.get("fairness") or {}).get("evictor_victim") for p in points)
        return ["No point evicted a block: the evictor × victim matrices are empty."] if tracked else []
    label, group = chosen_group(point_groups(have))
    items: list = [_heat_figure(group[:MAX_HEAT_PANELS], label)]
    if len(group) > MAX_HEAT_PANELS:
        items.append(f"Heat maps of the first {MAX_HEAT_PANELS} of {len(group)} points at {label}; the table has all.")
    rows = []
    for p in have:
        m, names = _matrix(p)
        total = m.sum()
        i, j = np.unravel_index(np.argmax(m), m.shape)
        rows.append(
            [
                p["name"],
                plain(int(total)),
                pct(np.trace(m) / total),
                f"{names[i]} → {names[j]}",
                pct(m[i, j] / total),
            ]
        )
    items.append("Evictions by evicting and victim tenant, every point with evictions:")
    header = ["point", "blocks evicted", "tenant evicted its own", "heaviest pair (evictor → victim)", "its share"]
    items.append(Table(header, rows))
    return items


def _matrix(p: dict) -> tuple[np.ndarray, list[str]] | None:
    ev = (p.get("fairness") or {}).get("evictor_victim")
    if not ev or len(ev["tenants"]) < 2:
        return None
    m = np.asarray(ev["matrix"], dtype=float)
    return (m, list(ev["tenants"])) if m.sum() > 0 else None


def _shared_axes(mats: list[tuple[np.ndarray, list[str]]]) -> list[str]:
    """The MAX_HEAT - 1 tenants most involved in evictions (as evictor or victim) over all the panels: the same
    tenants on every panel's axes, so the panels compare cell by cell."""
    involved: dict[str, float] = {}
    for m, names in mats:
        for k, name in enumerate(names):
            involved[name] = involved.get(name, 0.0) + m[k, :].sum() + m[:, k].sum()
    return sorted(involved, key=lambda n: -involved[n])[: MAX_HEAT - 1]


def _reduced(m: np.ndarray, names: list[str], keep: list[str]) -> tuple[np.ndarray, list[str]]:
    """`m` on the tenants `keep`, plus one 'other' row and column summing the rest: every eviction stays in
    the plot while its labels stay readable."""
    if len(names) <= len(keep) + 1:
        return m, names
    index = [[names.index(n)] if n in names else [] for n in keep]
    index.append([k for k, n in enumerate(names) if n not in keep])
    out = np.array([[m[np.ix_(r, c)].sum() for c in index] for r in index])
    return out, [*keep, f"other ({len(index[-1])})"]


def _heat_figure(group: list[dict], label: str) -> Figure:
    import matplotlib
    import matplotlib.pyplot as plt

    cols = _columns(len(group))
    rows = -(-len(group) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(FULL_WIDTH, 3.8 * rows), squeeze=False, layout="constrained")
    raw = [_matrix(p) for p in group]
    keep = _shared_axes(raw)
    mats = [_reduced(m, names, keep) for m, names in raw]
    vmax = max(m.max() for m, _ in mats) + 1
    # one log colour scale for all panels: one heavy tenant would otherwise paint every other cell alike,
    # and a shared scale lets the panels be compared
    norm = matplotlib.colors.LogNorm(vmin=1, vmax=max(vmax, 2))
    for ax, p, (m, names) in zip(axes.flat, group, mats):
        im = ax.imshow(m + 1, cmap="viridis", norm=norm)
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
        ax.set_yticks(range(len(names)), names, fontsize=6)
        ax.set_title(p["name"], fontsize=9)
        ax.set_xlabel("victim tenant", fontsize=7)
    for row in axes:
        row[0].set_ylabel("evicting tenant", fontsize=7)
    for ax in axes.flat[len(group) :]:
        ax.set_visible(False)
    fig.colorbar(im, ax=axes.ravel().tolist(), label="blocks evicted + 1 (log)", shrink=0.8)
    return Figure(
        svg(fig),
        f"Evictor × victim at {label}, one panel per policy: whose insertions evicted whose blocks. Axes name "
        f"the {MAX_HEAT - 1} tenants most involved over these panels (the same on each); 'other' sums the rest "
        "(summary.json has every matrix).",
    )
