"""What `kvbench calibrate` must know of the server it measures, beyond the OpenAI routes: how long a request may be,
how many sequences decode together at most, and how the server cuts a long prefill into steps. vLLM publishes the
first (`max_model_len`) and its KV blocks (`/metrics`); its step budget is `--max-num-batched-tokens` (2048 on CPU,
not published). llama.cpp's llama-server publishes none of them on the OpenAI routes; they come from its own
`/props` and `/slots` (kvbench.live.engine_settings) and, for the engine `kvbench engine up llama-cpp` started,
from the arguments it recorded:

- context: a request must fit its slot's `n_ctx` (llama-server refuses a prompt of n_ctx tokens or more);
- slots (`--parallel N`, default 4 sharing one context): at most that many sequences decode together, so larger
  decode batches would queue and never run as one (they are dropped from the plan, with a warning);
- step budget: each server iteration puts every generating slot's sampled token in one batch, then fills it with
  prompt tokens up to `n_batch` (`-b/--batch-size`, default 2048) and runs it as one `llama_decode`; a longer prompt
  takes several iterations, exactly what the fit's chunked prefill rows say with chunk = n_batch. Inside one
  decode the batch is evaluated in micro-batches of `n_ubatch` (`-ub/--ubatch-size`, default 512) tokens: their
  cost is per token and per attention pair like the rest of the step, so the step model needs no term for them
  (recorded, so that a reader knows which chunking the terms assume).

Every read is optional; what is not known stays out of the facts and the defaults above apply.
"""

from __future__ import annotations

import shlex

LLAMA_N_BATCH = 2048  # llama-server -b/--batch-size default (common/common.h, n_batch)
LLAMA_N_UBATCH = 512  # llama-server -ub/--ubatch-size default (n_ubatch)
VLLM_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's CPU default step budget (its GPU default is 8192)


def _flag(args: list[str], names: tuple[str, ...]) -> str | None:
    """The value of the last of `names` in `args` (`--flag V` or `--flag=V`), as llama-server's parser takes the
    last one given."""
    found = None
    for k, a in enumerate(args):
        for n in names:
            if a == n and k + 1 < len(args):
                found = args[k + 1]
            elif a.startswith(n + "="):
                found = a.split("=", 1)[1]
    return found


def llama_batching(engine_args: str | None, total_context: int | None) -> dict:
    """n_batch and n_ubatch of a llama-server started with `engine_args` (None: not known, the defaults), as
    llama_context clamps them: a causal model's n_batch is at most the context, n_ubatch at most n_batch."""
    args = shlex.split(engine_args or "")
    n_batch = int(_flag(args, ("-b", "--batch-size")) or LLAMA_N_BATCH)
    n_ubatch = int(_flag(args, ("-ub", "--ubatch-size")) or LLAMA_N_UBATCH)
    if total_context:
        n_batch = min(n_batch, int(total_context))
    return {
        "n_batch": n_batch,
        "n_ubatch": min(n_ubatch, n_batch),
        "batching_from": "engine arguments" if engine_args is not None else "llama-server defaults",
    }


def _kvbench_engine(base: str):
    """The llama-cpp engine `kvbench engine up` runs at `base`, or None (another server)."""
    from kvbench import engines

    try:
        info = engines.running("llama-cpp")
    except Exception:  # noqa: BLE001 - a foreign server: its arguments are simply unknown
        return None
    if info is None or info.url.rstrip("/") != base.rstrip("/"):
        return None
    return info


async def llama_facts(session, base: str) -> dict | None:
    """llama-server's facts for calibration and fidelity (the module's text), or None when `base` is no
    llama-server: engine, slots, context_tokens (per slot), total_context_tokens, unified_kv, n_batch, n_ubatch,
    and for kvbench's own engine its CPU pinning (`cpus`, None: not pinned)."""
    from kvbench.live.engine_settings import from_llama

    props = await _get_json(session, base + "/props")
    if not isinstance(props, dict) or "total_slots" not in props:
        return None
    info = _kvbench_engine(base)
    engine_args = None if info is None else str(info.settings.get("engine_args") or "")
    facts = from_llama(props, await _get_json(session, base + "/slots"), engine_args)
    facts.update(llama_batching(engine_args, facts.get("total_context_tokens")))
    if info is not None:
        facts["cpus"] = info.settings.get("cpus")
    return facts


async def _get_json(session, url: str):
    try:
        async with session.get(url) as resp:
            if resp.status != 200:
                return None
            return await resp.json(content_type=None)
    except Exception:  # noqa: BLE001 - optional facts
        return None


def step_budget(given: int | None, facts: dict) -> int:
    """The prefill chunk the fit assumes: the one given, else llama-server's n_batch, else vLLM's CPU default."""
    if given:
        return int(given)
    if facts.get("engine") == "llama.cpp":
        return int(facts.get("n_batch") or LLAMA_N_BATCH)
    return VLLM_MAX_NUM_BATCHED_TOKENS


def max_decode_batch(facts: dict) -> int | None:
    """Sequences the server decodes together at most (llama.cpp: its slots); None: not known (vLLM: hundreds)."""
    if facts.get("engine") == "llama.cpp" and facts.get("slots"):
        return int(facts["slots"])
    return None


def request_context(max_model_len: int | None, facts: dict) -> int | None:
    """The longest request, prompt plus output, the server takes: vLLM's max_model_len; llama-server's slot
    context less one (it refuses a prompt of n_ctx tokens and stops generating one short of it)."""
    if max_model_len:
        return max_model_len
    if facts.get("engine") == "llama.cpp" and facts.get("context_tokens"):
        return int(facts["context_tokens"]) - 1
    return None
