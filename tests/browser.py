"""Render a report in headless Chromium and say what went wrong: console errors and warnings, uncaught page
errors, requests (a self-contained report fetches nothing), and whether its plots (<svg>, <canvas>) drew.

Drives the system's Chromium (Debian's `chromium`, or the binary KVBENCH_CHROMIUM names) with the Python
`playwright` package; never `playwright install` (no browser downloads). Tests call `require_browser()` (or use
the `browser_required` fixture): it skips when Chromium or playwright is missing, and fails instead when
KVBENCH_REQUIRE_BROWSER is set (as .ci/run does), like KVBENCH_REQUIRE_ENGINES for the engine tests.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .conftest import missing

# Root in a container with no network: no sandbox, no GPU, nothing that phones home.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",  # containers often have a 64 MB /dev/shm; Chromium then crashes without it
]
# playwright gives every launch a fresh temporary profile (--user-data-dir), removed on close.
TIMEOUT_MS = 60_000  # a 2-core CI machine that is also running other things

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
  return {svg, canvas};
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
            f"canvas {self.canvas_nonempty}/{self.canvas_total} non-empty"
        ]
        lines += [f"  {p}" for p in self.problems] + [f"  console warning: {m}" for m in self.console_warnings]
        return "\n".join(lines)


def chromium_executable() -> str | None:
    """KVBENCH_CHROMIUM when set (an empty or missing path hides Chromium), else `chromium` on PATH."""
    named = os.environ.get("KVBENCH_CHROMIUM")
    if named is not None:
        return named if named and os.access(named, os.X_OK) else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def browser_problem() -> str | None:
    """Why no page can be rendered here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package playwright is not installed (pip install -e '.[dev]')"
    if chromium_executable() is None:
        where = os.environ.get("KVBENCH_CHROMIUM")
        if where is not None:
            return f"KVBENCH_CHROMIUM={where!r} is not an executable"
        return "no chromium on PATH (apt-get install chromium, or set KVBENCH_CHROMIUM to the binary)"
    return None


def require_browser() -> None:
    problem = browser_problem()
    if problem is None:
        return
    missing("KVBENCH_REQUIRE_BROWSER", f"{problem}; the report-rendering tests need a browser")


@pytest.fixture(scope="session")
def browser_required():
    """Skip (or fail) every test that uses it; session-scoped so that it runs before module-scoped fixtures."""
    require_browser()


def check_page(html_path, screenshot: Path | None = None) -> PageCheck:
    """Open `html_path` (file://) in headless Chromium, wait until it is idle, and return what happened."""
    from playwright.sync_api import sync_playwright

    url = Path(html_path).resolve().as_uri()
    result = PageCheck(url)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_executable(), args=CHROMIUM_ARGS, timeout=TIMEOUT_MS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(TIMEOUT_MS)

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
            if screenshot is not None:
                Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(screenshot), full_page=True)
                result.screenshot = Path(screenshot)
        finally:
            browser.close()
    return result
