"""Latency and time sections of a run report: percentile tables and CDFs of TTFT / TPOT / ITL / E2EL,
per-tenant latency fairness, and the timeline of request rate, latency and KV occupancy."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.live.latency import PERCENTILES
from kvbench.report.page import Figure, Section, Table, num, pct, svg

METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"), ("ttfo", "TTFO"))
CDF_POINTS = 400  # quantiles drawn per CDF: enough for a smooth line, bounded for millions of requests


def _ms(x) -> str:
    return "–" if x is None else f"{x:,.2f}"


def measured(requests: pa.Table) -> pa.Table:
    """Requests that count in latency metrics (vLLM's rule): answered, and not sent during warm-up."""
    ok = pc.equal(requests.column("status"), "ok")
    warm = pc.fill_null(requests.column("warmup"), False)
    return requests.filter(pc.and_(ok, pc.invert(warm)))


def latency_sections(point: dict, requests: pa.Table | None) -> list[Section]:
    lat = point.get("latency")
    if not lat:
        return [Section("Latency"), Section("Latency by tenant")]
    rows = []
    for key, title in METRICS:
        d = lat.get(key)
        if d:
            rows.append(
                [title, _ms(d["mean_ms"])]
                + [_ms(d[f"p{p}_ms"]) for p in PERCENTILES]
                + [_ms(d["max_ms"]), num(d["count"])]
            )
    for key, title in (("ttft", "TTFT from scheduled send"), ("e2el", "E2EL from scheduled send")):
        d = (lat.get("from_scheduled") or {}).get(key)
        if d:
            rows.append(
                [title, _ms(d["mean_ms"])]
                + [_ms(d[f"p{p}_ms"]) for p in PERCENTILES]
                + [_ms(d["max_ms"]), num(d["count"])]
            )
    if lat.get("schedule_lag"):
        d = lat["schedule_lag"]
        rows.append(
            ["schedule lag", _ms(d["mean_ms"])]
            + [_ms(d[f"p{p}_ms"]) for p in PERCENTILES]
            + [_ms(d["max_ms"]), num(d["count"])]
        )
    header = ["metric (ms)", "mean"] + [f"p{p}" for p in PERCENTILES] + ["max", "count"]
    r = lat["requests"]
    facts = [
        [
            "requests sent / ok / failed / not sent",
            f"{r['sent']:,} / {r['ok']:,} / {r['failed']:,} / {r['not_sent']:,}",
        ],
        ["warm-up requests (left out)", num(r["warmup"])],
        ["duration (s)", num(lat.get("duration_s"))],
        ["request throughput (req/s)", num(lat.get("request_throughput"))],
        ["output throughput (tok/s)", num(lat.get("output_throughput"))],
    ]
    if lat.get("goodput"):
        g = lat["goodput"]
        slo = ", ".join(f"{k}≤{v:g}" for k, v in g["slo"].items())
        facts.append([f"goodput ({slo})", f"{g['requests_per_s']:.4g} req/s, {pct(g['fraction'])} of requests"])
    items: list = [Table(["", ""], facts), Table(header, rows)]
    if requests is not None:
        fig = _cdfs(measured(requests))
        if fig is not None:
            items.insert(
                1, Figure(fig, "Cumulative distributions of per-request latencies (warm-up and failures excluded)")
            )
    tenants = lat.get("by_tenant") or []
    tenant_items: list = []
    if len(tenants) > 1:
        jain = (lat.get("fairness") or {}).get("jain", {}).get("ttft_p50")
        tenant_items = [
            f"Jain's index over tenants' median TTFT: {num(jain)} (1 = every tenant waits the same).",
            Table(
                ["tenant", "requests", "TTFT p50 ms", "TTFT p99 ms", "slowdown (p50 / everyone's p50)"],
                [
                    [t["name"], num(t["requests"]), _ms(t["ttft_p50_ms"]), _ms(t["ttft_p99_ms"]), num(t["slowdown"])]
                    for t in tenants[:30]
                ],
            ),
        ]
    return [Section("Latency", items), Section("Latency by tenant", tenant_items)]


def _cdfs(rows: pa.Table) -> str | None:
    import matplotlib.pyplot as plt

    if rows.num_rows == 0:
        return None
    series = []
    for key, title in METRICS[:4]:
        if key == "itl":
            values = pc.list_flatten(rows.column("itl_s")).to_numpy(zero_copy_only=False)
        else:
            values = rows.column(f"{key}_s").to_numpy(zero_copy_only=False)
        values = np.asarray(values, dtype=np.float64)
        values = values[np.isfinite(values)]
        if values.size:
            series.append((title, values * 1000.0))
    if not series:
        return None
    fig, axes = plt.subplots(1, len(series), figsize=(3 * len(series), 2.8), squeeze=False)
    q = np.linspace(0, 1, CDF_POINTS)
    for ax, (title, values) in zip(axes[0], series):
        ax.plot(np.quantile(values, q), q)
        ax.set_xlabel(f"{title} (ms)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    fig.tight_layout()
    return svg(fig)


def _working_set(trace: pa.Table) -> pa.Table:
    """request_id, arrival_s and the distinct block ids seen up to and including each request (content ids:
    salts would split them further)."""
    hashes = trace.column("block_hashes").combine_chunks()
    offsets = np.asarray(hashes.offsets)
    values = np.asarray(hashes.values.slice(offsets[0], offsets[-1] - offsets[0]))
    owner = np.repeat(np.arange(trace.num_rows), np.diff(offsets))
    _, first = np.unique(values, return_index=True)
    seen = np.cumsum(np.bincount(owner[first], minlength=trace.num_rows))
    return pa.table({"request_id": trace.column("request_id"), "arrival_s": trace.column("arrival_s"), "seen": seen})


def timeline_section(summary: dict, point: dict, requests: pa.Table | None, trace: pa.Table | None) -> Section:
    """Request rate, latency and KV occupancy against time. Live runs: send times, measured TTFT and the
    engine's own KV usage gauge polled during the run. Offline runs: trace arrival times, the hit rate, and the
    working set (distinct blocks seen so far) against the capacity: a policy that inserts every miss and
    evicts only when full holds the smaller of the two."""
    import matplotlib.pyplot as plt

    if requests is None or requests.num_rows == 0:
        return Section("Timeline")
    live = requests.column("actual_send_s").null_count < requests.num_rows
    rows = requests.filter(pc.equal(requests.column("point"), point["name"]))
    if live:
        rows = rows.filter(pc.is_valid(rows.column("actual_send_s")))
        t = rows.column("actual_send_s").to_numpy(zero_copy_only=False)
    elif trace is not None and "arrival_s" in trace.column_names:
        rows = rows.select(["request_id", "input_tokens", "hit_tokens"]).join(_working_set(trace), "request_id")
        t = rows.column("arrival_s").to_numpy(zero_copy_only=False)
    else:
        return Section("Timeline")
    if t.size == 0 or not np.isfinite(t).any():
        return Section("Timeline")
    order = np.argsort(t, kind="stable")
    t = t[order] - np.nanmin(t)
    fig, axes = plt.subplots(3, 1, figsize=(8, 6.5), sharex=True)
    span = max(float(np.nanmax(t)), 1e-9)
    bins = np.linspace(0, span, min(100, max(10, int(np.sqrt(t.size)))) + 1)
    counts, edges = np.histogram(t, bins)
    axes[0].step(edges[:-1], counts / np.diff(edges), where="post")
    axes[0].set_ylabel("requests / s")
    if live:
        ttft = rows.column("ttft_s").to_numpy(zero_copy_only=False).astype(np.float64)[order] * 1000
        axes[1].plot(t, ttft, ".", markersize=2)
        axes[1].set_ylabel("TTFT (ms)")
        timeline = point.get("server_timeline") or point.get("kv_timeline") or {}
        usage = [np.nan if u is None else u for u in timeline.get("kv_usage") or []]
        if usage:
            start = float(np.nanmin(rows.column("actual_send_s").to_numpy(zero_copy_only=False)))
            axes[2].plot(np.asarray(timeline["t_s"]) - start, 100 * np.asarray(usage, dtype=float))
            axes[2].set_ylabel("engine KV usage (%)")
        else:
            axes[2].text(0.5, 0.5, "the server exposes no KV usage gauge", ha="center", transform=axes[2].transAxes)
    else:
        hit = rows.column("hit_tokens").to_numpy(zero_copy_only=False).astype(np.float64)[order]
        inp = rows.column("input_tokens").to_numpy(zero_copy_only=False).astype(np.float64)[order]
        axes[1].plot(t, np.divide(hit, inp, out=np.zeros_like(hit), where=inp > 0), ".", markersize=2)
        axes[1].set_ylabel("token hit rate")
        axes[2].plot(t, rows.column("seen").to_numpy()[order], label="distinct blocks seen")
        if "capacity_blocks" in point:
            axes[2].axhline(point["capacity_blocks"], color="grey", linestyle=":", label="capacity")
        axes[2].legend(fontsize=7)
        axes[2].set_ylabel("blocks")
    axes[2].set_xlabel("time since the first request (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    what = "send time" if live else "trace arrival time"
    return Section(
        "Timeline",
        [Figure(svg(fig), f"Request rate, latency or hit rate, and KV occupancy by {what} ({point['name']})")],
    )
