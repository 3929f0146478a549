"""The failure section of a serving run's report: requests by outcome, failures by error class with the first
message of each class, and when they happened (failed beside answered requests per time bin of send time).

Classes are counted from requests.parquet's `error` column with `latency.error_class`, the rule summary.json's
`failures` uses, so the two agree; summary.json keeps only the top few classes, requests.parquet all of them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.metrics.latency import error_class
from kvbench.report.page import Figure, Section, Table, pct, svg
from kvbench.report.sections import section_at
from kvbench.report.style import FULL_WIDTH, duration, plain, time_axis

MESSAGE_CHARS = 200  # a first message longer than this is cut (the whole text is in requests.parquet)
OK_COLOUR = "#c7c7c7"  # answered requests: a quiet grey, so the failures stand out against them
# error classes take these in order of frequency: red first, none of them the grey of the answered
CLASS_COLOURS = ("#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#1f77b4", "#bcbd22", "#17becf")
UNSENT = ("not_sent", "cancelled")  # never sent: counted, but they are no failure of the server


def _outcomes(point: dict, rows: pa.Table | None) -> dict | None:
    """The point's counts by outcome: summary.json's record for a live point, else counted from its rows (a
    live run recorded before that record existed; engine-sim's rejected requests are 'error' rows too)."""
    if point.get("failures"):
        return point["failures"]
    if rows is None or rows.num_rows == 0 or rows.column("actual_send_s").null_count == rows.num_rows:
        return None  # an offline point: nothing was sent
    status = rows.column("status").to_pylist()
    failed = sum(s not in ("ok", *UNSENT) for s in status)
    sent = len(status) - sum(s in UNSENT for s in status)
    return {
        "requests": len(status),
        "ok": status.count("ok"),
        "failed": failed,
        "timeout": status.count("timeout"),
        "cancelled": status.count("cancelled"),
        "not_sent": status.count("not_sent"),
        "failure_rate": failed / sent if sent else None,
    }


def _failed_rows(rows: pa.Table) -> list[tuple[float, str, str]]:
    """(send time, class, message) of every failed request, in send order. A request sent by nobody has no
    actual send time: its scheduled one stands in."""
    status = rows.column("status").to_pylist()
    errors = rows.column("error").to_pylist()
    sent = pc.coalesce(rows.column("actual_send_s"), rows.column("scheduled_send_s")).to_pylist()
    out = [
        (t if t is not None else np.nan, error_class(e) or "unknown", e or "(no message)")
        for s, e, t in zip(status, errors, sent)
        if s not in ("ok", *UNSENT)
    ]
    return sorted(out, key=lambda r: (np.isnan(r[0]), r[0]))


def _class_rows(name: str, failed: list[tuple[float, str, str]], start: float, n_failed: int) -> list[list[str]]:
    """A row per error class, most frequent first: its count, share of the failures, when it first happened and
    its first message."""
    classes: dict[str, list] = {}
    for t, cls, msg in failed:
        classes.setdefault(cls, []).append((t, msg))
    rows = []
    for cls, hits in sorted(classes.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        t, msg = hits[0]
        msg = msg if len(msg) <= MESSAGE_CHARS else msg[: MESSAGE_CHARS - 1] + "…"
        when = "–" if np.isnan(t) else "0 s" if t <= start else duration(t - start)
        rows.append([name, cls, plain(len(hits)), pct(len(hits) / n_failed if n_failed else None), when, msg])
    return rows


def _timeline(series: list[tuple[str, np.ndarray, list[tuple[float, str, str]]]]) -> str | None:
    """One panel per point: answered and failed requests (by class) per time bin of send time, stacked."""
    import matplotlib.pyplot as plt

    series = [s for s in series if s[1].size or s[2]]
    if not series:
        return None
    # each point from its own first send (a sweep's points run one after another), on one shared x axis
    sent = [np.concatenate([ok, [t for t, _, _ in fails]]) for _, ok, fails in series]
    starts = [float(np.nanmin(t)) for t in sent]
    span = max(max(float(np.nanmax(t)) - t0 for t, t0 in zip(sent, starts)), 1e-9)
    divisor, unit = time_axis(span)
    edges = np.linspace(0, span / divisor, 61)
    counts: dict[str, int] = {}
    for _, _, fails in series:
        for _, cls, _ in fails:
            counts[cls] = counts.get(cls, 0) + 1
    colours = {c: CLASS_COLOURS[i % len(CLASS_COLOURS)] for i, c in enumerate(sorted(counts, key=counts.get)[::-1])}
    height = 2.0 * len(series) + 0.6
    fig, axes = plt.subplots(len(series), 1, figsize=(FULL_WIDTH, height), sharex=True, squeeze=False)
    width = edges[1] - edges[0]
    for ax, (name, ok, fails), start in zip(axes[:, 0], series, starts):
        bottom = np.histogram((ok - start) / divisor, edges)[0].astype(float)
        ax.bar(edges[:-1], bottom, width, align="edge", color=OK_COLOUR, label="answered")
        times = np.array([t for t, _, _ in fails], dtype=float)
        labels = np.array([c for _, c, _ in fails], dtype=object)
        for cls, colour in colours.items():
            n = np.histogram((times[labels == cls] - start) / divisor, edges)[0]
            if n.any():
                ax.bar(edges[:-1], n, width, bottom=bottom, align="edge", color=colour, label=cls)
                bottom = bottom + n
        ax.set_ylabel("requests")
        ax.set_title(name, fontsize=9, loc="left")
        ax.grid(axis="y", alpha=0.3)
    handles = {lab: h for ax in axes[:, 0] for h, lab in zip(*ax.get_legend_handles_labels())}
    # beside the plot, not over it: a legend inside would hide the bars of the last bins
    axes[0, 0].legend(handles.values(), handles.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    axes[-1, 0].set_xlabel(f"send time since the point's first request ({unit})")
    fig.tight_layout()
    return svg(fig)


@section_at(100, "summary", "requests", per_point=True)
def failure_section(summary: dict, requests: pa.Table | None) -> Section:
    """Requests by outcome for every serving point, failures by class with the first message of each, and a
    timeline of failures beside answered requests. A run where every request was answered says so in a line."""
    table_rows, class_rows, series = [], [], []
    sent = unsent = n_failed = 0
    for p in summary.get("points", []):
        rows = None
        if requests is not None:
            rows = requests.filter(pc.equal(requests.column("point"), p["name"]))
        f = _outcomes(p, rows)
        if f is None:
            continue
        table_rows.append(
            [p["name"]]
            + [plain(f[k]) for k in ("requests", "ok", "failed", "timeout", "cancelled", "not_sent")]
            + [pct(f["failure_rate"])]
        )
        sent += f["requests"] - f["not_sent"] - f["cancelled"]
        unsent += f["not_sent"] + f["cancelled"]
        n_failed += f["failed"]
        if not f["failed"]:
            continue
        if rows is not None and rows.num_rows:
            failed = _failed_rows(rows)
            ok = rows.filter(pc.equal(rows.column("status"), "ok")).column("actual_send_s")
            ok_t = np.asarray(ok.to_numpy(zero_copy_only=False), dtype=float)
            ok_t = ok_t[np.isfinite(ok_t)]
            all_t = np.concatenate([ok_t, [t for t, _, _ in failed if np.isfinite(t)]])
            start = float(all_t.min()) if all_t.size else 0.0
            # shares of the failures read here (a huge run's report reads its first rows only)
            class_rows += _class_rows(p["name"], failed, start, len(failed))
            series.append((p["name"], ok_t, [r for r in failed if np.isfinite(r[0])]))
        else:  # no requests.parquet at hand: summary.json's top classes, without messages
            for e in f.get("top_errors") or []:
                class_rows.append([p["name"], e["error"], plain(e["count"]), pct(e["count"] / f["failed"]), "–", "–"])
    if not table_rows:
        return Section("Requests and failures")
    if not n_failed and all("engine" in p for p in summary["points"]):
        return Section("Requests and failures")  # a model that rejected nothing: no failure to speak of
    if not n_failed:
        line = f"No failures: every one of the {plain(sent)} requests sent was answered"
        line += f" ({plain(unsent)} more were never sent)." if unsent else "."
        return Section("Requests and failures", [line])
    header = ["point", "requests", "ok", "failed", "of which timeout", "cancelled", "not sent", "failed share"]
    items: list = [Table(header, table_rows)]
    if class_rows:
        items.append(
            "Failures by error class (the text before the error's first colon), most frequent first, with the "
            "first message of each; requests.parquet's error column has every message."
        )
        class_header = [
            "point",
            "error class",
            "requests",
            "share of failures",
            "first (since the first send)",
            "first message",
        ]
        if len({r[0] for r in class_rows}) == 1:  # one point: its name adds nothing to every row
            class_header, class_rows = class_header[1:], [r[1:] for r in class_rows]
        items.append(Table(class_header, class_rows))
    fig = _timeline(series)
    if fig is not None:
        items.append(Figure(fig, "Requests per time bin of send time: answered (grey) and failed, by error class"))
    return Section("Requests and failures", items)
