"""The runner's live path: an online backend (one that answers requests one at a time over the network) is
driven by the core's dispatcher (`pacing`), and its outcomes go to requests.parquet as they complete, so
that a crash or Ctrl-C leaves everything measured so far on disk (DESIGN.md section 8)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .backend import PointResult
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


def run_live(backend, table: pa.Table, meta, run_dir: Path, summary: dict, warmup: float, progress=None) -> None:
    """Replay `table` through an online backend; fills `summary` (also when interrupted) and writes
    requests.parquet. Re-raises KeyboardInterrupt after recording, for the caller to finish the outputs."""
    n = request_count(table, backend.pacing)
    outcomes = [Outcome(row=i) for i in range(n)]
    writer = ResultWriter(run_dir / "requests.parquet")
    pending: list[Outcome] = []
    written: set[int] = set()
    last_flush = time.monotonic()

    def flush() -> None:
        nonlocal last_flush
        if pending:
            _write(writer, table, pending, meta.block_size)
            written.update(o.row for o in pending)
            pending.clear()
        last_flush = time.monotonic()

    def on_done(o: Outcome) -> None:
        pending.append(o)
        if progress is not None:
            progress(o)
        if len(pending) >= FLUSH_EVERY or time.monotonic() - last_flush > FLUSH_SECONDS:
            flush()

    async def main() -> None:
        origin = time.perf_counter()
        async with backend.connect(table, meta, origin):
            await dispatch(table, backend.pacing, outcomes, backend.send, on_done, origin)

    interrupted = False
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        interrupted = True
    finally:
        flush()
        # requests never sent (or still waiting when the run stopped) are recorded too: nothing is lost
        rest = [o for o in outcomes if o.row not in written]
        if rest:
            _write(writer, table, rest, meta.block_size)
        writer.close()
        summary["points"] = [_point_summary(backend, table, meta, outcomes, warmup)]
        summary["interrupted"] = interrupted
    if interrupted:
        raise KeyboardInterrupt


def _point_summary(backend, table: pa.Table, meta, outcomes: list[Outcome], warmup: float) -> dict:
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
    extra = backend.extra()
    server = extra.get("server", {})
    return {
        "name": POINT,
        **hits,
        "cached_tokens_reported": sum(o.cached_tokens is not None for o in outcomes) > 0,
        "prompt_tokens_mismatch": mismatched,
        "latency": latency,
        "server_counters": reconcile(server.get("counters_before"), server.get("counters_after"), reported),
        "model": extra.get("model"),
    }
