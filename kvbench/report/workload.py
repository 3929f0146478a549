"""Workload sections of a run report: trace characterisation (prompt and output length histograms, how soon
blocks are reused) and the agent task view (calls per task, hit rate by call depth, task completion)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.report.page import Figure, Section, Table, pct, svg
from kvbench.report.sections import section_at
from kvbench.report.style import FULL_WIDTH, count, duration, plain, time_axis

MAX_REUSE_REFS = 20_000_000  # block references examined for reuse intervals: bounded memory on huge traces
MAX_TASKS_SHOWN = 20


@section_at(180, "requests", "trace", "point", per_point=True)
def characterisation_section(requests: pa.Table | None, trace: pa.Table | None, point: str) -> Section:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    if requests is None or requests.num_rows == 0:
        return Section("Trace characterisation")
    rows = requests.filter(pc.equal(requests.column("point"), point))
    reuse = _reuse(trace) if trace is not None else None
    panels = 3 if reuse is not None else 2
    fig, axes = plt.subplots(1, panels, figsize=(FULL_WIDTH * panels / 3, 2.8), layout="constrained")
    for ax, col, title in zip(axes, ("input_tokens", "output_tokens"), ("prompt", "output")):
        x = rows.column(col).to_numpy(zero_copy_only=False)
        ax.hist(x, bins=40, color="tab:blue" if col == "input_tokens" else "tab:orange")
        ax.set_xlabel(f"{title} length (tokens)")
        _short_ticks(ax)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("requests")
    items: list = []
    if reuse is not None:
        gaps_s, gaps_req, refs = reuse
        if gaps_s.size:
            positive = gaps_s[gaps_s > 0]
            if positive.size:
                # log-spaced bins on a log axis: intervals run from milliseconds (one request's own blocks) to
                # hours, and the axis reads in time units instead of log10 seconds
                lo, hi = np.log10(positive.min()), np.log10(positive.max())
                axes[2].hist(positive, bins=np.logspace(lo, max(hi, lo + 1e-3), 41), color="tab:green")
                axes[2].set_xscale("log")
                _duration_ticks(axes[2], positive.min(), positive.max())
            axes[2].yaxis.set_major_formatter(FuncFormatter(lambda v, _: count(v)))
            axes[2].set_xlabel("reuse interval")
        axes[2].grid(alpha=0.3)
        reused = gaps_s.size / refs if refs else 0.0
        stats = [
            ["block references examined", plain(refs)],
            ["references that reuse an earlier block", pct(reused)],
        ]
        if gaps_s.size:
            stats += [
                [
                    "reuse interval p50 / p90",
                    f"{duration(np.percentile(gaps_s, 50))} / {duration(np.percentile(gaps_s, 90))}",
                ],
                [
                    "reuse distance p50 / p90 (requests)",
                    f"{plain(float(np.percentile(gaps_req, 50)))} / {plain(float(np.percentile(gaps_req, 90)))}",
                ],
            ]
        items.append(Table(["block reuse", "value"], stats))
        items.append(
            "Reuse interval: time since the same block hash was last referenced. The reuse distance in distinct "
            "blocks (stack distance) is what the LRU hit-rate-vs-capacity curve integrates."
        )
    items.insert(0, Figure(svg(fig), "Prompt and output length histograms, and block reuse intervals"))
    return Section("Trace characterisation", items)


def _short_ticks(ax) -> None:
    """At most five ticks per axis, as short counts (5k, 10k): the default ticks of a long-tailed length run into
    each other ('5000 10000150002000025000') on a third of the page."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(nbins=5, integer=True))
        axis.set_major_formatter(FuncFormatter(lambda v, _: count(v)))


# Ticks a person reads on a time axis: decades below a minute, then the minute, the hour, the day, the week
# (a decade of seconds reads '16.7 min', '2.78 h').
TIME_TICKS = {1e-3: "1 ms", 1e-2: "10 ms", 0.1: "100 ms", 1: "1 s", 10: "10 s", 60: "1 min", 600: "10 min",
              3600: "1 h", 36000: "10 h", 86400: "1 d", 604800: "1 wk", 2592000: "30 d"}  # fmt: skip


def _duration_ticks(ax, lo: float, hi: float) -> None:
    """A log time axis from `lo` to `hi` seconds labelled at TIME_TICKS, every other one when more than four fit."""
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    ticks = [t for t in TIME_TICKS if lo <= t <= hi] or [min(TIME_TICKS, key=lambda t: abs(t - lo))]
    ticks = ticks[:: 2 if len(ticks) > 4 else 1]  # a third of the page holds four labels
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(lambda v, _: TIME_TICKS.get(v, duration(v)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _reuse(trace: pa.Table) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(seconds since the previous reference of the same block, requests since it, references examined)."""
    if "block_hashes" not in trace.column_names:
        return None
    hashes = trace.column("block_hashes").combine_chunks()
    refs = min(len(hashes.values) if hasattr(hashes, "values") else 0, MAX_REUSE_REFS)
    if refs == 0:
        return np.empty(0), np.empty(0), 0
    offsets = np.asarray(hashes.offsets)
    rows = int(np.searchsorted(offsets, refs, side="right")) - 1  # whole requests within the bound
    refs = int(offsets[rows] - offsets[0])
    values = np.asarray(hashes.values.slice(offsets[0], refs))
    owner = np.repeat(np.arange(rows), np.diff(offsets[: rows + 1]))
    arrival = trace.column("arrival_s").to_numpy()[:rows].astype(np.float64)
    order = np.lexsort((owner, values))
    same = values[order][1:] == values[order][:-1]
    later, earlier = order[1:][same], order[:-1][same]
    return arrival[owner[later]] - arrival[owner[earlier]], (owner[later] - owner[earlier]).astype(np.float64), refs


@section_at(170, "requests", "trace", "point", per_point=True)
def agent_section(requests: pa.Table | None, trace: pa.Table | None, point: str) -> Section:
    """Agent workloads: each session is one task (a tree of calls that branch and merge)."""
    import matplotlib.pyplot as plt

    if requests is None or trace is None or "session_id" not in trace.column_names:
        return Section("Agent tasks")
    agent = trace.filter(pc.equal(trace.column("workload").cast(pa.string()), "agent"))
    if agent.num_rows == 0:
        return Section("Agent tasks")
    rows = requests.filter(pc.equal(requests.column("point"), point))
    rows = rows.select(["request_id", "input_tokens", "hit_tokens", "actual_send_s", "e2el_s"])
    cols = ["request_id", "session_id", "turn", "arrival_s"]
    joined = agent.select([c for c in cols if c in agent.column_names]).join(rows, "request_id", join_type="inner")
    if joined.num_rows == 0:
        return Section("Agent tasks")
    live = joined.column("actual_send_s").null_count < joined.num_rows
    task = joined.column("session_id").cast(pa.string()).to_numpy(zero_copy_only=False)
    hit = joined.column("hit_tokens").to_numpy(zero_copy_only=False).astype(np.float64)
    inp = joined.column("input_tokens").to_numpy(zero_copy_only=False).astype(np.float64)
    names, idx = np.unique(task, return_inverse=True)
    calls = np.bincount(idx)
    task_in = np.bincount(idx, inp)
    task_hit = np.bincount(idx, hit)
    table_rows = []
    completion = None
    if live:
        send = joined.column("actual_send_s").to_numpy(zero_copy_only=False).astype(np.float64)
        end = send + joined.column("e2el_s").to_numpy(zero_copy_only=False).astype(np.float64)
        first = np.full(names.size, np.inf)
        last = np.full(names.size, -np.inf)
        np.minimum.at(first, idx, send)
        np.fmax.at(last, idx, end)
        completion = last - first
    for k in np.argsort(-task_in)[:MAX_TASKS_SHOWN]:
        row = [str(names[k]), plain(int(calls[k])), plain(int(task_in[k])), pct(task_hit[k] / max(task_in[k], 1))]
        if completion is not None:
            row.append(duration(completion[k]))
        table_rows.append(row)
    header = ["task", "calls", "prompt tokens", "hit rate"] + (["completion"] if completion is not None else [])
    items: list = [
        f"{names.size:,} tasks, {int(calls.sum()):,} calls; "
        f"overall token hit rate {pct(task_hit.sum() / max(task_in.sum(), 1))}.",
        Table(header, table_rows),
    ]
    if names.size > MAX_TASKS_SHOWN:
        items.append(
            f"The {MAX_TASKS_SHOWN} tasks with the most prompt tokens of {names.size:,}; requests.parquet has every "
            "call (join it to the trace's session_id for the rest)."
        )
    if "turn" in joined.column_names:
        from matplotlib.ticker import PercentFormatter

        depth = joined.column("turn").to_numpy(zero_copy_only=False).astype(np.int64)
        d_in = np.bincount(depth, inp)
        d_hit = np.bincount(depth, hit)
        shown = np.nonzero(d_in)[0]
        fig, ax = plt.subplots(
            1, 2 if completion is not None else 1, figsize=(9 if completion is not None else 5, 3), squeeze=False
        )
        ax[0][0].plot(shown, d_hit[shown] / d_in[shown], marker="o", markersize=3)
        ax[0][0].set_xlabel("call depth in the task (turn)")
        ax[0][0].set_ylabel("token hit rate")
        ax[0][0].yaxis.set_major_formatter(PercentFormatter(1.0))
        ax[0][0].grid(alpha=0.3)
        if completion is not None:
            done = completion[np.isfinite(completion)]
            scale, unit = time_axis(float(done.max()) if done.size else 0.0)
            ax[0][1].hist(done / scale, bins=30)
            _short_ticks(ax[0][1])
            ax[0][1].set_xlabel(f"task completion time ({unit})")
            ax[0][1].set_ylabel("tasks")
            ax[0][1].grid(alpha=0.3)
        fig.tight_layout()
        items.insert(0, Figure(svg(fig), "Hit rate by call depth: later calls reuse the task's growing context"))
    return Section("Agent tasks", items)
