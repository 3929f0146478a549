"""The model-vs-measurement error table of `kvbench.run.fidelity` as report text, for `kvbench compare` and the
`kvbench fidelity` run report: Markdown (terminals, PRs) and HTML, with the cells that miss the targets of
docs/fidelity.md highlighted.

Targets: TTFT MAPE at most 20%, E2EL MAPE at most 10%, median modeled/measured ratio within 0.85–1.15 (TTFT,
TPOT and E2EL alike). The peer figure we hold ourselves against: BLIS (inference-sim) reports 22.8% TTFT and
11.8% E2E MAPE over 38 vLLM experiments.

The page layout of `kvbench.report.page` escapes every table cell, so a highlighted cell cannot be said in its
Table. A page section holds a `FidelityTable` instead: a plain Table (bold cells) for Markdown and the
terminal, which `html_ready` swaps for the highlighted HTML table before the page is rendered as HTML.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from kvbench.report.page import Figure, Section, Table
from kvbench.run.fidelity import format_rows, rows

TITLE = "Model vs measurement"
MAPE_TARGETS = {"ttft": 0.20, "e2el": 0.10}  # docs/fidelity.md, issue 13
RATIO_BAND = (0.85, 1.15)
PEER = "BLIS (inference-sim) reports 22.8% TTFT and 11.8% E2E MAPE over 38 vLLM experiments"
OFF_STYLE = "background:#fbe1dd;font-weight:600"  # inline: page.STYLE is shared by every report
LEGEND = (
    f"Highlighted: MAPE above its target (TTFT {MAPE_TARGETS['ttft']:.0%}, E2EL {MAPE_TARGETS['e2el']:.0%}) or a "
    f"median ratio outside {RATIO_BAND[0]}–{RATIO_BAND[1]}."
)

# header of `format_rows` -> (metric, statistic) whose value decides whether that cell is off target
_JUDGED = {
    "TTFT MAPE": ("ttft", "mape"),
    "E2EL MAPE": ("e2el", "mape"),
    "TTFT ratio": ("ttft", "median_ratio"),
    "TPOT ratio": ("tpot", "median_ratio"),
    "E2EL ratio": ("e2el", "median_ratio"),
}


def explanation(skipped_first: int = 0) -> str:
    """What the numbers are, which requests count, and the targets (one paragraph)."""
    skipped = f", the live run's first {skipped_first} requests sent left out" if skipped_first else ""
    return (
        "Per request APE = |modeled − measured| / measured; MAPE is its mean over the requests, p90 APE its 90th "
        "percentile, ratio the median modeled/measured (1 is exact, below 1 the model is too fast). Counted: "
        f"the requests answered ok by both runs{skipped}; TPOT only for outputs of more than one token; TTFT and "
        "TPOT leave out streams that reached the client in one burst (a starved client or server: the times say "
        "when the burst came, not when the tokens were made; counted as burst streams); cached "
        "exact: requests whose modeled hit tokens equal the server's reported cached_tokens. "
        f"Targets (docs/fidelity.md): TTFT MAPE ≤ {MAPE_TARGETS['ttft']:.0%}, E2EL MAPE ≤ "
        f"{MAPE_TARGETS['e2el']:.0%}, ratios within {RATIO_BAND[0]}–{RATIO_BAND[1]}; for scale, {PEER}. "
        "Cells off target are bold (highlighted in HTML)."
    )


def _is_off(statistic: str, metric: str, value) -> bool:
    if value is None:
        return False
    if statistic == "mape":
        return value > MAPE_TARGETS[metric]
    return not RATIO_BAND[0] <= value <= RATIO_BAND[1]


def off_target(table: dict) -> list[list[bool]]:
    """Per cell of `format_rows(table)`'s body, whether it misses its target."""
    header, _ = format_rows(table)
    flags = []
    for _, errors in rows(table):
        row = []
        for title in header:
            metric, statistic = _JUDGED.get(title, (None, None))
            stats = (errors.get(metric) or {}) if metric else {}
            row.append(bool(stats.get("requests")) and _is_off(statistic, metric, stats.get(statistic)))
        flags.append(row)
    return flags


def _highlighted_cells(table: dict) -> tuple[list[str], list[list[tuple[str, bool]]]]:
    header, body = format_rows(table)
    return header, [list(zip(cells, flags)) for cells, flags in zip(body, off_target(table))]


@dataclass
class FidelityTable(Table):
    """The error table as a page Table (bold cells off target), carrying the table dict for `html_ready`."""

    source: dict = field(default_factory=dict)

    @classmethod
    def of(cls, table: dict) -> FidelityTable:
        header, body = _highlighted_cells(table)
        return cls(header, [[f"**{c}**" if off else c for c, off in row] for row in body], source=table)


def table_html(table: dict) -> str:
    """The error table alone as an HTML <table>, off-target cells highlighted (with a tooltip why)."""
    header, body = _highlighted_cells(table)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)

    def td(text: str, off: bool) -> str:
        if not off:
            return f"<td>{html.escape(text)}</td>"
        return f"<td class='off' style='{OFF_STYLE}' title='off target'>{html.escape(text)}</td>"

    rows_html = "".join("<tr>" + "".join(td(c, off) for c, off in row) + "</tr>" for row in body)
    return f"<table><tr>{head}</tr>{rows_html}</table>"


def _markdown_table(t: Table) -> str:
    def cell(x) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in t.header) + " |"]
    lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(t.header))) + "|")
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in t.rows]
    return "\n".join(lines)


def fidelity_markdown(table: dict) -> str:
    """The explanation paragraph and the error table in Markdown, off-target cells bold; no heading (the
    caller puts it under its own, e.g. `## Model vs measurement`)."""
    return explanation(table.get("skipped_first", 0)) + "\n\n" + _markdown_table(FidelityTable.of(table)) + "\n"


def fidelity_html(table: dict) -> str:
    """The explanation paragraph and the highlighted error table as an HTML fragment (no heading), styled
    like the tables of `kvbench.report.page`."""
    note = html.escape(explanation(table.get("skipped_first", 0)))
    return f"<p class='note'>{note}</p>{table_html(table)}"


def html_ready(sections: list[Section]) -> list[Section]:
    """`sections` with every FidelityTable replaced by its highlighted HTML table, for `page.render_html`: a
    <figure> holds the table (a figure may hold a table; the page inserts a figure's markup as it is) and the
    legend is its caption."""
    return [
        Section(s.title, [Figure(table_html(i.source), LEGEND) if isinstance(i, FidelityTable) else i for i in s.items])
        for s in sections
    ]
