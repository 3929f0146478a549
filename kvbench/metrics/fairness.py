"""Tenant fairness, defined three ways beside Jain's index on raw hit rates (docs/semantics.md, Fairness):

- **by usage**: each tenant's hit rate over its *own bound*, the hit rate an unbounded cache would give its
  requests alone (keys with salts and adapters folded in, as the cache sees them). A tenant whose traffic
  repeats little cannot hit much, whatever the policy: this asks how much of what it could get it got;
- **by entitlement**: each tenant's share of all hit tokens (the prefill the cache saved) over its share of
  `--tenant-weights` (what it pays for or is promised): 1 when every tenant gets what it is entitled to;
- **by SLO**: each tenant's share of answered requests within its TTFT/TPOT/E2EL targets (`--tenant-slo`, else the
  trace's slo_ttft_ms / slo_tpot_ms columns), and whether its TTFT p99 is within its TTFT target: the check of
  "can this pool promise every tenant its p99".

Jain's index is taken over each view's per-tenant values. Computed after the run from requests.parquet and
the trace, so every backend gets the same definitions (latency views need modeled or measured TTFT)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from kvbench.errors import KvbenchError, KvbenchWarning
from kvbench.metrics.slo import parse_slo
from kvbench.trace.compute import call, fill_null, index_in, to_text
from kvbench.trace.hitsums import NO_LABEL


def jain_index(values) -> float | None:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when all equal, 1/n when one takes all."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0 or not np.any(x):
        return None
    return float(x.sum() ** 2 / (x.size * np.square(x).sum()))


def max_min_ratio(values) -> float | None:
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0 or x.min() <= 0:
        return None  # undefined when some tenant gets nothing; the per-tenant table shows who
    return float(x.max() / x.min())


def parse_tenant_weights(text: str | None) -> dict[str, float]:
    """'gold=3,free=1' -> {"gold": 3.0, "free": 1.0} (relative: only their ratios matter)."""
    weights = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, _, value = part.partition("=")
        try:
            weights[name.strip()] = float(value)
        except ValueError:
            raise KvbenchError(
                f"--tenant-weights {part!r}: use TENANT=WEIGHT, e.g. --tenant-weights gold=3,free=1"
            ) from None
        if not name.strip() or not weights[name.strip()] > 0:
            raise KvbenchError(f"--tenant-weights {part!r}: a weight is a number > 0 for a named tenant")
    return weights


def parse_tenant_slo(text: str | None) -> dict[str, dict[str, float]]:
    """'gold:ttft=200,tpot=30;free:ttft=2000' (milliseconds, as --slo; '*' for tenants not named) ->
    {"gold": {"ttft_ms": 200, "tpot_ms": 30}, "free": {"ttft_ms": 2000}}."""
    out: dict[str, dict[str, float]] = {}
    for spec in filter(None, (s.strip() for s in (text or "").split(";"))):
        tenant, sep, targets = spec.partition(":")
        if not sep or not tenant.strip():
            raise KvbenchError(f"--tenant-slo {spec!r}: use TENANT:ttft=MS,tpot=MS, tenants separated by ';'")
        out.setdefault(tenant.strip(), {}).update(parse_slo(targets, "--tenant-slo"))
    return out


def own_bounds(table: pa.Table, block_size: int) -> dict[str, float]:
    """Per tenant: token hit rate of an unbounded cache fed only that tenant's requests (prefix rule)."""
    from kvbench.cache.densify import numbered_chunks
    from kvbench.cache.prepared import fold_isolation
    from kvbench.trace.stats import infinite_cache_hits

    tenants = _tenants(table)
    keys = fold_isolation(table)
    inp = table.column("input_tokens").to_numpy().astype(np.int64)
    out = {}
    for name in sorted(set(tenants.tolist())):
        rows = np.flatnonzero(tenants == name)
        mine = call("array_take", keys, pa.array(rows))
        hits = np.minimum(infinite_cache_hits(mine, number=numbered_chunks) * block_size, inp[rows])
        total = int(inp[rows].sum())
        out[name] = float(hits.sum()) / total if total else 0.0
    return out


def check_options(table: pa.Table | None, options: dict | None, source: str) -> None:
    """Before the run: the tenants named by --tenant-weights / --tenant-slo are the trace's."""
    if not options or table is None:
        return
    names = set(_tenants(table).tolist()) if has_tenants(table) else set()
    for option, given in (
        ("--tenant-weights", options.get("tenant_weights")),
        ("--tenant-slo", options.get("tenant_slo")),
    ):
        unknown = sorted(set(given or ()) - names - {"*"})
        if unknown:
            known = ", ".join(sorted(names)[:12]) or "none: the trace has no tenant column"
            raise KvbenchError(f"{option} names tenants not in {source}: {', '.join(unknown)} (its tenants: {known})")


def has_tenants(table: pa.Table | None) -> bool:
    return table is not None and "tenant" in table.column_names and table.column("tenant").null_count < table.num_rows


def _tenants(table) -> np.ndarray:
    if "tenant" not in table.column_names:
        return np.full(table.num_rows, NO_LABEL, dtype=object)
    col = table.column("tenant")
    return np.array(fill_null(to_text(col), NO_LABEL).to_pylist(), dtype=object)


def _targets(table, rows_tenants: np.ndarray, tenant_slo: dict) -> dict[str, np.ndarray]:
    """Per request: its TTFT, TPOT and E2EL targets in ms (NaN: none). --tenant-slo first ('*' for the others),
    then the trace's own columns (TTFT and TPOT)."""
    n = len(rows_tenants)
    out = {}
    for key, column in (("ttft_ms", "slo_ttft_ms"), ("tpot_ms", "slo_tpot_ms"), ("e2el_ms", None)):
        values = np.full(n, np.nan)
        if column in table.column_names:
            values = fill_null(table.column(column), math.nan).to_numpy(zero_copy_only=False).astype(np.float64)
        for tenant, targets in tenant_slo.items():
            if key in targets:
                sel = np.ones(n, bool) if tenant == "*" else rows_tenants == tenant
                if tenant == "*":
                    sel &= ~np.isin(rows_tenants, [t for t in tenant_slo if t != "*"])
                values = np.where(sel, targets[key], values)
        out[key] = values
    return out


def fairness_views(rows: pa.Table, tenants: np.ndarray, targets: dict, weights: dict,
                   bounds: dict | None) -> tuple[list[dict], dict]:  # fmt: skip
    """One point's per-tenant rows and fairness facts. `rows`: its requests.parquet rows, in trace order, one per
    trace row (status, input_tokens, hit_tokens and, when modeled or measured, ttft_s, tpot_s and e2el_s);
    `tenants` and `targets` (`_targets`): the trace's, per row, the same for every point."""
    ok = np.array([s in ("ok", None) for s in rows.column("status").to_pylist()])  # (offline rows: no status)
    inp = rows.column("input_tokens").to_numpy().astype(np.int64)
    hit = fill_null(rows.column("hit_tokens"), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    has_latency = "ttft_s" in rows.column_names and rows.column("ttft_s").null_count < rows.num_rows
    if has_latency:
        ttft = fill_null(rows.column("ttft_s"), math.nan).to_numpy(zero_copy_only=False) * 1000.0
        tpot = fill_null(rows.column("tpot_s"), math.nan).to_numpy(zero_copy_only=False) * 1000.0
        e2el = fill_null(rows.column("e2el_s"), math.nan).to_numpy(zero_copy_only=False) * 1000.0
    names = sorted(set(tenants.tolist()))
    total_hit, total_w = max(int(hit[ok].sum()), 1), sum(weights.get(t, 0.0) for t in names)
    per = []
    for name in names:
        sel = ok & (tenants == name)
        rate = hit[sel].sum() / inp[sel].sum() if inp[sel].sum() else 0.0
        row = {"name": name, "requests": int(sel.sum()), "hit_rate": float(rate)}
        if bounds is not None:
            row["own_bound"] = bounds[name]
            row["hit_rate_of_bound"] = float(rate / bounds[name]) if bounds[name] > 0 else None
        if weights:
            row["hit_share"] = float(hit[sel].sum() / total_hit)
            row["entitlement"] = weights.get(name, 0.0) / total_w
            row["share_of_entitlement"] = row["hit_share"] / row["entitlement"] if row["entitlement"] else None
        if has_latency:
            row.update(_slo_facts(sel, {"ttft_ms": ttft, "tpot_ms": tpot, "e2el_ms": e2el}, targets))
        per.append(row)
    facts = {"jain": {}}
    for key, view in (("hit_rate_of_bound", "hit_rate_of_bound"), ("share_of_entitlement", "share_of_entitlement"),
                      ("slo_attainment", "slo_attainment")):  # fmt: skip
        values = [r[key] for r in per if r.get(key) is not None]
        if len(values) > 1:
            facts["jain"][view] = jain_index(values)
    judged = [r for r in per if r.get("ttft_p99_target_ms") is not None]
    if judged:
        missed = [r["name"] for r in judged if not r["ttft_p99_met"]]
        facts["p99_guarantee"] = {"met": not missed, "tenants": len(judged), "missed": missed}
    return per, facts


def _slo_facts(sel, times: dict, targets: dict) -> dict:
    """A tenant's SLO attainment (answered requests within every target they have) and its TTFT p99 against
    its TTFT target (the strictest when its requests differ). `times` and `targets`: ms per request by key."""
    has_target = sel & np.any([np.isfinite(t) for t in targets.values()], axis=0)
    good = has_target.copy()
    for key, target in targets.items():
        good &= ~(times[key] > target)  # a NaN (no target, or no TPOT with one output token) never breaks one
    ttft = times["ttft_ms"]
    mine = ttft[sel & np.isfinite(ttft)]
    p99 = float(np.percentile(mine, 99)) if mine.size else None
    ttft_targets = targets["ttft_ms"][sel & np.isfinite(targets["ttft_ms"])]
    target = float(ttft_targets.min()) if ttft_targets.size else None
    return {
        "slo_attainment": float(good.sum() / has_target.sum()) if has_target.any() else None,
        "ttft_p99_ms": p99,
        "ttft_p99_target_ms": target,
        "ttft_p99_met": (p99 <= target) if p99 is not None and target is not None else None,
    }


# what the views read of requests.parquet (not every column of every point)
VIEW_COLUMNS = ["point", "request_id", "status", "input_tokens", "hit_tokens", "ttft_s", "tpot_s", "e2el_s"]


def add_fairness_views(read_rows: Callable[[list[str]], pa.Table], summary: dict, table: pa.Table | None,
                       options: dict) -> None:  # fmt: skip
    """Every point of a finished run gets `tenant_fairness` (per-tenant rows) and more `fairness` facts. Needs
    the trace in memory (a streamed replay is left as it is, and says so). `read_rows(columns)`: those columns
    of the run's per-request results (requests.parquet, read by the runner), KvbenchError when none."""
    if table is None:  # streamed: the own bounds would need another pass over every tenant's block ids
        if options:  # asked for (--tenant-weights, --tenant-slo): say they are missing, and why
            why = "they need the trace in memory; replay with --no-stream for them"
            summary.setdefault("skipped", []).append({"what": "tenant fairness views", "why": why})
            warnings.warn(f"tenant fairness views skipped: {why}", KvbenchWarning, stacklevel=2)
        return
    if not has_tenants(table):
        return  # no tenants: nothing to be fair between
    try:
        rows = read_rows(VIEW_COLUMNS)
    except KvbenchError:
        return  # nothing was written
    bounds = own_bounds(table, summary["trace"]["block_size"])
    weights = options.get("tenant_weights") or {}
    tenants = _tenants(table)  # (per trace row: once for every point)
    targets = _targets(table, tenants, options.get("tenant_slo") or {})
    for point in summary["points"]:
        mine = call("filter", rows, call("equal", rows.column("point"), pa.scalar(point["name"])))
        if mine.num_rows != table.num_rows:
            continue  # a point cut short (interrupted): its rows do not line up with the trace
        position = index_in(mine.column("request_id"), table.column("request_id").combine_chunks())
        order = np.argsort(np.asarray(position))
        per, facts = fairness_views(call("take", mine, pa.array(order)), tenants, targets, weights, bounds)
        point["tenant_fairness"] = per
        point.setdefault("fairness", {}).setdefault("jain", {}).update(facts.pop("jain"))
        point["fairness"].update(facts)


def describe_guarantee(point: dict) -> str:
    """One line for the terminal: whether every tenant's TTFT p99 is within its target, and who misses by how much."""
    g = point["fairness"]["p99_guarantee"]
    if g["met"]:
        return f"within target for all {g['tenants']} tenants that have one"
    rows = {r["name"]: r for r in point["tenant_fairness"]}
    missed = [f"{t} ({rows[t]['ttft_p99_ms']:.0f} ms > {rows[t]['ttft_p99_target_ms']:g} ms)" for t in g["missed"][:4]]
    more = f" and {len(g['missed']) - 4} more" if len(g["missed"]) > 4 else ""
    return f"missed by {len(g['missed'])} of {g['tenants']} tenants: {', '.join(missed)}{more}"
