"""Latency metrics of a live run, defined as `vllm bench serve` defines them (docs/semantics.md, Latency), so that
numbers compare: TTFT = first content chunk - send; E2EL = last content chunk - send; TPOT = (E2EL - TTFT) /
(output tokens - 1) for requests with more than one output token; ITL = gaps between consecutive content
chunks, pooled over requests; percentiles by linear interpolation; failed requests are left out and counted.

The same latencies are also given from the *scheduled* send time (what a user who arrived on time waited,
free of coordinated omission), with the schedule lag (actual - scheduled send) on its own.
"""

from __future__ import annotations

import math

import numpy as np

from kvbench.metrics.fairness import jain_index

PERCENTILES = (50, 90, 95, 99)


def error_class(error: str | None) -> str | None:
    """The kind of a failed request's `error`, for counting failures: the text before its first colon (the live
    client writes 'http 429: …', 'timeout: …', 'connection refused: …', 'stream cut: …', 'not an event
    stream: …', 'malformed event: …', 'error event: …'); the whole text, cut short, when it has no such class."""
    if not error:
        return None
    head, sep, _ = error.partition(":")
    return head.strip() if sep and 0 < len(head) <= 40 else error.strip()[:40]


def per_request(outcomes) -> dict[str, np.ndarray | list]:
    """Per-request columns (seconds) in the order of `outcomes`; NaN where not measured."""
    n = len(outcomes)
    sched = np.array([o.scheduled_s for o in outcomes], dtype=np.float64)
    sent = np.array([o.sent_s for o in outcomes], dtype=np.float64)
    first = np.array([o.first_chunk_s for o in outcomes], dtype=np.float64)
    first_out = np.array([o.first_output_s for o in outcomes], dtype=np.float64)
    last = np.array([o.last_chunk_s for o in outcomes], dtype=np.float64)
    out_tok = np.array([o.completion_tokens if o.completion_tokens is not None else len(o.chunk_s) for o in outcomes])
    ttft, e2el = first - sent, last - sent
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out_tok > 1, (e2el - ttft) / (out_tok - 1), np.nan)
    ok = np.array([o.status == "ok" for o in outcomes], dtype=bool) if n else np.zeros(0, bool)
    for a in (ttft, e2el, tpot):
        a[~ok] = np.nan
    return {
        "scheduled_send_s": sched,
        "actual_send_s": sent,
        "ttft_s": ttft,
        "ttfo_s": np.where(ok, first_out - sent, np.nan),
        "tpot_s": tpot,
        "e2el_s": e2el,
        "ttft_from_scheduled_s": np.where(ok, first - sched, np.nan),
        "e2el_from_scheduled_s": np.where(ok, last - sched, np.nan),
        "schedule_lag_s": sent - sched,
        "itl_s": [np.diff(o.chunk_s).astype(np.float32) if o.status == "ok" else None for o in outcomes],
        "output_tokens": out_tok,
        "ok": ok,
    }


def distribution(values, unit_scale: float = 1000.0) -> dict | None:
    """mean, std and percentiles in milliseconds (values in seconds); None when nothing was measured."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return None
    pct = np.percentile(x, PERCENTILES)  # linear interpolation, as numpy's default and vLLM's
    return {
        "mean_ms": float(x.mean() * unit_scale),
        "std_ms": float(x.std() * unit_scale),
        **{f"p{p}_ms": float(v * unit_scale) for p, v in zip(PERCENTILES, pct)},
        "max_ms": float(x.max() * unit_scale),
        "count": int(x.size),
    }


def latency_summary(cols: dict, warmup: np.ndarray, tenants: list, slo: dict[str, float]) -> dict:
    """summary.json's `latency` block: distributions, throughput, goodput and per-tenant fairness."""
    ok = cols["ok"]
    measured = ok & ~warmup
    sent = np.isfinite(cols["actual_send_s"])
    if measured.any():
        start = np.nanmin(cols["actual_send_s"][measured])
        end = np.nanmax(cols["actual_send_s"][measured] + cols["e2el_s"][measured])
        span = max(end - start, 1e-9)
    else:
        span = math.nan
    itl = [x for x, m in zip(cols["itl_s"], measured) if m and x is not None and len(x)]
    out = {
        "requests": {
            "sent": int(sent.sum()),
            "ok": int(ok.sum()),
            "failed": int((sent & ~ok).sum()),
            "not_sent": int((~sent).sum()),
            "warmup": int(warmup.sum()),
            "measured": int(measured.sum()),
        },
        "duration_s": float(span) if measured.any() else None,
        "request_throughput": float(measured.sum() / span) if measured.any() else None,
        "output_throughput": float(cols["output_tokens"][measured].sum() / span) if measured.any() else None,
        "ttft": distribution(cols["ttft_s"][measured]),
        "tpot": distribution(cols["tpot_s"][measured]),
        "itl": distribution(np.concatenate(itl) if itl else []),
        "e2el": distribution(cols["e2el_s"][measured]),
        "ttfo": distribution(cols["ttfo_s"][measured]),
        "from_scheduled": {
            "ttft": distribution(cols["ttft_from_scheduled_s"][measured]),
            "e2el": distribution(cols["e2el_from_scheduled_s"][measured]),
        },
        "schedule_lag": distribution(cols["schedule_lag_s"][sent & ~warmup]),
    }
    if slo and measured.any():
        good = measured.copy()
        for key, limit in slo.items():
            values = cols[key.replace("_ms", "_s")] * 1000.0
            good &= ~(values > limit)  # NaN TPOT (one output token) does not break a TPOT SLO
        out["goodput"] = {
            "slo": slo,
            "requests_per_s": float(good.sum() / span),
            "fraction": float(good.sum() / measured.sum()),
        }
    out["by_tenant"] = _by_tenant(cols, measured, tenants)
    p50 = [t["ttft_p50_ms"] for t in out["by_tenant"] if t["ttft_p50_ms"] is not None]
    out["fairness"] = {"jain": {"ttft_p50": jain_index(p50) if len(p50) > 1 else None}}
    return out


def modeled_latency_summary(
    ttft, tpot, e2el, output_tokens, tenants: list, *, send=None, ok=None, itl=None, slo: dict | None = None
) -> dict:
    """`latency_summary` for an offline backend's times (engine-sim's modeled, torch's measured service times):
    sent when it arrived (`send`, zeros when requests have no clock), nothing queued behind a client; goodput
    against `slo` (parse_slo's) when given."""
    n = len(ttft)
    zeros = np.zeros(n)
    send = zeros if send is None else send
    cols = {
        "ok": np.ones(n, bool) if ok is None else ok,
        "actual_send_s": send,
        "scheduled_send_s": send,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "e2el_s": e2el,
        "itl_s": [None] * n if itl is None else itl,
        "ttfo_s": np.full(n, np.nan),
        "output_tokens": output_tokens,
        "ttft_from_scheduled_s": ttft,
        "e2el_from_scheduled_s": e2el,
        "schedule_lag_s": zeros,
    }
    return latency_summary(cols, np.zeros(n, dtype=bool), tenants, slo or {})


def _by_tenant(cols: dict, measured: np.ndarray, tenants: list) -> list[dict]:
    names = np.array(["(none)" if t is None else str(t) for t in tenants], dtype=object)
    rows = []
    overall = np.nanmedian(cols["ttft_s"][measured]) if measured.any() else math.nan
    for name in sorted(set(names.tolist())):
        sel = measured & (names == name)
        ttft = cols["ttft_s"][sel]
        p50 = float(np.percentile(ttft, 50) * 1000) if ttft.size else None
        rows.append(
            {
                "name": name,
                "requests": int(sel.sum()),
                "ttft_p50_ms": p50,
                "ttft_p99_ms": float(np.percentile(ttft, 99) * 1000) if ttft.size else None,
                # slowdown: this tenant's median TTFT over everyone's
                "slowdown": float(np.percentile(ttft, 50) / overall) if ttft.size and overall > 0 else None,
            }
        )
    return rows
