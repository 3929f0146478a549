"""`kvbench report DIR… [--screenshot]`: (re)write report.md and report.html of run directories, and on request
take PNG screenshots of them (and of the pages of `kvbench compare --out`, `kvbench sweep` and `kvbench demo`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from kvbench import options
from kvbench.cli.render import console
from kvbench.errors import KvbenchError

# Pages that other commands write, in the order they are looked for; `kvbench report` takes their pictures but
# leaves rewriting them to the command that made them (it knows the runs and the options they were made from).
OTHER_PAGES = {
    "compare.html": "kvbench compare --out",
    "index.html": "kvbench sweep or kvbench demo",
}


def _page_of(folder: Path, screenshot: bool) -> Path | None:
    """The existing page of a folder that is not a run directory (None for a run directory); an error if it
    has none, or if it has one but there is nothing to do with it (no --screenshot)."""
    if (folder / "summary.json").exists():
        return None
    for name, command in OTHER_PAGES.items():
        if (folder / name).exists():
            if not screenshot:
                raise KvbenchError(
                    f"{folder}: not a run directory but the {name} of {command}; rerun that command to rewrite "
                    "it, or give --screenshot to take its picture"
                )
            return folder / name
    raise KvbenchError(
        f"{folder}: not a run directory (no summary.json), nor a folder of kvbench compare --out, sweep or demo"
    )


@dataclasses.dataclass(frozen=True)
class ReportOptions:
    """The options of `report`."""

    trace_path: str | None = options.option(
        None,
        "the trace the run replayed, for the sections that need block hashes and sessions (trace "
        "characterisation, agent tasks) [default: the path recorded in summary.json, when it still exists]",
        unit="path",
        flag="--trace",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
    )
    screenshot: bool = options.option(
        False,
        "after rendering, write a full-page PNG of each page (1400 px wide) to DIR/screenshots/report.png "
        "(compare.png, index.png for the folders of compare --out, sweep and demo, whose pages are pictured as "
        "they are, not rewritten). A screenshot is derived from its page: an earlier one of the same page is "
        "replaced. Needs Chromium (apt install chromium, or KVBENCH_CHROMIUM=/path/to/binary) and the Python "
        "package playwright (pip install playwright); without them the reports are still written and the "
        "command exits non-zero",
        unit="on/off",
        is_flag=True,
    )


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@options.command_options(ReportOptions)
def report(runs, trace_path, screenshot):
    """Write report.md and the self-contained report.html of each run directory from its summary.json and
    requests.parquet (after an interrupted run, or with a newer kvbench). With --screenshot, the folders of
    kvbench compare --out, kvbench sweep and kvbench demo may be given too, to picture their pages.

    Example: kvbench report reports/chat-sim --screenshot
    """
    from kvbench.report import rewrite_reports
    from kvbench.run.comparison import load_run
    from kvbench.run.resultparts import list_parts
    from kvbench.run.results import REQUESTS_FILE

    # Every folder is checked before any is rendered: a typo in the last one should not cost the others' time.
    other_pages = {run: _page_of(run, screenshot) for run in runs}
    pages = []
    for run in runs:
        if other_pages[run] is not None:
            pages.append(other_pages[run])
            continue
        summary = {k: v for k, v in load_run(run).items() if not k.startswith("_")}
        parts = list_parts(run / REQUESTS_FILE)
        if parts:  # a killed run: what it flushed is reported (a live run's --resume completes it)
            click.echo(f"{run}: killed (or still running): reporting the {len(parts)} result parts it wrote")
        with console.status(f"rendering {run}"):
            rewrite_reports(run, summary, trace_path)
        click.echo(f"{run}/report.html")
        pages.append(run / "report.html")
    if screenshot:
        from kvbench.report.screenshot import screenshot_pages, screenshot_path

        # The reports above are on disk already, so a missing browser (BrowserMissing) loses none of them.
        with console.status(f"taking {len(pages)} screenshot(s) in headless Chromium"):
            written = screenshot_pages([(page, screenshot_path(page)) for page in pages])
        for png in written:
            click.echo(str(png))
