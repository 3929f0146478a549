"""`kvbench compare RUN RUN…`: runs side by side; latency percentiles with bootstrap confidence intervals and
the differences from a baseline that exceed noise; and the fidelity gap between a prediction (an offline
backend) and a measurement (live) of the same trace, for hit rate and, when the offline backend models
latency, for TTFT; with one live run and runs that model it (engine-sim or sim, on the same request ids), the
per-request errors of `kvbench.run.fidelity` for each modeled point. The tables and plots of the page are made
from this analysis in `kvbench.cli.compare`, for `kvbench compare` and for the index of `kvbench sweep`.

Two runs are of the same trace when their trace fingerprints match, or when one replayed a re-cut copy
(`kvbench trace rebase`, which records the fingerprint it came from): a simulator must see the trace at the
engine's block size to predict what the engine can hit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvbench.errors import KvbenchError
from kvbench.run.fidelity import fidelity as error_table
from kvbench.run.results import read_requests, requests_schema, result_files
from kvbench.run.settingcheck import warnings as setting_warnings

LIVE = "openai"
MODELS = ("engine-sim", "sim")  # offline backends whose runs can be a model of a live run
METRICS = ("ttft", "tpot", "itl", "e2el")
QUANTILES = (50, 90, 99)
N_BOOT = 1000
SEED = 0
CI = (2.5, 97.5)  # a 95% percentile-bootstrap interval

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
FORMATS = {title: f for title, _, f in COLUMNS}

Progress = Callable[[int, int, str], None]  # (steps done, steps in all, what is being done)


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
    run["_label"] = run.get("run_id") or Path(path).name
    return run


def _label_uniquely(runs: list[dict]) -> None:
    """Two directories of the same name (a/live, b/live) must still be told apart in tables and plots."""
    seen: dict[str, int] = {}
    for run in runs:
        n = seen[run["_label"]] = seen.get(run["_label"], 0) + 1
        if n > 1:
            run["_label"] = f"{run['_label']}#{n}"


def _trace_key(run: dict) -> set[str]:
    trace = run.get("trace", {})
    return {k for k in (trace.get("fingerprint"), (trace.get("source") or {}).get("rebased_from")) if k}


def side_by_side(runs: list[dict]) -> list[dict]:
    rows = []
    for run in runs:
        for point in run["points"]:
            row = {"run": run["_label"], "backend": run["backend"], "point": point["name"]}
            for title, get, _ in COLUMNS:
                row[title] = get(point)
            rows.append(row)
    return rows


# --- latency samples and the bootstrap ---------------------------------------------------------------


@dataclass
class Samples:
    """The measured latencies (seconds) of one point of one run, warm-up and failed requests left out as in
    `kvbench.metrics.latency`. Per metric the flat values and how many each request gave (ITL: its gaps, others 1):
    the bootstrap resamples requests, because the gaps of one request are not independent of each other."""

    values: dict[str, np.ndarray] = field(default_factory=dict)
    lengths: dict[str, np.ndarray] = field(default_factory=dict)
    ttft_by_request: dict[str, float] = field(default_factory=dict)


def latency_samples(run_dir: Path) -> dict[str, Samples]:
    """{point name: Samples} for every point of a run whose requests.parquet holds TTFTs (live runs, and
    offline backends that model latency); {} when there are none."""
    cols = ["point", "request_id", "ttft_s", "tpot_s", "e2el_s", "itl_s", "status", "warmup"]
    try:
        files = result_files(run_dir)
        # a simulator's millions of rows need not be read to learn that
        if files and all(_all_null(pq.ParquetFile(f).metadata, "ttft_s") for f in files):
            return {}
        t = read_requests(run_dir, columns=cols)
    except (OSError, ValueError, pa.ArrowException):
        return {}
    if t.num_rows == 0 or t.column("ttft_s").null_count == t.num_rows:
        return {}
    ok = pc.fill_null(pc.equal(t.column("status"), "ok"), True)  # offline backends leave status null
    measured = pc.and_(ok, pc.invert(pc.fill_null(t.column("warmup"), False)))
    t = t.filter(measured)
    points = t.column("point").to_numpy(zero_copy_only=False)
    out = {}
    for name in dict.fromkeys(points.tolist()):
        rows = t.filter(pa.array(points == name))
        s = Samples()
        for m in ("ttft", "tpot", "e2el"):
            x = rows.column(f"{m}_s").to_numpy(zero_copy_only=False).astype(np.float64)
            s.values[m] = x[np.isfinite(x)]
            s.lengths[m] = np.ones(s.values[m].size, dtype=np.int64)
        itl = rows.column("itl_s")
        lengths = pc.fill_null(pc.list_value_length(itl), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        s.values["itl"] = pc.list_flatten(itl).to_numpy(zero_copy_only=False).astype(np.float64)
        s.lengths["itl"] = lengths[lengths > 0]
        ttft = rows.column("ttft_s").to_numpy(zero_copy_only=False)
        ids = rows.column("request_id").to_pylist()
        s.ttft_by_request = {i: float(v) for i, v in zip(ids, ttft) if np.isfinite(v)}
        if s.values["ttft"].size:
            out[name] = s
    return out


def _all_null(meta: pq.FileMetaData, column: str) -> bool:
    """Whether the row-group statistics say that `column` holds nulls only (False when they do not say)."""
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        leaf = next(
            (group.column(j) for j in range(group.num_columns) if group.column(j).path_in_schema == column), None
        )
        stats = leaf.statistics if leaf is not None else None
        if stats is None or stats.null_count != group.num_rows:
            return False
    return True


def bootstrap(values: np.ndarray, lengths: np.ndarray, rng: np.random.Generator, n_boot: int = N_BOOT):
    """(n_boot, len(QUANTILES)) percentiles of resamples of whole requests (`lengths[i]` values each)."""
    n = lengths.size
    out = np.empty((n_boot, len(QUANTILES)))
    if (lengths == 1).all():
        step = max(1, 4_000_000 // n)  # vectorised in chunks of at most 4M values (32 MB)
        for s in range(0, n_boot, step):
            idx = rng.integers(0, n, (min(step, n_boot - s), n))
            out[s : s + len(idx)] = np.percentile(values[idx], QUANTILES, axis=1).T
        return out
    starts = np.cumsum(lengths) - lengths
    for b in range(n_boot):
        idx = rng.integers(0, n, n)
        ln = lengths[idx]
        # the positions of the chosen requests' values: start of each, then consecutive
        flat = np.repeat(starts[idx] - (np.cumsum(ln) - ln), ln) + np.arange(ln.sum())
        out[b] = np.percentile(values[flat], QUANTILES)
    return out


def _latency(samples: dict, progress: Progress | None, step: int, total: int):
    """Per (run, point) and metric: the percentiles with their bootstrap intervals; and the bootstrap draws."""
    rows, draws = [], {}
    for i, ((run, point), s) in enumerate(samples.items()):
        for j, m in enumerate(METRICS):
            if s.lengths[m].size < 2:
                continue
            rng = np.random.default_rng([SEED, i, j])  # the same intervals however often compare runs
            boot = bootstrap(s.values[m], s.lengths[m], rng)
            est = np.percentile(s.values[m], QUANTILES)
            lo, hi = np.percentile(boot, CI, axis=0)
            draws[run, point, m] = (est, boot)
            row = {"run": run, "point": point, "metric": m, "count": int(s.values[m].size)}
            for q, e, a, b in zip(QUANTILES, est, lo, hi):
                row[f"p{q}_ms"] = float(e * 1000)
                row[f"p{q}_ci_ms"] = [float(a * 1000), float(b * 1000)]
            rows.append(row)
        if progress:
            progress(step + i + 1, total, f"bootstrap {run}:{point}")
    return rows, draws


def _differences(draws: dict) -> list[dict]:
    """Every (run, point) against the baseline, the first one measured: a difference of percentiles is
    significant when the bootstrap interval of the difference (independent resamples) excludes 0."""
    keys = list(dict.fromkeys((r, p) for r, p, _ in draws))
    if len(keys) < 2:
        return []
    base, rows = keys[0], []
    for run, point in keys[1:]:
        for m in METRICS:
            if (run, point, m) not in draws or (*base, m) not in draws:
                continue
            (e0, b0), (e1, b1) = draws[(*base, m)], draws[run, point, m]
            lo, hi = np.percentile(b1 - b0, CI, axis=0)
            row = {"run": run, "point": point, "baseline": f"{base[0]}:{base[1]}", "metric": m}
            for q, d, a, b in zip(QUANTILES, e1 - e0, lo, hi):
                row[f"p{q}"] = {
                    "diff_ms": float(d * 1000),
                    "ci_ms": [float(a * 1000), float(b * 1000)],
                    "significant": bool(a > 0 or b < 0),
                }
            rows.append(row)
    return rows


# --- fidelity: predicted (offline) vs measured (live) ------------------------------------------------


def _same_trace_pairs(runs: list[dict]):
    live = [r for r in runs if r["backend"] == LIVE]
    for m in live:
        for s in runs:
            if s["backend"] != LIVE and _trace_key(m) & _trace_key(s):
                yield m, s


def fidelity(runs: list[dict]) -> list[dict]:
    """Predicted (offline backends) vs measured (live) hit rates for every pair of runs of the same trace,
    with per-request agreement when both runs kept their requests.parquet."""
    out = []
    for m, s in _same_trace_pairs(runs):
        measured = m["points"][0] if m["points"] else {}
        for p in s["points"]:
            row = {
                "predicted": f"{s['_label']}:{p['name']}",
                "measured": m["_label"],
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
        sim = read_requests(sim_dir, columns=["point", "request_id", "hit_tokens"])
        live = read_requests(live_dir, columns=["request_id", "cached_tokens", "status", "input_tokens"])
    except (OSError, ValueError, pa.ArrowException):
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


def ttft_fidelity(runs: list[dict], samples: dict) -> list[dict]:
    """Modeled (an offline backend that fills ttft_s) vs measured (live) TTFT, per offline point: the
    percentiles, and the error per request over the requests both answered."""
    out = []
    for m, s in _same_trace_pairs(runs):
        live = next((v for (r, _), v in samples.items() if r == m["_label"]), None)
        for (r, point), model in samples.items():
            if r != s["_label"] or live is None:
                continue
            row = {"modeled": f"{r}:{point}", "measured": m["_label"]}
            for q in (50, 99):
                row[f"TTFT p{q} modeled ms"] = float(np.percentile(model.values["ttft"], q) * 1000)
                row[f"TTFT p{q} measured ms"] = float(np.percentile(live.values["ttft"], q) * 1000)
            common = model.ttft_by_request.keys() & live.ttft_by_request.keys()
            err = np.array([model.ttft_by_request[k] - live.ttft_by_request[k] for k in common]) * 1000
            row["requests compared"] = len(common)
            row["median |error| ms"] = float(np.median(np.abs(err))) if err.size else None
            row["mean error ms"] = float(err.mean()) if err.size else None
            out.append(row)
    return out


# --- model vs measurement: per-request errors of each modeled point against the one live run ----------

REQUEST_COLUMNS = ["point", "request_id", "status", "workload", "tenant", "output_tokens", "ttft_s", "tpot_s"]
REQUEST_COLUMNS += ["e2el_s", "actual_send_s", "scheduled_send_s", "cached_tokens", "hit_tokens"]


def _read_requests(run_dir: Path) -> pa.Table | str:
    """The columns of a run's requests.parquet that `kvbench.run.fidelity` reads, or why they could not be read."""
    try:
        names = set(requests_schema(run_dir).names)
        table = read_requests(run_dir, columns=[c for c in REQUEST_COLUMNS if c in names])
    except (OSError, ValueError, pa.ArrowException) as exc:
        return f"cannot read requests.parquet ({type(exc).__name__})"
    return table if "request_id" in names else "requests.parquet has no request_id column"


def model_vs_measurement(runs: list[dict], skip_first: int = 0) -> list[dict]:
    """With one live run among `runs`, for each point of each modeled run (MODELS): {modeled: "run:point",
    backend, measured: live run, table: kvbench.run.fidelity's errors}, or a one-line `note` in place of the table
    saying why there is none. [] when there is nothing to pair."""
    live = [r for r in runs if r["backend"] == LIVE]
    modeled = [r for r in runs if r["backend"] in MODELS]
    if not live or not modeled:
        return []
    if len(live) > 1:
        return [{"note": "model vs measurement needs one live run, not " + ", ".join(r["_label"] for r in live)}]
    measured = live[0]["_label"]
    live_requests = _read_requests(live[0]["_dir"])
    if isinstance(live_requests, str):
        return [{"measured": measured, "note": f"the live run {measured}: {live_requests}"}]
    live_ids, out = set(pc.unique(live_requests["request_id"]).to_pylist()), []
    for run in modeled:
        entry = {"modeled": run["_label"], "backend": run["backend"], "measured": measured}
        requests = _read_requests(run["_dir"])
        if isinstance(requests, str) or live_ids.isdisjoint(pc.unique(requests["request_id"]).to_pylist()):
            why = requests if isinstance(requests, str) else "no request id in common: not a model of that run"
            out.append({**entry, "note": why})
            continue
        # one table per point: a point is one configuration of the model, each replaying every request
        points = pc.unique(requests["point"]).to_pylist() if "point" in requests.column_names else [None]
        for point in points:
            rows = requests if point is None else requests.filter(pc.equal(requests["point"], point))
            label = run["_label"] if point is None else f"{run['_label']}:{point}"
            try:
                out.append({**entry, "modeled": label, "table": error_table(live_requests, rows, skip_first)})
            except KvbenchError as exc:
                out.append({**entry, "modeled": label, "note": str(exc)})
    return out


# --- the whole analysis ---------------------------------------------------------------------------


@dataclass
class Comparison:
    runs: list[dict]  # summaries, with _dir and _label (never written out: _dir is a path of this machine)
    samples: dict[tuple[str, str], Samples]  # (run label, point) -> measured latencies
    result: dict  # JSON-ready tables: runs, latency, differences, fidelity, ttft_fidelity, model_vs_measurement


def analyse(runs: list[dict], progress: Progress | None = None, skip_first: int = 0) -> Comparison:
    """Every table; `skip_first`: how many of the live run's first requests sent model_vs_measurement skips."""
    _label_uniquely(runs)
    samples: dict[tuple[str, str], Samples] = {}
    total = len(runs) * 2
    for i, run in enumerate(runs):
        for point, s in latency_samples(run["_dir"]).items():
            samples[run["_label"], point] = s
        if progress:
            progress(i + 1, total, f"reading {run['_label']}")
    total = len(runs) + len(samples)
    latency, draws = _latency(samples, progress, len(runs), total)
    result = {
        "runs": side_by_side(runs),
        "latency": latency,
        "differences": _differences(draws),
        "fidelity": fidelity(runs),
        "ttft_fidelity": ttft_fidelity(runs, samples),
        "model_vs_measurement": model_vs_measurement(runs, skip_first),
        "bootstrap": {"resamples": N_BOOT, "seed": SEED, "interval": list(CI), "unit": "request"},
        "setting_warnings": setting_warnings(runs),
    }
    return Comparison(runs, samples, result)


def compare(paths: list[Path], progress: Progress | None = None, skip_first: int = 0) -> Comparison:
    if len(paths) < 1:
        raise KvbenchError("give at least one run directory")
    if skip_first < 0:
        raise KvbenchError(f"skip_first must be 0 or more requests, not {skip_first}")
    return analyse([load_run(p) for p in paths], progress, skip_first)
