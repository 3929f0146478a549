"""MkDocs hook: fills docs/benchmarks.md from benchmarks/results/*.json at build time, so the page can't drift
from the committed results. For each file: its command, when it records one, and its top-level numbers, strings
and small tables of numbers (a dict of at most MAX_ROWS scalars, or of dicts of scalars, such as per-concurrency
medians); per-round details stay in the file."""

from __future__ import annotations

import json
from pathlib import Path

MARKER = "<!-- benchmark-results -->"
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MAX_ROWS = 24


def _scalar(v) -> bool:
    return isinstance(v, bool | int | float | str) and not (isinstance(v, str) and len(v) > 160)


def _show(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|")


def _section(path: Path) -> list[str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return [f"## {path.name}", "", f"unreadable: {e}", ""]
    out = [f"## {path.stem}", "", f"`benchmarks/results/{path.name}`", ""]
    if not isinstance(data, dict):
        return out + [f"{len(data)} records" if isinstance(data, list) else _show(data), ""]
    if isinstance(data.get("command"), str):
        out += ["```bash", data["command"], "```", ""]
    flat = [(k, v) for k, v in data.items() if k != "command" and _scalar(v)]
    if flat:
        out += ["| key | value |", "|---|---|"] + [f"| {k} | {_show(v)} |" for k, v in flat] + [""]
    for key, table in data.items():
        if not isinstance(table, dict) or not 0 < len(table) <= MAX_ROWS:
            continue
        if all(_scalar(v) for v in table.values()):
            out += [f"**{key}**", "", "| | value |", "|---|---|"]
            out += [f"| {k} | {_show(v)} |" for k, v in table.items()] + [""]
        elif all(isinstance(v, dict) and all(_scalar(x) for x in v.values()) for v in table.values()):
            cols = list(dict.fromkeys(c for row in table.values() for c in row))
            if len(cols) > 12:
                continue
            out += [f"**{key}**", "", "| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
            out += [f"| {k} | " + " | ".join(_show(r.get(c, "")) for c in cols) + " |" for k, r in table.items()]
            out += [""]
    return out


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    lines: list[str] = []
    for path in sorted(RESULTS.glob("*.json")):
        lines += _section(path)
    return markdown.replace(MARKER, "\n".join(lines))
