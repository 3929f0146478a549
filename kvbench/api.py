"""The Python API (`import kvbench`): the CLI's commands as functions, each a thin layer over the modules that
do the work, so a run made here is the run `kvbench replay` makes. Backend options are the backend's replay
options by Python name (`--share-lora-kv` is `share_lora_kv=`), converted and defaulted by the same click
parameters. Errors are KvbenchErrors with the CLI's messages. Heavy modules are imported on first call."""

from __future__ import annotations

from pathlib import Path

from kvbench.errors import KvbenchError


class Trace:
    """A validated trace: `table` (pyarrow) and `meta` (TraceMeta), read from `path` when first used."""

    def __init__(self, path=None, table=None, meta=None):
        self.path = None if path is None else Path(path)
        self._table, self._meta = table, meta

    @property
    def table(self):
        if self._table is None:
            from kvbench.trace.validation import read_valid_trace

            self._table, self._meta = read_valid_trace(self.path)
        return self._table

    @property
    def meta(self):
        if self._meta is None:
            from kvbench.trace.files import read_meta

            self._meta = read_meta(self.path)
        return self._meta

    def to_polars(self):
        import polars as pl

        return pl.from_arrow(self.table)

    def save(self, path) -> Trace:
        """Write the trace to `path` (Parquet, schema v1); replays need it in a file."""
        from kvbench.trace.files import write_trace

        self.path = write_trace(self.table, path, self.meta)
        return self

    def __repr__(self) -> str:
        return f"Trace({str(self.path) if self.path else '<in memory>'!r}, block_size={self.meta.block_size})"


class Run:
    """A run directory (`path`) and its summary.json (`summary`); `requests` reads its per-request rows."""

    def __init__(self, path, summary: dict):
        self.path, self.summary = Path(path), summary

    @property
    def requests(self):
        """One row per request and point (a killed run's result parts included), as a polars DataFrame."""
        import polars as pl

        from kvbench.run.results import read_requests

        return pl.from_arrow(read_requests(self.path))

    @property
    def hit_rate(self) -> dict[str, float]:
        """Token hit rate over all requests, by point name (e.g. {'lru/1000blocks': 0.41, 'belady/1000blocks':
        0.52})."""
        return {p["name"]: p["hit_rate"]["token"]["all"] for p in self.summary["points"]}

    def report(self, trace=None) -> Path:
        """(Re)write report.md and report.html, as `kvbench report` does; returns the report.html path."""
        from kvbench.report import rewrite_reports

        rewrite_reports(self.path, self.summary, trace)
        return self.path / "report.html"

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, backend={self.summary.get('backend')!r}, points={len(self.summary['points'])})"


class Sweep:
    """A sweep folder (`path`), its manifest (sweep.json) and a `Run` for every point that has one."""

    def __init__(self, path, manifest: dict):
        self.path, self.manifest = Path(path), manifest

    @property
    def runs(self) -> dict[str, Run]:
        done = (p for p in self.manifest["points"] if p["status"] in ("ok", "skipped"))
        return {p["name"]: open_run(self.path / p["dir"]) for p in done}


def load_trace(path) -> Trace:
    """Read and validate a trace file; raises ValidationFailed (a KvbenchError) listing its violations."""
    from kvbench.trace.validation import read_valid_trace

    return Trace(path, *read_valid_trace(path))


def generate(kind: str, n: int, seed: int = 0, path=None, block_size: int | None = None, **options) -> Trace:
    """A seeded synthetic trace of `kind` (chat, agent, …; `kvbench trace gen KIND` options by Python name).
    With `path`, written there (validated as written, streamed kinds in bounded memory); else in memory."""
    import dataclasses

    from kvbench.trace import generators
    from kvbench.trace.validation import check

    gen = _registered(generators.get, kind)
    _check_names(options, [f.name for f in dataclasses.fields(gen.params_type)], f"trace gen {kind}")
    block_size = generators.DEFAULT_BLOCK_SIZE if block_size is None else block_size
    if path is not None:
        gen.write(path, n, seed=seed, block_size=block_size, **options)
        return Trace(path)
    table, meta = gen.run(n, seed=seed, block_size=block_size, **options)
    check(table, meta.block_size, f"generated {kind}")  # as `kvbench demo` does: a generator bug never yields a trace
    return Trace(None, table, meta)


def import_trace(source_format: str, path, out, **options) -> Trace:
    """Convert a public trace (`kvbench trace import FORMAT SRC -o OUT`): validated, written to `out`."""
    import inspect

    from kvbench.trace import importers
    from kvbench.trace.files import write_trace
    from kvbench.trace.validation import check

    imp = _registered(importers.get, source_format)
    _check_names(options, list(inspect.signature(imp.read).parameters)[1:], f"trace import {source_format}")
    if not Path(path).exists():
        raise KvbenchError(f"Invalid value for 'SRC': Path {str(path)!r} does not exist.")
    options = {k: v for k, v in options.items() if v is not None}
    if imp.write is not None:  # batch by batch, validated as it is written
        imp.write(Path(path), Path(out), **options)
    else:
        table, meta = imp.read(Path(path), **options)
        check(table, meta.block_size, str(path))
        write_trace(table, out, meta)
    return Trace(out)


def validate(trace):
    """Every schema violation of a trace file (read chunk by chunk) or an in-memory Trace: a ValidationReport
    (`ok`, `violations`, `summary()`), never raised. An unreadable file raises TraceFormatError."""
    if isinstance(trace, Trace) and trace.path is None:
        from kvbench.trace.validation import validate_table

        return validate_table(trace.table, trace.meta.block_size, "<in memory>")
    from kvbench.trace.scan import validate_file

    return validate_file(trace.path if isinstance(trace, Trace) else trace)


def replay(trace, backend: str = "sim", out=None, report: bool = True, overwrite: bool = False, *,
           warmup: float | None = None, stream: bool | None = None, resume: bool = False, force: bool = False,
           workers: int = 1, executor: str = "local", ray_address: str = "", progress=None,
           trace_cache: bool = True, **options) -> Run:  # fmt: skip
    """`kvbench replay TRACE --backend BACKEND [options]`: a run directory (`out`, else reports/<time>-…).
    `options` are the backend's, e.g. replay("chat.parquet", policy="lru,s3fifo", capacity=[1000, 10000]).
    `trace_cache`: --trace-cache/--no-trace-cache (kvbench.run.tracecache).
    An existing `out` is refused unless `overwrite` (or `resume`, for live backends). A live run's failure
    rate is in `summary['points'][0]['failures']`; Ctrl-C returns the run with summary['interrupted']."""
    import click

    from kvbench.redact import redact
    from kvbench.run.runner import run_replay
    from kvbench.trace.stats import DEFAULT_WARMUP

    path = _trace_path(trace)
    warmup = _cli_value(click.FloatRange(0, 1, max_open=True), DEFAULT_WARMUP if warmup is None else warmup, "--warmup")
    workers = _cli_value(click.IntRange(min=1), workers, "--workers")
    _check_names(options, _names(backend), f"replay --backend {backend}")
    backend_options = _backend_options(backend, options)
    given = "".join(f", {k}={v!r}" for k, v in redact(options).items())
    run_dir, summary = run_replay(
        path, backend, backend_options, out=out, warmup=warmup, progress=progress, report=report, stream=stream,
        command=f"kvbench.replay({str(path)!r}, backend={backend!r}{given})", resume=resume, workers=workers,
        executor=executor, ray_address=ray_address, overwrite=overwrite, force=force, trace_cache=trace_cache,
    )  # fmt: skip
    return Run(run_dir, summary)


def open_run(path) -> Run:
    """The Run of an existing run directory (made by replay, the CLI or a sweep)."""
    from kvbench.run.comparison import load_run

    return Run(path, {k: v for k, v in load_run(Path(path)).items() if not k.startswith("_")})


def compare(*runs, skip_first: int = 0, out=None, overwrite: bool = False) -> dict:
    """`kvbench compare RUN RUN…`: the tables (runs, latency, differences, fidelity, …) as a dict; with `out`,
    also DIR/compare.html, compare.md and compare.json (a DIR holding a comparison needs `overwrite`)."""
    from kvbench.report.compare import page_sections, write_page
    from kvbench.run.comparison import compare as run_compare
    from kvbench.run.rundir import check_new_file

    if out is not None:
        check_new_file(Path(out) / "compare.json", overwrite, "comparison")
    cmp = run_compare([r.path if isinstance(r, Run) else Path(r) for r in _flat(runs)], skip_first=skip_first)
    if out is not None:
        write_page(Path(out), "compare", "kvbench compare", page_sections(cmp, Path(out)), cmp.result)
    return cmp.result


def sweep(grid=None, out=None, *, executor: str = "local", workers: int | None = None, retries: int | None = None,
          index: bool = True, **axes) -> Sweep:  # fmt: skip
    """`kvbench sweep`: a `Grid`, or its axes by name (trace, backend, policy, capacity, engine_args, engine,
    warmup; each a list or 'a,b') and backend options passed to every point. One run directory per point under
    `out` (else reports/sweep-<time>); a rerun with the same `out` skips the finished points. `index`: write
    index.html comparing the points. Failed points are recorded in the manifest, not raised."""
    from kvbench.report.sweep import write_index
    from kvbench.run.executors import DEFAULT_RETRIES, ExecutorSettings
    from kvbench.run.rundir import sweep_dir
    from kvbench.run.sweeps import Grid, run_sweep

    if grid is None:
        grid = _grid(axes)
    elif not isinstance(grid, Grid) or axes:
        raise KvbenchError("give sweep() a Grid, or the grid's axes and options as keywords, not both")
    settings = ExecutorSettings(executor, workers, DEFAULT_RETRIES if retries is None else retries)
    settings.check()
    out_dir = sweep_dir(out)
    manifest = run_sweep(grid, out_dir, executor=settings, command="kvbench.sweep(...)")
    if index:
        write_index(out_dir, manifest)
    return Sweep(out_dir, manifest)


# --- helpers ---------------------------------------------------------------------------------------------


def _grid(axes: dict):
    """A sweep Grid from keywords: axes (a list or 'a,b'), engine, warmup, and backend options, each converted
    by the click parameters of the backends that declare it."""
    from kvbench.run.sweeps import OPTION_AXES, Grid, split_values

    plain = {"trace", "backend", "engine_args", "engine", "warmup", *OPTION_AXES}
    get = {k: axes.pop(k) for k in plain & set(axes)}
    backends = split_values(get.pop("backend", "sim"))
    _check_names(axes, set().union(plain, *map(_names, backends)), "sweep")
    options = {}
    for backend in backends:  # a point gets the options its backend declares (sweep.run_point filters them)
        mine = {k: v for k, v in axes.items() if k in _names(backend)}
        options.update(_backend_options(backend, mine, given_only=True))
    traces = [str(_trace_path(t)) for t in _flat([get.pop("trace", [])])]
    lists = {field: split_values(get.pop(axis, None)) for axis, field in OPTION_AXES.items()}
    engine_args = [str(a) for a in _flat([get.pop("engine_args", [])])]
    return Grid(traces, backends, engine_args=engine_args, options=options, **lists, **get)  # get: engine, warmup


def _trace_path(trace) -> Path:
    if isinstance(trace, Trace):
        if trace.path is None:
            raise KvbenchError(
                "this trace is in memory only: save it first (trace.save(PATH)), or generate it with "
                "path=PATH; a run records the trace file it replayed"
            )
        return trace.path
    return Path(trace)


def _flat(items) -> list:
    out = []
    for item in items:
        out += _flat(item) if isinstance(item, list | tuple) else [item]
    return out


def _registered(get, name: str):
    try:
        return get(name)
    except KeyError as exc:
        raise KvbenchError(exc.args[0]) from None


def _check_names(given, known, command: str) -> None:
    """A keyword no option of `command` has is refused as click refuses an unknown flag (with a suggestion)."""
    import difflib

    import click

    flags = sorted("--" + k.replace("_", "-") for k in known)
    for name in set(given) - set(known):
        flag = "--" + name.replace("_", "-")
        msg = click.NoSuchOption(flag, possibilities=difflib.get_close_matches(flag, flags)).format_message()
        raise KvbenchError(f"kvbench {command}: {msg} (keyword {name!r}; options: {', '.join(flags)})")


def _names(backend: str) -> set[str]:
    from kvbench.run.plugins import backend_names, load_backend

    if backend not in backend_names():  # the CLI's message
        raise KvbenchError(f"unknown backend {backend!r}; installed: {', '.join(backend_names())}")
    return {p.name for p in load_backend(backend).cli_options()}


def _backend_options(backend: str, options: dict, given_only: bool = False) -> dict:
    """Every option of the backend as `kvbench replay` passes them to the runner: the given ones converted by
    the backend's own click parameters (a list is joined with commas: capacity=[1000, 10000]), the others at
    their defaults (`given_only`: the given ones alone)."""
    import click

    from kvbench.run.plugins import load_backend

    params = load_backend(backend).cli_options()
    multiple = {p.name for p in params if p.multiple}
    given = {
        k: ",".join(map(str, v)) if isinstance(v, list | tuple) and k not in multiple else v for k, v in options.items()
    }
    cmd = click.Command(f"kvbench replay --backend {backend}", params=params)
    try:
        converted = dict(cmd.make_context(cmd.name, [], default_map=given).params)
    except click.ClickException as exc:
        raise KvbenchError(exc.format_message()) from None
    return {k: v for k, v in converted.items() if k in given} if given_only else converted


def _cli_value(kind, value, flag: str):
    import click

    try:
        return kind.convert(value, None, None)
    except click.BadParameter as exc:
        exc.param_hint = f"'{flag}'"
        raise KvbenchError(exc.format_message()) from None
