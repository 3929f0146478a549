"""A run's report.md and self-contained report.html, made from its summary.json and requests.parquet (and the
trace, when at hand, for the sections that need block hashes or sessions)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from kvbench.report.page import Section, Table, render_html, render_markdown
from kvbench.report.sections import Inputs, run_sections, section_at
from kvbench.report.style import plain
from kvbench.run.results import RESULT_SCHEMA, read_requests, result_files

MAX_REPORT_ROWS = 2_000_000  # per-request plots read at most this many rows: a report of a huge run stays quick


def load_requests(run_dir: Path, limit: int = MAX_REPORT_ROWS) -> tuple[pa.Table | None, bool]:
    """(the first `limit` rows of the run's results, with every column of RESULT_SCHEMA, whether it has more),
    or (None, False) if it has none. A killed run's results are read from the parts it left
    (`results.read_requests`)."""
    if not result_files(run_dir):
        return None, False
    rows = read_requests(run_dir, max_rows=limit + 1)
    for col in RESULT_SCHEMA:  # a run recorded before a column was added: the column is unknown (null)
        if col.name not in rows.column_names:
            rows = rows.append_column(col, pa.nulls(rows.num_rows, col.type))
    return rows.slice(0, limit), rows.num_rows > limit


def _no_path(value) -> str:
    """A config value as text, file paths cut to their name: a report is shared, the machine's layout isn't."""
    text = str(value)
    return Path(text).name if text.startswith(("/", "~")) else text


@section_at(20, "summary", "truncated")
def run_section(summary: dict, truncated: bool) -> Section:
    trace = summary["trace"]
    rows = [
        [
            "trace",
            f"{Path(trace['path']).name} ({trace['requests']:,} requests, block size {trace['block_size']} tokens)",
        ],
        ["backend", summary["backend"]],
        ["kvbench", summary.get("kvbench_version", "–")],
        ["created (UTC)", summary.get("created", "–")],
        ["complete", "yes" if summary.get("complete") else "no (interrupted: the points below finished)"],
    ]
    for part in summary.get("skipped") or []:
        rows.append(["skipped", f"{part['what']}: {part['why']}"])
    items: list = [Table(["run", ""], rows)]
    if truncated:
        items.append(f"Per-request plots use the first {MAX_REPORT_ROWS:,} rows of requests.parquet.")
    return Section("Run", items)


def _setting(value) -> str:
    """A config value as a person writes it: booleans as yes/no, lists joined, numbers without scientific
    notation, file paths cut to their name (a report is shared, the machine's layout isn't)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float):
        return plain(value)
    if isinstance(value, list | tuple):
        return ", ".join(_setting(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {_setting(v)}" for k, v in value.items())
    return _no_path(value)


@section_at(30, "summary")
def config_section(summary: dict) -> Section:
    """The backend's settings as the run used them (summary.json's `config`), with the unit each option states;
    unset ones left out. Pacing, a nested record, is spread over its own rows."""
    config = dict(summary.get("config") or {})
    config.update({f"pacing: {k}": v for k, v in (config.pop("pacing", None) or {}).items()})
    units = summary.get("units") or {}  # recorded by the runner (a run of an older kvbench has none)
    rows = []
    for key, value in sorted(config.items()):
        if value in (None, "", [], {}, ()):
            continue
        unit = units.get(key.removeprefix("pacing: ").replace("-", "_"), "")
        rows.append([key.replace("_", " "), _setting(value), unit])
    return Section("Configuration", [Table(["setting", "value", "unit"], rows)] if rows else [])


def sections(
    summary: dict, requests: pa.Table | None, trace: pa.Table | None, truncated: bool = False
) -> list[Section]:
    point = summary["points"][0]["name"] if summary["points"] else None
    if trace is not None and trace.num_rows > MAX_REPORT_ROWS:
        trace = trace.slice(0, MAX_REPORT_ROWS)
    # the serving sections cover every point; the trace views, the first point's
    return run_sections(Inputs(summary, requests, trace, truncated, point))


def write_reports(run_dir: Path, summary: dict, trace: pa.Table | None = None) -> None:
    """Write report.md and report.html into `run_dir` (plots need matplotlib, imported only here)."""
    import matplotlib

    matplotlib.use("Agg")
    requests, truncated = load_requests(Path(run_dir))
    parts = sections(summary, requests, trace, truncated)
    title = f"kvbench run {summary['run_id']}"
    (Path(run_dir) / "report.md").write_text(render_markdown(title, parts))
    (Path(run_dir) / "report.html").write_text(render_html(title, parts))


def rewrite_reports(run_dir: Path, summary: dict, trace_path: Path | None = None) -> None:
    """`write_reports` for a finished (or killed) run, reading the trace it replayed when it is still there:
    `trace_path`, else the path in summary.json (a streamed run's trace is not read whole)."""
    from kvbench.trace.files import read_trace

    path = Path(trace_path) if trace_path is not None else Path(summary["trace"]["path"])
    trace = read_trace(path)[0] if path.exists() and not summary["trace"].get("streamed") else None
    write_reports(run_dir, summary, trace)
