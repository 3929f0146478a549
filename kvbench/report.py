"""report.md and a self-contained report.html (inline SVG plots) from a run's summary."""

from __future__ import annotations

import html
import io
from pathlib import Path


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.2f}%"


def _num(x) -> str:
    if x is None:
        return "–"
    return f"{x:,}" if isinstance(x, int) else f"{x:.4g}"


def _tables(summary: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for every table, shared by the Markdown and the HTML report."""
    inf = summary["infinite_cache"]["token"]
    out = [
        (
            "Run",
            ["", ""],
            [
                [
                    "trace",
                    f"{summary['trace']['path']} ({summary['trace']['requests']:,} requests, "
                    f"block size {summary['trace']['block_size']})",
                ],
                ["backend", summary["backend"]],
                ["infinite-cache bound (token, all / steady)", f"{_pct(inf['all'])} / {_pct(inf['steady'])}"],
                ["complete", str(summary.get("complete"))],
            ],
        )
    ]
    points = summary["points"]
    if points:
        rows = [
            [
                p["name"],
                _pct(p["hit_rate"]["token"]["all"]),
                _pct(p["hit_rate"]["token"]["steady"]),
                _pct(p["hit_rate"]["block"]["all"]),
                _pct(p["hit_rate"]["block"]["steady"]),
                _num(p["evictions"]),
                _num(p["fairness"]["jain"]["hit_rate"]),
                "yes" if p.get("underfilled") else "",
            ]
            for p in points
        ]
        out.append(
            (
                "Hit rate per point",
                [
                    "point",
                    "token all",
                    "token steady",
                    "block all",
                    "block steady",
                    "evictions",
                    "Jain (tenants)",
                    "underfilled",
                ],
                rows,
            )
        )
    for key, title in (("by_tenant", "tenant"), ("by_workload", "workload"), ("by_modality", "modality")):
        if not points or not points[0].get(key):
            continue
        names = [g["name"] for g in points[0][key]][:30]
        header = [title] + [p["name"] for p in points[:8]]
        rows = []
        for name in names:
            row = [name]
            for p in points[:8]:
                g = next((g for g in p[key] if g["name"] == name), None)
                row.append(_pct(g["hit_rate"]) if g else "–")
            rows.append(row)
        out.append((f"Hit rate by {title} (all requests)", header, rows))
    return out


def _markdown(summary: dict) -> str:
    lines = [f"# kvbench run `{summary['run_id']}`", ""]
    for title, header, rows in _tables(summary):
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    if summary.get("curves"):
        lines += ["## Hit-rate-vs-capacity curve", "", "See report.html for the plot; sampled points:", ""]
        for c in summary["curves"]:
            pairs = list(zip(c["capacity_blocks"], c["token_all"]))[:: max(1, len(c["capacity_blocks"]) // 12)]
            lines.append(f"- {c['policy']}: " + ", ".join(f"{cap:,} → {_pct(h)}" for cap, h in pairs))
        lines.append("")
    return "\n".join(lines)


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def _plots(summary: dict) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = []
    inf = summary["infinite_cache"]["token"]["steady"]
    by_policy: dict[str, list] = {}
    for p in summary["points"]:
        if "capacity_blocks" in p:
            by_policy.setdefault(p["policy"], []).append((p["capacity_blocks"], p["hit_rate"]["token"]["steady"]))
    sweep = any(len(v) > 1 for v in by_policy.values()) or summary.get("curves")
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4))
        for c in summary.get("curves", []):
            ax.plot(c["capacity_blocks"], c["token_steady"], label=f"{c['policy']} (one-pass curve)")
        for name, pts in sorted(by_policy.items()):
            pts.sort()
            style = "k--" if name == "belady" else "-o"
            ax.plot([c for c, _ in pts], [h for _, h in pts], style, label=name, markersize=3)
        ax.axhline(inf, color="grey", linestyle=":", label="infinite cache")
        ax.set_xscale("log")
        ax.set_xlabel("capacity (blocks)")
        ax.set_ylabel("token hit rate (steady state)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        plots.append(("Hit rate vs capacity", _svg(fig)))
    point = summary["points"][0] if summary["points"] else None
    for key in ("by_tenant", "by_workload", "by_modality"):
        groups = point.get(key) if point else None
        if groups and len(groups) > 1:
            groups = groups[:30]
            fig, ax = plt.subplots(figsize=(7, 0.25 * len(groups) + 1))
            ax.barh([g["name"] for g in groups][::-1], [g["hit_rate"] for g in groups][::-1])
            ax.set_xlabel(f"token hit rate ({point['name']})")
            plots.append((f"Hit rate {key.replace('_', ' ')}", _svg(fig)))
    ev = point and point["fairness"].get("evictor_victim")
    if ev and len(ev["tenants"]) > 1:
        import numpy as np

        m = np.asarray(ev["matrix"], dtype=float)[:30, :30]
        fig, ax = plt.subplots(figsize=(6, 5))
        # log scale: one heavy tenant would otherwise paint every other cell the same colour
        im = ax.imshow(m + 1, cmap="viridis", norm=matplotlib.colors.LogNorm(vmin=1, vmax=max(m.max() + 1, 2)))
        ax.set_xlabel("victim tenant")
        ax.set_ylabel("evicting tenant")
        names = ev["tenants"][:30]
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
        ax.set_yticks(range(len(names)), names, fontsize=6)
        fig.colorbar(im, label="blocks evicted + 1 (log scale)")
        plots.append((f"Evictor × victim ({point['name']})", _svg(fig)))
    return plots


def _html(summary: dict) -> str:
    parts = [f"<h1>kvbench run <code>{html.escape(summary['run_id'])}</code></h1>"]
    for title, svg in _plots(summary):
        parts.append(f"<h2>{html.escape(title)}</h2><figure>{svg}</figure>")
    for title, header, rows in _tables(summary):
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        parts.append(f"<h2>{html.escape(title)}</h2><table><tr>{head}</tr>{body}</table>")
    style = (
        "body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;"
        "text-align:right}td:first-child,th:first-child{text-align:left}figure{margin:0}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>kvbench {html.escape(summary['run_id'])}"
        f"</title><style>{style}</style></head><body>{''.join(parts)}</body></html>"
    )


def write_reports(run_dir: Path, summary: dict) -> None:
    (run_dir / "report.md").write_text(_markdown(summary))
    (run_dir / "report.html").write_text(_html(summary))
