"""How far a modeled run is from a measured one, request by request (docs/fidelity.md).

The two runs replayed the same requests: a live run against a serving engine, and a model of it (engine-sim,
driven by the live run's own send times and output lengths, or the sim backend for hits alone). They are joined
on `request_id`; a request counts when it was answered ok in both (a null status, as the sim backend writes, is
ok) and is not one of the first `skip` requests the live run sent, failed ones included (engines pay one-off
costs on their first requests). Per metric (TTFT, TPOT for outputs of
more than one token, E2EL): APE = |modeled − measured| / measured, and over the requests MAPE (mean APE), the
median modeled/measured ratio, the 90th percentile of APE and the mean modeled/measured ratio of the means.
Cached-token exactness: the share of requests whose modeled hit tokens equal the engine's reported
`cached_tokens`. All of it overall, by workload and by tenant.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.errors import KvbenchError

METRICS = ("ttft_s", "tpot_s", "e2el_s")
GROUPS = ("workload", "tenant")


def _answered(table: pa.Table) -> pa.Table:
    """The rows answered ok; a null status counts as ok, since the offline backends (sim) leave it null."""
    return table.filter(pc.fill_null(pc.equal(table["status"], "ok"), True))


def _send_order(live: pa.Table) -> np.ndarray:
    """Row positions of the live run in the order its requests went out (actual send time, else scheduled)."""
    for name in ("actual_send_s", "scheduled_send_s"):
        if name in live.column_names:
            sent = live[name].to_numpy(zero_copy_only=False).astype(np.float64)
            return np.argsort(np.where(np.isfinite(sent), sent, np.inf), kind="stable")  # never sent: last
    raise KvbenchError("the live run's requests.parquet has no send times (actual_send_s); cannot skip its first")


def _column(t: pa.Table, name: str, kind: str) -> np.ndarray | None:
    """A column as numpy: kind "label" (text, "" for null), "float" (NaN for null) or "int" (None for null,
    object dtype, so that a count the server did not report stays distinguishable from 0); None if absent."""
    if name not in t.column_names:
        return None
    c = t[name]
    if kind == "label":
        if pa.types.is_dictionary(c.type):
            c = c.cast(pa.string())
        return np.array(["" if x is None else str(x) for x in c.to_pylist()], dtype=object)
    if kind == "float":
        return c.to_numpy(zero_copy_only=False).astype(np.float64)
    return np.array(c.to_pylist(), dtype=object)


def join(live: pa.Table, modeled: pa.Table, skip: int = 0) -> dict[str, np.ndarray]:
    """The requests both runs answered, as columns: request_id, workload, tenant, output_tokens, live_* and
    model_* of each metric, cached_tokens (live; None per request the server did not report, None as a whole
    when the column is absent) and hit_tokens (modeled, likewise). `modeled` must hold one point's rows: a
    request id seen twice there is an error."""
    for name, table in (("live", live), ("modeled", modeled)):
        missing = {"request_id", "status", *METRICS} - set(table.column_names)
        if missing:
            raise KvbenchError(f"the {name} run's requests.parquet lacks {', '.join(sorted(missing))}")
    if skip:
        # the first `skip` requests sent, whatever their outcome: a failed first request paid the warm-up too
        live = live.take(pa.array(_send_order(live)[skip:], pa.int64()))
    ok_live, ok_model = _answered(live), _answered(modeled)
    index: dict[str, int] = {}
    for j, rid in enumerate(ok_model["request_id"].to_pylist()):
        if rid in index:
            raise KvbenchError(
                f"the modeled requests hold {rid!r} twice: a run of several points must be split by point first"
            )
        index[rid] = j
    pairs = [(i, index[rid]) for i, rid in enumerate(ok_live["request_id"].to_pylist()) if rid in index]
    rows_live = pa.array([i for i, _ in pairs], pa.int64())
    rows_model = pa.array([j for _, j in pairs], pa.int64())
    a, b = ok_live.take(rows_live), ok_model.take(rows_model)
    n = a.num_rows
    outputs = _column(a, "output_tokens", "int")
    out = {
        "request_id": np.array(a["request_id"].to_pylist(), dtype=object),
        "workload": _column(a, "workload", "label") if "workload" in a.column_names else np.full(n, "", object),
        "tenant": _column(a, "tenant", "label") if "tenant" in a.column_names else np.full(n, "", object),
        # the trace's output length (what was asked for); 0 when unknown, which keeps the request out of TPOT
        "output_tokens": np.zeros(n, np.int64) if outputs is None else np.array([x or 0 for x in outputs], np.int64),
    }
    for m in METRICS:
        out["live_" + m] = _column(a, m, "float")
        out["model_" + m] = _column(b, m, "float")
    out["cached_tokens"] = _column(a, "cached_tokens", "int")
    out["hit_tokens"] = _column(b, "hit_tokens", "int")
    return out


def metric_errors(measured: np.ndarray, modeled: np.ndarray) -> dict:
    keep = np.isfinite(measured) & np.isfinite(modeled) & (measured > 0)
    measured, modeled = measured[keep], modeled[keep]
    if not measured.size:
        return {"requests": 0}
    ape = np.abs(modeled - measured) / measured
    return {
        "requests": int(measured.size),
        "mape": float(ape.mean()),
        "median_ratio": float(np.median(modeled / measured)),
        "p90_ape": float(np.percentile(ape, 90)),
        "mean_ratio": float(modeled.mean() / measured.mean()),
        "measured_mean_s": float(measured.mean()),
        "modeled_mean_s": float(modeled.mean()),
    }


# a stream whose tokens came faster than this share of the run's 90th-percentile TPOT came in a burst (a
# percentile high enough that bursts, however many, do not move it)
BURST_SHARE = 0.1


def bursts(j: dict) -> np.ndarray:
    """Requests whose tokens reached the client all at once (a starved client or server flushed the stream
    late): their measured TTFT and TPOT say when the burst came, not when the engine made the tokens, so they
    are left out of those two errors (E2EL, the last token's arrival, still counts) and counted apart."""
    tpot = j["live_tpot_s"]
    many = (j["output_tokens"] > 2) & np.isfinite(tpot)
    if not many.any():
        return np.zeros(len(tpot), dtype=bool)
    return many & (tpot < BURST_SHARE * np.percentile(tpot[many], 90))


def _errors(j: dict, mask: np.ndarray) -> dict:
    burst = bursts(j)
    out = {"requests": int(mask.sum()), "burst_streams": int((burst & mask).sum())}
    for m in METRICS:
        sel = mask & (j["output_tokens"] > 1) if m == "tpot_s" else mask
        if m != "e2el_s":
            sel = sel & ~burst
        out[m.removesuffix("_s")] = metric_errors(j["live_" + m][sel], j["model_" + m][sel])
    if j["cached_tokens"] is not None and j["hit_tokens"] is not None:
        # only the requests whose server reported cached_tokens (and whose model reported hits) can be judged
        both = np.array([c is not None and h is not None for c, h in zip(j["cached_tokens"], j["hit_tokens"])])
        judged = both & mask
        got = np.array([c if c is not None else -1 for c in j["cached_tokens"]], dtype=np.int64)
        hit = np.array([h if h is not None else -1 for h in j["hit_tokens"]], dtype=np.int64)
        n = int(judged.sum())
        exact = int((got[judged] == hit[judged]).sum())
        out["cached_tokens"] = {
            "requests": n,
            "exact": exact,
            "exact_share": exact / n if n else None,
            "measured": int(got[judged].sum()),
            "modeled": int(hit[judged].sum()),
        }
    return out


def fidelity(live: pa.Table, modeled: pa.Table, skip: int = 0) -> dict:
    """The error table (module docstring), JSON-ready: overall, then by workload and by tenant."""
    j = join(live, modeled, skip)
    if not len(j["request_id"]):
        raise KvbenchError(
            "the live and the modeled run have no request in common that both answered ok; were they replays of "
            "the same trace?"
        )
    everything = np.ones(len(j["request_id"]), dtype=bool)
    table = {"skipped_first": skip, "overall": _errors(j, everything)}
    for g in GROUPS:
        labels = sorted({str(x) for x in j[g] if x not in (None, "")})
        if len(labels) > 1:
            table["by_" + g] = {lab: _errors(j, np.array([str(x) == lab for x in j[g]])) for lab in labels}
    return table


def rows(table: dict) -> list[tuple[str, dict]]:
    """(label, errors) for every row of a table: overall first, then each group's labels."""
    out = [("all", table["overall"])]
    for g in GROUPS:
        for label, errs in table.get("by_" + g, {}).items():
            out.append((f"{g} {label}", errs))
    return out


def format_rows(table: dict) -> tuple[list[str], list[list[str]]]:
    """Header and text cells of the error table, as the terminal, Markdown and HTML reports show it."""
    header = ["requests", "TTFT MAPE", "TTFT ratio", "TTFT p90 APE", "TPOT MAPE", "TPOT ratio", "E2EL MAPE",
              "E2EL ratio", "cached exact"]  # fmt: skip
    body = []
    for label, e in rows(table):
        burst = e.get("burst_streams")
        cells = [label, f"{e['requests']}" + (f" ({burst} burst)" if burst else "")]
        for m in ("ttft", "tpot", "e2el"):
            x = e.get(m, {})
            if not x.get("requests"):
                cells += ["–", "–"] + (["–"] if m == "ttft" else [])
                continue
            cells += [f"{x['mape']:.1%}", f"{x['median_ratio']:.3f}"] + ([f"{x['p90_ape']:.1%}"] if m == "ttft" else [])
        c = e.get("cached_tokens")
        cells.append(f"{c['exact']}/{c['requests']}" if c and c["requests"] else "–")
        body.append(cells)
    return ["", *header], body
