"""`kvbench replay TRACE --backend NAME [backend options]`: one run directory with results and reports."""

from __future__ import annotations

import json
import shlex
import sys

import click

from ..distributed import EXECUTORS
from ..errors import KvbenchError
from ..plugins import backend_names, load_backend
from ..stats import DEFAULT_WARMUP
from .render import console

DEFAULT_BACKEND = "sim"


def _backend_from_args(args: list[str]) -> str:
    for i, arg in enumerate(args):
        if arg == "--backend" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--backend="):
            return arg.split("=", 1)[1]
    return DEFAULT_BACKEND


class ReplayCommand(click.Command):
    """Adds the chosen backend's own options before parsing, so `--help` and errors speak of them."""

    def parse_args(self, ctx, args):
        self._add_backend_options(_backend_from_args(args))
        return super().parse_args(ctx, args)

    def _add_backend_options(self, name: str) -> None:
        if getattr(self, "_backend_loaded", None) == name:
            return
        try:
            backend = load_backend(name)
        except KeyError as exc:
            raise click.BadParameter(exc.args[0], param_hint="--backend") from None
        self.params = [p for p in self.params if not getattr(p, "_from_backend", False)]
        for opt in backend.cli_options():
            opt._from_backend = True
            self.params.append(opt)
        self._backend_loaded = name


@click.command(cls=ReplayCommand)
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
@click.option(
    "--backend",
    default=DEFAULT_BACKEND,
    show_default=True,
    help="backend plug-in (kvbench.backends entry points); its options are listed below",
)
@click.option("--out", type=click.Path(file_okay=False), help="run directory [default: reports/<run-id>/]")
@click.option(
    "--warmup",
    type=click.FloatRange(0, 1, max_open=True),
    default=DEFAULT_WARMUP,
    show_default=True,
    help="fraction of requests (by arrival) left out of steady-state metrics",
)
@click.option("--json", "as_json", is_flag=True, help="print summary.json to stdout")
@click.option(
    "--report/--no-report",
    default=True,
    show_default=True,
    help="write report.md and report.html (plots) next to the results",
)
@click.option(
    "--stream/--no-stream",
    default=None,
    help="read the trace's block ids row group by row group, in bounded memory (sim: lru and vllm, no "
    "Belady bound) [default: stream traces of more than 60 million block references]",
)
@click.option(
    "--resume",
    is_flag=True,
    help="live backends: continue the interrupted run in --out DIR; requests it answered (ok, error, timeout) "
    "are kept, the rest are sent",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="live backends: load generators sharing the run, each with whole sessions (and what they depend on), all "
    "starting at one instant; --max-concurrency applies to each. More than 1 needs --executor ray",
)
@click.option(
    "--executor",
    type=click.Choice(EXECUTORS),
    default="local",
    show_default=True,
    help="local: one client in this process (--workers 1 only); ray: each worker a Ray actor, its results merged "
    "into this run",
)
@click.option(
    "--ray-address",
    default="",
    help="with --executor ray: the cluster, 'auto' (the one `ray start` runs here) or ray://HOST:10001 "
    "[default: start a local cluster for this run]",
)
def replay(
    trace_path, backend, out, warmup, as_json, report, stream, resume, workers, executor, ray_address, **backend_options
):
    """Replay TRACE through a backend and write requests.parquet, summary.json and reports.

    Example: kvbench replay traces/samples/chat.parquet --policy lru,radix-lru --capacity 1000,3000,10000
    """
    from ..backend import Progress as PointProgress
    from ..runner import run_replay

    if backend not in backend_names():
        raise KvbenchError(f"unknown backend {backend!r}; installed: {', '.join(backend_names())}")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("replaying", total=None)
        failed = 0

        def progress(item):
            nonlocal failed
            if isinstance(item, PointProgress):  # an offline point's requests
                bar.update(task, completed=item.done, total=item.total, description=item.what)
            elif hasattr(item, "status"):  # a live request finished
                failed += item.status != "ok"
                bar.update(task, advance=1, description=f"replaying: {failed} failed")
            else:  # an offline configuration point finished
                bar.update(task, advance=1, description=f"replaying: finished {item.name}")

        run_dir, summary = run_replay(
            trace_path,
            backend,
            backend_options,
            out=out,
            warmup=warmup,
            command=shlex.join(["kvbench", *sys.argv[1:]]),
            progress=progress,
            report=report,
            stream=stream,
            resume=resume,
            workers=workers,
            executor=executor,
            ray_address=ray_address,
        )
    for w in summary.get("workers") or ():
        if w["status"] == "dead":
            lost = ", ".join(w["unfinished_sessions"][:10]) + (" …" if len(w["unfinished_sessions"]) > 10 else "")
            click.secho(
                f"worker {w['id']} on {w['host']} died: {w['error']}; {w['unfinished_requests']} requests of "
                f"{len(w['unfinished_sessions'])} sessions unfinished ({lost}); see summary.json workers",
                fg="red",
                err=True,
            )
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    for p in summary["points"]:
        hr = p["hit_rate"]["token"]
        flag = "  (underfilled: the cache never filled during warm-up)" if p.get("underfilled") else ""
        click.echo(f"{p['name']:>28}: token hit rate {hr['all']:.4f} all, {hr['steady']:.4f} steady{flag}")
    if summary.get("workers"):
        workers = summary["workers"]
        alive = sum(w["status"] == "alive" for w in workers)
        lag = max((w["schedule_lag"]["p99_ms"] or 0.0) for w in workers)
        click.echo(f"{'workers':>28}: {alive} of {len(workers)} alive, schedule lag p99 at most {lag:.1f} ms")
    for c in summary["curves"]:
        click.echo(f"{c['policy'] + ' curve':>28}: {len(c['capacity_blocks'])} capacities, see report.html")
    click.echo(f"results in {run_dir}/ (summary.json, requests.parquet{', report.html' if report else ''})")
