"""The replay runner: trace in, run directory out. It owns validation, result collection and outputs;
the backend (found by entry point) only answers requests."""

from __future__ import annotations

import datetime as _dt
import json
import platform
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from kvbench import __version__
from kvbench.cache.densify import numbered_chunks
from kvbench.errors import KvbenchError, KvbenchWarning
from kvbench.metrics.fairness import add_fairness_views, has_tenants
from kvbench.metrics.fairness import check_options as check_fairness
from kvbench.metrics.hits import MetricSums
from kvbench.metrics.saturation import saturation
from kvbench.options import NO_UNIT, unit_of
from kvbench.redact import redact, redact_text
from kvbench.registry import Registry
from kvbench.run.backend import (
    OfflineBackend,
    OnlineBackend,
    PointResult,
    Skipped,
    StreamedPoint,
    StreamingBackend,
    TraceCacheUser,
    protocol_of,
)
from kvbench.run.limits import RequestLimits
from kvbench.run.limits import apply as apply_limits
from kvbench.run.plugins import load_backend
from kvbench.run.results import WRITE_ROWS, ResultWriter, read_requests
from kvbench.run.rundir import RunDir, stamp
from kvbench.run.tracecache import TraceCache
from kvbench.trace.compute import pc
from kvbench.trace.files import TraceMeta
from kvbench.trace.scan import STREAM_BLOCK_REFS, ScannedTrace, block_references, scan_trace, trace_fingerprint
from kvbench.trace.stats import DEFAULT_WARMUP, hit_rates, infinite_cache_hits
from kvbench.trace.validation import block_lengths, read_valid_trace

DEFAULT_REPORTS = Path("reports")


def new_run_id(backend: str, trace_path: Path) -> str:
    """The default run name; `RunDir.claim` adds a suffix when another run took it in the same second."""
    return f"{stamp()}-{backend}-{trace_path.stem}"


def _environment() -> dict:
    return {"python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine()}


class _Trace(NamedTuple):
    """A trace opened for a replay: read whole (`table`, `n_blocks`) or scanned for streaming (`scanned`)."""

    meta: TraceMeta
    facts: dict  # for the summary: fingerprint, requests, block_references
    infinite_cache: dict  # hit rates of an unbounded cache (`stats.hit_rates`)
    table: pa.Table | None = None
    n_blocks: np.ndarray | None = None  # int64[n] blocks per request, with `table`
    scanned: ScannedTrace | None = None
    cache: TraceCache | None = None  # its entry in the trace cache (`tracecache`), for a backend that uses one


def _open_trace(trace_path: Path, stream: bool | None, warmup: float, cache=False, light=False) -> _Trace:
    """A trace over STREAM_BLOCK_REFS block references (or any, with stream=True) is scanned, to be read
    again chunk by chunk; otherwise it is read whole, which is faster. Read whole with `cache`, what reading
    it computes comes from its entry in the trace cache (made on the first run); `light`: the backend takes
    the trace without block_hashes (`TraceCacheUser`), which the entry then need not read at all."""
    if stream is None:
        refs = block_references(trace_path)
        stream = refs > STREAM_BLOCK_REFS
        if stream:
            warnings.warn(
                f"{trace_path.name} has {refs:,} block references, over the {STREAM_BLOCK_REFS:,} read whole: "
                "replaying it streamed, in bounded memory (--no-stream reads it whole)",
                KvbenchWarning,
                stacklevel=2,
            )
    if stream:
        s = scan_trace(trace_path, warmup=warmup)
        facts = {"fingerprint": s.fingerprint, "requests": s.n_requests, "block_references": s.block_references}
        return _Trace(s.meta, facts, s.infinite_cache, scanned=s)
    entry = TraceCache.for_file(trace_path) if cache else None
    if entry is not None and (hit := entry.load_trace()) is not None:
        table = hit.table if light else entry.with_block_hashes(hit.table)
        infinite = _infinite_rates(hit.infinite_hits, hit.n_blocks, table, hit.meta.block_size, warmup)
        return _Trace(hit.meta, hit.facts, infinite, table, hit.n_blocks, cache=entry)
    table, meta = read_valid_trace(trace_path)
    return _whole(table, meta, warmup, entry)


def _whole(table: pa.Table, meta: TraceMeta, warmup: float, entry: TraceCache | None = None) -> _Trace:
    """A trace read whole: its facts and infinite-cache hits, stored in the trace cache's `entry` if given."""
    n_blocks = block_lengths(table.column("block_hashes"))
    hits = infinite_cache_hits(table.column("block_hashes"), number=numbered_chunks)
    facts = {
        "fingerprint": trace_fingerprint(table),
        "requests": table.num_rows,
        "block_references": int(n_blocks.sum()),
    }
    if entry is not None:
        entry.store_trace(meta, facts, table, n_blocks, hits)
    infinite = _infinite_rates(hits, n_blocks, table, meta.block_size, warmup)
    return _Trace(meta, facts, infinite, table, n_blocks, cache=entry)


def _infinite_rates(hits: np.ndarray, n_blocks: np.ndarray, table: pa.Table, block_size: int, warmup: float) -> dict:
    input_tokens = table.column("input_tokens").to_numpy().astype(np.int64)
    return hit_rates(hits, n_blocks, input_tokens, block_size, warmup)


def _whole_answers(point: PointResult, trace: _Trace) -> Iterator[tuple]:
    """(rows, their block counts, their answers) of a point answered at once, slice by slice: results are
    written and summed the same way as a streamed point's (and their rows built a slice at a time)."""
    for start in range(0, trace.table.num_rows, WRITE_ROWS):
        stop = min(start + WRITE_ROWS, trace.table.num_rows)
        answers = {k: v[start:stop] for k, v in point.columns.items()}
        yield trace.table.slice(start, stop - start), trace.n_blocks[start:stop], answers


def _streamed_answers(point: StreamedPoint, trace: _Trace) -> Iterator[tuple]:
    """(rows, their block counts, their answers) of a streamed point, the trace read chunk by chunk."""
    for chunk in trace.scanned.chunks():
        n_blocks = pc.list_value_length(chunk.column("block_hashes")).to_numpy(zero_copy_only=False)
        yield chunk, n_blocks, point.answer(chunk)


def run_replay(
    trace_path,
    backend_name: str,
    backend_options: dict,
    out: Path | None = None,
    warmup: float = DEFAULT_WARMUP,
    command: str | None = None,
    progress=None,
    report: bool = True,
    stream: bool | None = None,
    resume: bool = False,
    workers: int = 1,
    executor: str = "local",
    ray_address: str = "",
    overwrite: bool = False,
    force: bool = False,
    trace_cache: bool = True,
    trace_label: str | None = None,
    fairness: dict | None = None,
    limits: RequestLimits | None = None,
):
    """Replay a trace through a backend; returns (run directory, summary). Writes requests.parquet as points
    are answered and summary.json after every point, so an interrupted run keeps and reports what it finished.
    `stream`: replay in bounded memory, the trace read by row group (None: when the trace is large).
    `resume` (live backends): continue the interrupted run in `out`, sending only what it did not answer.
    `workers`, `executor`, `ray_address` (live backends): spread the load over Ray actors (`distributed`).
    Every option is checked before the run directory is claimed (`rundir`): an existing `out` is refused unless
    `resume` or `overwrite`; `force` lets --resume go on with pacing options that differ from the first run's.
    A run that fails before it measured anything leaves no directory behind. `trace_cache`: an offline replay of
    a trace read whole keeps what reading and preparing it computes in the trace cache, and loads it from there
    on the next run of the same file (`tracecache`; results are the same either way). `trace_label`: how the
    results name the trace when `trace_path` is a copy of it (a sweep's point on another node). `fairness`:
    {"tenant_weights": …, "tenant_slo": …} as `kvbench.metrics.fairness` parses them, for its per-tenant views.
    `limits` (`kvbench.run.limits`): outputs capped and prompts fitted to the context, for every backend alike;
    a live backend that reads the engine's settings (`engine_settings()`) has its context checked by default."""
    trace_path = Path(trace_path)
    backend, protocol = _make_backend(backend_name, backend_options)
    online = protocol is OnlineBackend
    check_executor(workers, executor, online, ray_address)
    if resume and not (online and out):
        raise KvbenchError("--resume continues a live run: give the interrupted run's --out DIR and a live backend")
    limits = limits or RequestLimits()
    engine = backend.engine_settings() if online and hasattr(backend, "engine_settings") else None
    changes = limits.changes_trace() or bool(engine and engine.get("context_tokens"))
    light = isinstance(backend, TraceCacheUser) and not changes
    cache = trace_cache and not online and not changes
    trace = _open_trace(trace_path, False if online or changes else stream, warmup, cache=cache, light=light)
    from kvbench.run.pacing import request_count

    sent = request_count(trace.table, backend.pacing) if online and hasattr(backend, "pacing") else None
    trace, limited = _limited(trace, limits, engine, warmup, str(trace_path), sent)
    check_fairness(trace.table, fairness, trace_path.name)
    if trace.scanned is not None and protocol is not StreamingBackend:
        raise KvbenchError(
            f"backend {backend_name} needs the whole trace in memory and cannot stream it; "
            "replay it with --no-stream, or cut the trace shorter"
        )
    config = redact({**backend.config(), "warmup": warmup, **({"fairness": fairness} if fairness else {})})
    if resume:
        _check_resumable(Path(out), config, force)
    claimed = RunDir.claim(
        out, DEFAULT_REPORTS / new_run_id(backend_name, trace_path), resume=resume, overwrite=overwrite
    )
    run_dir = claimed.path
    summary = _new_summary(run_dir.name, command, trace_label or trace_path, trace, backend_name, config)
    summary["units"] = option_units(type(backend))
    summary["limits"] = limited
    if engine is not None:
        summary["engine_settings"] = engine
    try:
        if online:
            _run_online(backend, backend_name, backend_options, trace, run_dir, summary, warmup, progress, report,
                        resume, workers, executor, ray_address)  # fmt: skip
        else:
            _run_offline(backend, trace, run_dir, summary, warmup, progress, report)
        return run_dir, summary
    except Exception:
        if not _measured(summary):
            claimed.discard()
        raise


def _limited(trace: _Trace, limits: RequestLimits, engine: dict | None, warmup: float, source: str, sent=None):
    """The trace with `limits` applied (`kvbench.run.limits`) and their record; the trace as it was when they
    change nothing. `sent`: a live run's --max-requests, the leading requests it sends, which alone are
    checked (and then kept: the rest would not be sent)."""
    if trace.table is None:  # scanned: only when nothing is to change
        return trace, None
    whole = trace.table if sent is None else trace.table.slice(0, sent)
    table, record = apply_limits(whole, trace.meta.block_size, limits, engine, source)
    return (trace if table is whole else _whole(table, trace.meta, warmup)), record


# Where a live run's load generators run (`--executor`): this process, or Ray actors. The live layer, above this
# one, provides each as a `kvbench.live_executors` entry point (pyproject.toml): the runner only names them.
LIVE_EXECUTORS: Registry[Callable] = Registry(None, "live executor", group="kvbench.live_executors")
# What writes a finished (or interrupted) run's reports: the report layer's `write_reports`, a
# `kvbench.run_reports` entry point, so that the runner never imports the layer that reads its results.
RUN_REPORTS: Registry[Callable] = Registry(None, "run report", group="kvbench.run_reports")


def check_executor(workers: int, executor: str, online: bool, ray_address: str = "") -> None:
    """The options of a distributed live run (`kvbench.live.distributed`) fit the backend and each other."""
    if (workers > 1 or executor != "local") and not online:
        raise KvbenchError(
            "--workers and --executor ray drive a live backend (e.g. --backend openai); a simulator replays in one "
            "process"
        )
    if workers > 1 and executor == "local":
        raise KvbenchError(
            f"--workers {workers} runs the load generators as Ray actors: add --executor ray (a local Ray cluster "
            "is started unless --ray-address names one)"
        )
    if ray_address and executor != "ray":
        raise KvbenchError("--ray-address is for --executor ray")


def _make_backend(backend_name: str, backend_options: dict):
    """The backend built with its options, and the protocol its class declares."""
    try:
        backend_cls = load_backend(backend_name)
    except KeyError as exc:
        raise KvbenchError(exc.args[0]) from None
    protocol = protocol_of(backend_cls, backend_name)  # load_backend checked that it declares one
    declared = {p.name: p for p in backend_cls.cli_options()}
    unknown = sorted(set(backend_options) - set(declared))
    if unknown:  # the CLI cannot pass one; a caller from Python could, and it must not be dropped unseen
        flags = ", ".join(p.opts[0] for p in declared.values() if not getattr(p, "hidden", False))
        raise KvbenchError(
            f"--backend {backend_name} has no option {', '.join(repr(k) for k in unknown)}; its options: {flags}"
        )
    return backend_cls(**backend_options), protocol


def option_units(backend_cls) -> dict[str, str]:
    """The unit each of the backend's options states in its --help, by option name (those with a unit only):
    recorded in summary.json so that a report, which reads the run directory only, can show them."""
    units = {p.name: unit_of(p) for p in backend_cls.cli_options()}
    return {name: unit for name, unit in units.items() if unit and unit not in NO_UNIT}


def _new_summary(run_id: str, command, trace_path, trace: _Trace, backend_name: str, config: dict) -> dict:
    """summary.json before the first point: what was replayed, through what, how; no results yet."""
    return {
        "kvbench_version": __version__,
        "run_id": run_id,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": redact_text(command) if command else command,
        "environment": _environment(),
        "trace": {
            "path": str(trace_path),
            **trace.facts,
            "streamed": trace.scanned is not None,
            "block_size": trace.meta.block_size,
            "source": trace.meta.source,
        },
        "backend": backend_name,
        "config": config,
        "infinite_cache": trace.infinite_cache,
        "points": [],
        "curves": [],
        "complete": False,
    }


def _measured(summary: dict) -> bool:
    """Whether a run got far enough to keep: an offline point finished, or a live request was sent."""
    for point in summary["points"]:
        requests = (point.get("latency") or {}).get("requests")
        if requests is None or requests["sent"] > 0:
            return True
    return False


def _check_resumable(out: Path, config: dict, force: bool) -> None:
    """--resume goes on only with the pacing the interrupted run used (else its requests would mix two
    schedules), unless forced."""
    try:
        before = json.loads((out / "summary.json").read_text()).get("config", {})
    except (OSError, ValueError):
        return  # RunDir.claim says what is missing
    was, now = before.get("pacing") or {}, config.get("pacing") or {}
    changed = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
    if changed and not force:
        diffs = "; ".join(f"{k}: {was.get(k)!r} then, {now.get(k)!r} now" for k in changed)
        raise KvbenchError(
            f"--resume {out}: pacing options differ from the interrupted run's ({diffs}); resume with the same "
            "options, or add --force to mix the two schedules"
        )


def _run_online(backend: OnlineBackend, backend_name, backend_options, trace, run_dir, summary, warmup, progress,
                report, resume, workers, executor, ray_address) -> None:  # fmt: skip
    """The online protocol: requests sent one at a time by the dispatcher, in this process or Ray workers."""
    # loaded here: a simulator's run never needs the live client (aiohttp, Ray's pickling: 0.15 s of start-up)
    send_all = LIVE_EXECUTORS[executor]
    _write_summary(run_dir, summary)
    try:
        send_all(backend, backend_name, backend_options, trace.table, trace.meta, run_dir, summary, warmup, progress,
                 resume=resume, workers=workers, ray_address=ray_address)  # fmt: skip
        summary["complete"] = True
    except KeyboardInterrupt:
        summary["interrupted"] = True
    finally:
        _live_saturation(run_dir, summary)
        _finish(run_dir, summary, report, trace.table)


LIVE_TIMING = ["point", "scheduled_send_s", "actual_send_s", "ttft_s", "e2el_s", "status", "input_tokens", "workload"]


def _live_saturation(run_dir: Path, summary: dict) -> None:
    """A live point's saturation verdict, from the rows just written: its summary record was made by the live
    path (in one process or from Ray workers), requests.parquet holds every outcome either way."""

    try:
        rows = read_requests(run_dir, columns=LIVE_TIMING)
    except KvbenchError:
        return  # nothing was written: the run failed before its first request
    for point in summary["points"]:
        mine = rows.filter(pc.equal(rows.column("point"), point["name"]))
        if mine.num_rows:
            cols = {k: mine.column(k).to_numpy(zero_copy_only=False) for k in LIVE_TIMING[1:6]}
            tokens = mine.column("input_tokens").to_numpy(zero_copy_only=False)
            verdict = saturation(cols, tokens, mine.column("workload").to_pylist())
            limit = ((summary.get("config") or {}).get("pacing") or {}).get("max_concurrency")
            if verdict is not None and verdict["saturated"] and limit:
                # the queue may be the client's own: with at most `limit` requests in flight, a schedule faster
                # than the deployment answers them waits in the client, which says so rather than blame the server
                verdict["client_limit"] = limit
                held = f" (at most {limit} in flight: --max-concurrency holds the rest in the client)"
                verdict["why"] = verdict.get("why", "") + held
            if verdict is not None:
                point["saturation"] = verdict


OFFLINE_COMMIT_S = 1.0  # offline points' rows and summary are made durable at most this often (results.ResultWriter)


def _run_offline(backend: OfflineBackend, trace, run_dir, summary, warmup, progress, report) -> None:
    """The offline protocols: whole points (`replay`), or streamed ones (`StreamingBackend.replay_stream`) when
    the trace was scanned to be read chunk by chunk. `progress` gets each backend's `Progress` and each point."""
    meta, scanned = trace.meta, trace.scanned
    _write_summary(run_dir, summary)
    writer = ResultWriter(run_dir / "requests.parquet", commit_every_s=OFFLINE_COMMIT_S)
    try:
        if scanned is None and isinstance(backend, TraceCacheUser):
            points = backend.replay_cached(trace.table, meta, trace.cache, progress=progress)
        elif scanned is None:
            points = backend.replay(trace.table, meta, progress=progress)
        else:
            points = backend.replay_stream(scanned, progress=progress)
        for point in points:
            if isinstance(point, Skipped):
                _skipped(summary, point)
                continue
            # a PointResult without hit_blocks (a curve) has no rows, streamed or not; a StreamedPoint always has
            if not isinstance(point, PointResult) or "hit_blocks" in point.columns:
                point, totals = _write_and_sum(point, trace, writer, warmup)
                record = {"name": point.name, **point.labels, **totals, **point.extra}
                # time modeled (engine-sim) has a saturation verdict; a cache simulation has none. A streamed
                # point keeps no per-request columns (bounded memory).
                if scanned is None and "scheduled_send_s" in point.columns:
                    table = trace.table
                    workloads = table.column("workload").to_pylist() if "workload" in table.column_names else None
                    verdict = saturation(point.columns, table.column("input_tokens").to_numpy(), workloads)
                    if verdict is not None:
                        record["saturation"] = verdict
                summary["points"].append(record)
            if "curve" in point.extra:
                summary["curves"].append({**point.labels, **point.extra["curve"]})
            if writer.commit_due():  # the summary on disk lists only points whose rows are durable
                writer.commit()
                _write_summary(run_dir, summary)
            if progress is not None:
                progress(point)
        summary["complete"] = True
    except KeyboardInterrupt:
        summary["interrupted"] = True
    finally:
        writer.close()
        table = trace.table
        if trace.cache is not None and (report or has_tenants(table)):
            table = trace.cache.with_block_hashes(table)  # the reports and the fairness views read the block ids
        _finish(run_dir, summary, report, table if scanned is None else None)


def _skipped(summary: dict, part: Skipped) -> None:
    summary.setdefault("skipped", []).append({"what": part.what, "why": part.why})  # written with the points
    warnings.warn(f"{part.what} skipped: {part.why}", KvbenchWarning, stacklevel=2)


def _write_and_sum(point, trace: _Trace, writer: ResultWriter, warmup: float) -> tuple[PointResult, dict]:
    """Write a point's answers and sum its metrics one chunk at a time, then drop them: a streamed point keeps
    nothing per request. Returns the point (a streamed one, finished) and its metrics."""
    metrics = MetricSums(trace.facts["requests"], trace.meta.block_size, warmup)
    answered = _whole_answers if trace.scanned is None else _streamed_answers
    for rows, n_blocks, answers in answered(point, trace):
        writer.write(rows, PointResult(point.labels, answers))
        metrics.add(rows, n_blocks, answers["hit_blocks"], answers.get("evictions"))
    if trace.scanned is not None:
        point = PointResult(point.labels, extra=point.finish())
    return point, metrics.result(point.extra.pop("evict_matrix", None), point.extra.pop("tenant_names", None))


def _finish(run_dir: Path, summary: dict, report: bool, trace=None) -> None:
    fairness = summary["config"].get("fairness") or {}
    add_fairness_views(lambda columns: read_requests(run_dir, columns=columns), summary, trace, fairness)
    if len(summary["points"]) == 1:  # a single point's metrics are also the run's top-level keys
        only = summary["points"][0]
        for key in ("hit_rate", "evictions", "fairness", "by_tenant", "by_workload", "by_modality", "latency"):
            if key in only:
                summary[key] = only[key]
    _write_summary(run_dir, summary)
    if report:
        for write in RUN_REPORTS.values():
            write(run_dir, summary, trace)


def _write_summary(run_dir: Path, summary: dict) -> None:
    tmp = run_dir / "summary.json.partial"
    tmp.write_text(json.dumps(summary, indent=2, default=_json_default))
    tmp.replace(run_dir / "summary.json")


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
