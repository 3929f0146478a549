"""`kvbench replay TRACE --backend NAME [backend options]`: one run directory with results and reports."""

from __future__ import annotations

import contextlib
import json
import shlex
import sys

import click

from kvbench import options
from kvbench.cli import BackendOptionsCommand
from kvbench.cli.replay_options import DEFAULT_BACKEND, ReplayOptions
from kvbench.errors import KvbenchError
from kvbench.metrics.failures import check_failure_rate, describe
from kvbench.metrics.fairness import describe_guarantee
from kvbench.metrics.saturation import describe as describe_saturation
from kvbench.redact import redact_argv
from kvbench.run.plugins import backend_names, load_backend


def _backend_from_args(args: list[str]) -> str:
    for i, arg in enumerate(args):
        if arg == "--backend" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--backend="):
            return arg.split("=", 1)[1]
    return DEFAULT_BACKEND


class ReplayCommand(BackendOptionsCommand):
    """Takes the chosen backend's own options, so `--help` and errors speak of them."""

    def backend_options(self, args):
        try:
            return load_backend(_backend_from_args(args)).cli_options()
        except KeyError as exc:
            raise click.BadParameter(exc.args[0], param_hint="--backend") from None


@click.command(cls=ReplayCommand)
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
@options.command_options(ReplayOptions)
def replay(
    trace_path,
    backend,
    out,
    overwrite,
    warmup,
    tenant_weights,
    tenant_slo,
    max_output_tokens,
    context_tokens,
    fit_context,
    like,
    as_json,
    report,
    stream,
    trace_cache,
    resume,
    force,
    max_failure_rate,
    workers,
    executor,
    ray_address,
    **backend_options,
):
    """Replay TRACE through a backend and write requests.parquet, summary.json and reports.

    Example: kvbench replay traces/samples/chat.parquet --policy lru,radix-lru --capacity 1000,3000,10000
    """
    from kvbench.metrics.fairness import parse_tenant_slo, parse_tenant_weights
    from kvbench.run.backend import Progress as PointProgress
    from kvbench.run.limits import RequestLimits
    from kvbench.run.runner import run_replay

    fairness = {"tenant_weights": parse_tenant_weights(tenant_weights), "tenant_slo": parse_tenant_slo(tenant_slo)}

    if backend not in backend_names():
        raise KvbenchError(f"unknown backend {backend!r}; installed: {', '.join(backend_names())}")
    if like:
        context_tokens = _like(like, trace_path, backend, backend_options, context_tokens)
    with _progress_bar() as bar:
        task = bar.add_task("replaying", total=None) if bar else None
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
            command=shlex.join(redact_argv(["kvbench", *sys.argv[1:]])),
            progress=progress if bar else None,
            report=report,
            stream=stream,
            resume=resume,
            workers=workers,
            executor=executor,
            ray_address=ray_address,
            overwrite=overwrite,
            fairness={k: v for k, v in fairness.items() if v} or None,
            force=force,
            trace_cache=trace_cache,
            limits=RequestLimits(max_output_tokens, context_tokens, fit_context),
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
    if summary.get("engine_settings"):
        from kvbench.live.engine_settings import describe as describe_engine

        click.echo(f"{'engine':>28}: {describe_engine(summary['engine_settings'])}", err=True)
    _say_limits(summary.get("limits") or {})
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        _print_points(summary)
        click.echo(f"results in {run_dir}/ (summary.json, requests.parquet{', report.html' if report else ''})")
    _exit_status(summary, run_dir, max_failure_rate)


def _like(url: str, trace_path: str, backend: str, backend_options: dict, context_tokens):
    """--like URL: the sim backend's options set from what the engine publishes (kvbench.run.like), printed;
    returns the context to check prompts against."""
    from kvbench.live.engine_settings import describe as describe_engine
    from kvbench.live.engine_settings import read_url
    from kvbench.run.like import options_like
    from kvbench.trace.files import read_meta

    if backend not in ("sim", "engine-sim"):
        raise KvbenchError(f"--like sets up a prediction (--backend sim or engine-sim), not --backend {backend}")
    settings = read_url(url)
    click.echo(f"{'like':>28}: {describe_engine(settings)}", err=True)
    try:
        block_size = read_meta(trace_path).block_size
    except (OSError, ValueError) as exc:
        raise KvbenchError(f"cannot read {trace_path}: {exc}") from None
    ctx = click.get_current_context()
    given = {k: v if ctx.get_parameter_source(k) == click.core.ParameterSource.COMMANDLINE else None
             for k, v in backend_options.items()}  # fmt: skip
    chosen = options_like(settings, block_size, given, backend)
    backend_options.update(chosen)
    shown = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in chosen.items())
    click.echo(f"{'set from the engine':>28}: {shown or 'nothing (all given)'}", err=True)
    return context_tokens or settings.get("context_tokens")


def _say_limits(limits: dict) -> None:
    """One line on stderr when prompts were cut or skipped to fit the context."""
    done = limits.get("cut") or limits.get("skipped")
    if done:
        how = "cut to their leading whole blocks" if limits.get("cut") else "left out"
        click.secho(
            f"{done} requests did not fit the {limits['context_tokens']}-token context ({limits['context_from']}; the "
            f"longest prompt had {limits['longest_prompt']} tokens): {how}",
            fg="yellow",
            err=True,
        )


def _progress_bar():
    """A progress bar on stderr when it is a terminal; none when it is a pipe or a log, where a bar is noise
    (and rich's import is a tenth of a second of a short simulation)."""
    if not sys.stderr.isatty():
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kvbench.cli.render import console

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    return Progress(*columns, console=console, transient=True)


def _token_hit_rate(point: dict) -> str:
    hr = point["hit_rate"]["token"]
    if point.get("cached_tokens_reported") is False:  # a live server that sends no usage.prompt_tokens_details
        return "token hit rate n/a (the server reports no cached tokens)"
    return f"token hit rate {hr['all']:.4f} all, {hr['steady']:.4f} steady"


def _print_points(summary: dict) -> None:
    for p in summary["points"]:
        flag = "  (underfilled: the cache never filled during warm-up)" if p.get("underfilled") else ""
        click.echo(f"{p['name']:>28}: {_token_hit_rate(p)}{flag}")
        if "failures" in p:
            click.echo(f"{'requests':>28}: {describe(p['failures'])}")
        if (p.get("engine") or {}).get("deployment"):  # engine-sim's multi-device instances and their KV pool
            click.echo(f"{'deployment':>28}: {p['engine']['deployment']}")
        if p.get("saturation"):  # engine-sim and live points: whether the deployment kept up with the load
            line = describe_saturation(p["saturation"])
            click.secho(f"{'load':>28}: {line}", fg="yellow" if p["saturation"]["saturated"] else None)
        guarantee = (p.get("fairness") or {}).get("p99_guarantee")
        if guarantee:  # --tenant-slo or the trace's targets: can this pool promise every tenant its TTFT p99
            click.secho(f"{'tenant TTFT p99':>28}: {describe_guarantee(p)}", fg=None if guarantee["met"] else "yellow")
    if summary.get("workers"):
        workers = summary["workers"]
        alive = sum(w["status"] == "alive" for w in workers)
        lag = max((w["schedule_lag"]["p99_ms"] or 0.0) for w in workers)
        click.echo(f"{'workers':>28}: {alive} of {len(workers)} alive, schedule lag p99 at most {lag:.1f} ms")
    for c in summary["curves"]:
        click.echo(f"{c['policy'] + ' curve':>28}: {len(c['capacity_blocks'])} capacities, see report.html")


def _exit_status(summary: dict, run_dir, max_failure_rate: float) -> None:
    """Exit 130 after an interruption (with how to go on), 3 when too many requests failed, 4 when a load
    worker was lost before it answered its requests (with how to send them), else 0."""
    resume = f"resume with: {shlex.join(redact_argv(['kvbench', *_resume_args(run_dir)]))}"
    if summary.get("interrupted"):
        live = any("failures" in p for p in summary["points"])
        how = resume if live else f"the points it finished are kept in {run_dir}/ (summary.json lists them)"
        click.secho(f"interrupted: {how}", fg="yellow", err=True)
        sys.exit(130)
    lost = sum(w["unfinished_requests"] for w in summary.get("workers") or () if w["status"] == "dead")
    if lost:  # (before the failure rate, which counts them too: what to do next is to resume)
        click.secho(f"{lost} requests were not answered (worker_lost); {resume}", fg="yellow", err=True)
        sys.exit(4)
    for p in summary["points"]:
        if "failures" in p:
            check_failure_rate(p["failures"], max_failure_rate)


def _resume_args(run_dir) -> list[str]:
    """The command that was run, with --out RUN_DIR and --resume (and without --overwrite)."""
    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if arg in ("--out", "--overwrite", "--resume") or arg.startswith("--out="):
            skip = arg == "--out"
            continue
        args.append(arg)
    return [*args, "--out", str(run_dir), "--resume"]
