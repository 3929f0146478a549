"""Server-side counters scraped from a Prometheus `/metrics` endpoint before and after a live run, and their
reconciliation with what the requests reported (DESIGN.md section 7: reported separately, never mixed).

Counter names per engine (sample names as exposed; checked against each engine's metrics code):
- vLLM: vllm:prompt_tokens_total, vllm:prompt_tokens_cached_total, vllm:prefix_cache_queries_total and
  vllm:prefix_cache_hits_total (tokens), vllm:request_success_total
- SGLang: sglang:prompt_tokens_total, sglang:cached_tokens_total, sglang:num_requests_total
- llama.cpp (--metrics): llamacpp:prompt_tokens_total, llamacpp:prompt_tokens_cached_total (newer builds),
  llamacpp:n_decode_total
"""

from __future__ import annotations

COUNTERS = {
    "prompt_tokens": ("vllm:prompt_tokens_total", "sglang:prompt_tokens_total", "llamacpp:prompt_tokens_total"),
    "cached_tokens": (
        "vllm:prompt_tokens_cached_total",
        "sglang:cached_tokens_total",
        "llamacpp:prompt_tokens_cached_total",
    ),
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total",),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total",),
    "requests": ("vllm:request_success_total", "sglang:num_requests_total"),
}
AGREE_WITHIN = 0.01  # relative difference above which per-request sums and counters are flagged


def parse(text: str) -> dict[str, float]:
    """Sum of every sample by name (over label sets, e.g. per model or finish reason)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


def counters(samples: dict[str, float]) -> dict[str, float]:
    """The known counters present in a scrape, by kvbench name."""
    out = {}
    for key, names in COUNTERS.items():
        for name in names:
            if name in samples:
                out[key] = samples[name]
                break
    return out


async def scrape(session, base_url: str) -> dict[str, float] | None:
    """Counters from `base_url`/metrics, or None when the server has no metrics endpoint."""
    try:
        async with session.get(base_url.rstrip("/") + "/metrics") as resp:
            if resp.status != 200:
                return None
            return counters(parse(await resp.text()))
    except Exception:  # noqa: BLE001 - a server without /metrics (or a dead one) is reported, not fatal
        return None


def reconcile(before: dict | None, after: dict | None, reported: dict[str, int]) -> dict:
    """Counter deltas over the run beside the per-request sums (`reported`: prompt_tokens, cached_tokens),
    with a flag for each pair that disagrees by more than AGREE_WITHIN."""
    if before is None or after is None:
        return {"available": False}
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    checks = {}
    for key, total in reported.items():
        if key in delta:
            diff = delta[key] - total
            checks[key] = {
                "server": delta[key],
                "requests": total,
                "agree": abs(diff) <= AGREE_WITHIN * max(abs(total), 1),
            }
    return {"available": True, "delta": delta, "checks": checks, "agree": all(c["agree"] for c in checks.values())}
