"""The demo's index page: one row per workload, the hit-rate-vs-capacity curves of every workload side by
side, live-vs-predicted fidelity when live runs were made, and a link to every run's own report."""

from __future__ import annotations

import os
from pathlib import Path

from kvbench.report.page import Figure, Links, Section, Table, num, pct, render_html, render_markdown, svg
from kvbench.report.style import INFINITE_STYLE, line_style, log_ticks


def _rel(path: Path, base: Path) -> str:
    return Path(os.path.relpath(path, base)).as_posix()


def _swept(run) -> bool:
    return any("capacity_blocks" in p for p in run.summary["points"])


def _workload_rows(demo) -> list[list[str]]:
    rows = []
    for workload in demo.traces:
        for run in (r for r in demo.runs if r.workload == workload and _swept(r) and r.backend != "prediction"):
            s = run.summary
            points = [p for p in s["points"] if p.get("policy") != "belady"]
            smallest = min((p.get("capacity_blocks", 0) for p in points), default=None)
            at_small = [p for p in points if p.get("capacity_blocks") == smallest]
            best = max(at_small, key=lambda p: p["hit_rate"]["token"]["steady"], default=None)
            bound = next(
                (p for p in s["points"] if p.get("policy") == "belady" and p.get("capacity_blocks") == smallest), None
            )
            rows.append(
                [
                    workload,
                    run.backend,
                    num(s["trace"]["requests"]),
                    pct(s["infinite_cache"]["token"]["steady"]),
                    num(smallest),
                    f"{best['policy']} {pct(best['hit_rate']['token']['steady'])}" if best else "–",
                    pct(bound["hit_rate"]["token"]["steady"]) if bound else "–",
                ]
            )
    return rows


def _curves(demo) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in demo.runs if _swept(r) and r.backend != "prediction"]
    if not runs:
        return None
    cols = min(3, len(runs))
    rows = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, run in zip(axes.flat, runs):
        by_policy: dict[str, list] = {}
        for p in run.summary["points"]:
            if "capacity_blocks" in p:
                by_policy.setdefault(p["policy"], []).append((p["capacity_blocks"], p["hit_rate"]["token"]["steady"]))
        for c in run.summary.get("curves") or []:  # the policy's colour, lighter: the curve behind its points
            ax.plot(c["capacity_blocks"], c["token_steady"], alpha=0.35, label=f"{c['policy']} curve",
                    **line_style(c["policy"]))  # fmt: skip
        for name, pts in sorted(by_policy.items()):
            pts.sort()
            ax.plot([c for c, _ in pts], [h for _, h in pts], marker="o", markersize=3, label=name, **line_style(name))
        ax.axhline(run.summary["infinite_cache"]["token"]["steady"], label="infinite", **INFINITE_STYLE)
        ax.set_xscale("log")
        log_ticks(ax)
        ax.set_title(f"{run.workload} ({run.backend})", fontsize=10)
        ax.set_xlabel("capacity (blocks)", fontsize=8)
        ax.set_ylabel("steady token hit rate", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(runs) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    return svg(fig)


def _serving_row(run, p: dict) -> list[str]:
    """One point's row: the deployment, whether it kept up, and its latencies only when it did (a saturated
    point's percentiles measure how long the trace ran, not the deployment)."""
    from kvbench.metrics.saturation import describe

    lat, engine, verdict = p["latency"], p["engine"], p.get("saturation") or {}
    tpot = lat.get("tpot") or {}
    if verdict.get("saturated"):
        latency = ["queue grows: not meaningful"] + ["–"] * 2
    else:
        latency = [
            f"{lat['ttft']['p50_ms']:,.1f} / {lat['ttft']['p99_ms']:,.1f}",
            f"{tpot['p50_ms']:,.2f}" if tpot else "–",
            f"{lat['e2el']['p50_ms'] / 1000:,.2f}",
        ]
    return [
        run.workload,
        f"{run.backend} {p['name']}",
        num(engine.get("instances")),
        describe(verdict) or "–",
        pct(p["hit_rate"]["token"]["all"]),
        *latency,
        num(engine["preemptions"]),
    ]


def _modeled(demo) -> Section:
    """Offline backends that model time (engine-sim): what users would feel, per workload, with whether the
    deployment served the load."""
    rows = []
    for run in demo.runs:
        for p in run.summary["points"]:
            lat, engine = p.get("latency"), p.get("engine")
            if not lat or not engine or not lat.get("ttft"):
                continue
            rows.append(_serving_row(run, p))
    if not rows:
        return Section("Modeled serving")
    note = (
        "The engine simulator's modeled latencies on the demo's deployment: as many instances as the trace's "
        "busiest stretch needs by the roofline model (see each report's config). A prefix cache that hits also "
        "saves prefill time. A saturated point (its queue grows to the end of the run, docs/semantics.md, "
        "Saturation) shows no latencies: they would measure the queue, not the deployment."
    )
    header = [
        "workload",
        "run / point",
        "instances",
        "load",
        "hit rate",
        "TTFT p50 / p99 (ms)",
        "TPOT p50 (ms)",
        "E2EL p50 (s)",
        "preemptions",
    ]
    return Section("Modeled serving", [note, Table(header, rows)])


def _fidelity(demo) -> Section:
    from kvbench.run.comparison import fidelity, load_run

    rows = []
    for workload in demo.traces:
        live = next((r for r in demo.runs if r.workload == workload and r.backend == "live"), None)
        pred = next((r for r in demo.runs if r.workload == workload and r.backend == "prediction"), None)
        if not (live and pred):
            continue
        for f in fidelity([load_run(live.run_dir), load_run(pred.run_dir)]):
            rows.append(
                [
                    workload,
                    pct(f.get("hit rate predicted")),
                    pct(f.get("hit rate measured")),
                    num(f.get("requests compared")),
                    pct(f.get("requests equal")),
                ]
            )
    if not rows:
        return Section("Live engine vs prediction")
    note = (
        "The live vLLM CPU engine (one request at a time) beside the vllm policy's prediction of the same "
        "requests at the engine's block size; 'requests equal' is the share whose cached tokens match exactly."
    )
    header = ["workload", "predicted hit rate", "measured hit rate", "requests", "requests equal"]
    return Section("Live engine vs prediction", [note, Table(header, rows)])


def write_index(demo) -> Path:
    out = demo.out
    sections = [
        Section(
            "Workloads",
            [
                "Each workload kind generated with its seed and replayed through the offline backends' demo grid. "
                "Capacities are shares of each trace's distinct blocks; the best policy and the Belady bound "
                "are at the smallest capacity, steady state.",
                Table(
                    [
                        "workload",
                        "backend",
                        "requests",
                        "infinite-cache hit rate",
                        "smallest capacity (blocks)",
                        "best policy there",
                        "Belady bound there",
                    ],
                    _workload_rows(demo),
                ),
            ],
        )
    ]
    curves = _curves(demo)
    if curves:
        sections.append(
            Section(
                "Hit rate vs capacity",
                [Figure(curves, "Every workload: policies, the one-pass LRU curve and the bounds")],
            )
        )
    sections.append(_modeled(demo))
    sections.append(_fidelity(demo))
    links = [(f"{r.workload} — {r.backend}", _rel(r.run_dir / "report.html", out)) for r in demo.runs]
    sections.append(Section("Run reports", [Links(links)]))
    if demo.skipped:
        sections.append(Section("Skipped", [Table(["what", "why"], [list(s) for s in demo.skipped])]))
    sections.append(Section("Traces", [Links([(name, _rel(p, out)) for name, p in demo.traces.items()])]))
    (out / "index.md").write_text(render_markdown("kvbench demo", sections))
    path = out / "index.html"
    path.write_text(render_html("kvbench demo", sections))
    return path
