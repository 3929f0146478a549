"""The report's three further views of tenant fairness (`kvbench.metrics.fairness`): hit rate over each tenant's own
bound, hit share over entitlement (--tenant-weights), SLO attainment and the TTFT p99 guarantee (--tenant-slo or
the trace's targets); a summary row per point, then each point's tenants."""

from __future__ import annotations

from kvbench.report.page import Table, pct
from kvbench.report.style import plain

MAX_POINTS = 4  # points whose per-tenant table is shown (summary.json has every point's)
MAX_TENANTS = 30  # rows of a per-tenant table: beyond that the busiest ones


def views_items(points: list[dict]) -> list:
    have = [p for p in points if p.get("tenant_fairness")]
    if not have:
        return []
    # a column per view some point has (entitlement needs --tenant-weights, SLO ones a modeled or measured TTFT)
    views = [
        (key, title)
        for key, title in (
            ("hit_rate_of_bound", "Jain, hit rate of own bound"),
            ("share_of_entitlement", "Jain, share of entitlement"),
            ("slo_attainment", "Jain, SLO attainment"),
        )
        if any(any(key in r for r in p["tenant_fairness"]) for p in have)
    ]
    guarantee = any("p99_guarantee" in p["fairness"] for p in have)
    rows = []
    for p in have:
        jain = p["fairness"].get("jain", {})
        row = [p["name"], *(_jain(jain.get(key)) for key, _ in views)]
        rows.append(row + ([_guarantee(p["fairness"].get("p99_guarantee"))] if guarantee else []))
    header = ["point", *(title for _, title in views)] + (["TTFT p99 guarantee"] if guarantee else [])
    items: list = [
        "Fairness three more ways (docs/semantics.md, Fairness): Jain's index over each tenant's hit rate divided by "
        "its own bound (what an unbounded cache gives its requests alone), over its share of the hit tokens divided "
        "by its share of --tenant-weights, and over its SLO attainment; the TTFT p99 guarantee holds when every "
        "tenant with a TTFT target has its p99 within it.",
        Table(header, rows),
    ]
    for p in have[:MAX_POINTS]:
        tenants = sorted(p["tenant_fairness"], key=lambda r: -r["requests"])[:MAX_TENANTS]
        cols = _columns(tenants)
        busiest = f" (the {MAX_TENANTS} busiest)" if len(tenants) == MAX_TENANTS else ""
        items.append(f"{p['name']}, by tenant{busiest}")
        items.append(Table([c[0] for c in cols], [[c[1](r) for c in cols] for r in tenants]))
    if len(have) > MAX_POINTS:
        items.append(f"Per-tenant tables of the first {MAX_POINTS} of {len(have)} points; summary.json has all.")
    return items


def _columns(tenants: list[dict]) -> list[tuple]:
    """The per-tenant columns the rows have (entitlement and SLO ones only when given or modeled)."""
    cols = [("tenant", lambda r: r["name"]), ("requests", lambda r: plain(r["requests"])),
            ("hit rate", lambda r: pct(r["hit_rate"]))]  # fmt: skip
    if any("own_bound" in r for r in tenants):
        cols += [
            ("own bound", lambda r: pct(r["own_bound"])),
            ("of bound", lambda r: _num(r["hit_rate_of_bound"], "no reuse to get")),
        ]
    if any("entitlement" in r for r in tenants):
        cols += [
            ("hit share", lambda r: pct(r["hit_share"])),
            ("entitled", lambda r: pct(r["entitlement"])),
            ("share / entitled", lambda r: _num(r["share_of_entitlement"], "no weight")),
        ]
    if any(r.get("ttft_p99_ms") is not None for r in tenants):
        cols += [
            ("SLO attainment", lambda r: "no target" if r.get("slo_attainment") is None else pct(r["slo_attainment"])),
            ("TTFT p99 / target", _p99_cell),
        ]
    return cols


def _p99_cell(r: dict) -> str:
    p99, target = r.get("ttft_p99_ms"), r.get("ttft_p99_target_ms")
    if p99 is None:
        return "none answered"
    if target is None:
        return f"{plain(p99, 3)} ms / none"
    return f"{plain(p99, 3)} / {plain(target, 3)} ms {'met' if r['ttft_p99_met'] else 'MISSED'}"


def _guarantee(g: dict | None) -> str:
    if not g:
        return "no TTFT targets"
    if g["met"]:
        return f"met by all {g['tenants']} tenants"
    missed = ", ".join(g["missed"][:5]) + (" …" if len(g["missed"]) > 5 else "")
    return f"missed by {len(g['missed'])} of {g['tenants']}: {missed}"


def _num(value, missing: str) -> str:
    return missing if value is None else plain(value, 3)


def _jain(value) -> str:
    return "undefined (all 0)" if value is None else plain(value, 3)
