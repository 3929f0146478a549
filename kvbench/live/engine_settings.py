"""What a serving engine publishes about its KV cache and context, read before a run (docs/fidelity.md,
Engine settings): a prediction is only right when it is given the engine's settings, and a live run records them so
that `kvbench compare` can say when a prediction was made with others.

- vLLM: `vllm:cache_config_info` on /metrics (block_size, num_gpu_blocks, enable_prefix_caching) and
  `max_model_len` on /v1/models;
- llama.cpp's llama-server: `total_slots` and `n_ctx` on /props, each slot's `n_ctx` on /slots. It does not
  publish `--cache-reuse` or `--cache-ram`, nor whether its slots share one context (the default, `--parallel`
  unset) or split it (`--parallel N`): both show N slots of one `n_ctx`. For an engine `kvbench engine up`
  started, its recorded arguments say; for another, they stay unknown (None).

Every read is optional: what a server does not answer is left out, never guessed."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp

TIMEOUT_S = 10.0


async def _get(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url) as resp:
            return await resp.text(errors="replace") if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


def _json(text: str | None):
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def vllm_cache_config(metrics: str | None) -> dict:
    """The labels of vLLM's cache_config_info gauge, as numbers and booleans where they are; {} if absent."""
    m = re.search(r"^vllm:cache_config_info\{([^}]*)\}", metrics or "", re.M)
    if not m:
        return {}
    out: dict = {}
    for key, value in re.findall(r'(\w+)="([^"]*)"', m.group(1)):
        out[key] = int(value) if value.isdigit() else {"True": True, "False": False}.get(value, value)
    return out


def from_vllm(models, metrics: str | None) -> dict:
    cache = vllm_cache_config(metrics)
    card = (models or {}).get("data", [{}])[0] if isinstance(models, dict) else {}
    out = {"engine": "vllm"}
    if isinstance(card.get("max_model_len"), int):
        out["context_tokens"] = card["max_model_len"]
    for key, name in (("block_size", "block_size"), ("num_gpu_blocks", "num_gpu_blocks")):
        if isinstance(cache.get(key), int):
            out[name] = cache[key]
    if isinstance(cache.get("enable_prefix_caching"), bool):
        out["prefix_caching"] = cache["enable_prefix_caching"]
    return out


def from_llama(props: dict, slots, engine_args: str | None = None) -> dict:
    """llama-server's settings from /props and /slots, and, for one `kvbench engine up` started, the
    arguments it was started with (`engine_args`), which alone say how the context is shared and cache reuse."""
    out: dict = {"engine": "llama.cpp", "unified_kv": None, "cache_reuse": None}  # not published
    if isinstance(props.get("total_slots"), int):
        out["slots"] = props["total_slots"]
    per_slot = [s.get("n_ctx") for s in slots] if isinstance(slots, list) else []
    if per_slot and all(isinstance(c, int) for c in per_slot):
        out["context_tokens"] = min(per_slot)  # what one request may use: its slot's context
    elif isinstance((props.get("default_generation_settings") or {}).get("n_ctx"), int):
        out["context_tokens"] = props["default_generation_settings"]["n_ctx"]
    if engine_args is not None:
        args = engine_args.split()
        parallel = _arg(args, ("--parallel", "-np"))
        out["unified_kv"] = parallel is None or int(parallel) < 0  # llama-server's default: -1, unified
        out["cache_reuse"] = int(_arg(args, ("--cache-reuse",)) or 0)
    if out.get("context_tokens") and out.get("slots"):
        # unified: the slots share the context each sees; split: each has its own
        out["total_context_tokens"] = out["context_tokens"] * (1 if out["unified_kv"] in (True, None) else out["slots"])
    return out


def _arg(args: list[str], names: tuple[str, ...]) -> str | None:
    for k, a in enumerate(args):
        if a in names and k + 1 < len(args):
            return args[k + 1]
        for n in names:
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def _engine_args(base: str) -> str | None:
    """The arguments of the llama-cpp engine `kvbench engine up` runs at `base`, if that is one."""
    from kvbench import engines

    info = engines.running("llama-cpp")
    if info is None or info.url.rstrip("/") != base.rstrip("/"):
        return None
    return str(info.settings.get("engine_args") or "")


async def read(session: aiohttp.ClientSession, base: str) -> dict:
    """The engine's settings as far as it publishes them (see the module's text); {"engine": "unknown"} for a
    server that publishes none of them."""
    props = _json(await _get(session, base + "/props"))
    if isinstance(props, dict) and "total_slots" in props:
        return from_llama(props, _json(await _get(session, base + "/slots")), _engine_args(base))
    models, metrics = _json(await _get(session, base + "/v1/models")), await _get(session, base + "/metrics")
    if vllm_cache_config(metrics) or (isinstance(models, dict) and "max_model_len" in str(models)):
        return from_vllm(models, metrics)
    return {"engine": "unknown"}


def read_url(base: str, headers: dict | None = None, timeout_s: float = TIMEOUT_S) -> dict:
    """`read` in its own event loop, for a caller outside one (the offline backends' --like)."""

    async def main():
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(headers=headers or {}, timeout=timeout) as session:
            return await read(session, base.rstrip("/"))

    return asyncio.run(main())


def describe(settings: dict) -> str:
    """One line of what was read, for the terminal."""
    shown = ", ".join(f"{k} {v}" for k, v in settings.items() if k != "engine" and v is not None)
    return f"{settings.get('engine', 'unknown')}: {shown or 'publishes no cache or context settings'}"
