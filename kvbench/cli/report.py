"""`kvbench report RUN…`: (re)write report.md and report.html of run directories."""

from __future__ import annotations

from pathlib import Path

import click

from kvbench.cli.render import console


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="the trace the run replayed, for the sections that need block hashes and sessions (trace "
    "characterisation, agent tasks) [default: the path recorded in summary.json, when it still exists]",
)
def report(runs, trace_path):
    """Write report.md and the self-contained report.html of each run directory from its summary.json and
    requests.parquet (after an interrupted run, or with a newer kvbench)."""
    from kvbench.report import rewrite_reports
    from kvbench.run.comparison import load_run
    from kvbench.run.resultparts import list_parts
    from kvbench.run.results import REQUESTS_FILE

    for run in runs:
        summary = {k: v for k, v in load_run(run).items() if not k.startswith("_")}
        parts = list_parts(run / REQUESTS_FILE)
        if parts:  # a killed run: what it flushed is reported (a live run's --resume completes it)
            click.echo(f"{run}: killed (or still running): reporting the {len(parts)} result parts it wrote")
        with console.status(f"rendering {run}"):
            rewrite_reports(run, summary, trace_path)
        click.echo(f"{run}/report.html")
