"""The measuring runs: single-request TTFTs (fresh prompts and prompts after a cached context) and the decode step
time of batches decoding together, read from the streamed inter-token times; `measure` runs them all against a
live endpoint, every point `repeats` times in shuffled orders, and returns the `Result` the fit takes (medians)."""

from __future__ import annotations

import asyncio
import math
import random
import secrets
import statistics
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from kvbench.backends.enginesim.calibrate.joining import join_points, join_sample
from kvbench.backends.enginesim.calibrate.plan import DecodePoint, Plan, PrefillPoint, Progress, Result

from kvbench.errors import KvbenchError
from kvbench.live.endpoint import (
    EMPTY_TEXT_TRIES,
    Meter,
    Prompts,
    base_url,
    host_port,
    model_info,
    reset_prefix_cache,
    server_facts,
    shown,
)
from kvbench.live.servers import llama_facts, max_decode_batch, request_context, step_budget

MIN_WINDOW_STEPS = 8  # decode steps a batch must run together for its step time to count
WARMUP_REQUESTS = 2
DECODE_ATTEMPTS = 3


async def _prefill_sample(meter: Meter, cached: int, new: int) -> tuple[float, int | None]:
    """(TTFT seconds, tokens the server says it served from its cache) of one lone request of `new` fresh tokens
    after a `cached`-token context, which is sent just before so that the server caches it."""
    context = meter.prompts(cached) if cached else []
    if cached:
        await meter.send(context, 1, allow_empty=True)  # caches the context (its answer's text is not timed)
    for _ in range(EMPTY_TEXT_TRIES):
        o = await meter.send(context + meter.prompts(new), 1, allow_empty=True)
        if o.chunk_s:  # (an answer without text has no first-token time: new tokens are drawn, EMPTY_TEXT_TRIES)
            return o.first_chunk_s - o.sent_s, o.cached_tokens
    raise KvbenchError(
        f"{EMPTY_TEXT_TRIES} answers in a row to {cached + new}-token prompts generated a token without streaming "
        "any text, so their first token cannot be timed; check the server's log"
    )


def _prefill_points(samples: dict, reported: dict) -> list[PrefillPoint]:
    for (p, n), got in reported.items():
        if p == 0 and statistics.median(got) > 0:
            raise KvbenchError(
                f"the server served {statistics.median(got):.0f} of {n} tokens of fresh {n}-token prompts from its "
                "prefix cache, so their TTFT is no prefill time: the prompts repeat an earlier run's (same --seed?). "
                "Rerun without --seed (a fresh one each run) or reset the server's prefix cache"
            )
    points = []
    for (p, n), s in samples.items():
        got = reported.get((p, n))
        server_cached = int(statistics.median(got)) if got else None
        # what the server really reused (whole blocks of the context, or nothing without prefix caching) is what
        # its prefill skipped; a server that does not say is taken to have reused the whole context
        cached = p if server_cached is None else min(server_cached, p + n - 1)
        rounded = [round(x, 6) for x in s]
        points.append(PrefillPoint(cached, p + n - cached, statistics.median(s), rounded, server_cached))
    return sorted(points, key=lambda q: (q.cached_tokens, q.new_tokens))


def decode_step(outcomes, prompt_tokens: int) -> tuple[float, float, int] | None:
    """(step seconds, batch KV tokens mid-window, steps in the window) of a batch decoding together, or None when
    it never ran all at once."""
    start = max(o.chunk_s[0] for o in outcomes)  # every sequence has its first token
    end = min(o.chunk_s[-1] for o in outcomes)  # no sequence has finished
    rates, steps = [], []
    for o in outcomes:
        inside = [t for t in o.chunk_s if start <= t <= end]
        per_chunk = (o.completion_tokens or len(o.chunk_s)) / len(o.chunk_s)  # > 1 if the server coalesces
        if len(inside) >= 2:
            tokens = (len(inside) - 1) * per_chunk
            rates.append((inside[-1] - inside[0]) / tokens)
            steps.append(tokens)
    if len(rates) < len(outcomes) or min(steps) < MIN_WINDOW_STEPS:
        return None
    mid = (start + end) / 2
    kv = 0.0
    for o in outcomes:
        per_chunk = (o.completion_tokens or len(o.chunk_s)) / len(o.chunk_s)
        kv += prompt_tokens + sum(1 for t in o.chunk_s if t <= mid) * per_chunk
    return statistics.median(rates), kv, int(min(steps))


def _batch_detail(outcomes) -> str:
    firsts = [o.chunk_s[0] for o in outcomes]
    lasts = [o.chunk_s[-1] for o in outcomes]
    chunks = sorted(len(o.chunk_s) for o in outcomes)
    return (
        f"first tokens spread over {1e3 * (max(firsts) - min(firsts)):.0f} ms, the first stream ended "
        f"{1e3 * (min(lasts) - max(firsts)):.0f} ms after the last one began, {chunks[0]}–{chunks[-1]} chunks each"
    )


async def _decode_sample(meter: Meter, plan: Plan, batch: int, context: int, warnings: list[str]):
    """(step seconds, KV tokens, window steps) of `batch` concurrent `context`-token requests, or None (with a
    warning) when they never decoded together."""
    # long enough that the batch decodes together for decode_tokens steps after the prefills
    out = plan.decode_tokens + math.ceil(batch * context / 1024)
    for _attempt in range(DECODE_ATTEMPTS):  # other traffic on the server can split a batch once
        outs = await asyncio.gather(*(meter.send(meter.prompts(context), out) for _ in range(batch)))
        got = decode_step(outs, context)
        if got is not None:
            return got
    warnings.append(
        f"decode batch of {batch} × {context}-token prompts left out of one repeat: it never decoded together for "
        f"{MIN_WINDOW_STEPS} steps in {DECODE_ATTEMPTS} tries ({_batch_detail(outs)})"
    )
    return None


def _decode_points(samples: dict, warnings: list[str]) -> list[DecodePoint]:
    points = []
    for (b, ctx), s in samples.items():
        points.append(
            DecodePoint(
                b,
                ctx,
                statistics.median(kv for _, kv, _ in s),
                statistics.median(step for step, _, _ in s),
                [round(step, 6) for step, _, _ in s],
                min(n for _, _, n in s),
            )
        )
    if len({p.kv_tokens for p in points}) < 2:
        raise KvbenchError(
            f"only {len(points)} decode point(s) could be measured: batches did not decode together (the server "
            "runs fewer sequences at a time, its prefills outlast the decode, or other traffic reaches it); lower "
            "--batch-sizes, raise --decode-tokens, or calibrate while nothing else uses the server. "
            + " ".join(warnings[-3:])
        )
    return sorted(points, key=lambda q: (q.batch, q.context_tokens))


async def _measure_points(meter: Meter, plan: Plan, progress: Progress, result: Result) -> None:
    """Every point once per repeat, each repeat in its own shuffled order (seeded by the plan): a burst of other
    load, or the server warming up, then lands on random points instead of on all the long prompts or all the
    large batches, which would bend the fitted terms."""
    points = [("prefill", 0, n) for n in plan.prompt_lengths]
    points += [("prefill", p, n) for p, n in plan.context_points()]
    points += [("decode", b, ctx) for ctx in plan.decode_contexts for b in plan.batch_sizes]
    points += [("join", offset, plan.join_tokens) for offset in plan.join_offsets_s]
    order = random.Random(plan.seed)
    prefill: dict[tuple[int, int], list[float]] = {}
    reported: dict[tuple[int, int], list[int]] = {}
    decode: dict[tuple[int, int], list[tuple[float, float, int]]] = {}
    join: dict[float, list[tuple[float, float]]] = {offset: [] for offset in plan.join_offsets_s}
    for _ in range(plan.repeats):
        for kind, a, b in order.sample(points, len(points)):
            if kind == "prefill":
                ttft, cached = await _prefill_sample(meter, a, b)
                prefill.setdefault((a, b), []).append(ttft)
                if cached is not None:
                    reported.setdefault((a, b), []).append(cached)
                what = f"prefill: {b} new tokens after {a} cached" if a else f"prefill: {b}-token prompts"
                progress(what, 2 if a else 1)
            elif kind == "join":
                got = await join_sample(meter, a, b)
                if got is not None:
                    join[a].append(got)
                progress(f"join: two {b}-token prompts sent {a * 1e3:g} ms apart", 2)
            else:
                got = await _decode_sample(meter, plan, a, b, result.warnings)
                if got is not None:
                    decode.setdefault((a, b), []).append(got)
                progress(f"decode: batch {a}, {b}-token prompts", a)
    result.prefill = _prefill_points(prefill, reported)
    result.decode = _decode_points(decode, result.warnings)
    result.join = join_points(join, plan.join_tokens)


async def measure_async(
    url: str,
    plan: Plan,
    model: str | None = None,
    endpoint: str = "completions",
    api_key: str | None = None,
    timeout_s: float = 300.0,
    progress: Progress | None = None,
    on_plan: Callable[[Plan], None] | None = None,
) -> Result:
    try:
        from kvbench.live.client import OpenAIClient
    except ImportError as exc:
        raise KvbenchError(f"kvbench calibrate needs the live extra ({exc}); pip install 'kvbench[live]'") from None

    progress = progress or (lambda what, n: None)
    base = base_url(url)
    parts = urlsplit(base)
    if not parts.scheme or parts.query or parts.fragment:
        raise KvbenchError(
            f"--url {shown(url)!r}: give the server's base URL with its scheme and no query, e.g. http://127.0.0.1:8011"
        )
    t0 = time.perf_counter()
    async with OpenAIClient(base, endpoint=endpoint, timeout_s=timeout_s, api_key=api_key, origin=t0) as client:
        model, max_len = await model_info(client.session, base, model)
        llama = await llama_facts(client.session, base)
        facts = llama or {}
        max_len = request_context(max_len, facts)
        asked = plan.batch_sizes
        plan = plan.bounded(max_len, max_decode_batch(facts))
        plan.max_num_batched_tokens = step_budget(plan.max_num_batched_tokens, facts)
        dropped = sorted(set(asked) - set(plan.batch_sizes))
        if plan.seed is None:
            plan.seed = secrets.randbits(62)
        if on_plan:
            on_plan(plan)
        meter = Meter(client, model, endpoint, Prompts(plan.vocab, plan.seed))
        for _ in range(WARMUP_REQUESTS):  # first requests pay one-off costs (allocations, lazy imports)
            await meter.send(meter.prompts(min(256, plan.max_prompt_tokens)), 4, allow_empty=True)
        result = Result(host_port(base), model, endpoint, max_len, plan)
        result.server = {**await server_facts(client.session, base), **facts}
        result.server["prefix_cache_reset"] = await reset_prefix_cache(client.session, base)
        if dropped:
            result.warnings.append(
                f"decode batches of {', '.join(map(str, dropped))} sequences left out: the server decodes at most "
                f"{max_decode_batch(facts)} together (llama-server's slots, --parallel)"
            )
        await _measure_points(meter, plan, progress, result)
    result.seconds = time.perf_counter() - t0
    return result


def measure(url: str, plan: Plan, **kw) -> Result:
    """Measure the endpoint at `url` (see `measure_async` for the options); raises KvbenchError on failure."""
    try:
        return asyncio.run(measure_async(url, plan, **kw))
    except OSError as exc:
        raise KvbenchError(
            f"cannot reach {shown(url)} ({exc.strerror or exc}); is the server up? (`kvbench engine status`)"
        ) from None
