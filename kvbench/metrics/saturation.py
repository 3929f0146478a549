"""Whether a point's deployment kept up with the load it was offered (docs/semantics.md, Saturation).

A replay that offers more work than the deployment serves does not measure latency: its queue grows for as long
as the trace lasts, so TTFT and E2EL grow with the trace's length and their percentiles say nothing about the
deployment. This module reads a point's per-request timing (modeled by engine-sim, measured by a live run) and
says whether, and from when, the queue grew without recovering, beside the offered and served rates.

The verdict rests on queueing delay, not on rates alone: a short, dense trace whose last requests take long to
finish has a served rate below its offered rate without any queue building up, while a queue that keeps growing
to the end of the run is saturation whatever the rates say.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

MIN_REQUESTS = 8  # fewer timed requests than this give no trend worth a verdict
MAX_BINS = 20  # bins of the run, in schedule order, whose median delays are compared
MIN_PER_BIN = 5  # ... each holding at least this many requests (when the run has them), so a median is stable
FLOOR_S = 0.05  # growth below this is noise in any deployment (a scheduler tick, a network round trip)
RATE_SHARE = 0.5  # taken up at under half the offered rate: saturated, whatever the median request saw
CENTRAL = 0.9  # rates are taken over the middle 90% of their events' times
SPAN_SHARE = 0.1  # growth past this share of the run's length counts even below a service time
SETTLED = 0.25  # a bin is back "at the early level" when its median is within this share of the threshold


def saturation(columns: Mapping[str, object], input_tokens=None, workloads=None) -> dict | None:
    """The saturation verdict of one point from its per-request columns: `scheduled_send_s` (when the trace or
    the pacing meant each request to go), `actual_send_s`, `e2el_s`, `status`, and the queueing signal —
    `queue_s` (engine-sim: arrival to the scheduler's admission) or else `ttft_s` (a live server queues before
    the first token). `input_tokens`: the prompts' lengths, for the offered token rate. `workloads`: each
    request's workload label; with two or more, each workload gets its own verdict too (`by_workload`), and
    one that saturates while the whole does not becomes the verdict (`workload` names it): a reasoning pool
    serving a tenth of the requests can drown while the median request is served at once. None when the
    point has no timing (an offline cache simulation)."""
    scheduled = _floats(columns.get("scheduled_send_s"))
    if scheduled is None or not np.isfinite(scheduled).any():
        return None
    origin = float(np.nanmin(scheduled))
    whole = _one(columns, input_tokens, origin)
    labels = None if workloads is None else np.asarray(workloads, dtype=object)
    names = [] if labels is None else sorted({w for w in labels.tolist() if w is not None})
    if len(names) < 2:
        return whole
    by = {}
    for name in names:
        mask = labels == name
        if int(mask.sum()) >= MIN_REQUESTS:
            part = {k: _take(v, mask) for k, v in columns.items()}
            by[name] = _one(part, None if input_tokens is None else np.asarray(input_tokens)[mask], origin)
    drowned = sorted((v["from_s"], name) for name, v in by.items() if v["saturated"])
    if whole["saturated"] or not drowned:
        whole["by_workload"] = {name: _brief(v) for name, v in by.items()}
        return whole
    name = drowned[0][1]
    verdict = {**by[name], "workload": name, "all": _brief(whole), "why": f"{name} requests: {by[name]['why']}"}
    verdict["by_workload"] = {k: _brief(v) for k, v in by.items()}
    return verdict


def _brief(v: dict) -> dict:
    return {k: v[k] for k in ("saturated", "from_s", "offered_rps", "served_rps", "queue_growth_s", "why")}


def _take(values, mask: np.ndarray):
    if values is None:
        return None
    return (values if isinstance(values, np.ndarray) else np.asarray(values, dtype=object))[mask]


def _one(columns: Mapping[str, object], input_tokens, origin: float) -> dict:
    """The verdict of one set of requests, times counted from `origin` (the point's first scheduled send)."""
    scheduled = _floats(columns.get("scheduled_send_s"))
    n = scheduled.size
    sent = _floats(columns.get("actual_send_s"))
    sent = scheduled if sent is None else sent
    e2el = _floats(columns.get("e2el_s"))
    e2el = np.full(n, np.nan) if e2el is None else e2el
    status = np.asarray(columns.get("status") if columns.get("status") is not None else ["ok"] * n, dtype=object)
    ok = (status == "ok") & np.isfinite(e2el) & np.isfinite(sent)
    queue = _floats(columns.get("queue_s"))
    wait = queue if queue is not None else _floats(columns.get("ttft_s"))
    wait = np.full(n, np.nan) if wait is None else wait
    # Delay from when a request was due to when the deployment took it up: client-side schedule lag (a
    # concurrency cap, a client that cannot keep up) plus the server's own queue.
    lag = np.where(np.isfinite(sent), sent - scheduled, np.nan)
    delay = np.where(ok, lag + wait, np.nan)
    timed_out = status == "timeout"
    if timed_out.any() and np.isfinite(delay).any():
        # a request given up on waited at least as long as the longest that got through: it counts as that
        # (a lower bound), so a run that ends in timeouts does not hide its queue by dropping them
        delay = np.where(timed_out, np.nanmax(delay), delay)

    valid = np.isfinite(scheduled)
    offered_rps = _per_second(scheduled[valid])
    tokens = None if input_tokens is None else np.asarray(input_tokens, dtype=np.float64)
    offered_tps = _per_second(scheduled[valid], tokens[valid]) if tokens is not None else None
    # Served: requests the deployment took up (admitted by the scheduler; first token on a live server) per
    # second, counted as the offered rate is (`_per_second`) but over the take-up times. A
    # deployment that keeps up takes up what arrives right away (served = offered); a saturated one works
    # through the backlog at its capacity, which in steady state is also the rate it completes requests.
    # Completions would not do: a request decoding for an hour completes long after the others whether or not
    # anything queued.
    taken = (scheduled + delay)[ok & np.isfinite(delay)]
    served_rps = _per_second(taken)
    out = {
        "saturated": False,
        "from_s": None,
        "offered_rps": offered_rps,
        "offered_input_tps": offered_tps,
        "served_rps": served_rps,
        "queue_growth_s": None,
        "early_delay_s": None,
        "late_delay_s": None,
        "signal": "queue_s" if queue is not None else "schedule lag + ttft_s",
        "bins": None,
    }
    timed = np.isfinite(delay) & valid
    if int(timed.sum()) < MIN_REQUESTS:
        out["why"] = f"too few timed requests ({int(timed.sum())}) to see a trend in queueing delay"
        return out
    service = np.where(ok, e2el, np.nan)[timed]  # a timed-out request has no service time of its own
    return _verdict(out, scheduled[timed] - origin, delay[timed], service)


def _verdict(out: dict, t: np.ndarray, delay: np.ndarray, e2el: np.ndarray) -> dict:
    """Bin the delays in schedule order and compare the last quarter of the run with the first."""
    order = np.argsort(t, kind="stable")
    t, delay, e2el = t[order], delay[order], e2el[order]
    n_bins = int(min(MAX_BINS, max(4, t.size // MIN_PER_BIN)))
    edges = np.linspace(0, t.size, n_bins + 1).astype(int)  # equal counts: bursty traces leave no bin empty
    starts = [float(t[a]) for a in edges[:-1]]
    medians = np.array([float(np.median(delay[a:b])) for a, b in zip(edges[:-1], edges[1:])])
    quarter = max(1, n_bins // 4)
    early, late = float(np.median(medians[:quarter])), float(np.median(medians[-quarter:]))
    growth = late - early
    # What counts as growth: more than a typical request's own service time (a request waiting longer than it
    # takes to serve is queued behind others, not merely slow), and never less than FLOOR_S. The service time
    # is taken in the first quarter, before any queue: later E2ELs include the queue being measured. In a run
    # shorter than a few service times (a burst squeezed into seconds, long decodes) no queue could grow by
    # one, so SPAN_SHARE of the run's length caps it: a queue growing by a tenth of the run is no noise.
    early_e2el = e2el[: edges[quarter]]
    early_e2el = early_e2el[np.isfinite(early_e2el)]
    service = float(np.median(early_e2el)) if early_e2el.size else 0.0
    threshold = max(min(service, SPAN_SHARE * float(t[-1] - t[0])), FLOOR_S)
    above = medians > early + threshold
    out.update(
        queue_growth_s=growth,
        early_delay_s=early,
        late_delay_s=late,
        bins={"start_s": starts, "median_delay_s": medians.tolist()},
    )
    if growth > threshold and above[-1]:
        # "from": the start of the bin after the last one still near the early level, i.e. the moment the
        # queue began the growth it never recovered from
        settled = np.nonzero(medians <= early + SETTLED * threshold)[0]
        first = int(settled[-1]) + 1 if settled.size else 0
        out.update(saturated=True, from_s=starts[min(first, n_bins - 1)])
        out["why"] = (
            f"queueing delay grew from {_s(early)} early in the run to {_s(late)} in its last quarter and "
            f"did not recover (growth counts past {_s(threshold)})"
        )
    elif _falls_behind(out):
        # The median request was taken up at once, yet requests were taken up at under half the rate they
        # came: a minority (one workload's pool, requests preempted and re-queued) waits ever longer. Its
        # start is read from each bin's slowest tenth the way the median's is read above.
        tails = np.array([float(np.quantile(delay[a:b], 0.9)) for a, b in zip(edges[:-1], edges[1:])])
        settled = np.nonzero(tails <= float(np.median(tails[:quarter])) + SETTLED * threshold)[0]
        first = int(settled[-1]) + 1 if settled.size else 0
        out.update(saturated=True, from_s=starts[min(first, n_bins - 1)])
        out["bins"]["p90_delay_s"] = tails.tolist()
        out["why"] = (
            f"requests were taken up at {_rate(out['served_rps'])}, under {RATE_SHARE:.0%} of the "
            f"{_rate(out['offered_rps'])} offered: the median request did not queue, but the slowest tenth waited "
            f"{_s(float(tails[-1]))} by the end"
        )
    elif growth > threshold:
        out["why"] = (
            f"queueing delay grew from {_s(early)} to {_s(late)} in the last quarter but was back near its "
            "early level at the end: a burst the deployment worked off"
        )
    else:
        out["why"] = (
            f"queueing delay stayed near its early level ({_s(early)} early, {_s(late)} in the last quarter; "
            f"growth counts past {_s(threshold)})"
        )
    return out


def _falls_behind(out: dict) -> bool:
    served, offered = out["served_rps"], out["offered_rps"]
    return served is not None and offered is not None and served < RATE_SHARE * offered


def _per_second(times: np.ndarray, weights: np.ndarray | None = None) -> float | None:
    """Events (or `weights`: their tokens) per second over the central CENTRAL share of `times`: a few
    stragglers (a request admitted an hour late, one sent long after the rest) would otherwise stretch the span
    and halve a rate that held for all the others. Small sets use their whole span."""
    weights = np.ones(times.size) if weights is None else weights
    if times.size < 20:
        lo, hi = (float(times.min()), float(times.max())) if times.size else (0.0, 0.0)
    else:
        lo, hi = (float(x) for x in np.quantile(times, [(1 - CENTRAL) / 2, (1 + CENTRAL) / 2]))
    inside = (times >= lo) & (times <= hi)
    return float(weights[inside].sum()) / (hi - lo) if hi > lo else None


def describe(verdict: dict | None) -> str | None:
    """One line for the terminal and the reports: 'saturated from t = 812 s: offered 9.1 req/s, served 4.2
    req/s', or 'not saturated: …'; None without a verdict."""
    if not verdict:
        return None
    rates = f"offered {_rate(verdict.get('offered_rps'))}, served {_rate(verdict.get('served_rps'))}"
    if verdict["saturated"]:
        who = f" ({verdict['workload']} requests)" if verdict.get("workload") else ""
        return f"saturated from t = {_s(verdict['from_s'])}{who}: {rates}"
    return f"not saturated: {rates}"


def _rate(rps: float | None) -> str:
    if rps is None:
        return "– req/s"
    return f"{rps:,.3g} req/s" if rps < 100 else f"{rps:,.0f} req/s"


def _s(seconds: float | None) -> str:
    # scaled to the value (ms, s, min, h) and written the way the reports write durations; "from t = 812 s"
    # stays in seconds up to two minutes' worth of thousands, to read against the trace's own arrival_s
    if seconds is None or not math.isfinite(seconds):
        return "–"
    a = abs(seconds)
    if a < 1:
        return f"{seconds * 1e3:.3g} ms"
    if a < 10_000:
        return f"{seconds:,.0f} s" if a >= 10 else f"{seconds:.3g} s"
    return f"{seconds / 60:,.0f} min" if a < 3 * 3600 else f"{seconds / 3600:,.1f} h"


def _floats(values) -> np.ndarray | None:
    if values is None:
        return None
    arr = np.asarray(values, dtype=object if not isinstance(values, np.ndarray) else None)
    if arr.dtype == object:
        arr = np.array([np.nan if v is None else v for v in arr], dtype=np.float64)
    return arr.astype(np.float64)
