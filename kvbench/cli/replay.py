"""`kvbench replay TRACE --backend NAME [backend options]`: one run directory with results and reports."""

from __future__ import annotations

import contextlib
import json
import shlex
import sys

import click

from kvbench.errors import KvbenchError
from kvbench.metrics.failures import DEFAULT_MAX_FAILURE_RATE, check_failure_rate, describe
from kvbench.metrics.fairness import describe_guarantee
from kvbench.metrics.saturation import describe as describe_saturation
from kvbench.redact import redact_argv
from kvbench.run.limits import CONTEXT_HELP, FIT_HELP, MAX_OUTPUT_HELP
from kvbench.run.plugins import backend_names, load_backend
from kvbench.run.runner import LIVE_EXECUTORS
from kvbench.trace.context import FIT_MODES
from kvbench.trace.stats import DEFAULT_WARMUP

DEFAULT_BACKEND = "sim"
TRACE_CACHE_HELP = (
    "offline backends, trace read whole: keep what reading and preparing TRACE computes (validation, "
    "fingerprint, infinite-cache hits; sim: dense block keys, 4-12 bytes of disk a block reference) in "
    "$KVBENCH_CACHE_DIR [default: ~/.cache/kvbench/prepared], keyed by the file's path, size and times, and load "
    "it on the next run of the same file (the first run pays the writing); results are the same either way. "
    "Delete the folder to clear it"
)


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
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    help="run directory; one that already holds a run is refused unless --resume or --overwrite "
    "[default: reports/<UTC time>-<backend>-<trace>/, with -2, -3, … if another run took the name]",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="replace what --out holds (deleted once every option was checked, just before the new run starts)",
)
@click.option(
    "--warmup",
    type=click.FloatRange(0, 1, max_open=True),
    default=DEFAULT_WARMUP,
    show_default=True,
    help="fraction of requests (by arrival) left out of steady-state metrics",
)
@click.option(
    "--tenant-weights",
    metavar="TENANT=W,...",
    help="what each tenant pays for or is entitled to, relative (e.g. gold=3,free=1): fairness by entitlement "
    "compares each tenant's share of the hit tokens with its share of these weights",
)
@click.option(
    "--tenant-slo",
    metavar="TENANT:ttft=MS,tpot=MS;...",
    help="TTFT/TPOT/E2EL targets per tenant, in ms, as --slo ('*' for the others; e.g. "
    "'gold:ttft=200,tpot=30;*:ttft=2000'): "
    "SLO attainment per tenant and whether each one's TTFT p99 is within its TTFT target, for backends that "
    "model or measure latency [default: the trace's slo_ttft_ms / slo_tpot_ms columns]",
)
@click.option("--max-output-tokens", type=click.IntRange(min=1), help=MAX_OUTPUT_HELP)
@click.option("--context", "context_tokens", type=click.IntRange(min=1), help=CONTEXT_HELP)
@click.option("--fit-context", type=click.Choice(FIT_MODES), default="refuse", show_default=True, help=FIT_HELP)
@click.option(
    "--like",
    metavar="URL",
    help="sim (and engine-sim, for vLLM): predict as the engine at URL is set up, from what it publishes "
    "(vLLM: /metrics cache_config_info and /v1/models; llama.cpp: /props and /slots): its policy, capacity, "
    "slots and context, printed; an option given here wins (docs/fidelity.md, Engine settings)",
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
    help="read the trace's block ids row group by row group, in bounded memory (sim: lru, vllm and the Belady "
    "bound, whose next uses take up to 40 bytes a block reference of scratch disk under $TMPDIR; no --curve) "
    "[default: stream traces of more than 60 million block references]",
)
@click.option(
    "--trace-cache/--no-trace-cache",
    default=True,
    show_default=True,
    help=TRACE_CACHE_HELP,
)
@click.option(
    "--resume",
    is_flag=True,
    help="live backends: continue the interrupted run in --out DIR; requests it answered (ok, error, timeout) "
    "are kept, the rest are sent. Refused when the pacing options differ from the first run's, unless --force",
)
@click.option("--force", is_flag=True, help="with --resume: go on although the pacing options changed")
@click.option(
    "--max-failure-rate",
    type=click.FloatRange(0, 1),
    default=DEFAULT_MAX_FAILURE_RATE,
    show_default=True,
    help="live backends: the share of sent requests (0-1) that may fail (error or timeout) before the command "
    "exits with status 3; the results are written either way. 0: any failed request fails the run",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="live backends: load generators sharing the run, each with whole sessions (and what they depend on), all "
    "starting at one instant; --max-concurrency applies to each. More than 1 needs --executor ray. A worker "
    "lost with its node leaves its unanswered requests as worker_lost and the command exits with status 4; "
    "--resume sends them",
)
@click.option(
    "--executor",
    type=click.Choice(list(LIVE_EXECUTORS)),
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
