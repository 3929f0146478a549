"""Render a report in headless Chromium and say what went wrong: console errors and warnings, uncaught page
errors, requests (a self-contained report fetches nothing), and whether its plots (<svg>, <canvas>) drew; and
read a report.md's sections to find the points a per-point section leaves out.

The browser is driven by kvbench.report.screenshot (the code `kvbench report --screenshot` uses), so the tests
see the pages exactly as the pictures users take do. Tests call `require_browser()` (or use the
`browser_required` fixture): it skips when Chromium or playwright is missing, and fails instead when
KVBENCH_REQUIRE_BROWSER is set (as .ci/run does), like KVBENCH_REQUIRE_ENGINES for the engine tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvbench.report.screenshot import browser_problem, capture, chromium, new_page

from .conftest import missing

# Elements that draw; those under <defs>, <clipPath>, … only define shapes that are drawn by reference.
_MEASURE_JS = """() => {
  const drawing = 'path,rect,line,polyline,polygon,circle,ellipse,text,use,image';
  const inert = 'defs,clipPath,mask,marker,pattern,symbol';
  const svgs = [...document.querySelectorAll('svg')].filter(s => !s.parentElement.closest('svg'));
  const svg = svgs.map(s => {
    const r = s.getBoundingClientRect();
    let bbox = [0, 0];
    try { const b = s.getBBox(); bbox = [b.width, b.height]; } catch (e) {}
    const drawn = [...s.querySelectorAll(drawing)].filter(e => !e.closest(inert)).length;
    return {drawn, width: r.width, height: r.height, bbox};
  });
  const canvas = [...document.querySelectorAll('canvas')].map(c => {
    const r = c.getBoundingClientRect();
    return {width: c.width, height: c.height, shown: r.width > 0 && r.height > 0};
  });
  // the tables of the Answer section, as the reader sees them (cell texts), for checks against summary.json
  const answer = [];
  const head = document.getElementById('answer');
  for (let el = head && head.nextElementSibling; el && el.tagName !== 'H2'; el = el.nextElementSibling) {
    const tables = el.tagName === 'TABLE' ? [el] : [...el.querySelectorAll('table')];
    for (const t of tables) answer.push([...t.rows].map(r => [...r.cells].map(c => c.innerText.trim())));
  }
  return {svg, canvas, width: document.documentElement.scrollWidth, answer};
}"""


@dataclass
class PageCheck:
    url: str
    title: str = ""
    console_errors: list[str] = field(default_factory=list)
    console_warnings: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)  # uncaught exceptions
    failed_requests: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # every request but the page itself (and data:/blob:)
    svg_total: int = 0
    svg_nonempty: int = 0
    canvas_total: int = 0
    canvas_nonempty: int = 0
    page_width: int = 0  # the document's scroll width: wider than the window means a horizontal scroll bar
    answer: list = field(default_factory=list)  # the Answer section's tables as shown: [table][row][cell] texts
    screenshot: Path | None = None

    @property
    def problems(self) -> list[str]:
        """Everything that should not happen on a self-contained report page (warnings are not counted)."""
        return (
            [f"console error: {m}" for m in self.console_errors]
            + [f"page error: {m}" for m in self.page_errors]
            + [f"failed request: {m}" for m in self.failed_requests]
            + [f"request: {u}" for u in self.requests if not any(f.startswith(f"{u}: ") for f in self.failed_requests)]
        )

    def __str__(self) -> str:
        lines = [
            f"{self.url}: title {self.title!r}, svg {self.svg_nonempty}/{self.svg_total} non-empty, "
            f"canvas {self.canvas_nonempty}/{self.canvas_total} non-empty, {self.page_width} px wide"
        ]
        lines += [f"  {p}" for p in self.problems] + [f"  console warning: {m}" for m in self.console_warnings]
        return "\n".join(lines)


def require_browser() -> None:
    problem = browser_problem()
    if problem is None:
        return
    missing("KVBENCH_REQUIRE_BROWSER", f"{problem}; the report-rendering tests need a browser")


@pytest.fixture(scope="session")
def browser_required():
    """Skip (or fail) every test that uses it; session-scoped so that it runs before module-scoped fixtures."""
    require_browser()


def _check_one(browser, html_path, screenshot: Path | None) -> PageCheck:
    url = Path(html_path).resolve().as_uri()
    result = PageCheck(url)
    page = new_page(browser)

    def on_console(msg):
        where = msg.location or {}
        text = f"{msg.text} ({where.get('url', '')}:{where.get('lineNumber', '')})"
        if msg.type == "error":
            result.console_errors.append(text)
        elif msg.type == "warning":
            result.console_warnings.append(text)

    def on_request(req):
        if req.url != url and not req.url.startswith(("data:", "blob:")):
            result.requests.append(req.url)

    page.on("console", on_console)
    page.on("pageerror", lambda exc: result.page_errors.append(str(exc)))
    page.on("request", on_request)
    page.on("requestfailed", lambda req: result.failed_requests.append(f"{req.url}: {req.failure}"))
    try:
        page.goto(url, wait_until="networkidle")
        result.title = page.title()
        found = page.evaluate(_MEASURE_JS)
        result.svg_total = len(found["svg"])
        result.svg_nonempty = sum(
            s["drawn"] > 0 and s["width"] > 0 and s["height"] > 0 and s["bbox"][0] > 0 and s["bbox"][1] > 0
            for s in found["svg"]
        )
        result.canvas_total = len(found["canvas"])
        result.canvas_nonempty = sum(c["width"] > 0 and c["height"] > 0 and c["shown"] for c in found["canvas"])
        result.page_width = found["width"]
        result.answer = found["answer"]
        if screenshot is not None:
            result.screenshot = capture(page, screenshot)
    finally:
        page.close()
    return result


def check_pages(pages: list[tuple[Path, Path | None]]) -> list[PageCheck]:
    """Each (html, screenshot or None): open it (file://) in one headless Chromium, wait until it is idle, and
    return what happened; with a screenshot path, also write its full-page PNG there."""
    with chromium() as browser:
        return [_check_one(browser, html, png) for html, png in pages]


def check_page(html_path, screenshot: Path | None = None) -> PageCheck:
    return check_pages([(html_path, screenshot)])[0]


# --- report.md: which per-point sections leave points out ---------------------------------------------------


def markdown_sections(md: str) -> dict[str, str]:
    """The text of each `## ` section of a report.md, by heading (the page title and its preamble left out)."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in md.splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return {title: "\n".join(lines) for title, lines in sections.items()}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table_headers(text: str) -> list[list[str]]:
    """The header row of every markdown table in `text`: a `|` row followed by a `|---|` separator row."""
    lines = text.splitlines()
    return [
        _cells(lines[i])
        for i in range(len(lines) - 1)
        if lines[i].lstrip().startswith("|") and re.fullmatch(r"\s*\|(\s*:?-+:?\s*\|)+\s*", lines[i + 1])
    ]


def _names(text: str, name: str) -> bool:
    # A point name as a whole: lru/200blocks must not be found inside radix-lru/200blocks.
    return re.search(rf"(?<![\w/.\-]){re.escape(name)}(?![\w/.\-])", text) is not None


def points_missing_by_section(md: str, points: list[str]) -> dict[str, list[str]]:
    """For each section of `md` that is per point (one of its tables has a `point` column, or point names as
    column headers), the points it never names; sections that name every point are left out. Other sections
    (the run's configuration, trace statistics) are not per point and are not looked at."""
    missing: dict[str, list[str]] = {}
    for title, text in markdown_sections(md).items():
        headers = table_headers(text)
        per_point = any("point" in (c.lower() for c in h) or any(c in points for c in h) for h in headers)
        if per_point:
            left_out = [p for p in points if not _names(text, p)]
            if left_out:
                missing[title] = left_out
    return missing


def table_rows(text: str) -> list[dict[str, str]]:
    """Every body row of every markdown table in `text`, as {header: cell}."""
    lines = text.splitlines()
    rows: list[dict[str, str]] = []
    header = None
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("|"):
            header = None
        elif header is None and i + 1 < len(lines) and re.fullmatch(r"\s*\|(\s*:?-+:?\s*\|)+\s*", lines[i + 1]):
            header = _cells(line)
        elif header is not None and not re.fullmatch(r"\s*\|(\s*:?-+:?\s*\|)+\s*", line):
            rows.append(dict(zip(header, _cells(line), strict=False)))
    return rows
