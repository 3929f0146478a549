"""Distributed load generation for a live replay (`kvbench replay … --workers N --executor ray`): the trace's
sessions are sharded across Ray actors (`loadworker.LoadWorker`), each running the ordinary dispatcher and
backend client on its shard; this driver merges what they measure into one run.

- Sharding unit: a session and everything linked to it by parent_id or depends_on (a connected component),
  so that a closed loop's dependencies never cross workers; a request with none of these is its own unit.
  Units go largest first to the worker with the fewest requests so far: balanced by requests, deterministic.
- One schedule: the driver computes the single-client schedule of the whole trace (`schedule_offsets`) and
  gives each worker its rows' offsets, and one wall-clock start instant that every worker waits for; so the
  merged run's scheduled send times are a single client's for the same options.
- One result: outcomes come back in batches (the driver polls every POLL_S), go to requests.parquet as
  `run_live` writes them and into the same summary, plus `workers` (per-worker lag, failures, sessions).
- A dead worker (killed, crashed, node lost) loses only what it had not reported: those requests are
  recorded as `worker_lost`, its unfinished sessions are listed, the other workers' results are kept.
"""

from __future__ import annotations

import datetime as _dt
import heapq
import logging
import os
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvbench.errors import KvbenchError, KvbenchWarning
from kvbench.live.replay import DONE, IncrementalResults, point_summary, previous_outcomes, resumed_clock
from kvbench.metrics.latency import per_request
from kvbench.run.executors import init_ray
from kvbench.run.pacing import Outcome, request_count, schedule_offsets

START_MARGIN_S = 2.0  # the shared start is this far after the workers are placed: it covers their connect
POLL_S = 0.5  # how often the driver collects answered requests from the workers
STOP_WAIT_S = 15.0  # after Ctrl-C, how long a worker may take to report what it cancelled
PLACE_WAIT_S = 120.0  # how long workers may wait for a place in the cluster (1 CPU each)


def unit_names(table: pa.Table) -> list[str]:
    """The name each row's sharding unit is listed under: its session, or its own id without one."""
    ids = table.column("request_id").to_pylist()
    if "session_id" not in table.column_names:
        return ids
    return [s if s is not None else r for s, r in zip(table.column("session_id").to_pylist(), ids)]


def sharding_units(table: pa.Table) -> list[list[int]]:
    """Rows that must run on one worker: sessions joined by parent_id and depends_on links (union-find),
    each a list of rows in trace order; units ordered by their first row."""
    n = table.num_rows
    root = list(range(n))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    def join(i: int, j: int) -> None:
        a, b = find(i), find(j)
        if a != b:
            root[max(a, b)] = min(a, b)

    index = {rid: i for i, rid in enumerate(table.column("request_id").to_pylist())}
    first_of_session: dict[str, int] = {}

    def column(name):
        return table.column(name).to_pylist() if name in table.column_names else [None] * n

    for i, (session, parent, deps) in enumerate(zip(column("session_id"), column("parent_id"), column("depends_on"))):
        if session is not None:
            join(first_of_session.setdefault(session, i), i)
        for linked in ([parent] if parent is not None else []) + list(deps or ()):
            j = index.get(linked)
            if j is not None:  # a link to a request outside the replayed rows binds nothing
                join(i, j)
    units: dict[int, list[int]] = {}
    for i in range(n):
        units.setdefault(find(i), []).append(i)
    return list(units.values())


@dataclass
class Shard:
    worker: int
    rows: list[int] = field(default_factory=list)  # rows of the replayed table, in trace order
    units: list[str] = field(default_factory=list)  # its sessions (and loose requests), `unit_names`


def shard_sessions(table: pa.Table, workers: int) -> list[Shard]:
    """Split the replayed rows into `workers` shards of whole units, greedy largest-first by request count
    (ties: the earlier unit, the lower worker), so the same trace always shards the same way."""
    names = unit_names(table)
    shards = [Shard(w) for w in range(workers)]
    lightest = [(0, w) for w in range(workers)]  # (requests so far, worker): a heap
    for unit in sorted(sharding_units(table), key=lambda u: (-len(u), u[0])):
        load, w = heapq.heappop(lightest)
        shards[w].rows.extend(unit)
        shards[w].units.extend(dict.fromkeys(names[i] for i in unit))
        heapq.heappush(lightest, (load + len(unit), w))
    for s in shards:
        s.rows.sort()
    return shards


@dataclass
class _Worker:
    shard: Shard
    handle: object
    where: dict
    run_ref: object = None
    take_ref: object = None
    status: str = "alive"
    error: str | None = None
    final: dict | None = None  # what `run` returned
    failure: KvbenchError | None = None  # why `run` raised, as the single client would have


def run_distributed(
    backend,
    backend_name: str,
    backend_options: dict,
    table: pa.Table,
    meta,
    run_dir: Path,
    summary: dict,
    warmup: float,
    progress=None,
    resume: bool = False,
    workers: int = 2,
    ray_address: str = "",
) -> None:
    """`run_live` with the load spread over `workers` Ray actors; fills `summary` the same way (plus `workers`
    and `distributed`) and re-raises KeyboardInterrupt after recording."""
    ray = _ray()
    started_ray = not ray.is_initialized()
    if started_ray:
        _init_ray(ray, ray_address, workers)
    run = _DistributedRun(backend, table, meta, run_dir, resume, workers, progress)
    interrupted = False
    try:
        summary["distributed"] = run.start_workers(ray, backend_name, backend_options, run_dir.name, ray_address)
        interrupted = run.collect(ray)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for w in run.pool:
            ray.kill(w.handle)
        if started_ray:
            ray.shutdown()
        run.merge(summary, warmup, interrupted)
    if interrupted:
        raise KeyboardInterrupt
    for w in run.pool:
        if w.failure is not None:
            raise KvbenchError(f"worker {w.shard.worker} ({w.where['host']}): {w.failure}")


class _DistributedRun:
    """One distributed replay, step by step: shard the rows still to send (here), start a worker per shard,
    collect their outcomes as they come, merge everything into the run's outputs."""

    def __init__(self, backend, table: pa.Table, meta, run_dir: Path, resume: bool, workers: int, progress):
        self.backend, self.table, self.meta, self.progress = backend, table, meta, progress
        self.n = request_count(table, backend.pacing)
        self.kept = previous_outcomes(run_dir, table, resume)
        self.outcomes = [self.kept.get(i) or Outcome(row=i) for i in range(self.n)]
        self.todo = np.array([i for i in range(self.n) if i not in self.kept], dtype=np.int64)
        self.rows = table.take(pa.array(self.todo))
        self.offsets = schedule_offsets(self.rows, backend.pacing)  # the single client's schedule, split below
        # warm-up: the first requests of the whole schedule, wherever they run
        first = np.lexsort((self.todo, self.offsets))[: backend.pacing.warmup_requests]
        self.warm = set(self.todo[first].tolist())
        self.workers = workers
        self.shards = [s for s in shard_sessions(self.rows, workers) if s.rows]
        self.results = IncrementalResults(run_dir / "requests.parquet", table, meta.block_size, self.kept)
        self.pool: list[_Worker] = []
        self.reported: set[int] = set()

    def start_workers(self, ray, backend_name: str, backend_options: dict, run_id: str, ray_address: str) -> dict:
        """Place a worker per shard, then start them all on one wall-clock instant; returns the summary's
        `distributed` record."""
        self.pool = self._place_workers(ray, backend_name, backend_options, run_id)
        for w in self.pool:  # shard rows -> trace rows
            w.shard.rows = self.todo[w.shard.rows].tolist()
        start_wall = time.time() + START_MARGIN_S
        for w in self.pool:
            w.run_ref = w.handle.run.remote(start_wall)
        return {
            "executor": "ray",
            "ray_address": ray_address or "local",
            "workers": self.workers,
            "start_utc": _dt.datetime.fromtimestamp(start_wall, _dt.UTC).isoformat(timespec="milliseconds"),
            "start_margin_s": START_MARGIN_S,
        }

    def _place_workers(self, ray, backend_name: str, backend_options: dict, run_id: str) -> list[_Worker]:
        """A Ray actor per shard, each given its rows and their offsets; waits until every one has a place."""
        from kvbench.live.loadworker import LoadWorker

        remote = ray.remote(num_cpus=1, max_restarts=0)(LoadWorker)
        # named for `ray list actors` (and tests); unique, as a name is freed only once the actor is gone
        prefix = f"kvbench-{run_id}-{uuid.uuid4().hex[:6]}"
        handles = []
        for s in self.shards:
            options = dict(backend_options)
            if s.worker > 0 and options.get("reset_prefix_cache"):
                options["reset_prefix_cache"] = False  # once, by worker 0, before the shared start
            picked = pa.array(s.rows, pa.int64())
            handle = remote.options(name=f"{prefix}-w{s.worker}", scheduling_strategy="SPREAD").remote(
                backend_name, options, self.rows.take(picked), self.meta, self.offsets[s.rows], resumed_clock(self.kept)
            )
            handles.append(handle)
        try:
            where = ray.get([h.where.remote() for h in handles], timeout=PLACE_WAIT_S)
        except ray.exceptions.RayError as exc:  # (GetTimeoutError is one)
            for h in handles:
                ray.kill(h)
            if not isinstance(exc, ray.exceptions.GetTimeoutError):
                raise KvbenchError(f"a load worker could not start: {_short(exc)}") from None
            cpus = ray.cluster_resources().get("CPU", 0)
            raise KvbenchError(
                f"{len(handles)} workers (1 CPU each) found no place in {PLACE_WAIT_S:g} s on a cluster "
                f"of {cpus:g} CPUs; use fewer --workers or a larger cluster"
            ) from None
        return [_Worker(s, h, w) for s, h, w in zip(self.shards, handles, where)]

    def collect(self, ray) -> bool:
        """Take the workers' outcomes until every worker is done; on Ctrl-C, stop them and take what they
        cancelled. Returns whether the run was interrupted."""
        try:
            _collect(ray, self.pool, self.accept, wait=None)
            return False
        except KeyboardInterrupt:
            for w in self.pool:
                if w.status == "alive" and w.final is None:
                    w.handle.stop.remote()
            _collect(ray, self.pool, self.accept, wait=STOP_WAIT_S)
            return True

    def accept(self, w: _Worker, batch: list[Outcome]) -> None:
        for o in batch:  # every outcome is stored before `progress` (which may raise Ctrl-C) sees any
            o.row = w.shard.rows[o.row]
            o.warmup = o.row in self.warm and o.sent_s == o.sent_s
            self.outcomes[o.row] = o
            self.reported.add(o.row)
            self.results.add(o)
        for o in batch:
            if self.progress is not None:
                self.progress(o)

    def merge(self, summary: dict, warmup: float, interrupted: bool) -> None:
        """Record what the lost workers did not report, close requests.parquet and fill the summary."""
        for w in self.pool:
            if w.final is None:  # dead, or silent after a stop: what it did not report is lost
                self._record_lost(w)
        self.results.close(self.outcomes)
        finals = [w.final for w in self.pool if w.final is not None]
        extra = _merged_extra(finals)
        summary["points"] = [point_summary(self.backend, self.table, self.meta, self.outcomes, warmup, extra=extra)]
        names = unit_names(self.table.slice(0, self.n))
        summary["workers"] = [_worker_summary(w, self.outcomes, names) for w in self.pool]
        summary["workers_dead"] = sum(w.status == "dead" for w in self.pool)
        summary["interrupted"] = interrupted
        summary["resumed_requests"] = len(self.kept)

    def _record_lost(self, w: _Worker) -> None:
        if w.status == "alive":
            w.status, w.error = "dead", "did not report after the run was interrupted"
        for r in w.shard.rows:
            if r not in self.reported:  # (a worker that failed to connect sent nothing: they stay not_sent)
                self.outcomes[r].status = "not_sent" if w.failure else "worker_lost"
                how = "could not run" if w.failure else "was lost"
                self.outcomes[r].error = f"worker {w.shard.worker} ({w.where['host']}) {how}: {w.error}"


def _ray():
    try:
        import ray
    except ImportError:
        raise KvbenchError("--executor ray needs Ray: pip install 'kvbench[ray]'") from None
    return ray


def _note(message: str) -> None:
    warnings.warn(message, KvbenchWarning, stacklevel=3)  # as the run's other notes are given


def _init_ray(ray, address: str, workers: int) -> None:
    try:
        address = address or os.environ.get("RAY_ADDRESS")  # (set by Ray for a `ray job submit` driver)
        if address:
            init_ray(ray, address, _note, logging_level=logging.WARNING)
        else:  # a new local cluster with a CPU for each worker, however few cores this machine has ("local": not
            # whatever cluster already runs on this machine, which ray.init() would join)
            cpus = max(os.cpu_count() or 1, workers)
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise KvbenchError(f"cannot connect to the Ray cluster {address or '(local)'}: {exc}") from None


def _collect(ray, pool: list[_Worker], accept, wait: float | None) -> None:
    """Poll every running worker until all have finished or died (or `wait` seconds passed)."""
    deadline = None if wait is None else time.monotonic() + wait
    while True:
        running = [w for w in pool if w.status == "alive" and w.final is None]
        if not running or (deadline is not None and time.monotonic() > deadline):
            return
        ray.wait([w.run_ref for w in running], num_returns=1, timeout=POLL_S)  # woken early when one ends
        for w in running:
            if w.take_ref is None:
                w.take_ref = w.handle.take.remote()
        ray.wait([w.take_ref for w in running], num_returns=len(running), timeout=POLL_S)
        for w in running:
            ended = _ready(ray, w.run_ref)
            # a batch taken before the run ended holds outcomes the run's own answer does not
            if ended or _ready(ray, w.take_ref):
                try:
                    batch = ray.get(w.take_ref, timeout=STOP_WAIT_S)
                    w.take_ref = None
                    accept(w, batch)
                except ray.exceptions.ActorUnavailableError:
                    w.take_ref = None  # unreachable for now: asked again next round
                except ray.exceptions.RayError as exc:
                    w.take_ref = None
                    w.status, w.error = "dead", _short(exc)
                    continue
            if ended:
                try:
                    final = ray.get(w.run_ref)
                except ray.exceptions.RayError as exc:
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, KvbenchError):  # the worker could not run (server unreachable…)
                        w.status, w.error, w.failure = "dead", str(cause), cause
                    else:
                        w.status, w.error = "dead", _short(exc)
                    continue
                w.final = final
                accept(w, final.pop("rest"))


def _ready(ray, ref) -> bool:
    return ref is not None and bool(ray.wait([ref], timeout=0)[0])


def _short(exc: BaseException) -> str:
    """Ray's multi-line error, as its first and last lines (what failed, and why: killed, node lost…)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"


def _merged_extra(finals: list[dict]) -> dict | None:
    """One backend `extra()` for the run: server counters from the earliest scrape before the start and the
    latest after the end (each worker scraped around its own part); model and the rest from worker 0.

    Which scrape comes first or last is told from the times that bound them: a worker's before-scrape ends
    before `connected_at_s`, and its after-scrape starts after `sent_until_s`. The worker that stopped sending
    last scraped after every other worker's last answer; the time its scrape *ended* would not tell that
    (a slow scrape that started early can end last and miss another worker's last request)."""
    if not finals:
        return {}
    first = min(finals, key=lambda f: f["connected_at_s"])
    last = max(finals, key=lambda f: f["sent_until_s"])
    extra = dict(finals[0]["extra"])
    extra["requests_resent"] = sum(int(f["extra"].get("requests_resent") or 0) for f in finals)
    if "server" in extra:
        extra["server"] = {
            **first["extra"]["server"],
            "counters_before": first["extra"]["server"].get("counters_before"),
            "counters_after": last["extra"]["server"].get("counters_after"),
        }
    return extra


def _worker_summary(w: _Worker, outcomes: list[Outcome], names: list[str]) -> dict:
    mine = [outcomes[r] for r in w.shard.rows]
    cols = per_request(mine)
    sent = np.isfinite(cols["actual_send_s"])
    lag = cols["schedule_lag_s"][sent] * 1000.0
    unfinished = [o.row for o in mine if o.status not in DONE]
    return {
        "id": w.shard.worker,
        "host": w.where["host"],
        "node": w.where["node"],
        "pid": w.where["pid"],
        "status": w.status,
        "error": w.error,
        "sessions": len(w.shard.units),
        "requests": len(mine),
        "ok": int(cols["ok"].sum()),
        "failed": int((sent & ~cols["ok"]).sum()),
        "schedule_lag": {
            "p50_ms": float(np.percentile(lag, 50)) if lag.size else None,
            "p99_ms": float(np.percentile(lag, 99)) if lag.size else None,
            "max_ms": float(lag.max()) if lag.size else None,
        },
        "start_late_ms": max(0.0, w.final["connected_at_s"] * 1000.0) if w.final else None,
        "unfinished_requests": len(unfinished),
        "unfinished_sessions": list(dict.fromkeys(names[r] for r in unfinished)),
        "session_ids": w.shard.units,
    }
