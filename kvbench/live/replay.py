"""The runner's live path: an online backend (one that answers requests one at a time over the network) is
driven by the core's dispatcher (`pacing`) on uvloop where it is installed, and its outcomes are made durable
as they complete (a part file every FLUSH_SECONDS, or FLUSH_EVERY outcomes if sooner, `resultparts`), so that
Ctrl-C, SIGTERM or even SIGKILL leaves everything measured up to the last flush on disk (docs/architecture.md,
Run directory)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.errors import KvbenchError
from kvbench.live.dispatch import dispatch
from kvbench.live.servercounters import reconcile
from kvbench.metrics.failures import failure_summary
from kvbench.metrics.hits import point_metrics
from kvbench.metrics.latency import latency_summary, per_request
from kvbench.run.backend import OnlineBackend, PointResult
from kvbench.run.pacing import Outcome, request_count
from kvbench.run.results import ResultWriter, read_requests, result_files, result_rows

FLUSH_SECONDS = 2.0  # the longest an outcome waits to be written as a durable part: a kill loses at most this much
FLUSH_EVERY = 4096  # ... or sooner, once this many are pending (bounded memory). Each part costs a Parquet
# file, two fsyncs and a rename whatever its size, on a thread that shares the core and the GIL with the
# client's loop: 256 a part cost ~8 % of the process's CPU at 1,300 requests/s.
POINT = "live"


def _columns(outcomes: list[Outcome], block_size: int) -> dict:
    cols = per_request(outcomes)
    cached = np.array([o.cached_tokens if o.cached_tokens is not None else -1 for o in outcomes], dtype=np.int64)
    hit_tokens = np.where(cached >= 0, cached, 0)
    return {
        "scheduled_send_s": cols["scheduled_send_s"],
        "actual_send_s": cols["actual_send_s"],
        "ttft_s": cols["ttft_s"],
        "tpot_s": cols["tpot_s"],
        "e2el_s": cols["e2el_s"],
        "itl_s": cols["itl_s"],
        "cached_tokens": np.where(cached >= 0, cached, None).tolist() if (cached < 0).any() else cached,
        "hit_tokens": hit_tokens,
        "hit_blocks": hit_tokens // block_size,
        "server_prompt_tokens": [o.prompt_tokens for o in outcomes],
        "ttfo_s": cols["ttfo_s"],
        "warmup": [o.warmup for o in outcomes],
        "status": [o.status for o in outcomes],
        "error": [o.error for o in outcomes],
    }


def _answers(table: pa.Table, outcomes: list[Outcome], block_size: int) -> tuple[pa.Table, PointResult]:
    rows = pa.array([o.row for o in outcomes], pa.int64())
    return table.take(rows), PointResult(labels={"point": POINT}, columns=_columns(outcomes, block_size))


def _write(writer: ResultWriter, table: pa.Table, outcomes: list[Outcome], block_size: int) -> None:
    writer.write(*_answers(table, outcomes, block_size))


DONE = ("ok", "error", "timeout")  # answered (or given up on): a resumed run does not send these again


def _previous(run_dir: Path, table: pa.Table) -> dict[int, Outcome]:
    """Outcomes of the requests a previous, interrupted (or killed) run of the same trace answered (for
    --resume)."""
    if not result_files(run_dir):
        return {}
    try:
        prev = read_requests(run_dir)
    except KvbenchError as exc:
        raise KvbenchError(f"cannot read the previous results to resume: {exc}") from None
    path = run_dir / "requests.parquet"
    index = {rid: i for i, rid in enumerate(table.column("request_id").to_pylist())}
    out = {}
    for r in prev.to_pylist():
        row = index.get(r["request_id"])
        if row is None:
            raise KvbenchError(f"{path}: request {r['request_id']!r} is not in this trace; resume with the same trace")
        if r["status"] not in DONE:
            continue
        o = Outcome(row=row, scheduled_s=r["scheduled_send_s"], sent_s=r["actual_send_s"], status=r["status"])
        o.error, o.cached_tokens, o.prompt_tokens = r["error"], r["cached_tokens"], r["server_prompt_tokens"]
        o.warmup = bool(r["warmup"])
        if r["status"] == "ok":
            o.first_chunk_s = o.sent_s + r["ttft_s"]
            o.first_output_s = o.sent_s + r["ttfo_s"] if r["ttfo_s"] is not None else math.nan
            o.chunk_s = (o.first_chunk_s + np.concatenate([[0.0], np.cumsum(r["itl_s"] or [])])).tolist()
            o.last_chunk_s = o.sent_s + r["e2el_s"]
            o.completion_tokens = len(o.chunk_s)
        out[row] = o
    return out


class IncrementalResults:
    """A live run's results, made durable as outcomes arrive: a writer thread turns what is pending into a
    part file FLUSH_SECONDS after the last flush, or as soon as FLUSH_EVERY outcomes are pending, so a kill
    loses at most FLUSH_SECONDS of answers; `close` records every request not written yet (unsent ones too:
    nothing is lost) and merges the parts into requests.parquet. `kept`: a resumed run's answers from before,
    which replace the previous run's files first. Shared by the single-client path and the distributed driver."""

    def __init__(self, path: Path, table: pa.Table, block_size: int, kept: dict[int, Outcome]):
        self.table, self.block_size = table, block_size
        base = result_rows(*_answers(table, [kept[i] for i in sorted(kept)], block_size)) if kept else None
        self.writer = ResultWriter(path, base=base)
        self.added: set[int] = set(kept)  # rows handed to the writer thread (or kept): close writes the rest
        self._pending: list[Outcome] = []
        self._wake = threading.Condition()
        self._closing = False
        self._error: BaseException | None = None
        # Writing (Arrow conversion, compression, fsync) happens on its own thread: done on the event loop it
        # stalls sends for 5-30 ms per flush, which shows up as schedule lag.
        self._thread = threading.Thread(target=self._write_parts, name="kvbench-results", daemon=True)
        self._thread.start()

    def add(self, o: Outcome) -> None:
        with self._wake:
            self._pending.append(o)
            self.added.add(o.row)
            if len(self._pending) >= FLUSH_EVERY:
                self._wake.notify()

    def _write_parts(self) -> None:
        while True:
            with self._wake:
                deadline = time.monotonic() + FLUSH_SECONDS
                while not self._closing and len(self._pending) < FLUSH_EVERY:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._wake.wait(left)
                batch, self._pending, closing = self._pending, [], self._closing
            if batch:
                try:
                    _write(self.writer, self.table, batch, self.block_size)
                except BaseException as exc:  # disk full…: `close` raises it, never silently missing rows
                    self._error = exc
                    return
            if closing:
                return

    def close(self, outcomes: list[Outcome]) -> None:
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()  # every pending outcome lands before the last ones
        if self._error is not None:
            raise self._error
        rest = [o for o in outcomes if o.row not in self.added]
        if rest:
            _write(self.writer, self.table, rest, self.block_size)
        self.writer.close()


def event_loop() -> asyncio.Runner:
    """The client's event loop: uvloop where it is installed (as `vllm bench serve`'s), else asyncio's own.
    uvloop's loop, transports and timers in C cost less per request, so one core sends more, and a loop that
    shares its core with other work falls behind its schedule less."""
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


GC_YOUNG_THRESHOLD = 20_000  # allocations between young collections during a run (Python's default: 700)


@contextlib.contextmanager
def steady_gc():
    """The garbage collector during a run: everything made before it (the trace, its prompts, the modules) is
    frozen out of the collector's scans, and young collections come less often. Otherwise every few seconds
    a full collection walks every object the process holds (25-60 ms with the loop stopped: that much
    schedule lag for the requests due meanwhile), and hundreds of young ones cost ~6 % of the loop's time."""
    gc.collect()
    gc.freeze()
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], GC_YOUNG_THRESHOLD), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def resumed_clock(kept: dict[int, Outcome]) -> float:
    """Where a resumed run's clock starts: after the previous run's last event, so that spans stay meaningful."""
    return max(
        (max(o.sent_s, o.last_chunk_s if o.last_chunk_s == o.last_chunk_s else 0) for o in kept.values()), default=0.0
    )


def previous_outcomes(run_dir: Path, table: pa.Table, resume: bool) -> dict[int, Outcome]:
    return _previous(run_dir, table) if resume else {}


def run_here(backend, backend_name, backend_options, table, meta, run_dir, summary, warmup, progress=None, *,
             resume=False, workers=1, ray_address="") -> None:
    """`--executor local` (kvbench.run.runner.LIVE_EXECUTORS): `run_live` in this process; the Ray executor's
    arguments (its workers, its cluster, the backend's name to rebuild it there) are not needed here."""
    run_live(backend, table, meta, run_dir, summary, warmup, progress, resume=resume)


def run_live(
    backend: OnlineBackend,
    table: pa.Table,
    meta,
    run_dir: Path,
    summary: dict,
    warmup: float,
    progress=None,
    resume=False,
) -> None:
    """Replay `table` through an online backend; fills `summary` (also when interrupted) and writes
    requests.parquet. Re-raises KeyboardInterrupt after recording, for the caller to finish the outputs.
    `resume`: keep what a previous run in `run_dir` answered and send only the rest."""
    n = request_count(table, backend.pacing)
    kept = previous_outcomes(run_dir, table, resume)
    outcomes = [kept.get(i) or Outcome(row=i) for i in range(n)]
    todo = [i for i in range(n) if i not in kept]
    results = IncrementalResults(run_dir / "requests.parquet", table, meta.block_size, kept)

    def on_done(o: Outcome) -> None:
        results.add(o)
        if progress is not None:
            progress(o)

    resumed_at = resumed_clock(kept)

    async def main() -> None:
        origin = time.perf_counter() - resumed_at
        async with backend.connect(table, meta, origin):
            rows = table if not kept else table.take(pa.array(todo, pa.int64()))
            await dispatch(rows, backend.pacing, [outcomes[i] for i in todo], backend.send, on_done, origin)

    interrupted = False
    try:
        with steady_gc(), event_loop() as runner:
            runner.run(main())
    except KeyboardInterrupt:
        interrupted = True
    finally:
        results.close(outcomes)
        summary["points"] = [point_summary(backend, table, meta, outcomes, warmup)]
        summary["interrupted"] = interrupted
        summary["resumed_requests"] = len(kept)
    if interrupted:
        raise KeyboardInterrupt


def point_summary(
    backend: OnlineBackend, table: pa.Table, meta, outcomes: list[Outcome], warmup: float, extra=None
) -> dict:
    """The run's one point: hit rates, latency and server counters over every row. `extra`: the backend's
    `extra()` when it was gathered elsewhere (a distributed run's workers)."""
    cols = per_request(outcomes)
    warm = np.array([o.warmup for o in outcomes], dtype=bool)
    tenants = table.column("tenant").slice(0, len(outcomes)).to_pylist() if "tenant" in table.column_names else []
    latency = latency_summary(cols, warm, tenants or [None] * len(outcomes), backend.slo)
    ok = cols["ok"]
    sub = table.slice(0, len(outcomes)).filter(pa.array(ok))
    n_blocks = pc.list_value_length(sub.column("block_hashes")).to_numpy(zero_copy_only=False).astype(np.int64)
    cached = np.array([o.cached_tokens or 0 for o, good in zip(outcomes, ok) if good], dtype=np.int64)
    hits = point_metrics(sub, n_blocks, meta.block_size, cached // meta.block_size, warmup, hit_tokens=cached)
    prompt = [o.prompt_tokens for o, good in zip(outcomes, ok) if good]
    expected = sub.column("input_tokens").to_numpy()
    mismatched = int(sum(p is not None and p != e for p, e in zip(prompt, expected)))
    reported = {"prompt_tokens": int(sum(p or 0 for p in prompt)), "cached_tokens": int(cached.sum())}
    extra = backend.extra() if extra is None else extra
    server = extra.get("server", {})
    return {
        "name": POINT,
        **hits,
        "cached_tokens_reported": sum(o.cached_tokens is not None for o in outcomes) > 0,
        "failures": failure_summary([o.status for o in outcomes], [o.error for o in outcomes]),
        "prompt_tokens_mismatch": mismatched,
        # requests written on a kept-alive connection the server had closed, sent once more (not faults)
        "requests_resent": int(extra.get("requests_resent") or 0),
        "latency": latency,
        "server_counters": reconcile(server.get("counters_before"), server.get("counters_after"), reported),
        "server_timeline": server.get("timeline") or None,
        "model": extra.get("model"),
    }
