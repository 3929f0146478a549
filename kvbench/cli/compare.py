"""`kvbench compare RUN RUN… [--out DIR] [--json]`."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import click

from kvbench import options
from kvbench.cli.render import console
from kvbench.report.compare import page_sections, write_page
from kvbench.report.page import render_markdown


class LazyBar:
    """A progress bar on stderr that appears only when the work has already taken a second: most
    comparisons finish sooner, and a bar that flashes up and vanishes is noise."""

    def __init__(self, after_s: float = 1.0):
        self.t0, self.after_s, self.bar, self.task = time.monotonic(), after_s, None, None

    def __call__(self, done: int, total: int, what: str) -> None:
        if self.bar is None:
            if time.monotonic() - self.t0 < self.after_s:
                return
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=console, transient=True,
            )  # fmt: skip
            self.bar.start()
            self.task = self.bar.add_task(what, total=total)
        self.bar.update(self.task, completed=done, total=total, description=what)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@dataclasses.dataclass(frozen=True)
class CompareOptions:
    """The options of `compare`."""

    as_json: bool = options.option(
        False,
        "print the tables as JSON (latencies in ms, hit rates 0..1; model_vs_measurement: MAPE, APE and "
        "ratios as fractions, means in seconds)",
        unit="on/off",
        flag="--json",
        is_flag=True,
    )
    out: str | None = options.option(
        None,
        "write DIR/compare.html (tables and plots), DIR/compare.md and DIR/compare.json instead of printing; "
        "a DIR that already holds a comparison is refused unless --overwrite",
        unit="path",
        type=click.Path(file_okay=False, path_type=Path),
    )
    overwrite: bool = options.option(False, "replace the comparison in --out DIR", unit="on/off", is_flag=True)
    skip_first: int = options.option(
        0,
        "leave the live run's first N requests sent (requests, failed ones included) out of the model vs "
        "measurement errors: engines pay one-off costs (compilation, cold caches) on their first requests",
        unit="requests",
        type=click.IntRange(min=0),
        metavar="N",
    )


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@options.command_options(CompareOptions)
def compare(runs, as_json, out, overwrite, skip_first):
    """Put run directories side by side: token hit rates (0..1), TTFT/TPOT/ITL/E2EL percentiles (ms) with 95%
    bootstrap intervals (1000 resamples of requests, seeded), each run's difference from the first run that
    measured latency (the baseline), flagged when it exceeds noise, throughput (requests/s) and failures;
    for runs of the same trace, the predicted (sim) vs measured (live) hit rate with the share of requests
    whose predicted hit tokens equal the server's cached_tokens, and modeled vs measured TTFT when an offline
    backend models latency. With one live run (backend openai) and runs that model it (engine-sim or sim,
    replaying the same request ids), a model vs measurement table per modeled point: TTFT/TPOT/E2EL MAPE
    (%), median modeled/measured ratio and TTFT p90 APE (%), and how many requests' modeled hit tokens equal
    the server's cached_tokens, overall, by workload and by tenant; cells that miss the targets (TTFT MAPE
    20%, E2EL MAPE 10%, ratio 0.85-1.15) are bold.

    Example: kvbench compare reports/chat-live reports/chat-sim --out reports/chat-compare
    """
    from kvbench.run.comparison import compare as run_compare
    from kvbench.run.rundir import check_new_file

    if out is not None:
        check_new_file(out / "compare.json", overwrite, "comparison")
    bar = LazyBar()
    try:
        cmp = run_compare(list(runs), progress=bar, skip_first=skip_first)
        if out is not None:
            bar(len(runs), len(runs) + 1, "plots")
            write_page(out, "compare", "kvbench compare", page_sections(cmp, out), cmp.result)
    finally:
        bar.close()
    for line in cmp.result["setting_warnings"]:  # a prediction made with other settings than the live run's
        click.secho(f"warning: the runs differ in {line}", fg="yellow", err=True)
    if as_json:
        click.echo(json.dumps(cmp.result, indent=2))
    elif out is None:
        click.echo(render_markdown("kvbench compare", page_sections(cmp, plots=False)))
    if out is not None:
        click.echo(f"wrote {out}/compare.html, compare.md and compare.json ({len(runs)} runs)", err=as_json)
