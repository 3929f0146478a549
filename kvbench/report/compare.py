"""The comparison page (tables and plots) of `kvbench compare` and of `kvbench sweep`'s index, laid out with
`kvbench.report.page`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from kvbench.report.fidelity import TITLE as MODEL_TITLE
from kvbench.report.fidelity import FidelityTable, explanation, html_ready
from kvbench.report.page import Figure, Links, Section, Table, pct, render_html, render_markdown, svg
from kvbench.report.style import colour, duration, line_style, log_ticks
from kvbench.report.tasks import task_comparison_section
from kvbench.run.comparison import CI, FORMATS, LIVE, METRICS, N_BOOT, QUANTILES, Comparison

NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
CDF_POINTS = 400  # an SVG line of every request would make the page megabytes long
MAX_BARS = 60


RATES = ("hit rate", "steady", "hit rate predicted", "hit rate measured")  # fractions, shown as run reports do


def _cell(key, value) -> str:
    if value is None:
        return "–"
    if key in RATES and isinstance(value, float):
        return pct(value)
    if key == "gap" and isinstance(value, float):
        return f"{100 * value:+.2f} points"
    if isinstance(value, float):
        return FORMATS.get(key, "{:.4f}").format(value)
    return str(value)


def _dict_table(rows: list[dict], keep: int = 1) -> Table:
    """Rows of dicts as a table; columns empty in every row are left out, except the first `keep`."""
    header = list(dict.fromkeys(k for row in rows for k in row))
    header = [k for i, k in enumerate(header) if i < keep or any(row.get(k) is not None for row in rows)]
    return Table(header, [[_cell(k, row.get(k)) for k in header] for row in rows])


def _ms(x: float) -> str:
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


def _diff_cell(d: dict) -> str:
    sign = "+" if d["diff_ms"] >= 0 else "−"
    text = f"{sign}{_ms(abs(d['diff_ms']))} ms"
    if not d["significant"]:
        return f"{text} ≈"
    return f"{text} {'▲' if d['diff_ms'] > 0 else '▼'} significant"


def run_link(run_dir: Path, out_dir: Path) -> str | None:
    """The run's report.html relative to `out_dir`; None when the two share no folder below the root, where
    the relative path would spell out this machine's folders."""
    report = Path(run_dir).resolve() / "report.html"
    out = Path(out_dir).resolve()
    if not report.exists() or len(Path(os.path.commonpath([report, out])).parts) <= 1:
        return None
    return Path(os.path.relpath(report, out)).as_posix()


def _latency_sections(result: dict) -> list[Section]:
    if not result["latency"]:
        return []
    heads = [f"p{q}" for q in QUANTILES]
    rows = [
        [f"{r['run']}:{r['point']}", NAMES[r["metric"]], f"{r['count']:,}"]
        + [f"{_ms(r[f'{h}_ms'])} [{_ms(r[f'{h}_ci_ms'][0])}, {_ms(r[f'{h}_ci_ms'][1])}]" for h in heads]
        for r in result["latency"]
    ]
    how = (
        f"Percentile [95% interval] in ms; intervals from {N_BOOT} bootstrap resamples of the measured requests "
        f"(seeded; ITL gaps resampled with their request); warm-up and failed requests left out."
    )
    out = [Section("Latency percentiles", [how, Table(["run:point", "metric", "samples", *heads], rows)])]
    diffs = result["differences"]
    if diffs:
        note = (
            f"Each run against the baseline {diffs[0]['baseline']} (the first run measured): ▲ slower / ▼ faster "
            f"when the {CI[1] - CI[0]:.0f}% bootstrap interval of the difference excludes 0, ≈ within noise."
        )
        rows = [[f"{d['run']}:{d['point']}", NAMES[d["metric"]]] + [_diff_cell(d[h]) for h in heads] for d in diffs]
        out.append(Section("Differences vs baseline", [note, Table(["run:point", "metric", *heads], rows)]))
    return out


def _hits_only(table: dict) -> bool:
    """A model that predicts cache hits and no latency (sim): only its cached tokens can be compared."""
    overall = table["overall"]
    return not any((overall.get(m) or {}).get("requests") for m in ("ttft", "tpot", "e2el"))


def _model_sections(result: dict) -> list[Section]:
    """One section: the explanation once, then per latency-modeling point its error table against the live
    run, the hit-only points (sim) together in one table, and the one line saying why a run was not compared."""
    entries = result.get("model_vs_measurement") or []
    if not entries:
        return []
    tables = [e for e in entries if "table" in e]
    items: list = [explanation(tables[0]["table"]["skipped_first"])] if tables else []
    hits = [e for e in tables if _hits_only(e["table"])]
    if hits:
        rows = []
        for e in hits:
            c = e["table"]["overall"].get("cached_tokens") or {}
            exact = f"{c['exact']:,} of {c['requests']:,} ({pct(c['exact_share'])})" if c.get("requests") else "–"
            ratio = f"{c['modeled'] / c['measured']:.3f}" if c.get("measured") else "–"
            rows.append([e["modeled"], exact, f"{c.get('modeled', 0):,}", f"{c.get('measured', 0):,}", ratio])
        header = ["modeled point", "requests with cached tokens exact", "modeled cached tokens",
                  "measured cached tokens", "modeled / measured"]  # fmt: skip
        items += [f"Hit-rate models (no latency modeled) against {hits[0]['measured']}:", Table(header, rows)]
    for e in entries:
        if "table" in e and not _hits_only(e["table"]):
            items += [f"{e['modeled']} ({e['backend']}) against {e['measured']}:", FidelityTable.of(e["table"])]
        elif "modeled" in e and "table" not in e:
            items.append(f"{e['modeled']} not compared with {e['measured']}: {e['note']}")
        elif "table" not in e:
            items.append(e["note"])
    return [Section(MODEL_TITLE, items)]


def _cdf_figure(cmp: Comparison) -> Figure | None:
    import matplotlib.pyplot as plt

    if not cmp.samples:
        return None
    drawn = [m for m in METRICS if any(s.values[m].size for s in cmp.samples.values())]
    if not drawn:
        return None  # an axis with nothing on it says nothing (engine-sim models no ITL)
    cols = min(2, len(drawn))
    fig, axes = plt.subplots(-(-len(drawn) // cols), cols, figsize=(5 * cols, 3.5 * -(-len(drawn) // cols)),
                             squeeze=False)  # fmt: skip
    for ax in axes.flat[len(drawn) :]:
        ax.remove()
    probs = np.linspace(0, 1, CDF_POINTS)
    for ax, m in zip(axes.flat, drawn):
        for (run, point), s in cmp.samples.items():
            x = s.values[m]
            if x.size:
                ax.plot(np.quantile(x, probs) * 1000, probs, label=f"{run}:{point}", drawstyle="steps-post")
        ax.set_xlabel(f"{NAMES[m]} (ms)")
        ax.set_ylabel("fraction of " + ("gaps" if m == "itl" else "requests"))
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    return Figure(svg(fig), "Latency CDFs per run (warm-up and failed requests left out)")


def _hit_rate_figure(cmp: Comparison) -> Figure | None:
    import matplotlib.pyplot as plt

    rows = [r for r in cmp.result["runs"] if r["hit rate"] is not None]
    if not rows:
        return None
    bars = rows[:MAX_BARS][::-1]
    backends = list(dict.fromkeys(r["backend"] for r in bars))
    colours = {b: colour(b) for b in backends}
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(bars) + 1))
    ax.barh([f"{r['run']}:{r['point']}" for r in bars], [r["hit rate"] for r in bars],
            color=[colours[r["backend"]] for r in bars])  # fmt: skip
    if len(backends) > 1:
        ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c, label=b) for b, c in colours.items()], fontsize=7)
    ax.set_xlabel("token hit rate (all requests)")
    ax.set_xlim(0, 1)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    more = f" (first {MAX_BARS})" if len(cmp.result["runs"]) > MAX_BARS else ""
    return Figure(svg(fig), f"Token hit rate per run and point{more}")


def _capacity_figure(cmp: Comparison) -> Figure | None:
    """One line per (run group, policy): a run's own capacity sweep, or a sweep's runs of one grid cell
    (`_group`, set by `kvbench sweep`), which each hold one capacity."""
    import matplotlib.pyplot as plt

    lines: dict[tuple[str, str], dict[int, float]] = {}
    measured = []  # live runs: one hit rate each, drawn across as what the predictions aim at
    for run in cmp.runs:
        for p in run["points"]:
            hr = (p.get("hit_rate") or {}).get("token", {}).get("steady")
            if "capacity_blocks" in p and "policy" in p and hr is not None:
                lines.setdefault((run.get("_group", run["_label"]), p["policy"]), {})[p["capacity_blocks"]] = hr
            elif run["backend"] == LIVE and hr is not None:
                measured.append((f"{run['_label']} (measured)", hr))
    if not any(len(v) > 1 for v in lines.values()):
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, hr in measured:
        ax.axhline(hr, color="grey", linestyle=":", label=label)
    groups = list(dict.fromkeys(g for g, _ in lines))
    dashes = ("-", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))  # one per run group; colour is the policy's
    for (group, policy), pts in sorted(lines.items()):
        caps = sorted(pts)
        style = (
            line_style(policy)
            if policy == "belady"
            else {**line_style(policy), "linestyle": dashes[groups.index(group) % len(dashes)]}
        )
        ax.plot(caps, [pts[c] for c in caps], marker="o", markersize=3, label=f"{group}: {policy}", **style)
    ax.set_xscale("log")
    log_ticks(ax)
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("token hit rate (steady state)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return Figure(svg(fig), "Hit rate vs capacity (belady dashed: the offline optimum)")


SAID = (50, 99)  # the percentiles the answer names: the typical request and the tail


def _moves(diffs: list[dict]) -> tuple[list[str], list[str], int]:
    """(slower, faster, within noise) for one run against the baseline: each metric whose p50 or p99 moved
    beyond the bootstrap noise, with the moves, e.g. 'TTFT (p50 −109 ms, p99 −683 ms)'."""
    slower, faster, same = [], [], 0
    for d in diffs:
        moved = [(q, d[f"p{q}"]["diff_ms"]) for q in SAID if d[f"p{q}"]["significant"]]
        same += len(SAID) - len(moved)
        if not moved:
            continue
        text = f"{NAMES[d['metric']]} ({', '.join(f'p{q} {_signed(ms)}' for q, ms in moved)})"
        (slower if sum(ms for _, ms in moved) > 0 else faster).append(text)
    return slower, faster, same


def _signed(ms: float) -> str:
    return ("+" if ms >= 0 else "−") + duration(abs(ms) / 1000)


def _is_bound(point: str) -> bool:
    """Belady's points: the offline optimum, a bound to compare with, never a choice to recommend."""
    return point.rsplit(":", 1)[-1].startswith("belady/")


def answer_section(result: dict) -> Section:
    """What differs, said the way a person would: per compared run, which metrics moved beyond the bootstrap
    noise at p50 or p99 and which way; the best hit rate; how close the predictions came to the measurement."""
    items: list[str] = []
    by_run: dict[str, list[dict]] = {}
    for d in result.get("differences") or []:
        by_run.setdefault(f"{d['run']}:{d['point']}", []).append(d)
    for name, rows in by_run.items():
        slower, faster, same = _moves(rows)
        base = rows[0]["baseline"]
        if not slower and not faster:
            items.append(f"{name} is indistinguishable from {base}: p50 and p99 of every latency within noise.")
            continue
        said = [f"slower {' and '.join(slower)}"] if slower else []
        said += [f"faster {' and '.join(faster)}"] if faster else []
        noise = f"; {same} other p50/p99 within noise" if same else ""
        items.append(f"Against {base}, {name} has {', '.join(said)}{noise}.")
    rated = [r for r in result.get("runs") or [] if r.get("hit rate") is not None and not _is_bound(r["point"])]
    if len(rated) > 1:
        best = max(rated, key=lambda r: r["hit rate"])
        items.append(f"Highest token hit rate in the table: {best['run']}:{best['point']} ({pct(best['hit rate'])}).")
    gaps = [r for r in result.get("fidelity") or [] if r.get("gap") is not None and not _is_bound(r["predicted"])]
    if gaps:
        close, far = min(gaps, key=lambda r: abs(r["gap"])), max(gaps, key=lambda r: abs(r["gap"]))
        items.append(
            f"Predicted against measured hit rate ({close['measured']}): closest {close['predicted']}, "
            f"{100 * abs(close['gap']):.1f} points off; furthest {far['predicted']}, "
            f"{100 * abs(far['gap']):.1f} points off."
        )
    return Section("Answer", items)


def page_sections(cmp: Comparison, out_dir: Path | None = None, plots: bool = True) -> list[Section]:
    """The comparison as page sections: tables always, plots and links to run reports when `out_dir`."""
    result = cmp.result
    sections = [answer_section(result), Section("Runs", [_dict_table(result["runs"], keep=4)])]
    sections += _latency_sections(result)
    if result["fidelity"]:
        sections.append(Section("Fidelity: predicted vs measured hit rate", [_dict_table(result["fidelity"])]))
    if result["ttft_fidelity"]:
        sections.append(Section("Fidelity: modeled vs measured TTFT", [_dict_table(result["ttft_fidelity"])]))
    sections += _model_sections(result)
    sections.append(task_comparison_section(cmp.runs))
    if plots:
        import matplotlib

        matplotlib.use("Agg")
        figs = [f(cmp) for f in (_cdf_figure, _hit_rate_figure, _capacity_figure)]
        sections.append(Section("Plots", [f for f in figs if f is not None]))
    if out_dir is not None:
        links = [(r["_label"], run_link(r["_dir"], out_dir)) for r in cmp.runs]
        unlinked = [name for name, href in links if href is None]
        items = [Links([(n, h) for n, h in links if h is not None])] if any(h for _, h in links) else []
        if unlinked:
            items.append("Reports not linked (no report.html, or outside this folder's tree): " + ", ".join(unlinked))
        sections.append(Section("Run reports", items))
    return sections


def write_page(out_dir: Path, stem: str, title: str, sections: list[Section], data: dict | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.html").write_text(render_html(title, html_ready(sections)))
    (out_dir / f"{stem}.md").write_text(render_markdown(title, sections).rstrip("\n") + "\n")
    if data is not None:
        (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=2))
