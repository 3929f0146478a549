"""The replay runner: trace in, run directory out. It owns validation, result collection and outputs;
the backend (found by entry point) only answers requests."""

from __future__ import annotations

import datetime as _dt
import json
import platform
import sys
from pathlib import Path

import numpy as np

from . import __version__
from .errors import KvbenchError
from .live import is_online, run_live
from .metrics import point_metrics
from .plugins import load_backend
from .results import TRACE_COLUMNS, ResultWriter
from .stats import DEFAULT_WARMUP, hit_rates, infinite_cache_hits
from .tracescan import STREAM_BLOCK_REFS, block_references, scan_trace, trace_fingerprint
from .validate import read_valid_trace

DEFAULT_REPORTS = Path("reports")


def new_run_id(backend: str, trace_path: Path) -> str:
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{backend}-{trace_path.stem}"


def _environment() -> dict:
    return {"python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine()}


def _open_trace(trace_path: Path, stream: bool | None):
    """(per-request table, block counts, infinite-cache hits, fingerprint, meta, whole table or None, scanned
    trace or None). A trace over STREAM_BLOCK_REFS block references (or any, with stream=True) is scanned
    with its block ids streamed; otherwise it is read whole, which is faster."""
    import pyarrow.compute as pc

    if stream is None:
        stream = block_references(trace_path) > STREAM_BLOCK_REFS
    if stream:
        s = scan_trace(trace_path)
        return s.requests, s.n_blocks, s.infinite_hits, s.fingerprint, s.meta, None, s
    table, meta = read_valid_trace(trace_path)
    n_blocks = pc.list_value_length(table.column("block_hashes")).to_numpy(zero_copy_only=False).astype(np.int64)
    hits = infinite_cache_hits(table.column("block_hashes"))
    return table, n_blocks, hits, trace_fingerprint(table), meta, table, None


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
):
    """Replay a trace through a backend; returns (run directory, summary). Writes requests.parquet point by
    point and summary.json after every point, so an interrupted run keeps and reports what it finished.
    `stream`: replay in bounded memory, block ids read by row group (None: when the trace is large)."""
    trace_path = Path(trace_path)
    try:
        backend_cls = load_backend(backend_name)
    except KeyError as exc:
        raise KvbenchError(exc.args[0]) from None
    backend = backend_cls(**backend_options)
    online = is_online(backend)
    requests, n_blocks, infinite_hits, fingerprint, meta, table, scanned = _open_trace(
        trace_path, False if online else stream
    )
    if scanned is not None and not hasattr(backend, "replay_stream"):
        raise KvbenchError(
            f"backend {backend_name} needs the whole trace in memory and cannot stream it; "
            "replay it with --no-stream, or cut the trace shorter"
        )
    input_tokens = requests.column("input_tokens").to_numpy().astype(np.int64)
    run_dir = Path(out) if out else DEFAULT_REPORTS / new_run_id(backend_name, trace_path)
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = {
        "kvbench_version": __version__,
        "run_id": run_dir.name,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": command,
        "environment": _environment(),
        "trace": {
            "path": str(trace_path),
            "fingerprint": fingerprint,
            "requests": requests.num_rows,
            "block_references": int(n_blocks.sum()),
            "streamed": scanned is not None,
            "block_size": meta.block_size,
            "source": meta.source,
        },
        "backend": backend_name,
        "config": {**backend.config(), "warmup": warmup},
        "infinite_cache": hit_rates(infinite_hits, n_blocks, input_tokens, meta.block_size, warmup),
        "points": [],
        "curves": [],
        "complete": False,
    }
    _write_summary(run_dir, summary)
    if online:
        try:
            run_live(backend, table, meta, run_dir, summary, warmup, progress)
            summary["complete"] = True
        except KeyboardInterrupt:
            summary["interrupted"] = True
        finally:
            _finish(run_dir, summary, report)
        return run_dir, summary
    writer = ResultWriter(run_dir / "requests.parquet")
    try:
        points = backend.replay(table, meta) if scanned is None else backend.replay_stream(scanned)
        for point in points:
            if "hit_blocks" in point.columns:
                writer.write(requests if scanned is None else scanned.chunks(TRACE_COLUMNS, blocks=False), point)
                metrics = point_metrics(
                    requests,
                    n_blocks,
                    meta.block_size,
                    point.columns["hit_blocks"],
                    warmup,
                    point.columns.get("evictions"),
                    point.extra.pop("evict_matrix", None),
                    point.extra.pop("tenant_names", None),
                )
                summary["points"].append({"name": point.name, **point.labels, **metrics, **point.extra})
            if "curve" in point.extra:
                summary["curves"].append({**point.labels, **point.extra["curve"]})
            _write_summary(run_dir, summary)
            if progress is not None:
                progress(point)
        summary["complete"] = True
    except KeyboardInterrupt:
        summary["interrupted"] = True
    finally:
        writer.close()
        _finish(run_dir, summary, report)
    return run_dir, summary


def _finish(run_dir: Path, summary: dict, report: bool) -> None:
    if len(summary["points"]) == 1:  # a single point's metrics are also the run's top-level keys
        only = summary["points"][0]
        for key in ("hit_rate", "evictions", "fairness", "by_tenant", "by_workload", "by_modality", "latency"):
            if key in only:
                summary[key] = only[key]
    _write_summary(run_dir, summary)
    if report:
        from .report import write_reports

        write_reports(run_dir, summary)


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
