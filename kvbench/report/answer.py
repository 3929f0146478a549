"""The answer block that opens a run report: what the run says, for the question its kind of run answers
(docs/reports.md). Every figure here is read from summary.json, never recomputed from other data, so the
report, the terminal and a notebook reading summary.json agree.

- A swept offline run (points with `capacity_blocks`): the best policy at each capacity with its hit rate and
  its gap to Belady, the prompt tokens it saves from prefill, and the capacity that reaches 80/90/95% of the
  infinite-cache bound.
- A run with tenants: the worst-served tenant at each capacity, and the policy that serves it best.
- A timed run (live, or engine-sim's model): throughput, goodput against --slo, TTFT/TPOT p50/p99, failures by
  class and the saturation verdict, per point.
"""

from __future__ import annotations

from kvbench.report.page import Section, Table, pct
from kvbench.report.sections import section_at
from kvbench.report.style import count, duration, plain, size

BOUND = "belady"
TARGETS = (0.8, 0.9, 0.95)  # shares of the infinite-cache hit rate a capacity is sized for
MIN_TENANT_REQUESTS = 10  # a tenant seen a handful of times is "worst served" only by its cold misses


def _steady(p: dict) -> float:
    return p["hit_rate"]["token"]["steady"]


def bytes_per_block(summary: dict) -> float | None:
    """KV bytes of one block under the run's --model geometry (a preset or its --specs file), or None when the
    run named none or it cannot be resolved any more (a specs file gone since): capacities then stay in blocks."""
    from kvbench.errors import KvbenchError
    from kvbench.models import KV_DTYPE_BYTES, resolve_model

    config = summary.get("config") or {}
    dtype = config.get("kv_dtype") or "bf16"
    if not config.get("model") or dtype not in KV_DTYPE_BYTES:
        return None
    try:
        model = resolve_model(config["model"], config.get("specs") or None)
    except (KvbenchError, KeyError, OSError, ValueError):
        return None
    return model.kv_bytes_per_token(dtype) * summary["trace"]["block_size"]


def _capacity(blocks: float, per_block: float | None) -> str:
    text = f"{plain(int(blocks))} blocks"
    return f"{text} ({size(blocks * per_block)})" if per_block else text


def best_by_capacity(summary: dict) -> list[dict]:
    """Per capacity tried: the best real policy (steady token hit rate), Belady's at that capacity, and the
    prompt tokens the best one served from cache."""
    by_cap: dict[int, list[dict]] = {}
    for p in summary["points"]:
        if "capacity_blocks" in p and "policy" in p and p.get("hit_rate"):
            by_cap.setdefault(p["capacity_blocks"], []).append(p)
    rows = []
    for cap in sorted(by_cap):
        real = [p for p in by_cap[cap] if p["policy"] != BOUND]
        if not real:
            continue
        best = max(real, key=_steady)
        bound = next((p for p in by_cap[cap] if p["policy"] == BOUND), None)
        rows.append({"capacity_blocks": cap, "best": best, "bound": bound, "others": real})
    return rows


def capacity_for(summary: dict, share: float) -> tuple[str, int | None, str]:
    """(policy, blocks, how) for the smallest capacity at which a policy reaches `share` of the infinite-cache
    steady hit rate: read off a one-pass curve when the run drew one (exact at the curve's capacities), else
    the smallest swept capacity that does. blocks is None when nothing tried reaches it."""
    target = share * summary["infinite_cache"]["token"]["steady"]
    found: list[tuple[int, str, str]] = []
    for c in summary.get("curves") or []:
        hit = next((cap for cap, h in zip(c["capacity_blocks"], c["token_steady"]) if h >= target), None)
        if hit is not None:
            found.append((int(hit), c["policy"], "one-pass curve"))
    for p in summary["points"]:
        if "capacity_blocks" in p and p.get("policy") not in (None, BOUND) and p.get("hit_rate"):
            if _steady(p) >= target:
                found.append((int(p["capacity_blocks"]), p["policy"], "smallest capacity tried"))
    if not found:
        return "", None, ""
    blocks, policy, how = min(found)
    return policy, blocks, how


def _worst_tenant(best: dict, others: list[dict]) -> list[str] | None:
    tenants = [t for t in best.get("by_tenant") or [] if t.get("requests", 0) >= MIN_TENANT_REQUESTS]
    if len(best.get("by_tenant") or []) < 2 or not tenants:
        return None
    worst = min(tenants, key=lambda t: t["hit_rate"] if t["hit_rate"] is not None else 1.0)
    rates = {}
    for p in others:
        g = next((t for t in p.get("by_tenant") or [] if t["name"] == worst["name"]), None)
        if g is not None and g["hit_rate"] is not None:
            rates[p["policy"]] = g["hit_rate"]
    # a tie goes to the policy that is best overall: no reason to switch for the same figure
    champion = max(rates, key=lambda k: (rates[k], k == best["policy"])) if rates else best["policy"]
    return [f"{worst['name']} ({pct(worst['hit_rate'])} under {best['policy']})",
            f"{champion} ({pct(rates.get(champion, worst['hit_rate']))})"]  # fmt: skip


def offline_items(summary: dict) -> list:
    rows = best_by_capacity(summary)
    if not rows:
        return []
    per_block = bytes_per_block(summary)
    tenants = any(_worst_tenant(r["best"], r["others"]) for r in rows)
    header = [
        "capacity",
        "best policy",
        "steady hit rate",
        "Belady",
        "gap to Belady",
        "prompt tokens from cache (all requests)",
    ]
    if tenants:
        header += ["worst-served tenant", "best policy for that tenant"]
    table = []
    for r in rows:
        best, bound = r["best"], r["bound"]
        gap = f"{100 * (_steady(bound) - _steady(best)):.1f} points" if bound else "–"
        saved = f"{count(best.get('hit_tokens'))} of {count(best.get('input_tokens'))}"
        row = [_capacity(r["capacity_blocks"], per_block), best["policy"], pct(_steady(best)),
               pct(_steady(bound)) if bound else "–", gap, saved]  # fmt: skip
        if tenants:
            row += _worst_tenant(best, r["others"]) or ["–", "–"]
        table.append(row)
    inf = summary["infinite_cache"]["token"]["steady"]
    top = rows[-1]
    lines = [
        f"At the largest capacity tried, {_capacity(top['capacity_blocks'], per_block)}, {top['best']['policy']} "
        f"serves {pct(_steady(top['best']))} of prompt tokens from cache in the steady state; an infinite cache "
        f"would serve {pct(inf)}."
    ]
    sizing = []
    for share in TARGETS:
        policy, blocks, how = capacity_for(summary, share)
        if blocks is None:
            sizing.append(f"{share:.0%} of the bound: not reached by any capacity tried")
        else:
            sizing.append(f"{share:.0%} of the bound: {_capacity(blocks, per_block)} with {policy} ({how})")
    lines.append("Capacity to reach " + "; ".join(sizing) + ".")
    if per_block is None:
        lines.append("Give --model to see capacities in bytes.")
    return [*lines, Table(header, table)]


def _lat(lat: dict, key: str, q: int) -> str:
    d = lat.get(key) or {}
    ms = d.get(f"p{q}_ms")
    return "–" if ms is None else duration(ms / 1000.0)


def _failures(point: dict) -> str:
    f = point.get("failures")
    if not f:
        return "–"
    if not f["failed"]:
        return "none"
    classes = ", ".join(f"{e['error']} ×{e['count']}" for e in f["top_errors"])
    return f"{f['failed']:,} ({classes})"


def _saturation(point: dict) -> str:
    s = point.get("saturation")
    if not s:
        return "not assessed"
    if not s.get("saturated"):
        return "no"
    since = s.get("from_s")
    limit = f", {s['client_limit']} in flight at most" if s.get("client_limit") else ""
    return "saturated" + ("" if since is None else f" from t = {duration(since)}") + limit


def timed_items(summary: dict) -> list:
    points = [p for p in summary["points"] if p.get("latency")]
    if not points:
        return []
    header = ["point", "requests/s", "output tokens/s", "goodput", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
              "failed", "saturated"]  # fmt: skip
    rows = []
    for p in points:
        lat = p["latency"]
        good = lat.get("goodput")
        goodput = f"{plain(good['requests_per_s'], 3)} req/s ({pct(good['fraction'])})" if good else "no --slo"
        rows.append([p["name"], plain(lat.get("request_throughput"), 3), plain(lat.get("output_throughput"), 3),
                     goodput, _lat(lat, "ttft", 50), _lat(lat, "ttft", 99), _lat(lat, "tpot", 50),
                     _lat(lat, "tpot", 99), _failures(p), _saturation(p)])  # fmt: skip
    if not any(p.get("failures") for p in points):  # a model fails no request: the column would be all dashes
        at = header.index("failed")
        header = header[:at] + header[at + 1 :]
        rows = [r[:at] + r[at + 1 :] for r in rows]
    items: list = []
    saturated = [p["name"] for p in points if (p.get("saturation") or {}).get("saturated")]
    if saturated:
        items.append(
            f"Saturated: {', '.join(saturated)} — requests arrive faster than the deployment serves them, so the "
            "queue grows through the run and its latencies measure the queue, not the engine."
        )
    slo = next((p["latency"]["goodput"]["slo"] for p in points if p["latency"].get("goodput")), None)
    if slo:
        met = ", ".join(f"{k.removesuffix('_ms').upper()} ≤ {v:g} ms" for k, v in slo.items())
        items.append(f"Goodput: requests per second that met every target ({met}), and their share of requests.")
    return [*items, Table(header, rows)]


@section_at(10, "summary")
def answer_section(summary: dict) -> Section:
    """The report's first section (empty, and so left out, when the run has no finished point)."""
    if not summary.get("points"):
        return Section("Answer")
    return Section("Answer", offline_items(summary) + timed_items(summary))
