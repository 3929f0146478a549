"""Terminal and Markdown rendering of `trace info` statistics (one table layout for both)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

console = Console(stderr=True)  # progress and status go to stderr so stdout stays machine-readable
stdout = Console(width=max(Console().width, 110))  # tables stay readable when piped


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _sections(stats: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for every table of the report."""
    hr = stats["infinite_cache_hit_rate"]
    overview = [
        ["requests", _fmt(stats["requests"])],
        ["duration (s)", _fmt(stats["duration_s"])],
        ["request rate (req/s)", _fmt(stats["rates"]["requests_per_s"])],
        [
            "input / output token rate (tok/s)",
            f"{_fmt(stats['rates']['input_tokens_per_s'])} / {_fmt(stats['rates']['output_tokens_per_s'])}",
        ],
        ["block size (tokens)", _fmt(stats["block_size"])],
        ["block references", _fmt(stats["blocks"]["references"])],
        ["unique blocks", _fmt(stats["blocks"]["unique"])],
        ["sessions / users / tenants", f"{stats['sessions']:,} / {stats['users']:,} / {stats['tenants']:,}"],
    ]
    lengths = [
        [name, _fmt(d["total"]), _fmt(d["mean"]), _fmt(d["p50"]), _fmt(d["p90"]), _fmt(d["p99"]), _fmt(d["max"])]
        for name, d in (("input tokens", stats["input_tokens"]), ("output tokens", stats["output_tokens"]))
    ]
    hits = [[unit, _fmt(hr[unit]["all"]), _fmt(hr[unit]["steady"])] for unit in ("token", "block")]
    out = [
        ("Overview", ["metric", "value"], overview),
        ("Lengths", ["", "total", "mean", "p50", "p90", "p99", "max"], lengths),
        (
            f"Infinite-cache prefix hit rate (steady state = after the first {hr['warmup']:.0%} of requests)",
            ["unit", "all requests", "steady state"],
            hits,
        ),
    ]
    for key, title in (("by_workload", "By workload"), ("by_tenant", "By tenant")):
        rows = stats[key]
        if rows:
            name = key.removeprefix("by_")
            out.append(
                (
                    title,
                    [name, "requests", "token share", "mean input", "mean output", "inf. hit rate"],
                    [
                        [
                            _fmt(r[name]),
                            _fmt(r["requests"]),
                            _fmt(r["token_share"]),
                            _fmt(r["mean_input"]),
                            _fmt(r["mean_output"]),
                            _fmt(r["infinite_cache_token_hit_rate"]),
                        ]
                        for r in rows[:20]
                    ],
                )
            )
    return out


def print_info(stats: dict) -> None:
    stdout.print(f"[bold]{stats['trace']}[/bold]")
    for title, header, rows in _sections(stats):
        table = Table(title=title, title_justify="left")
        for i, h in enumerate(header):
            table.add_column(h, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        stdout.print(table)


def info_markdown(stats: dict) -> str:
    lines = [f"# Trace report: `{stats['trace']}`", "", f"Source: `{stats['source']}`", ""]
    for title, header, rows in _sections(stats):
        lines += [
            f"## {title}",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
        ]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)
