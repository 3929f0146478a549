"""Latency and time sections of a run report, for every point: percentile tables and CDFs of TTFT / TPOT / ITL /
E2EL, per-tenant latency fairness, and the timeline of request rate, latency and KV occupancy. Times are
written in the unit that suits them (a 42,291,158 ms TTFT reads 11.7 h) and every point keeps one colour."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.metrics.latency import PERCENTILES
from kvbench.report.page import Figure, Section, Table, pct, svg
from kvbench.report.sections import section_at
from kvbench.report.style import FULL_WIDTH, PALETTE, SMALL_MULTIPLE, colour, duration, log_ticks, plain, time_axis

METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"), ("ttfo", "TTFO"))
CDF_POINTS = 400  # quantiles drawn per CDF: enough for a smooth line, bounded for millions of requests
MS_TABLE_LIMIT_MS = 10_000.0  # a table whose times all stay below this reads best in ms, two decimals
# ticks of a log time axis at round durations (1 ms … 10 s, 2 min, 20 min, 2 h, 20 h), not at decades of seconds
LOG_TIME_TICKS = (1e-3, 1e-2, 0.1, 1.0, 10.0, 120.0, 1200.0, 7200.0, 72000.0)
MAX_TENANTS = 30  # tenants listed per point; the rest are in summary.json (latency.by_tenant)


def point_colours(points: list[dict]) -> dict[str, str]:
    """A colour per point: its policy's colour (the same in every report) when the policies tell the points
    apart, else one colour per point in order (vllm/1instances and vllm/2instances share a policy; a live
    point has none)."""
    policies = [p.get("policy") for p in points]
    if all(policies) and len(set(policies)) == len(points):
        return {p["name"]: colour(pol) for p, pol in zip(points, policies)}
    return {p["name"]: PALETTE[i % len(PALETTE)] for i, p in enumerate(points)}


def point_lines(points: list[dict]) -> dict[str, dict]:
    """matplotlib line keywords per point: its colour, and a dash pattern that changes from point to point, so
    two points that behave alike (a pool too large for the policy to matter) stay visible on top of each other."""
    dashes = ("-", "--", ":", "-.")
    return {
        name: {"color": c, "linestyle": dashes[i % len(dashes)]}
        for i, (name, c) in enumerate(point_colours(points).items())
    }


def _ms(x) -> str:
    return "–" if x is None else f"{x:,.2f}"


def _time_unit(seconds: float) -> tuple[float, str]:
    """(divisor, unit) for an axis of latencies reaching `seconds`: ms below a second, else time_axis's."""
    return (1e-3, "ms") if seconds < 1.0 else time_axis(seconds)


def measured(requests: pa.Table) -> pa.Table:
    """Requests that count in latency metrics (vLLM's rule): answered, and not sent during warm-up."""
    ok = pc.equal(requests.column("status"), "ok")
    warm = pc.fill_null(requests.column("warmup"), False)
    return requests.filter(pc.and_(ok, pc.invert(warm)))


def _latency_rows(lat: dict) -> list[tuple[str, dict]]:
    """(metric title, distribution in ms) for every measured metric of a point, in table order. Without any
    schedule lag (a model sends every request on time) the rows from the scheduled send repeat the others and
    the lag is all zeros: they are left out, and the table's note says why."""
    out = [(title, lat[key]) for key, title in METRICS if lat.get(key)]
    if not _no_lag(lat):
        for key, title in (("ttft", "TTFT from scheduled send"), ("e2el", "E2EL from scheduled send")):
            if (lat.get("from_scheduled") or {}).get(key):
                out.append((title, lat["from_scheduled"][key]))
        if lat.get("schedule_lag"):
            out.append(("schedule lag", lat["schedule_lag"]))
    return out


def _no_lag(lat: dict) -> bool:
    lag = lat.get("schedule_lag")
    return bool(lag) and not lag["max_ms"] and not lag["mean_ms"]


def _facts(points: list[dict]) -> Table:
    """Requests, duration and throughput: one column per point."""

    def column(lat: dict) -> list[str]:
        r = lat["requests"]
        g = lat.get("goodput")
        return [
            f"{r['sent']:,} / {r['ok']:,} / {r['failed']:,} / {r['not_sent']:,}",
            plain(r["warmup"]),
            duration(lat.get("duration_s")),
            plain(lat.get("request_throughput")),
            plain(lat.get("output_throughput")),
        ] + ([f"{plain(g['requests_per_s'])} req/s, {pct(g['fraction'])} of requests"] if g else [])

    labels = [
        "requests sent / ok / failed / not sent",
        "warm-up requests (left out)",
        "duration",
        "request throughput (req/s)",
        "output throughput (tok/s)",
    ]
    slo = next((p["latency"]["goodput"]["slo"] for p in points if p["latency"].get("goodput")), None)
    if slo:
        labels.append(f"goodput ({', '.join(f'{k}≤{v:g}' for k, v in slo.items())})")
    cols = [column(p["latency"]) for p in points]
    rows = [[label] + [c[i] if i < len(c) else "–" for c in cols] for i, label in enumerate(labels)]
    return Table(["", *(p["name"] for p in points)], rows)


def _percentile_table(points: list[dict]) -> Table:
    """A row per metric, a row group per point; in ms when every time is ms-scale, else each time in its unit."""
    groups = [(p["name"], _latency_rows(p["latency"])) for p in points]
    values = [d[k] for _, rows in groups for _, d in rows for k in d if k.endswith("_ms") and d[k] is not None]
    in_ms = not values or max(values) < MS_TABLE_LIMIT_MS
    cell = _ms if in_ms else (lambda ms: duration(None if ms is None else ms / 1000.0))
    header = ["metric (ms)" if in_ms else "metric", "mean"] + [f"p{p}" for p in PERCENTILES] + ["max", "count"]
    rows = []
    for name, metrics in groups:
        for i, (title, d) in enumerate(metrics):
            values = [cell(d["mean_ms"])] + [cell(d[f"p{q}_ms"]) for q in PERCENTILES] + [cell(d["max_ms"])]
            row = [title, *values, plain(d["count"])]
            rows.append(row if len(groups) == 1 else [name if i == 0 else "", *row])
    if len(groups) > 1:
        header = ["point", *header]
    return Table(header, rows)


def _tenant_items(points: list[dict]) -> list:
    """Each point's tenants' median and p99 TTFT and slowdown, with Jain's index over their medians."""
    points = [p for p in points if len(p["latency"].get("by_tenant") or []) > 1]
    if not points:
        return []
    jain = {p["name"]: ((p["latency"].get("fairness") or {}).get("jain") or {}).get("ttft_p50") for p in points}
    note = "Jain's index over tenants' median TTFT (1 = every tenant waits the same)"
    if len(points) == 1:
        items: list = [f"{note}: {plain(next(iter(jain.values())))}."]
    else:  # one line per point would be a column of sentences: a table reads faster
        items = [f"{note}, per point:", Table(["point", "Jain's index"], [[n, plain(j)] for n, j in jain.items()])]
    rows, cut = [], []
    for p in points:
        # the busiest tenants first: when the list is cut, the tenants left out are the ones with fewest requests
        tenants = sorted(p["latency"]["by_tenant"], key=lambda t: (-(t["requests"] or 0), t["name"]))
        if len(tenants) > MAX_TENANTS:
            cut.append(f"{p['name']} {MAX_TENANTS} of {len(tenants)}")
        for i, t in enumerate(tenants[:MAX_TENANTS]):
            ttft = [duration(None if v is None else v / 1000) for v in (t["ttft_p50_ms"], t["ttft_p99_ms"])]
            row = [t["name"], plain(t["requests"]), *ttft, plain(t["slowdown"])]
            rows.append(row if len(points) == 1 else [p["name"] if i == 0 else "", *row])
    header = ["tenant", "requests", "TTFT p50", "TTFT p99", "slowdown (p50 / everyone's p50)"]
    items.append(Table(header if len(points) == 1 else ["point", *header], rows))
    if cut:
        items.append(
            f"Tenants shown, those with the most requests: {'; '.join(cut)}; summary.json (latency.by_tenant) "
            "has them all."
        )
    return items


@section_at(110, "summary", "requests", per_point=True)
def latency_sections(summary: dict, requests: pa.Table | None) -> list[Section]:
    points = [p for p in summary.get("points", []) if p.get("latency")]
    if not points:
        return [Section("Latency"), Section("Latency by tenant")]
    items: list = [_facts(points)]
    if requests is not None:
        fig = _cdfs(points, measured(requests))
        if fig is not None:
            caption = "Cumulative distributions of per-request latencies (warm-up and failures excluded)"
            items.append(Figure(fig, caption + (", one colour per point" if len(points) > 1 else "")))
    items.append(_percentile_table(points))
    if all(_no_lag(p["latency"]) for p in points):
        items.append(
            "Every request was sent when scheduled (no schedule lag): latencies from the scheduled send are these."
        )
    return [Section("Latency", items), Section("Latency by tenant", _tenant_items(points))]


def _values(rows: pa.Table, key: str) -> np.ndarray:
    column = pc.list_flatten(rows.column("itl_s")) if key == "itl" else rows.column(f"{key}_s")
    values = np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64)
    return values[np.isfinite(values)]


def _cdfs(points: list[dict], rows: pa.Table) -> str | None:
    """A panel per metric that has data in some point (no empty axes), a line per point."""
    import matplotlib.pyplot as plt

    lines = point_lines(points)
    per_point = {p["name"]: rows.filter(pc.equal(rows.column("point"), p["name"])) for p in points}
    panels = []
    for key, title in METRICS[:4]:
        series = [(name, _values(r, key)) for name, r in per_point.items()]
        series = [(name, v) for name, v in series if v.size]
        if series:
            panels.append((title, series))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(min(FULL_WIDTH, SMALL_MULTIPLE * len(panels)), 3.0))
    axes = np.atleast_1d(axes)
    q = np.linspace(0, 1, CDF_POINTS)
    for ax, (title, series) in zip(axes, panels):
        divisor, unit = _time_unit(max(float(np.quantile(v, 0.99)) for _, v in series))
        for name, v in series:
            ax.plot(np.quantile(v, q) / divisor, q, label=name, **lines[name])
        ax.set_xlabel(f"{title} ({unit})")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    if len(points) > 1:
        axes[0].legend(fontsize=7)
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


def _binned_median(t: np.ndarray, v: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The median of `v` in each time bin (NaN where a bin has none): one readable line per point where a
    cloud of dots per point would hide the others."""
    index = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, len(edges) - 2)
    out = np.full(len(edges) - 1, np.nan)
    for b in np.unique(index):
        out[b] = np.median(v[index == b])
    return out


def _serving_timeline(summary: dict, requests: pa.Table) -> Section:
    """Live and modeled runs: send rate, TTFT and the engine's KV usage and queue against send time, every
    point overlaid in its colour. Panels without data are left out."""
    import matplotlib.pyplot as plt

    points = summary.get("points", [])
    colours, lines = point_colours(points), point_lines(points)
    series = []
    for p in points:
        rows = requests.filter(pc.equal(requests.column("point"), p["name"]))
        rows = rows.filter(pc.is_valid(rows.column("actual_send_s")))
        t = np.asarray(rows.column("actual_send_s").to_numpy(zero_copy_only=False), dtype=np.float64)
        if t.size and np.isfinite(t).any():
            ttft = np.asarray(rows.column("ttft_s").to_numpy(zero_copy_only=False), dtype=np.float64)
            gauge = p.get("server_timeline") or p.get("kv_timeline") or {}
            series.append((p["name"], t, ttft, gauge, float(np.nanmin(t))))
    if not series:
        return Section("Timeline")
    span = max(float(np.nanmax(t)) - t0 for _, t, _, _, t0 in series)
    span = max([span] + [float(g["t_s"][-1]) - t0 for _, _, _, g, t0 in series if g.get("t_s")] + [1e-9])
    divisor, unit = time_axis(span)
    n = max(t.size for _, t, _, _, _ in series)
    edges = np.linspace(0, span, min(100, max(10, int(np.sqrt(n)))) + 1)

    def gauge_panel(key: str, floor: float) -> list:
        out = []
        for name, _, _, g, t0 in series:
            v = np.asarray([np.nan if x is None else x for x in g.get(key) or []], dtype=np.float64)
            if v.size and np.isfinite(v).any() and np.nanmax(v) > floor:
                out.append((name, (np.asarray(g["t_s"], dtype=np.float64) - t0) / divisor, v))
        return out

    # a queue that was always empty is left out (a flat line at 0 says less than its absence and a word)
    usage, waiting = gauge_panel("kv_usage", -1.0), gauge_panel("waiting", 0.0)
    answered = [(name, t - t0, ttft) for name, t, ttft, _, t0 in series if np.isfinite(ttft).any()]
    n_panels = 1 + bool(answered) + bool(usage) + bool(waiting)
    fig, axes = plt.subplots(n_panels, 1, figsize=(FULL_WIDTH, 2.0 * n_panels + 0.6), sharex=True, squeeze=False)
    axes = list(axes[:, 0])
    rates = {name: np.histogram(t - t0, edges)[0] / np.diff(edges) for name, t, _, _, t0 in series}
    ax = axes.pop(0)
    if len(rates) > 1 and all(np.array_equal(r, next(iter(rates.values()))) for r in rates.values()):
        # modeled points replay the same arrivals: one line, not one hidden under the next
        rates = {"every point": next(iter(rates.values()))}
    for name, r in rates.items():
        ax.step(edges[:-1] / divisor, r, where="post", color=colours.get(name, "grey"), label=name)
    ax.set_ylabel("requests / s")
    if answered:
        ax = axes.pop(0)
        finite = np.concatenate([v[np.isfinite(v)] for _, _, v in answered])
        # seconds of queueing beside milliseconds of prefill: a log axis, each tick in its own unit
        log = finite.min() > 0 and finite.max() / finite.min() > 1000
        ydiv, yunit = (1.0, "log scale") if log else _time_unit(float(np.quantile(finite, 0.99)))
        for name, t, ttft in answered:
            ok = np.isfinite(ttft)
            if len(answered) == 1:
                ax.plot(t[ok] / divisor, ttft[ok] / ydiv, ".", markersize=2, color=colours[name], alpha=0.4)
            median = _binned_median(t[ok], ttft[ok], edges)
            ax.plot(edges[:-1] / divisor, median / ydiv, label=f"{name} (median per bin)", **lines[name])
        if log:
            from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

            ax.set_yscale("log")
            ax.yaxis.set_major_locator(FixedLocator(LOG_TIME_TICKS))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: duration(v)))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel(f"TTFT ({yunit})")
    for panel, label, scale in ((usage, "engine KV usage (%)", 100.0), (waiting, "requests waiting", 1.0)):
        if panel:
            ax = axes.pop(0)
            for name, gt, v in panel:
                ax.plot(gt, v * scale, label=name, **lines[name])
            ax.set_ylabel(label)
    for ax in fig.axes:
        ax.grid(alpha=0.3)
        if len(series) > 1 or len(ax.get_lines()) > 2:
            ax.legend(fontsize=7, loc="upper left")
    fig.axes[-1].set_xlabel(f"send time since the point's first request ({unit})")
    fig.tight_layout()
    missing = "" if usage else "; the server exposes no KV usage gauge"
    caption = f"Request rate, TTFT, KV usage and queue by send time ({', '.join(colours)}){missing}"
    return Section("Timeline", [Figure(svg(fig), caption)])


MAX_TIMELINE_POINTS = 12  # hit-rate lines of an offline timeline; more tangle (the table above has them all)
_CAPACITY_DASHES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1)))  # one per capacity; colour: the policy


@section_at(160, "summary", "requests", "trace", per_point=True)
def timeline_section(summary: dict, requests: pa.Table | None, trace: pa.Table | None) -> Section:
    """Request rate, latency and KV occupancy against time. Live and modeled runs: send times, TTFT and the
    engine's KV usage (polled during a live run, modeled by engine-sim), for every point. Offline runs: trace
    arrival times, every point's hit rate per stretch of time, and the working set (distinct blocks seen so
    far) against the capacities: a policy that inserts every miss and evicts only when full holds the smaller
    of the two."""
    if requests is None or requests.num_rows == 0 or not summary.get("points"):
        return Section("Timeline")
    if requests.column("actual_send_s").null_count < requests.num_rows:
        return _serving_timeline(summary, requests)
    if trace is None or "arrival_s" not in trace.column_names:
        return Section("Timeline")
    return _offline_timeline(summary, requests, _working_set(trace))


def _timeline_points(summary: dict) -> list[dict]:
    """The points an offline timeline draws: the policies at the capacities they were compared at first (not
    Belady's extra bound-only capacities), at most MAX_TIMELINE_POINTS."""
    swept = {p["capacity_blocks"] for p in summary["points"] if p.get("policy") not in (None, "belady")}
    first = [p for p in summary["points"] if p.get("capacity_blocks") in swept or "capacity_blocks" not in p]
    return (first or summary["points"])[:MAX_TIMELINE_POINTS]


def _offline_timeline(summary: dict, requests: pa.Table, seen: pa.Table) -> Section:
    import matplotlib.pyplot as plt

    t = seen.column("arrival_s").to_numpy(zero_copy_only=False).astype(np.float64)
    if t.size == 0 or not np.isfinite(t).any():
        return Section("Timeline")
    t = t - np.nanmin(t)
    span = max(float(np.nanmax(t)), 1e-9)
    divisor, unit = time_axis(span)
    edges = np.linspace(0, span, min(100, max(10, int(np.sqrt(t.size)))) + 1)
    at = dict(
        zip(seen.column("request_id").to_pylist(), np.clip(np.searchsorted(edges, t, "right") - 1, 0, edges.size - 2))
    )
    fig, axes = plt.subplots(3, 1, figsize=(FULL_WIDTH, 7.5), sharex=True)
    counts, _ = np.histogram(t, edges)
    axes[0].step(edges[:-1] / divisor, counts / np.diff(edges), where="post", color="grey")
    axes[0].set_ylabel("requests / s")
    shown = _timeline_points(summary)
    caps = sorted({p["capacity_blocks"] for p in shown if "capacity_blocks" in p})
    for p in shown:
        rows = requests.filter(pc.equal(requests.column("point"), p["name"]))
        bins = np.array([at.get(r, 0) for r in rows.column("request_id").to_pylist()], dtype=np.int64)
        hit = np.bincount(bins, rows.column("hit_tokens").to_numpy(zero_copy_only=False), edges.size - 1)
        inp = np.bincount(bins, rows.column("input_tokens").to_numpy(zero_copy_only=False), edges.size - 1)
        rate = np.divide(hit, inp, out=np.full_like(hit, np.nan, dtype=np.float64), where=inp > 0)
        dash = _CAPACITY_DASHES[caps.index(p["capacity_blocks"]) % len(_CAPACITY_DASHES)] if caps else "-"
        style = {"color": colour(p.get("policy") or p["name"]), "linestyle": dash}
        axes[1].step(edges[:-1] / divisor, rate, where="post", label=p["name"], **style)
    axes[1].set_ylabel("token hit rate")
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    axes[2].plot(
        np.sort(t) / divisor, np.sort(seen.column("seen").to_numpy()), color="black", label="distinct blocks seen"
    )
    for cap in caps:
        axes[2].axhline(cap, color="grey", linestyle=":")
        axes[2].annotate(f"{plain(cap)} blocks", (0, cap), fontsize=7, color="grey", va="bottom")
    if caps and seen.num_rows and int(pc.max(seen.column("seen")).as_py()) > 20 * caps[0]:
        axes[2].set_yscale("log")  # capacities far below the working set would sit flat on a linear axis
        log_ticks(axes[2], "y")
    axes[2].legend(fontsize=7, loc="upper left")
    axes[2].set_ylabel("blocks")
    axes[2].set_xlabel(f"time since the first request ({unit})")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    cut = len(summary["points"]) - len(shown)
    more = f"; {cut} more points in 'Hit rate per point'" if cut else ""
    caption = (
        "Request rate, each point's token hit rate per stretch of time, and the working set against the "
        f"capacities, by trace arrival time{more}"
    )
    return Section("Timeline", [Figure(svg(fig), caption)])
