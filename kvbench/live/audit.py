"""`kvbench audit isolation`: does a server keep tenants with different `cache_salt` apart?

Paired probes on fresh random prompts (so earlier traffic cannot interfere), each sent twice in a row:
- control: the same prompt, no salt -> the second must hit (else prefix caching is off or not reported, and
  nothing can be concluded);
- same salt: the same prompt with salt A twice -> the second must hit (a salt must not disable caching);
- other salt: that prompt again with salt B -> must miss (salts isolate);
- no salt: that prompt again without a salt -> must miss (a salted prefix is not shared with unsalted users).
A hit is read from `usage.prompt_tokens_details.cached_tokens` (or llama.cpp's `timings.cache_n`) and, when
the server has one, from the `/metrics` counter delta of the probe.

llama.cpp's server (recognised by the `timings` in its answers) has no cache_salt: its slots and host prompt
cache match any request's tokens (docs/llama-cpp.md), so the verdict then says what isolates tenants there.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import asdict, dataclass

import numpy as np

from kvbench.errors import KvbenchError
from kvbench.live.endpoint import base_url
from kvbench.redact import redact_text, redact_url

PROBE_TOKENS = 512  # long enough to fill several blocks at any common block size (16 … 256)


@dataclass
class Probe:
    name: str
    salt: str | None
    expect_hit: bool
    cached_tokens: int | None = None
    counter_cached: float | None = None  # /metrics delta of cached prompt tokens during this probe

    @property
    def hit(self) -> bool | None:
        if self.cached_tokens is not None:
            return self.cached_tokens > 0
        return None if self.counter_cached is None else self.counter_cached > 0

    @property
    def passed(self) -> bool | None:
        return None if self.hit is None else self.hit == self.expect_hit


async def _complete(session, url: str, model: str, prompt: list[int], salt: str | None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise KvbenchError(f"{url}/v1/completions answered HTTP {resp.status}: {(await resp.text())[:200]}")
        return await resp.json()


def _cached(answer: dict) -> int | None:
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"])
    timings = answer.get("timings") or {}
    return int(timings["cache_n"]) if timings.get("cache_n") is not None else None


async def _audit(url: str, model: str | None, vocab: int) -> dict:
    import aiohttp

    from kvbench.live.servercounters import scrape

    rng = np.random.default_rng(secrets.randbits(64))

    def fresh() -> list[int]:
        return rng.integers(16, vocab, PROBE_TOKENS).tolist()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        if model is None:
            async with session.get(url + "/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
        salt_a, salt_b = f"kvbench-audit-{secrets.token_hex(4)}", f"kvbench-audit-{secrets.token_hex(4)}"
        control, shared = fresh(), fresh()
        plan = [
            (control, Probe("control: same prompt, no salt", None, True)),
            (shared, Probe("same salt", salt_a, True)),
            (shared, Probe("other salt", salt_b, False)),
            (shared, Probe("no salt after salted", None, False)),
        ]
        probes, llama_cpp = [], False
        for i, (prompt, probe) in enumerate(plan):
            if i < 2:  # the first send of a pair only fills the cache
                await _complete(session, url, model, prompt, probe.salt)
            before = await scrape(session, url)
            answer = await _complete(session, url, model, prompt, probe.salt)
            after = await scrape(session, url)
            probe.cached_tokens = _cached(answer)
            llama_cpp = llama_cpp or "timings" in answer  # llama-server's own field: no other server sends it
            if before and after and "cached_tokens" in after:
                probe.counter_cached = after["cached_tokens"] - before.get("cached_tokens", 0.0)
            probes.append(probe)
    return {"url": url, "model": model, "probes": probes, "engine": "llama.cpp" if llama_cpp else None}


# What to do instead on llama.cpp, whose cache has no notion of a tenant: the host prompt cache (--cache-ram)
# restores any cached prompt into any slot, so a slot per tenant isolates only with it turned off.
LLAMA_CPP_ADVICE = (
    "; llama.cpp has no cache_salt (a slot or its host prompt cache serves any request with the same tokens): "
    "run one llama-server per tenant, or pin each tenant to its own slot (request field id_slot) with "
    "--cache-ram 0 so that no cached prompt moves between slots"
)


def verdict(probes: list[Probe], engine: str | None = None) -> tuple[str, bool | None]:
    control, same, other, unsalted = probes
    if not control.hit:
        return "inconclusive: the control prompt did not hit (prefix caching off, or hits not reported)", None
    if not same.hit:
        return "salted requests never hit: a salt disables caching instead of isolating it", False
    if other.hit or unsalted.hit:
        text = "salts are ignored: requests with different cache_salt share cached prefixes"
        return text + (LLAMA_CPP_ADVICE if engine == "llama.cpp" else ""), False
    return "salts isolate: same salt hits, other salt and no salt miss", True


def audit_isolation(url: str, model: str | None = None, vocab: int = 4096) -> dict:
    import aiohttp

    try:
        result = asyncio.run(_audit(base_url(url), model, vocab))
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise KvbenchError(
            redact_text(f"cannot probe {url}: {type(exc).__name__}: {exc}; is the server up? (kvbench engine status)")
        ) from None
    text, ok = verdict(result["probes"], result["engine"])
    return {
        "url": redact_url(result["url"]),
        "model": result["model"],
        "engine": result["engine"],
        "verdict": text,
        "passed": ok,
        "probes": [{**asdict(p), "hit": p.hit, "passed": p.passed} for p in result["probes"]],
    }
