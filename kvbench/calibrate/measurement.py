"""The measuring runs: single-request TTFTs (fresh prompts and prompts after a cached context) and the decode step
time of batches decoding together, read from the streamed inter-token times; `measure` runs them all against a
live endpoint and returns the `Result` the fits take."""

from __future__ import annotations

import asyncio
import math
import secrets
import statistics
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from ..errors import KvbenchError
from .endpoint import Meter, Prompts, host_port, model_info, reset_prefix_cache, server_facts, shown
from .plan import DecodePoint, Plan, PrefillPoint, Progress, Result

MIN_WINDOW_STEPS = 8  # decode steps a batch must run together for its step time to count
WARMUP_REQUESTS = 2
DECODE_ATTEMPTS = 3


async def _prefill(meter: Meter, plan: Plan, progress: Progress) -> list[PrefillPoint]:
    samples: dict[tuple[int, int], list[float]] = {}
    reported: dict[tuple[int, int], list[int]] = {}
    # repeats interleaved across points, so that a burst of other load on the machine hits all points alike
    for _ in range(plan.repeats):
        for n in plan.prompt_lengths:
            o = await meter.send(meter.prompts(n), 1)
            samples.setdefault((0, n), []).append(o.first_chunk_s - o.sent_s)
            if o.cached_tokens is not None:
                reported.setdefault((0, n), []).append(o.cached_tokens)
            progress(f"prefill: {n}-token prompts", 1)
        for p in plan.context_lengths:
            for n in plan.context_new_tokens:
                if p + n > plan.max_prompt_tokens:
                    continue
                context = meter.prompts(p)
                await meter.send(context, 1)  # caches the context's full blocks
                o = await meter.send(context + meter.prompts(n), 1)
                samples.setdefault((p, n), []).append(o.first_chunk_s - o.sent_s)
                if o.cached_tokens is not None:
                    reported.setdefault((p, n), []).append(o.cached_tokens)
                progress(f"prefill: {n} new tokens after {p} cached", 2)
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
        cached, new = p, n
        if got is not None and p and server_cached < p // 2:
            cached, new = 0, p + n  # the server did not hit the context (no prefix caching): a plain prefill
        points.append(PrefillPoint(cached, new, statistics.median(s), [round(x, 6) for x in s], server_cached))
    return sorted(points, key=lambda q: (q.cached_tokens, q.new_tokens))


def _decode_step(outcomes, prompt_tokens: int) -> tuple[float, float, int] | None:
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


async def _decode(meter: Meter, plan: Plan, progress: Progress, warnings: list[str]) -> list[DecodePoint]:
    samples: dict[tuple[int, int], list[tuple[float, float, int]]] = {}
    for _ in range(plan.repeats):
        for ctx in plan.decode_contexts:
            for b in plan.batch_sizes:
                # long enough that the batch decodes together for decode_tokens steps after the prefills
                out = plan.decode_tokens + math.ceil(b * ctx / 1024)
                for _attempt in range(DECODE_ATTEMPTS):  # other traffic on the server can split a batch once
                    outs = await asyncio.gather(*(meter.send(meter.prompts(ctx), out) for _ in range(b)))
                    got = _decode_step(outs, ctx)
                    if got is not None:
                        samples.setdefault((b, ctx), []).append(got)
                        break
                else:
                    warnings.append(
                        f"decode batch of {b} × {ctx}-token prompts left out: it never decoded together for "
                        f"{MIN_WINDOW_STEPS} steps in {DECODE_ATTEMPTS} tries ({_batch_detail(outs)})"
                    )
                progress(f"decode: batch {b}, {ctx}-token prompts", b)
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
        from kvbench.backends.openai.client import OpenAIClient
    except ImportError as exc:
        raise KvbenchError(f"kvbench calibrate needs the live extra ({exc}); pip install 'kvbench[live]'") from None

    progress = progress or (lambda what, n: None)
    base = url.rstrip("/")
    parts = urlsplit(base)
    if not parts.scheme or parts.query or parts.fragment:
        raise KvbenchError(
            f"--url {shown(url)!r}: give the server's base URL with its scheme and no query, e.g. http://127.0.0.1:8011"
        )
    t0 = time.perf_counter()
    async with OpenAIClient(base, endpoint=endpoint, timeout_s=timeout_s, api_key=api_key, origin=t0) as client:
        model, max_len = await model_info(client.session, base, model)
        plan = plan.bounded(max_len)
        if plan.seed is None:
            plan.seed = secrets.randbits(62)
        if on_plan:
            on_plan(plan)
        meter = Meter(client, model, endpoint, Prompts(plan.vocab, plan.seed))
        for _ in range(WARMUP_REQUESTS):  # first requests pay one-off costs (allocations, lazy imports)
            await meter.send(meter.prompts(min(256, plan.max_prompt_tokens)), 4)
        result = Result(host_port(base), model, endpoint, max_len, plan)
        result.server = await server_facts(client.session, base)
        result.server["prefix_cache_reset"] = await reset_prefix_cache(client.session, base)
        result.prefill = await _prefill(meter, plan, progress)
        result.decode = await _decode(meter, plan, progress, result.warnings)
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
