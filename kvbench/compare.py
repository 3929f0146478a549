"""`kvbench compare RUN RUN…`: runs side by side, and the fidelity gap between a prediction (sim) and a
measurement (live) of the same trace.

Two runs are of the same trace when their trace fingerprints match, or when one replayed a re-cut copy
(`kvbench trace rebase`, which records the fingerprint it came from): a simulator must see the trace at the
engine's block size to predict what the engine can hit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .errors import KvbenchError

COLUMNS = [
    ("hit rate", lambda p: _get(p, "hit_rate", "token", "all"), "{:.4f}"),
    ("steady", lambda p: _get(p, "hit_rate", "token", "steady"), "{:.4f}"),
    ("TTFT p50 ms", lambda p: _get(p, "latency", "ttft", "p50_ms"), "{:.1f}"),
    ("TTFT p99 ms", lambda p: _get(p, "latency", "ttft", "p99_ms"), "{:.1f}"),
    ("TPOT p50 ms", lambda p: _get(p, "latency", "tpot", "p50_ms"), "{:.2f}"),
    ("ITL p50 ms", lambda p: _get(p, "latency", "itl", "p50_ms"), "{:.2f}"),
    ("E2EL p50 ms", lambda p: _get(p, "latency", "e2el", "p50_ms"), "{:.1f}"),
    ("req/s", lambda p: _get(p, "latency", "request_throughput"), "{:.2f}"),
    ("failed", lambda p: _get(p, "latency", "requests", "failed"), "{}"),
]


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d


def load_run(path: Path) -> dict:
    summary = Path(path) / "summary.json"
    if not summary.exists():
        raise KvbenchError(f"{path}: not a run directory (no summary.json); give directories made by kvbench replay")
    try:
        run = json.loads(summary.read_text())
    except json.JSONDecodeError as exc:
        raise KvbenchError(f"{summary}: not valid JSON ({exc}); was the run killed while writing it?") from None
    run["_dir"] = Path(path)
    return run


def _trace_key(run: dict) -> set[str]:
    trace = run.get("trace", {})
    return {k for k in (trace.get("fingerprint"), (trace.get("source") or {}).get("rebased_from")) if k}


def side_by_side(runs: list[dict]) -> list[dict]:
    rows = []
    for run in runs:
        for point in run["points"]:
            row = {"run": run["run_id"], "backend": run["backend"], "point": point["name"]}
            for title, get, _ in COLUMNS:
                row[title] = get(point)
            rows.append(row)
    return rows


def fidelity(runs: list[dict]) -> list[dict]:
    """Predicted (offline backends) vs measured (live) hit rates for every pair of runs of the same trace,
    with per-request agreement when both runs kept their requests.parquet."""
    live = [r for r in runs if r["backend"] == "openai"]
    offline = [r for r in runs if r["backend"] != "openai"]
    out = []
    for m in live:
        measured = m["points"][0]
        for s in offline:
            if not (_trace_key(m) & _trace_key(s)):
                continue
            for p in s["points"]:
                row = {
                    "predicted": f"{s['run_id']}:{p['name']}",
                    "measured": m["run_id"],
                    "hit rate predicted": _get(p, "hit_rate", "token", "all"),
                    "hit rate measured": _get(measured, "hit_rate", "token", "all"),
                }
                row["gap"] = _diff(row["hit rate measured"], row["hit rate predicted"])
                row.update(_per_request(s["_dir"], p["name"], m["_dir"]))
                out.append(row)
    return out


def _diff(a, b):
    return None if a is None or b is None else a - b


def _per_request(sim_dir: Path, point: str, live_dir: Path) -> dict:
    try:
        sim = pq.read_table(sim_dir / "requests.parquet", columns=["point", "request_id", "hit_tokens"])
        live = pq.read_table(
            live_dir / "requests.parquet", columns=["request_id", "cached_tokens", "status", "input_tokens"]
        )
    except (OSError, ValueError):
        return {}
    sim = sim.filter(pc.equal(sim.column("point"), point))
    live = live.filter(pc.equal(live.column("status"), "ok"))
    joined = sim.join(live, "request_id", join_type="inner")
    if joined.num_rows == 0:
        return {}
    pred = joined.column("hit_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
    meas = joined.column("cached_tokens").fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    inp = joined.column("input_tokens").to_numpy(zero_copy_only=False).sum()
    # hit rates over the requests both runs answered (a live run often covers a prefix of the trace)
    return {
        "hit rate predicted": float(pred.sum() / inp),
        "hit rate measured": float(np.maximum(meas, 0).sum() / inp),
        "gap": float((np.maximum(meas, 0).sum() - pred.sum()) / inp),
        "requests compared": joined.num_rows,
        "requests equal": float(np.mean(pred == meas)),
    }


def render_markdown(table: list[dict]) -> str:
    if not table:
        return ""
    heads = list(table[0])
    fmt = {title: f for title, _, f in COLUMNS}

    def cell(k, v):
        if v is None:
            return "–"
        if isinstance(v, float):
            return fmt.get(k, "{:.4f}").format(v)
        return str(v)

    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(cell(k, row.get(k)) for k in heads) + " |" for row in table]
    return "\n".join(lines)


def compare(paths: list[Path]) -> dict:
    if len(paths) < 1:
        raise KvbenchError("give at least one run directory")
    runs = [load_run(p) for p in paths]
    return {"runs": side_by_side(runs), "fidelity": fidelity(runs)}
