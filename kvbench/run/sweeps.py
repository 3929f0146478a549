"""`kvbench sweep`: replay a grid (trace x backend x policy x capacity x engine args), one run directory per
point under the sweep folder, with a manifest (sweep.json) that says what each point did.

Points are named from their values, so a rerun of the same grid finds the run directories of the points it
finished (complete summary.json) and skips them. A point that fails is recorded with its error and the
others still run. Engine args restart a local live engine (kvbench.engines) before the points that use them,
so points run in stages of equal engine args, in order; within a stage an executor (kvbench.run.executors: this
process, a process pool, Ray tasks) runs the points, each as a PointTask that writes its own run directory,
retrying failed tries. Live points of a stage run after its offline ones, one at a time unless --workers
says otherwise: side by side they would load the same server and disturb each other's latencies.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import ipaddress
import json
import os
import re
import socket
import time
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from urllib.parse import urlparse

from kvbench import __version__
from kvbench.errors import KvbenchError
from kvbench.options import PolicyOption
from kvbench.run.backend import is_online
from kvbench.run.executors import ExecutorSettings, one_line, open_pool, run_points
from kvbench.run.plugins import load_backend
from kvbench.run.rundir import MANIFEST
from kvbench.run.shipping import ShippedTask, share_traces, unpack
from kvbench.trace.stats import DEFAULT_WARMUP

AXES = ("trace", "backend", "policy", "capacity", "engine_args")
OPTION_AXES = {"policy": "policies", "capacity": "capacities"}  # backend options whose lists are grid axes
EXECUTOR_KEYS = tuple(f.name for f in fields(ExecutorSettings))
TOML_KEYS = {*AXES, *EXECUTOR_KEYS, "engine", "out", "warmup", "options"}


@dataclass(frozen=True)
class Point:
    trace: str
    backend: str
    policy: str | None = None  # None: the axis does not apply to the backend, or its default is used
    capacity: str | None = None
    engine_args: str | None = None  # None: the engine as it runs (or no engine)
    name: str = ""

    def values(self) -> dict:
        return {k: getattr(self, k) for k in AXES}


@dataclass
class Grid:
    traces: list[str]
    backends: list[str] = field(default_factory=lambda: ["sim"])
    policies: list[str] = field(default_factory=list)
    capacities: list[str] = field(default_factory=list)
    engine_args: list[str] = field(default_factory=list)
    engine: str | None = None  # the local engine that engine args restart
    options: dict = field(default_factory=dict)  # backend options by parameter name, passed to every point
    warmup: float = DEFAULT_WARMUP
    trace_cache: bool = True  # offline points keep and load what preparing a trace computes (run.tracecache)


def split_values(value) -> list[str]:
    """Flags and TOML give an axis as 'a,b', a list, or a single number."""
    items = value if isinstance(value, list | tuple) else [value]
    out = []
    for item in items:
        out += [s.strip() for s in str(item).split(",") if s.strip()] if item is not None else []
    return out


def read_toml(path: Path) -> dict:
    """The grid file's keys; trace and out paths are relative to the file's folder, as a reader expects, and
    are given back relative to the working directory so that no absolute path lands in summary.json."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as exc:
        raise KvbenchError(f"{path}: not valid TOML ({exc})") from None
    data = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = set(data) - TOML_KEYS
    if unknown:
        raise KvbenchError(
            f"{path}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(TOML_KEYS))}"
        )
    here = Path(path).parent

    def local(p: str) -> str:
        return p if Path(p).is_absolute() else os.path.relpath(here / p)

    if "trace" in data:
        data["trace"] = [local(t) for t in split_values(data["trace"])]
    if "out" in data:
        data["out"] = local(str(data["out"]))
    return data


def _params(backend: str) -> dict:
    """The backend's declared options by name."""
    try:
        return {p.name: p for p in load_backend(backend).cli_options()}
    except KeyError as exc:
        raise KvbenchError(exc.args[0]) from None


def point_options(point: Point, grid: Grid) -> dict:
    """The backend options of one point: the grid's options the backend declares, less those only other
    policies use (`--quota` goes to the tenant-quota points of a sweep over lru and tenant-quota), and the
    point's own axis values."""
    params = _params(point.backend)
    options = {}
    for name, value in grid.options.items():
        param = params.get(name)
        if param is None:
            continue
        if isinstance(param, PolicyOption) and point.policy is not None and point.policy not in param.policies:
            continue
        options[name] = value
    options.update({a: getattr(point, a) for a in OPTION_AXES if getattr(point, a) is not None})
    return options


def is_live(backend: str) -> bool:
    return is_online(load_backend(backend))


def expand(grid: Grid) -> list[Point]:
    """Every point of the grid, named; engine args apply only to live backends, policy and capacity only to
    backends that declare those options."""
    if not grid.traces:
        raise KvbenchError("give at least one trace: --trace FILE (repeatable) or `trace = [...]` in the grid file")
    points = []
    for backend in grid.backends:
        params, live = _params(backend), is_live(backend)
        if grid.engine_args and not live:
            raise KvbenchError(
                f"--engine-args restart a live engine, but backend {backend} is offline (it runs no engine); "
                "drop --engine-args or sweep them with --backend openai --engine NAME"
            )
        if grid.engine_args and not grid.engine:
            raise KvbenchError("--engine-args need --engine NAME: the local engine to restart with each of them")
        if live and not grid.engine and "url" in params and not grid.options.get("url"):
            raise KvbenchError(f"backend {backend} needs --url URL, or --engine NAME to use a local engine")
        # an axis left out takes the backend's default, named in the point (chat_sim_lru_1000, not chat_sim_1000)
        axes = {
            a: getattr(grid, f) or split_values(params[a].default) if a in params else []
            for a, f in OPTION_AXES.items()
        }
        for ea in grid.engine_args or [None]:  # outermost: one engine restart per value
            for trace in grid.traces:
                for policy in axes["policy"] or [None]:
                    for cap in axes["capacity"] or [None]:
                        points.append(Point(trace, backend, policy, cap, ea))
    for axis, f in OPTION_AXES.items():
        if getattr(grid, f) and all(getattr(p, axis) is None for p in points):
            raise KvbenchError(f"--{axis} applies to none of the backends {', '.join(grid.backends)}")
    if grid.engine and not any(is_live(b) for b in grid.backends):
        raise KvbenchError(f"--engine {grid.engine} serves live backends only; the grid has {', '.join(grid.backends)}")
    return name_points(points)


def _slug(value: str, limit: int = 40) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", value).strip("-.")[:limit] or "default"


def name_points(points: list[Point]) -> list[Point]:
    """Names from the values (trace stem, backend, policy, capacity, engine args), filesystem-safe; where two
    points would get the same name (traces of one stem in two folders), a hash of all their values follows."""
    names = []
    for p in points:
        parts = [Path(p.trace).stem, p.backend, p.policy, p.capacity, p.engine_args]
        names.append("_".join(_slug(str(v)) for v in parts if v is not None))
    counts = {n: names.count(n) for n in names}
    out = []
    for p, n in zip(points, names):
        if counts[n] > 1:
            n += "-" + hashlib.blake2b(json.dumps(p.values(), sort_keys=True).encode(), digest_size=3).hexdigest()
        out.append(Point(**p.values(), name=n))
    return out


def stages(points: list[Point]) -> list[tuple[str | None, list[Point]]]:
    """Points grouped by engine args, in first-appearance order: the engine restarts once per group."""
    groups: dict[str | None, list[Point]] = {}
    for p in points:
        groups.setdefault(p.engine_args, []).append(p)
    return list(groups.items())


def finished(run_dir: Path, point: Point) -> dict | None:
    """The summary of a run directory that holds this point's complete run, else None."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return summary if summary.get("complete") and summary.get("backend") == point.backend else None


def _outcome(summary: dict, status: str, seconds: float | None) -> dict:
    first = summary["points"][0] if summary.get("points") else {}
    hr = (first.get("hit_rate") or {}).get("token", {})
    return {"status": status, "error": None, "seconds": seconds, "hit_rate": hr.get("all"), "steady": hr.get("steady")}


def run_point(
    point: Point,
    grid: Grid,
    out_dir: Path,
    url: str | None = None,
    command: str | None = None,
    trace_label: str | None = None,
) -> dict:
    """Replay one point into out_dir/<name>. Always: run_sweep skips the points an earlier sweep finished,
    and a directory completed by an uncounted try of this sweep (a process pool that broke) is rewritten.
    `trace_label`: the trace's name in the results when point.trace is a copy of it (kvbench.run.shipping)."""
    from kvbench.run.runner import run_replay

    run_dir = out_dir / point.name
    options = point_options(point, grid)
    if url:
        options["url"] = url
    t0 = time.monotonic()
    try:
        _, summary = run_replay(
            point.trace,
            point.backend,
            options,
            out=run_dir,
            warmup=grid.warmup,
            command=f"{command or 'kvbench sweep'} [point {point.name}]",
            overwrite=True,  # the sweep owns its points' folders: one left unfinished is run again
            trace_cache=grid.trace_cache,
            trace_label=trace_label,
        )
    except Exception as exc:  # noqa: BLE001 - a failed point is recorded and the sweep goes on
        return {"status": "failed", "error": one_line(exc), "seconds": round(time.monotonic() - t0, 3)}
    if summary.get("interrupted"):  # run_replay keeps what a Ctrl-C left; the sweep stops with it
        raise KeyboardInterrupt
    return _outcome(summary, "ok" if summary.get("complete") else "failed", round(time.monotonic() - t0, 3))


@dataclass(frozen=True)
class PointTask:
    """Everything a worker needs to run one stage's points, picklable: the grid, the sweep folder, the live
    URL, and the folder the sweep was started in, which relative trace and --out paths are relative to (a
    process pool's worker moves there; a Ray point gets its trace and returns its run directory through Ray,
    kvbench.run.shipping)."""

    grid: Grid
    out_dir: str
    url: str | None
    command: str | None
    cwd: str

    def __call__(self, point: Point, trace_label: str | None = None, into: str | None = None) -> dict:
        """Run the point into `out_dir`, or into `into` (a worker's own folder, kvbench.run.shipping)."""
        try:
            here = os.getcwd()
        except FileNotFoundError:  # a worker whose folder was removed
            here = None
        if here != self.cwd:
            if not os.path.isdir(self.cwd):
                raise KvbenchError(f"{socket.gethostname()} has no folder {self.cwd}, where the sweep started")
            os.chdir(self.cwd)
        url = self.url if is_live(point.backend) else None
        outcome = run_point(point, self.grid, Path(into or self.out_dir), url, self.command, trace_label)
        return {**outcome, "host": socket.gethostname()}


def visible(out_dir: Path, point: Point, outcome: dict) -> dict:
    """A point reported done whose run directory this machine cannot read has failed: the index and any rerun
    need it here."""
    if outcome["status"] != "ok" or finished(out_dir / point.name, point) is not None:
        return outcome
    return {
        **outcome,
        "status": "failed",
        "error": f"ran on {outcome.get('host')}, but {out_dir / point.name}/summary.json is not complete here",
    }


def is_loopback(url: str | None) -> bool:
    """A URL only this machine can reach (a local engine's): its live points must run here."""
    host = urlparse(url).hostname if url else None
    if host is None:
        return False
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class EngineStages:
    """Restarts the grid's engine with each engine-args value (keeping its other settings), and puts it
    back as it was found at the end."""

    def __init__(self, name: str | None, say: Callable[[str], None], status: Callable[[str], None]):
        from kvbench import engines

        self.engines, self.name, self.say, self.status = engines, name, say, status  # lines; passing states
        self.original = engines.running(name) if name else None
        self.changed = False

    def url(self, engine_args: str | None) -> str | None:
        if not self.name:
            return None
        if engine_args is None:
            return (self.engines.running(self.name) or self.engines.up(self.name, progress=self.status)).url
        settings = dict(self.original.settings) if self.original else {}
        self.say(f"restarting {self.name} with engine args {engine_args!r}")
        self.changed = True
        info = self.engines.up(
            self.name, restart=True, progress=self.status, **{**settings, "engine_args": engine_args}
        )
        return info.url

    def restore(self) -> None:
        if self.changed and self.original is not None:
            self.say(f"restarting {self.name} with its settings from before the sweep")
            self.engines.up(self.name, restart=True, progress=self.status, **self.original.settings)


def write_manifest(out_dir: Path, manifest: dict) -> None:
    tmp = out_dir / (MANIFEST + ".partial")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(out_dir / MANIFEST)


def run_sweep(
    grid: Grid,
    out_dir: Path,
    executor: str | ExecutorSettings = "local",
    command: str | None = None,
    on_point: Callable[[Point, dict], None] | None = None,
    say: Callable[[str], None] = lambda msg: None,
    status: Callable[[str], None] = lambda msg: None,
) -> dict:
    """Run every point not finished before; returns the manifest (also written to out_dir/sweep.json after
    every point, so an interrupted sweep says how far it got)."""
    settings = executor if isinstance(executor, ExecutorSettings) else ExecutorSettings(executor)
    settings.check()
    points = expand(grid)
    out_dir = out_dir.absolute()  # (a Ray job's driver may lose its folder when it joins the cluster)
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = {p.name: {"name": p.name, **p.values(), "dir": p.name, "status": "pending"} for p in points}
    manifest = {
        "kvbench_version": __version__,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": command,
        "executor": settings.executor,
        "workers": settings.workers,
        "retries": settings.retries,
        "grid": {k: v for k, v in asdict(grid).items() if k != "options"},
        "options": grid.options,
        "points": list(entries.values()),
        "complete": False,
    }
    write_manifest(out_dir, manifest)

    def record(p: Point, outcome: dict) -> None:
        entries[p.name].update(outcome)
        write_manifest(out_dir, manifest)
        if on_point:
            on_point(p, entries[p.name])

    def retrying(p: Point, attempt: int, error: str) -> None:
        say(f"{p.name}: attempt {attempt} of {settings.retries + 1} failed ({error}); trying again")

    engine = EngineStages(grid.engine, say, status)
    try:
        with open_pool(settings, say) as pool:
            shipped = None  # with Ray: the traces, sent to the workers once (kvbench.run.shipping)
            start_dir = os.getcwd()  # (now: joining a Ray job's cluster may move this process elsewhere)

            def task_for(url):
                task = PointTask(grid, str(out_dir), url, command, start_dir)
                return task if shipped is None else ShippedTask(task, shipped)

            def received(p, outcome):
                return visible(out_dir, p, outcome if shipped is None else unpack(outcome, out_dir, p.name))

            for engine_args, stage in stages(points):
                todo = []
                for p in stage:  # finished by an earlier sweep: skipped here, never sent to a worker
                    done = finished(out_dir / p.name, p)
                    if done is None:
                        todo.append(p)
                    else:
                        record(p, {**_outcome(done, "skipped", None), "attempts": 0})
                offline = [p for p in todo if not is_live(p.backend)]
                live = [p for p in todo if is_live(p.backend)]
                if settings.executor == "ray" and todo and shipped is None:
                    shipped = share_traces(pool.share, [p.trace for p in points])

                for p, outcome in run_points(pool, task_for(None), offline, settings.retries, on_retry=retrying):
                    record(p, received(p, outcome))
                if not live:
                    continue
                try:
                    url = engine.url(engine_args)
                except Exception as exc:  # noqa: BLE001 - the engine failed: this stage's live points cannot run
                    for p in live:
                        record(p, {"status": "failed", "error": f"engine: {one_line(exc)}", "attempts": 0})
                    continue
                here = is_loopback(url or grid.options.get("url"))
                limit = settings.workers or 1  # side by side only when asked: they would share the server
                task = task_for(url)
                for p, outcome in run_points(pool, task, live, settings.retries, limit, here, on_retry=retrying):
                    record(p, received(p, outcome))
        manifest["complete"] = True
    finally:
        try:
            engine.restore()
        finally:
            write_manifest(out_dir, manifest)
    return manifest
