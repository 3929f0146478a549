"""`kvbench demo`: the README's main job, on embedded defaults, with no server."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from kvbench import options
from kvbench.cli.render import console


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """The options of `demo`."""

    out: str | None = options.option(
        None,
        "directory for the traces, the runs and index.html; one that holds something is refused unless "
        "--overwrite [default: reports/demo, or reports/demo-2, -3, … when taken]",
        unit="path",
        type=click.Path(file_okay=False, path_type=Path),
    )
    overwrite: bool = options.option(False, "replace what --out holds", unit="on/off", is_flag=True)
    n: int = options.option(
        2000,
        "requests generated per workload kind",
        unit="requests",
        flag=("-n", "--requests"),
        type=click.IntRange(min=10),
    )
    seed: int = options.option(1, "generator seed (the same seed gives the same traces)", unit="integer", type=int)
    live: bool = options.option(
        False,
        "also start the local vLLM CPU engine (installed under ~/.cache/kvbench the first time: several "
        "minutes, about 3.5 GB) and replay the first 40 fitting requests of each workload against it, beside the "
        "simulator's prediction",
        unit="on/off",
        is_flag=True,
    )
    live_llama: bool = options.option(
        False,
        "with --live, also start llama.cpp's llama-server (compiled from source the first time: 5-16 min on "
        "2 cores), replay the same requests against it beside the llama-slot policy's prediction, and write "
        "OUT/compare/WORKLOAD/compare.html: both engines and both predictions side by side (hit rates 0..1)",
        unit="on/off",
        is_flag=True,
    )


@click.command()
@options.command_options(DemoOptions)
def demo(out, overwrite, n, seed, live, live_llama):
    """Generate every workload kind, replay each through the cache simulator over a small policy × capacity
    grid (with the Belady bound and the one-pass LRU curve), and write OUT/index.html linking every report."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kvbench.cli.demo_run import demo_backends, run_demo
    from kvbench.run.rundir import RunDir
    from kvbench.trace.generators import registry

    out = RunDir.claim(out, Path("reports/demo"), overwrite=overwrite, what="demo", resumable=False).path
    if live_llama and not live:
        raise click.UsageError("--live-llama compares llama.cpp with the vLLM engine of --live: give both")
    per_kind = 1 + len(demo_backends()) + (2 if live else 0) + (2 if live_llama else 0)
    steps = len(registry()) * per_kind + 1 + live + live_llama
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True
    ) as bar:
        task = bar.add_task("starting", total=steps)

        def step(text: str) -> None:
            bar.update(task, advance=1, description=text)

        def engine_log(text: str) -> None:
            bar.update(task, description=f"engine: {text}")

        result = run_demo(out, n=n, seed=seed, live=live, step=step, engine_log=engine_log, live_llama=live_llama)
    for r in result.runs:
        p = r.summary.get("points") or []
        click.echo(f"{r.workload:>14} {r.backend:>10}: {len(p)} points  {r.run_dir}/report.html")
    for what, why in result.skipped:
        click.echo(f"skipped {what}: {why}")
    for page in sorted((result.out / "compare").glob("*/compare.html")):
        click.echo(f"vLLM vs llama.cpp: {page}")
    click.echo(f"index: {result.out / 'index.html'}")
