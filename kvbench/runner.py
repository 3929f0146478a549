"""The replay runner: trace in, run directory out. It owns validation, result collection and outputs;
the backend (found by entry point) only answers requests."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import platform
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

from . import __version__
from .errors import KvbenchError
from .metrics import point_metrics
from .plugins import load_backend
from .results import ResultWriter
from .stats import DEFAULT_WARMUP, hit_rates, infinite_cache_hits
from .validate import read_valid_trace

DEFAULT_REPORTS = Path("reports")


def trace_fingerprint(table: pa.Table) -> str:
    """Content hash of what a replay depends on (ids, times, lengths, block ids), not of file bytes, so the
    same trace written twice has the same fingerprint."""
    h = hashlib.blake2b(digest_size=16)
    for name in ("request_id", "arrival_s", "input_tokens", "output_tokens", "block_hashes"):
        col = table.column(name).combine_chunks()
        if pa.types.is_list(col.type):
            h.update(np.asarray(col.offsets).tobytes())
            col = col.flatten()
        for buf in col.buffers():
            if buf is not None:
                h.update(buf)
    return h.hexdigest()


def new_run_id(backend: str, trace_path: Path) -> str:
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{backend}-{trace_path.stem}"


def _environment() -> dict:
    return {"python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine()}


def _infinite_bound(table: pa.Table, block_size: int, warmup: float) -> dict:
    import pyarrow.compute as pc

    hits = infinite_cache_hits(table.column("block_hashes"))
    n_blocks = pc.list_value_length(table.column("block_hashes")).to_numpy(zero_copy_only=False).astype(np.int64)
    return hit_rates(hits, n_blocks, table.column("input_tokens").to_numpy().astype(np.int64), block_size, warmup)


def run_replay(
    trace_path,
    backend_name: str,
    backend_options: dict,
    out: Path | None = None,
    warmup: float = DEFAULT_WARMUP,
    command: str | None = None,
    progress=None,
    report: bool = True,
):
    """Replay a trace through a backend; returns (run directory, summary). Writes requests.parquet point by
    point and summary.json after every point, so an interrupted run keeps and reports what it finished."""
    trace_path = Path(trace_path)
    table, meta = read_valid_trace(trace_path)
    try:
        backend_cls = load_backend(backend_name)
    except KeyError as exc:
        raise KvbenchError(exc.args[0]) from None
    backend = backend_cls(**backend_options)
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
            "fingerprint": trace_fingerprint(table),
            "requests": table.num_rows,
            "block_size": meta.block_size,
            "source": meta.source,
        },
        "backend": backend_name,
        "config": {**backend.config(), "warmup": warmup},
        "infinite_cache": _infinite_bound(table, meta.block_size, warmup),
        "points": [],
        "curves": [],
        "complete": False,
    }
    writer = ResultWriter(run_dir / "requests.parquet")
    try:
        for point in backend.replay(table, meta):
            if "hit_blocks" in point.columns:
                writer.write(table, point)
                metrics = point_metrics(
                    table,
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
        if len(summary["points"]) == 1:  # a single point's metrics are also the run's top-level keys
            only = summary["points"][0]
            for key in ("hit_rate", "evictions", "fairness", "by_tenant", "by_workload", "by_modality"):
                summary[key] = only[key]
        _write_summary(run_dir, summary)
        if report:
            from .report import write_reports

            write_reports(run_dir, summary)
    return run_dir, summary


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
