"""PNG screenshots of report pages in headless Chromium, for `kvbench report --screenshot` and the browser tests.

Drives the system's Chromium (Debian's `chromium`, or the binary KVBENCH_CHROMIUM names) through the Python
`playwright` package. It never runs `playwright install`: kvbench must not download a browser behind the
user's back (and the machines it runs on are often offline), so a missing browser is reported with what to
install instead.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvbench.errors import KvbenchError

# Runs as root in containers with no network: no sandbox, no GPU, nothing that phones home.
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
TIMEOUT_MS = 60_000  # a 2-core machine that is also running other things
WIDTH = 1400  # wide enough for the reports' full-width figures and their widest tables
HEIGHT = 900  # the viewport; a full-page screenshot grows to the page's height
SCREENSHOT_DIR = "screenshots"
INSTALL_HINT = (
    "apt install chromium (or set KVBENCH_CHROMIUM to a Chromium binary) and pip install 'kvbench[screenshot]' "
    "(playwright)"
)


class BrowserMissing(KvbenchError):
    """No page can be rendered here: Chromium or the playwright package is missing."""


def chromium_executable() -> str | None:
    """KVBENCH_CHROMIUM when set (an empty or non-executable path hides Chromium), else `chromium` on PATH."""
    named = os.environ.get("KVBENCH_CHROMIUM")
    if named is not None:
        return named if named and os.access(named, os.X_OK) else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def browser_problem() -> str | None:
    """Why no page can be rendered here (saying what to install), or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package playwright is not installed (pip install 'kvbench[screenshot]')"
    if chromium_executable() is None:
        where = os.environ.get("KVBENCH_CHROMIUM")
        if where is not None:
            return f"KVBENCH_CHROMIUM={where!r} is not an executable file"
        return "no chromium on PATH (apt install chromium, or set KVBENCH_CHROMIUM to the binary)"
    return None


@contextmanager
def chromium() -> Iterator:
    """A launched headless Chromium (a playwright Browser), closed on exit; BrowserMissing if there is none.
    Launching takes a second or two, so callers with several pages open them all in one browser."""
    problem = browser_problem()
    if problem is not None:
        raise BrowserMissing(f"cannot take screenshots: {problem}; install with: {INSTALL_HINT}")
    from playwright.sync_api import Error, sync_playwright

    with sync_playwright() as pw:
        try:
            browser = pw.chromium.launch(executable_path=chromium_executable(), args=CHROMIUM_ARGS, timeout=TIMEOUT_MS)
        except Error as exc:  # a binary that is not Chromium, or one that crashes at start in this container
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BrowserMissing(
                f"{chromium_executable()} did not start as headless Chromium ({first}); install with: {INSTALL_HINT}"
            ) from None
        try:
            yield browser
        finally:
            browser.close()


def new_page(browser, width: int = WIDTH):
    page = browser.new_page(viewport={"width": width, "height": HEIGHT})
    page.set_default_timeout(TIMEOUT_MS)
    return page


def capture(page, png: Path) -> Path:
    """Write a full-page PNG of the loaded `page` to `png` (replacing an earlier one: it is derived data)."""
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(png), full_page=True)
    return png


def screenshot_pages(pages: list[tuple[Path, Path]], width: int = WIDTH) -> list[Path]:
    """Each (html, png) pair: open the page from disk, wait until it is idle (its scripts have drawn), and
    write its full-page screenshot. One browser for all of them. Returns the PNG paths."""
    written = []
    with chromium() as browser:  # first: it says what to install when playwright is missing
        from playwright.sync_api import Error

        for html, png in pages:
            page = new_page(browser, width)
            try:
                page.goto(Path(html).resolve().as_uri(), wait_until="networkidle")
                written.append(capture(page, png))
            except Error as exc:  # a page that never settles (timeout) or a browser that died: name the page
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise KvbenchError(f"{html}: no screenshot taken ({first})") from None
            finally:
                page.close()
    return written


def screenshot_path(html: Path) -> Path:
    """Where `kvbench report --screenshot` puts the picture of `html`: DIR/screenshots/<stem>.png."""
    html = Path(html)
    return html.parent / SCREENSHOT_DIR / f"{html.stem}.png"
