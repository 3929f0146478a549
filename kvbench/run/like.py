"""`replay --like URL` (sim, and engine-sim for vLLM): a prediction set up as the engine at URL is
(docs/fidelity.md, Engine settings), from what
it publishes (`kvbench.live.engine_settings`) instead of settings repeated by hand:

- llama.cpp: the `llama-slot` policy, its slots (none given: llama-server's default of slots sharing one
  context, which is what /slots shows when every slot has the whole context), the capacity as the context in
  blocks, and the prompts token by token as `--backend openai` sends them (`--vocab`, its default): llama.cpp
  reuses a prefix token by token, so hits in whole blocks would miss a partial last block. Whether the slots
  share one context and `--cache-reuse` are not published: for an engine `kvbench engine up` started they are
  read from its recorded arguments; for another, llama-server's defaults (shared, no reuse) are assumed unless
  `--slots` and `--cache-reuse` are given;
- vLLM: the `vllm` policy with the engine's KV blocks (`num_gpu_blocks`) as the capacity (engine-sim: its HBM
  pool, `--hbm-capacity`); a trace cut at another
  block size than the engine's is refused, with the command that re-cuts it.

Both give the replay the engine's context, so prompts are checked against it as a live run checks them. An
option the user gave wins over what was read."""

from __future__ import annotations

from kvbench.errors import KvbenchError
from kvbench.trace.tokens import DEFAULT_VOCAB


def options_like(settings: dict, block_size: int, given: dict, backend: str = "sim") -> dict:
    """The options of `backend` (sim, or engine-sim for vLLM) for an engine with these `settings`, under those
    `given` on the command line."""
    engine = settings.get("engine")
    out: dict = {}
    if engine == "llama.cpp" and backend != "sim":
        raise KvbenchError("engine-sim models vLLM's scheduler; predict llama.cpp with --backend sim --like URL")
    if engine == "llama.cpp":
        out["policy"] = "llama-slot"
        total = settings.get("total_context_tokens") or settings.get("context_tokens")
        if total:
            out["capacity"] = str(-(-int(total) // block_size))
        out["vocab"] = DEFAULT_VOCAB
        if settings.get("unified_kv") is False and settings.get("slots"):
            out["slots"] = int(settings["slots"])
        if settings.get("cache_reuse"):
            out["cache_reuse"] = int(settings["cache_reuse"])
    elif engine == "vllm":
        if settings.get("prefix_caching") is False:
            raise KvbenchError(
                "the engine runs with prefix caching off: every request is a miss, there is nothing to predict"
            )
        engine_bs = settings.get("block_size")
        if engine_bs and engine_bs != block_size:
            raise KvbenchError(
                f"the engine caches {engine_bs}-token blocks, the trace is cut at {block_size}: re-cut it with "
                f"`kvbench trace rebase TRACE --block-size {engine_bs} -o OUT` and replay OUT with --like"
            )
        out["policy"] = "vllm"
        if settings.get("num_gpu_blocks"):
            out["capacity" if backend == "sim" else "hbm_capacity"] = str(int(settings["num_gpu_blocks"]))
    else:
        raise KvbenchError(
            "the server publishes no cache settings kvbench can read (vLLM's /metrics cache_config_info, "
            "llama-server's /props and /slots): give --policy and --capacity by hand"
        )
    return {k: v for k, v in out.items() if given.get(k) is None}
