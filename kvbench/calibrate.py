"""`kvbench calibrate`: measure a live OpenAI-compatible endpoint's prefill and decode timing, fit the step-time
terms of the engine simulator's latency model (`backends/enginesim/roofline.py`, `Calibration`) and write them to
a TOML file that `kvbench replay … --backend engine-sim --calibration FILE` reads.

What is measured (every prompt is token ids drawn at random below the vocabulary, a new draw for every request, so
nothing is served from the prefix cache unless a point asks for it):

- prefill: the TTFT of single requests (max_tokens=1, nothing else in flight) at several prompt lengths, and of
  prompts whose first tokens were cached by the request just before (a cached context, as in chat turns and agent
  calls, where new tokens attend to a long cached prefix);
- decode: B concurrent requests (ignore_eos, a fixed number of output tokens) of several prompt lengths; once all
  B have their first token and until the first one ends, every engine step decodes one token of each, so the
  streamed inter-token time is the decode step time of a batch of B holding the batch's KV tokens.

The fits (least squares of the relative error, so that short prompts and small batches weigh as much as long ones):

- decode step time = decode_step_base_s + decode_s_per_kv_token × batch KV tokens (the Calibration's form), and
  for the record the same with a per-sequence term;
- TTFT = overhead + new tokens × s/token + (query, key) pairs × s/pair, where a prefill of N new tokens after P
  cached ones attends N·P + N²/2 pairs (a physical fit: a fixed per-request cost, the linear layers, attention);
- prefill_tokens_per_s: the rate that makes the simulator's own prefill time, max(N / rate, base + P × per-KV),
  closest to the measured TTFTs (relative least squares). The simulator has no per-request overhead and no
  attention term once calibrated, so this rate folds both in at the measured mix of lengths and contexts.

The file holds the [calibration] table (only Calibration's fields), a [measurements] table with every raw
point, the fits and their R², the endpoint as host:port only (never a key or a path) and the terms the
simulator cannot take yet (e.g. `request_overhead_s`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as _dt
import math
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from .errors import KvbenchError

# Log-spaced lengths: the prefill rate is fitted in relative error, each point weighing alike, so the grid says
# which sizes the rate must serve; doublings from 32 to 4096 tokens cover short chat turns to long documents.
DEFAULT_PROMPT_LENGTHS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_CONTEXT_LENGTHS = (512, 1024, 2048)  # cached prefix tokens for the prefill-after-context points
DEFAULT_CONTEXT_NEW = (64, 256, 1024)  # new tokens after each cached context
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)
DEFAULT_DECODE_CONTEXTS = (128, 1024)
DEFAULT_DECODE_TOKENS = 64
DEFAULT_VOCAB = 4096
DEFAULT_MAX_PROMPT = 4096
DEFAULT_REPEATS = 3
RESERVED_TOKENS = 16  # ids below this are left alone: engines' special tokens live there (as kvbench.prompts)
MIN_WINDOW_STEPS = 8  # decode steps a batch must run together for its step time to count
WARMUP_REQUESTS = 2
DECODE_ATTEMPTS = 3

Progress = Callable[[str, int], None]  # (what is being measured, requests just finished)


@dataclass
class Plan:
    """What to measure. Lengths in tokens; every point is measured `repeats` times (the median is fitted)."""

    prompt_lengths: tuple[int, ...] = DEFAULT_PROMPT_LENGTHS
    context_lengths: tuple[int, ...] = DEFAULT_CONTEXT_LENGTHS
    context_new_tokens: tuple[int, ...] = DEFAULT_CONTEXT_NEW
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    decode_contexts: tuple[int, ...] = DEFAULT_DECODE_CONTEXTS
    decode_tokens: int = DEFAULT_DECODE_TOKENS
    repeats: int = DEFAULT_REPEATS
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT
    vocab: int = DEFAULT_VOCAB
    seed: int | None = None  # None: a fresh seed each run (recorded), so no run repeats an earlier one's prompts

    def bounded(self, max_model_len: int | None) -> Plan:
        """The plan with every prompt (and its output) inside `max_prompt_tokens` and the server's context."""
        cap = self.max_prompt_tokens
        if max_model_len:
            cap = min(cap, max_model_len - self.decode_tokens - 1)
        if cap < 16:
            raise KvbenchError(
                f"prompts may be at most {cap} tokens (--max-prompt-tokens {self.max_prompt_tokens}, server context "
                f"{max_model_len}); raise --max-prompt-tokens or lower --decode-tokens"
            )
        lengths = tuple(sorted({min(n, cap) for n in self.prompt_lengths}))
        contexts = tuple(p for p in self.context_lengths if p + min(self.context_new_tokens, default=0) <= cap)
        news = tuple(n for n in self.context_new_tokens if n <= cap)
        decode = tuple(sorted({min(n, cap) for n in self.decode_contexts}))
        return dataclasses.replace(
            self,
            prompt_lengths=lengths,
            context_lengths=contexts,
            context_new_tokens=news,
            decode_contexts=decode,
            max_prompt_tokens=cap,
        )

    @property
    def prefill_requests(self) -> int:
        ctx = sum(1 for p in self.context_lengths for n in self.context_new_tokens if p + n <= self.max_prompt_tokens)
        return self.repeats * (len(self.prompt_lengths) + 2 * ctx)

    @property
    def decode_requests(self) -> int:
        return self.repeats * sum(self.batch_sizes) * len(self.decode_contexts)


@dataclass
class PrefillPoint:
    """Median TTFT (s) of requests of `new_tokens` uncached tokens after `cached_tokens` cached ones."""

    cached_tokens: int
    new_tokens: int
    ttft_s: float
    samples_s: list[float]
    server_cached_tokens: int | None = None  # what the server reported as cached (None: it does not say)

    @property
    def pairs(self) -> float:
        """(query, key) pairs attention computes: each new token attends the context and the new tokens up to it."""
        n, p = self.new_tokens, self.cached_tokens
        return n * p + n * (n + 1) / 2


@dataclass
class DecodePoint:
    """Median decode step time (s) of `batch` sequences of `context_tokens`-token prompts decoding together;
    `kv_tokens`: the batch's KV tokens at the middle of the measured window."""

    batch: int
    context_tokens: int
    kv_tokens: float
    step_s: float
    samples_s: list[float]
    window_steps: int


@dataclass
class Fit:
    """Least-squares coefficients (named), R² and the number of points."""

    coef: dict[str, float]
    r2: float
    n: int


@dataclass
class Result:
    url: str  # host:port only
    model: str
    endpoint: str
    max_model_len: int | None
    plan: Plan
    prefill: list[PrefillPoint] = field(default_factory=list)
    decode: list[DecodePoint] = field(default_factory=list)
    server: dict = field(default_factory=dict)  # what the server says of itself (vLLM: block size, KV blocks)
    warnings: list[str] = field(default_factory=list)  # points left out, and why
    seconds: float = 0.0


# --- measuring ------------------------------------------------------------------------------------------------


class _Prompts:
    """Unique random token ids: a fresh draw per request, so no two prompts share a first block."""

    def __init__(self, vocab: int, seed: int):
        if vocab <= RESERVED_TOKENS + 1:
            raise KvbenchError(f"--vocab {vocab} is too small; give the model's vocabulary size (e.g. 4096)")
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def __call__(self, n: int) -> list[int]:
        return self.rng.integers(RESERVED_TOKENS, self.vocab, size=n).tolist()


def shown(url: str) -> str:
    """`url` as messages show it: scheme, host, port and path, without credentials or a query."""
    parts = urlsplit(url if "://" in url else "http://" + url)
    return f"{parts.scheme}://{host_port(url)}{parts.path}".rstrip("/")


def host_port(url: str) -> str:
    """host:port of `url`, nothing else (no scheme, credentials, path or query)."""
    parts = urlsplit(url if "://" in url else "http://" + url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


class Meter:
    """Sends the measuring requests through kvbench's streaming client (backends/openai/client.py)."""

    def __init__(self, client, model: str, endpoint: str, prompts: _Prompts):
        self.client, self.model, self.endpoint, self.prompts = client, model, endpoint, prompts

    def payload(self, tokens: list[int], max_tokens: int) -> bytes:
        import orjson

        body = {
            "model": self.model,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "completions":
            body["prompt"] = tokens
        else:
            from .prompts import words

            body["messages"] = [{"role": "user", "content": words(tokens)}]
        return orjson.dumps(body)

    async def send(self, tokens: list[int], max_tokens: int):
        from .pacing import Outcome

        o = Outcome(row=0)
        o.sent_s = time.perf_counter() - self.client.origin
        await self.client.send(self.payload(tokens, max_tokens), o)
        if o.status != "ok":
            raise KvbenchError(_request_error(o.error or o.status, len(tokens)))
        if not o.chunk_s:
            raise KvbenchError(
                f"the server streamed no output token for a {len(tokens)}-token prompt; is {self.endpoint!r} the "
                "right --endpoint for it?"
            )
        return o


def _request_error(error: str, prompt_tokens: int) -> str:
    hint = "check the server's log"
    low = error.lower()
    if "http 400" in low and ("context" in low or "length" in low or "token" in low):
        hint = "lower --max-prompt-tokens below the server's context length"
    elif "http 401" in low or "http 403" in low:
        hint = "give the key's environment variable with --api-key-env"
    elif "http 404" in low:
        hint = "check --model (GET /v1/models lists the served names) and --endpoint"
    elif "connect" in low or "refused" in low:
        hint = "is the server up? (`kvbench engine status`; start one with `kvbench engine up vllm-cpu`)"
    elif "timeout" in low or "no complete answer" in low:
        hint = "raise --timeout or lower --max-prompt-tokens / --batch-sizes"
    return f"a {prompt_tokens}-token measuring request failed: {error}; {hint}"


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


async def _server_facts(session, base: str) -> dict:
    """vLLM's cache config from /metrics (block size, KV blocks), so the simulator's pool can match; {} if none."""
    import re

    try:
        async with session.get(base + "/metrics") as resp:
            if resp.status != 200:
                return {}
            text = await resp.text()
    except Exception:  # noqa: BLE001 - optional facts
        return {}
    m = re.search(r"^vllm:cache_config_info\{([^}]*)\}", text, re.M)
    if not m:
        return {}
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
    facts = {}
    for key in ("block_size", "num_gpu_blocks", "kv_cache_size_tokens"):
        if labels.get(key, "").isdigit():
            facts[key] = int(labels[key])
    return facts


async def _reset_prefix_cache(session, base: str) -> bool:
    """Empty the server's prefix cache where it lets us (vLLM with VLLM_SERVER_DEV_MODE=1, SGLang); the prompts
    are unique anyway, this only frees the cache of earlier traffic."""
    for path in ("/reset_prefix_cache", "/flush_cache"):
        try:
            async with session.post(base + path) as resp:
                if resp.status == 200:
                    return True
        except Exception:  # noqa: BLE001 - optional
            return False
    return False


async def _model_info(session, base: str, model: str | None) -> tuple[str, int | None]:
    try:
        async with session.get(base + "/v1/models") as resp:
            if resp.status in (401, 403):
                raise KvbenchError(
                    f"{shown(base)}/v1/models answered HTTP {resp.status}: give the key's environment variable with "
                    "--api-key-env"
                )
            data = (await resp.json(content_type=None))["data"]
    except KvbenchError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure: say what to do
        if model:
            return model, None
        raise KvbenchError(
            f"cannot list models at {shown(base)}/v1/models ({type(exc).__name__}: {exc}); is the server up? "
            "(`kvbench engine status`; `kvbench engine up vllm-cpu` starts one). Give --model NAME if it has no "
            "/v1/models"
        ) from None
    entry = next((d for d in data if d.get("id") == model), None) if model else (data[0] if data else None)
    if entry is None:
        if model:
            return model, None
        raise KvbenchError(f"{shown(base)}/v1/models lists no model; give --model NAME")
    return entry["id"], entry.get("max_model_len")


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
        model, max_len = await _model_info(client.session, base, model)
        plan = plan.bounded(max_len)
        if plan.seed is None:
            plan.seed = secrets.randbits(62)
        if on_plan:
            on_plan(plan)
        meter = Meter(client, model, endpoint, _Prompts(plan.vocab, plan.seed))
        for _ in range(WARMUP_REQUESTS):  # first requests pay one-off costs (allocations, lazy imports)
            await meter.send(meter.prompts(min(256, plan.max_prompt_tokens)), 4)
        result = Result(host_port(base), model, endpoint, max_len, plan)
        result.server = await _server_facts(client.session, base)
        result.server["prefix_cache_reset"] = await _reset_prefix_cache(client.session, base)
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


# --- fitting --------------------------------------------------------------------------------------------------


def least_squares(columns: dict[str, np.ndarray], y: np.ndarray, nonneg: bool = True, relative: bool = True) -> Fit:
    """y ≈ Σ coef[name] × column (a column of ones gives an intercept), least squares of the relative error (weights
    1/y: a 10 ms point counts as much as a 1 s one, so short prompts and small batches are not drowned by the long
    ones) unless `relative` is off. With `nonneg`, a negative coefficient is dropped (set to 0) and the rest refitted:
    step times cannot shrink as work grows. R² is of the plain residuals."""
    names = list(columns)
    y = np.asarray(y, dtype=np.float64)
    w = 1.0 / y if relative and np.all(y > 0) else np.ones_like(y)
    active = list(names)
    while True:
        x = np.column_stack([np.asarray(columns[k], dtype=np.float64) for k in active]) if active else None
        beta = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)[0] if active else np.zeros(0)
        negative = [k for k, b in zip(active, beta, strict=True) if b < 0]
        if not nonneg or not negative:
            break
        active.remove(min(negative, key=lambda k: beta[active.index(k)]))
    coef = dict.fromkeys(names, 0.0)
    coef.update({k: float(b) for k, b in zip(active, beta, strict=True)})
    pred = sum(coef[k] * np.asarray(columns[k], dtype=np.float64) for k in names)
    return Fit(coef, r_squared(y, pred), len(y))


def r_squared(y, pred) -> float:
    y, pred = np.asarray(y, dtype=np.float64), np.asarray(pred, dtype=np.float64)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    ss_res = float(((y - pred) ** 2).sum())
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)


def fit_decode(points: list[DecodePoint]) -> tuple[Fit, Fit]:
    """(step = base + per-KV × KV tokens, step = base + per-sequence × batch + per-KV × KV tokens)."""
    if len(points) < 2:
        raise KvbenchError("the decode fit needs at least two points: give two or more --batch-sizes")
    kv = np.array([p.kv_tokens for p in points])
    b = np.array([p.batch for p in points], dtype=np.float64)
    y = np.array([p.step_s for p in points])
    ones = np.ones_like(y)
    line = least_squares({"base_s": ones, "s_per_kv_token": kv}, y)
    full = least_squares({"base_s": ones, "s_per_seq": b, "s_per_kv_token": kv}, y)
    return line, full


def fit_prefill_physical(points: list[PrefillPoint]) -> Fit:
    """TTFT = overhead + per-token × new tokens + per-pair × attention pairs (DESIGN: a step's linear work and its
    attention), non-negative least squares."""
    if len(points) < 2:
        raise KvbenchError("the prefill fit needs at least two prompt lengths: give two or more --prompt-lengths")
    y = np.array([p.ttft_s for p in points])
    cols = {
        "overhead_s": np.ones_like(y),
        "s_per_token": np.array([p.new_tokens for p in points], dtype=np.float64),
        "s_per_pair": np.array([p.pairs for p in points], dtype=np.float64),
    }
    return least_squares(cols, y)


def fit_prefill_line(points: list[PrefillPoint]) -> Fit:
    """TTFT = a + L / prefill_tokens_per_s over the fresh prompts (no cached context): the issue's straight line."""
    fresh = [p for p in points if p.cached_tokens == 0]
    y = np.array([p.ttft_s for p in fresh])
    return least_squares({"intercept_s": np.ones_like(y), "s_per_token": np.array([p.new_tokens for p in fresh])}, y)


def modeled_prefill_s(new: float, cached: float, tokens_per_s: float, base_s: float, per_kv_s: float) -> float:
    """What the calibrated simulator charges for a prefill of `new` tokens after `cached` ones, alone in a step
    (LatencyModel._cost with a Calibration: the larger of the compute and the memory bound)."""
    return max(new / tokens_per_s, base_s + cached * per_kv_s)


def fit_prefill_rate(points: list[PrefillPoint], base_s: float, per_kv_s: float) -> tuple[float, float]:
    """(tokens/s, R²): the prefill rate whose simulated TTFTs are closest to the measured ones in relative terms
    (golden-section search on log rate). The simulator's prefill of N tokens takes max(N / rate, base + …): the
    rate absorbs the per-request overhead and the attention cost at the measured lengths and contexts."""
    y = np.array([p.ttft_s for p in points])
    new = np.array([p.new_tokens for p in points], dtype=np.float64)
    cached = np.array([p.cached_tokens for p in points], dtype=np.float64)

    def loss(log_rate: float) -> float:
        pred = np.maximum(new / math.exp(log_rate), base_s + cached * per_kv_s)
        return float((((pred - y) / y) ** 2).sum())

    lo, hi = math.log(1.0), math.log(1e9)
    grid = np.linspace(lo, hi, 200)
    best = grid[int(np.argmin([loss(g) for g in grid]))]
    a, b = best - (hi - lo) / 199, best + (hi - lo) / 199
    g = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        c, d = b - g * (b - a), a + g * (b - a)
        if loss(c) < loss(d):
            b = d
        else:
            a = c
    rate = math.exp((a + b) / 2)
    pred = np.maximum(new / rate, base_s + cached * per_kv_s)
    return rate, r_squared(y, pred)


@dataclass
class Calibrated:
    """The [calibration] table (Calibration's fields) and what the fits say beside it."""

    prefill_tokens_per_s: float
    decode_step_base_s: float
    decode_s_per_kv_token: float
    fits: dict
    proposed: dict = field(default_factory=dict)

    def calibration(self) -> dict:
        return {
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_step_base_s": self.decode_step_base_s,
            "decode_s_per_kv_token": self.decode_s_per_kv_token,
        }


def fit(result: Result) -> Calibrated:
    line, full = fit_decode(result.decode)
    base, per_kv = line.coef["base_s"], line.coef["s_per_kv_token"]
    physical = fit_prefill_physical(result.prefill)
    straight = fit_prefill_line(result.prefill)
    rate, rate_r2 = fit_prefill_rate(result.prefill, base, per_kv)
    overhead = max(0.0, physical.coef["overhead_s"] - base)
    fits = {
        "decode_line": {**line.coef, "r2": line.r2, "points": line.n},
        "decode_with_per_seq": {**full.coef, "r2": full.r2, "points": full.n},
        "prefill_line": {
            "intercept_s": straight.coef["intercept_s"],
            "tokens_per_s": 1 / straight.coef["s_per_token"] if straight.coef["s_per_token"] > 0 else math.inf,
            "r2": straight.r2,
            "points": straight.n,
        },
        "prefill_physical": {**physical.coef, "r2": physical.r2, "points": physical.n},
        "prefill_rate": {"tokens_per_s": rate, "r2": rate_r2, "points": len(result.prefill)},
    }
    # Terms the simulator's Calibration lacks, at the values these measurements give them (a proposal):
    proposed = {
        # outside the engine's step loop (HTTP, the API server, the hand-off to the engine core): TTFT's fixed part
        # less one step's fixed cost; paid once per request, added to its TTFT, occupies no engine step
        "request_overhead_s": overhead,
        # a prefill step's work: linear layers per new token, attention per (query, key) pair, added to the step's
        # fixed cost (on a CPU nothing overlaps: the step is the sum, not the roofline's max)
        "prefill_s_per_token": physical.coef["s_per_token"],
        "prefill_s_per_pair": physical.coef["s_per_pair"],
        # a decode step's cost per running sequence (sampling, output processing), beside its KV term
        "decode_s_per_seq": full.coef["s_per_seq"],
    }
    return Calibrated(rate, base, per_kv, fits, proposed)


# --- the file ---------------------------------------------------------------------------------------------------


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isinf(v) or math.isnan(v):
            return '"' + str(v) + '"'
        return repr(float(f"{v:.6g}"))
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


def _table(name: str, d: dict) -> list[str]:
    lines, sub = [f"[{name}]"], []
    for k, v in d.items():
        if v is None:
            continue
        if isinstance(v, dict):
            sub.append((k, v))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            sub.append((k, v))
        else:
            lines.append(f"{k} = {_toml_value(v)}")
    out = lines + [""]
    for k, v in sub:
        if isinstance(v, dict):
            out += _table(f"{name}.{k}", v)
        else:
            for row in v:
                out += [f"[[{name}.{k}]]"] + [f"{a} = {_toml_value(b)}" for a, b in row.items() if b is not None] + [""]
    return out


def render(result: Result, cal: Calibrated, command: str | None = None) -> str:
    """The calibration file's text: a comment header, [calibration], [measurements]."""
    created = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    f = cal.fits
    overhead_ms = cal.proposed.get("request_overhead_s", 0.0) * 1e3
    header = [
        f"# kvbench calibration of {result.model!r} at {result.url}, measured {created} in {result.seconds:.0f} s.",
        "# Use it with the engine simulator, beside the hardware and model it stands in for, e.g. the local vLLM CPU",
        "# engine:",
        "#   kvbench replay TRACE --backend engine-sim --hardware cpu --model kvbench-tiny --calibration THIS_FILE",
        "# (with that engine's scheduler limits, --max-num-seqs 128 --max-num-batched-tokens 2048 on CPU, and its KV",
        "# pool, --hbm-capacity BLOCKS; [measurements.server] has the block count where the server reports it).",
        "#",
        "# [calibration] replaces the roofline's terms (backends/enginesim/roofline.py, Calibration):",
        "#   prefill_tokens_per_s   the rate whose simulated prefill, max(N / rate, base + P × per-KV) for N new",
        "#                          tokens after P cached, is closest to the measured TTFTs: it folds in the",
        "#                          per-request overhead and the attention cost at the measured mix, which the",
        "#                          simulator lacks",
        "#   decode_step_base_s     intercept of decode step time against the batch's KV tokens (streamed ITL)",
        "#   decode_s_per_kv_token  slope of that line",
        "# Terms the simulator cannot take yet are in [measurements.proposed]: request_overhead_s (TTFT's fixed",
        f"# part less one step's: {overhead_ms:.1f} ms here), the cost per attention (query, key) pair, a",
        "# per-sequence decode cost. The raw points and every fit with its R² are in [measurements].",
    ]
    if command:
        header.append(f"# Command: {command}")
    meas = {
        "url": result.url,
        "model": result.model,
        "endpoint": result.endpoint,
        "max_model_len": result.max_model_len,
        "seconds": round(result.seconds, 1),
        "repeats": result.plan.repeats,
        "seed": result.plan.seed,
        "server": result.server or None,
        "warnings": result.warnings or None,
        "fits": f,
        "proposed": cal.proposed or None,
        "prefill": [
            {
                "cached_tokens": p.cached_tokens,
                "new_tokens": p.new_tokens,
                "ttft_s": p.ttft_s,
                "samples_s": p.samples_s,
                "server_cached_tokens": p.server_cached_tokens,
            }
            for p in result.prefill
        ],
        "decode": [
            {
                "batch": p.batch,
                "prompt_tokens": p.context_tokens,
                "kv_tokens": round(p.kv_tokens, 1),
                "step_s": p.step_s,
                "samples_s": p.samples_s,
                "window_steps": p.window_steps,
            }
            for p in result.decode
        ],
    }
    body = _table("calibration", cal.calibration()) + _table("measurements", meas)
    return "\n".join(header) + "\n\n" + "\n".join(body).rstrip() + "\n"


def write(path: str | Path, result: Result, cal: Calibrated, command: str | None = None) -> Path:
    path = Path(path)
    text = render(result, cal, command)
    import tomllib

    tomllib.loads(text)  # never write a file the simulator cannot read
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text)
    tmp.replace(path)
    return path
