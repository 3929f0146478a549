"""Server-side counters scraped from a Prometheus `/metrics` endpoint before and after a live run, and their
reconciliation with what the requests reported (docs/semantics.md, Hit rates: reported separately, never mixed).

Counter names per engine (sample names as exposed; checked against each engine's metrics code):
- vLLM: vllm:prompt_tokens_total, vllm:prompt_tokens_cached_total, vllm:prefix_cache_queries_total and
  vllm:prefix_cache_hits_total (tokens), vllm:request_success_total
- SGLang: sglang:prompt_tokens_total, sglang:cached_tokens_total, sglang:num_requests_total
- llama.cpp (--metrics): llamacpp:prompt_tokens_total, llamacpp:prompt_tokens_cached_total (newer builds),
  llamacpp:n_decode_total
"""

from __future__ import annotations

import asyncio

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
# Gauges polled during a run for the report's timeline (KV usage as a 0-1 fraction of the engine's cache).
GAUGES = {
    "kv_usage": (
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
        "llamacpp:kv_cache_usage_ratio",
    ),
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred"),
}
POLL_SECONDS = 1.0
AGREE_WITHIN = 0.01  # relative difference above which per-request sums and counters are flagged


def parse(text: str) -> dict[str, float]:
    """Sum of every sample by name (over label sets, e.g. per model or finish reason)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


def counters(samples: dict[str, float], known: dict = COUNTERS) -> dict[str, float]:
    """The known counters (or gauges) present in a scrape, by kvbench name."""
    out = {}
    for key, names in known.items():
        for name in names:
            if name in samples:
                out[key] = samples[name]
                break
    return out


async def scrape(session, base_url: str, known: dict = COUNTERS, problems: list | None = None) -> dict | None:
    """Counters (or gauges) from `base_url`/metrics, or None when the server has no metrics endpoint. A refusal
    (401/403: the endpoint wants other credentials) is appended to `problems` as one line, so that it can be
    told apart from a server that simply has no /metrics."""
    try:
        async with session.get(base_url.rstrip("/") + "/metrics") as resp:
            if resp.status != 200:
                if resp.status in (401, 403) and problems is not None:
                    from kvbench.redact import redact_text

                    body = " ".join((await resp.text(errors="replace"))[:200].split())
                    problems.append(redact_text(f"GET {base_url}/metrics answered http {resp.status}: {body}"))
                return None
            text = await resp.text()
        # parsing a large page takes milliseconds: off the event loop, so that sends are not delayed
        return counters(await asyncio.to_thread(parse, text), known)
    except Exception:  # noqa: BLE001 - a server without /metrics (or a dead one) is reported, not fatal
        return None


async def poll_gauges(session, base_url: str, now, timeline: dict[str, list]) -> None:
    """Append the GAUGES to `timeline` (t_s from `now()`, plus one list per gauge) every POLL_SECONDS until
    cancelled; stops at once on a server without them."""
    while True:
        t = now()
        values = await scrape(session, base_url, GAUGES)
        if not values:
            return
        timeline.setdefault("t_s", []).append(round(t, 3))
        for key in GAUGES:
            timeline.setdefault(key, []).append(values.get(key))
        await asyncio.sleep(max(0.0, POLL_SECONDS - (now() - t)))


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
