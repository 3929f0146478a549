"""The saturation section of a run report: for every point with timing (engine-sim, live), whether the
deployment kept up with the load, from when it did not, offered against served rate, and, when saturated, the
queueing delay over the run, so a latency table beside it is read for what it is (kvbench/metrics/saturation.py,
docs/semantics.md, Saturation). Everything comes from summary.json: the verdict carries its binned delays."""

from __future__ import annotations

from kvbench.report.page import Figure, Section, Table, svg
from kvbench.report.sections import section_at
from kvbench.report.style import FULL_WIDTH, count, duration, plain, time_axis

PLOT_HEIGHT = 2.6  # inches: a trend to glance at beside the table, not a figure to study


@section_at(90, "summary", per_point=True)
def saturation_section(summary: dict) -> Section:
    """Section "Saturation": one table row per timed point and one delay plot per saturated point; empty (no
    items) when no point has timing (an offline cache simulation)."""
    points = [p for p in summary.get("points", []) if p.get("saturation")]
    if not points:
        return Section("Saturation")
    rows = [_row(p["name"], p["saturation"]) for p in points]
    header = [
        "point",
        "verdict",
        "from t =",
        "offered",
        "offered input",
        "served",
        "delay early",
        "delay, last quarter",
    ]
    items: list = [
        "Saturated: the queueing delay (time from a request's scheduled send to its admission, or to its first "
        "token on a live server) kept growing to the end of the run, past an early request's service time, or "
        "requests were taken up at under half the rate they were offered while the median one did not queue. "
        "Latency percentiles of a saturated point grow with the trace's length and describe the queue, not the "
        "deployment. Served: requests taken up (admitted; first token on a live server) per second over the "
        "schedule's window.",
        Table(header, rows),
    ]
    items += [f"{p['name']}: {p['saturation']['why']}." for p in points]
    by_workload = _workload_rows(points)
    if by_workload:
        items.append(
            "Each workload on its own (a pool serving one workload can drown while the median request is "
            "served at once; such a workload becomes the point's verdict):"
        )
        items.append(Table(["point", "workload", "verdict", "from t =", "offered", "served"], by_workload))
    saturated = [p for p in points if p["saturation"]["saturated"] and p["saturation"].get("bins")]
    if saturated:
        items.append(Figure(_plot(saturated), "Median queueing delay over the run, saturated points"))
    return Section("Saturation", items)


def _row(name: str, v: dict) -> list[str]:
    return [
        name,
        "saturated" if v["saturated"] else "not saturated",
        duration(v["from_s"]) if v["saturated"] else "–",
        _per_s(v.get("offered_rps"), "req"),
        _per_s(v.get("offered_input_tps"), "tok"),
        _per_s(v.get("served_rps"), "req"),
        duration(v.get("early_delay_s")),
        duration(v.get("late_delay_s")),
    ]


def _workload_rows(points: list[dict]) -> list[list[str]]:
    rows = []
    for p in points:
        for name, v in (p["saturation"].get("by_workload") or {}).items():
            verdict = "saturated" if v["saturated"] else "not saturated"
            when = duration(v["from_s"]) if v["saturated"] else "–"
            rows.append(
                [p["name"], name, verdict, when, _per_s(v["offered_rps"], "req"), _per_s(v["served_rps"], "req")]
            )
    return rows


def _per_s(rate: float | None, what: str) -> str:
    """A rate in plain figures: 0.0177 req/s, 9.1 req/s, 40.5k tok/s (never 4.05e+04)."""
    if rate is None:
        return "–"
    return f"{count(rate) if rate >= 1000 else plain(rate, 3)} {what}/s"


def _plot(points: list[dict]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvbench.report.timing import point_colours

    colours = point_colours(points)
    span = max(max(p["saturation"]["bins"]["start_s"]) for p in points) or 1.0
    t_div, t_unit = time_axis(span)
    peak = max(
        max(p["saturation"]["bins"].get("p90_delay_s") or p["saturation"]["bins"]["median_delay_s"]) for p in points
    )
    d_div, d_unit = (1e-3, "ms") if peak < 1.0 else time_axis(peak)
    fig, ax = plt.subplots(figsize=(FULL_WIDTH, PLOT_HEIGHT))
    for p in points:
        v = p["saturation"]
        t = [x / t_div for x in v["bins"]["start_s"]]
        ax.step(t, [d / d_div for d in v["bins"]["median_delay_s"]], where="post", color=colours[p["name"]],
                label=p["name"])  # fmt: skip
        if v["bins"].get("p90_delay_s"):  # saturated by its slowest tenth: draw that beside the median
            ax.step(t, [d / d_div for d in v["bins"]["p90_delay_s"]], where="post", color=colours[p["name"]],
                    linestyle="--", label=f"{p['name']}, slowest tenth (p90)")  # fmt: skip
        ax.axvline(v["from_s"] / t_div, color=colours[p["name"]], linestyle=":", linewidth=1)
    ax.set_xlabel(f"scheduled send ({t_unit} from the first request)")
    ax.set_ylabel(f"median delay ({d_unit})")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title="dotted: saturated from", title_fontsize=8)
    return svg(fig)
