"""The runner's live path: an online backend (one that answers requests one at a time over the network) is
driven by the core's dispatcher (`pacing`), and its outcomes go to requests.parquet as they complete, so
that a crash or Ctrl-C leaves everything measured so far on disk (DESIGN.md section 8)."""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .backend import PointResult
from .errors import KvbenchError
from .latency import latency_summary, per_request
from .metrics import point_metrics
from .pacing import Outcome, dispatch, request_count
from .results import ResultWriter
from .servercounters import reconcile

FLUSH_EVERY = 256  # outcomes buffered before they are appended to requests.parquet
FLUSH_SECONDS = 2.0
POINT = "live"


def is_online(backend) -> bool:
    return hasattr(backend, "send") and hasattr(backend, "connect")


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


def _write(writer: ResultWriter, table: pa.Table, outcomes: list[Outcome], block_size: int) -> None:
    rows = pa.array([o.row for o in outcomes], pa.int64())
    writer.write(table.take(rows), PointResult(labels={"point": POINT}, columns=_columns(outcomes, block_size)))


DONE = ("ok", "error", "timeout")  # answered (or given up on): a resumed run does not send these again


def _previous(path: Path, table: pa.Table) -> dict[int, Outcome]:
    """Outcomes of the requests a previous, interrupted run of the same trace answered (for --resume)."""
    if not path.exists():
        return {}
    try:
        prev = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise KvbenchError(f"{path}: cannot read the previous results to resume ({exc})") from None
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
    """requests.parquet, appended to as outcomes arrive (every FLUSH_EVERY outcomes or FLUSH_SECONDS), so that
    a crash or Ctrl-C keeps what was measured; `close` records every request not written yet (unsent ones
    too: nothing is lost). Shared by the single-client path and the distributed driver."""

    def __init__(self, path: Path, table: pa.Table, block_size: int, kept: dict[int, Outcome]):
        self.table, self.block_size = table, block_size
        self.writer = ResultWriter(path)
        if kept:
            _write(self.writer, table, [kept[i] for i in sorted(kept)], block_size)
        self.pending: list[Outcome] = []
        self.written: set[int] = set(kept)
        self.last_flush = time.monotonic()
        # Writing (Arrow conversion, compression, disk) happens on one worker thread: done on the event loop it
        # stalls sends for 5-30 ms per flush, which shows up as schedule lag.
        self.background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbench-results")
        self.writes = []

    def add(self, o: Outcome) -> None:
        self.pending.append(o)
        if len(self.pending) >= FLUSH_EVERY or time.monotonic() - self.last_flush > FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            batch = list(self.pending)
            self.writes.append(self.background.submit(_write, self.writer, self.table, batch, self.block_size))
            self.written.update(o.row for o in batch)
            self.pending.clear()
        self.last_flush = time.monotonic()

    def close(self, outcomes: list[Outcome]) -> None:
        self.flush()
        self.background.shutdown(wait=True)  # every submitted write lands before the last ones
        for w in self.writes:
            w.result()  # a failed write (disk full…) is an error, never silently missing rows
        rest = [o for o in outcomes if o.row not in self.written]
        if rest:
            _write(self.writer, self.table, rest, self.block_size)
        self.writer.close()


def resumed_clock(kept: dict[int, Outcome]) -> float:
    """Where a resumed run's clock starts: after the previous run's last event, so that spans stay meaningful."""
    return max(
        (max(o.sent_s, o.last_chunk_s if o.last_chunk_s == o.last_chunk_s else 0) for o in kept.values()), default=0.0
    )


def previous_outcomes(run_dir: Path, table: pa.Table, resume: bool) -> dict[int, Outcome]:
    return _previous(run_dir / "requests.parquet", table) if resume else {}


def run_live(
    backend, table: pa.Table, meta, run_dir: Path, summary: dict, warmup: float, progress=None, resume=False
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
        asyncio.run(main())
    except KeyboardInterrupt:
        interrupted = True
    finally:
        results.close(outcomes)
        summary["points"] = [point_summary(backend, table, meta, outcomes, warmup)]
        summary["interrupted"] = interrupted
        summary["resumed_requests"] = len(kept)
    if interrupted:
        raise KeyboardInterrupt


def point_summary(backend, table: pa.Table, meta, outcomes: list[Outcome], warmup: float, extra=None) -> dict:
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
        "prompt_tokens_mismatch": mismatched,
        "latency": latency,
        "server_counters": reconcile(server.get("counters_before"), server.get("counters_after"), reported),
        "server_timeline": server.get("timeline") or None,
        "model": extra.get("model"),
    }
