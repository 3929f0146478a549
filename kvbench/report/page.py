"""One page layout for every report kvbench writes (a run, a comparison, a sweep, the demo index): a list of
sections holding tables, figures, text and links, rendered as a self-contained HTML file (inline SVG, inline
CSS, no scripts, nothing fetched) and as Markdown with the same tables for terminals and PRs."""

from __future__ import annotations

import html
import io
import re
from dataclasses import dataclass, field


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclass
class Figure:
    svg: str  # an <svg> element
    caption: str


@dataclass
class Links:
    items: list[tuple[str, str]]  # (text, relative href)


@dataclass
class Section:
    title: str
    items: list = field(default_factory=list)  # Table | Figure | Links | str (a paragraph)


STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;font-size:13px;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
    "text-align:right}td:first-child,th:first-child{text-align:left}th{background:#f4f4f4}"
    "figure{margin:.5em 0}figcaption{font-size:12px;color:#555}svg{max-width:100%;height:auto}"
    "td.t{text-align:left}td:first-child{white-space:nowrap}"
    "h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}"
    "nav a{margin-right:1em}.note{color:#555;font-size:13px}"
)


def svg(fig) -> str:
    """A matplotlib figure as an inline <svg> element (the figure is closed)."""
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    # matplotlib's RDF metadata block: namespaces and a creator line, nothing a reader needs
    start, end = text.find("<metadata>"), text.find("</metadata>")
    return text[:start] + text[end + len("</metadata>") :] if 0 <= start < end else text


def _anchor(title: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in title.lower()).strip("-")


_FIGURE = re.compile(r"^[\s+−\-–~≈<>≤≥$]*[\d.,]")  # a cell that starts like a number: aligned right to compare


def _td(cell) -> str:
    """A table cell: figures right-aligned (digits under digits), prose such as an error message left-aligned."""
    text = str(cell)
    words = len(text) > 1 and not _FIGURE.match(text) and text not in ("yes", "no", "n/a")
    return f"<td class='t'>{html.escape(text)}</td>" if words else f"<td>{html.escape(text)}</td>"


def _html_item(item) -> str:
    if isinstance(item, Table):
        head = "".join(f"<th>{html.escape(h)}</th>" for h in item.header)
        body = "".join("<tr>" + "".join(_td(c) for c in row) + "</tr>" for row in item.rows)
        return f"<table><tr>{head}</tr>{body}</table>"
    if isinstance(item, Figure):
        return f"<figure>{item.svg}<figcaption>{html.escape(item.caption)}</figcaption></figure>"
    if isinstance(item, Links):
        return (
            "<ul>"
            + "".join(
                f"<li><a href='{html.escape(href, quote=True)}'>{html.escape(text)}</a></li>"
                for text, href in item.items
            )
            + "</ul>"
        )
    return f"<p class='note'>{html.escape(str(item))}</p>"


def render_html(title: str, sections: list[Section]) -> str:
    nav = "".join(f"<a href='#{_anchor(s.title)}'>{html.escape(s.title)}</a>" for s in sections if s.items)
    body = "".join(
        f"<h2 id='{_anchor(s.title)}'>{html.escape(s.title)}</h2>" + "".join(_html_item(i) for i in s.items)
        for s in sections
        if s.items
    )
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<link rel='icon' href='data:,'><style>{STYLE}</style></head>"
        f"<body><h1>{html.escape(title)}</h1><nav>{nav}</nav>{body}</body></html>"
    )


def _md_cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def render_markdown(title: str, sections: list[Section]) -> str:
    lines = [f"# {title}", ""]
    for s in sections:
        if not s.items:
            continue
        lines += [f"## {s.title}", ""]
        for item in s.items:
            if isinstance(item, Table):
                lines.append("| " + " | ".join(_md_cell(h) for h in item.header) + " |")
                lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(item.header))) + "|")
                lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in item.rows]
            elif isinstance(item, Figure):
                lines.append(f"*Plot in the HTML report: {item.caption}*")
            elif isinstance(item, Links):
                lines += [f"- [{text}]({href})" for text, href in item.items]
            else:
                lines.append(str(item))
            lines.append("")
    return "\n".join(lines)


def pct(x) -> str:
    return "–" if x is None else f"{100 * x:.2f}%"


def num(x) -> str:
    if x is None:
        return "–"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:.4g}"
