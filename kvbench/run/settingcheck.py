"""Whether the runs of a comparison were made with the same settings (docs/fidelity.md, Engine settings): a
prediction is only right when it replays the requests the live run sent (the same output cap and context fit)
with the engine's own cache settings (what the live run read from the engine: `engine_settings` in its
summary). Each difference is one warning that names both values; `kvbench compare` prints them."""

from __future__ import annotations

LIMITS = ("max_output_tokens",)


def _label(run: dict) -> str:
    return run.get("_label") or run.get("run_id") or "?"


def _points(run: dict, policy: str) -> list[dict]:
    return [p for p in run.get("points", ()) if p.get("policy") == policy]


def _limit_warnings(runs: list[dict]) -> list[str]:
    out = []
    first = runs[0]
    a = first.get("limits") or {}
    for other in runs[1:]:
        b = other.get("limits") or {}
        for key in LIMITS:
            if a.get(key) != b.get(key):
                out.append(f"{key}: {_label(first)} {a.get(key)}, {_label(other)} {b.get(key)}")
        if a.get("over") or b.get("over"):  # some prompts did not fit: both must have cut them alike
            for key in ("context_tokens", "fit_context"):
                if a.get(key) != b.get(key):
                    values = f"{_label(first)} {a.get(key)}, {_label(other)} {b.get(key)}"
                    out.append(f"{key} (prompts over the context): {values}")
    return out


def _llama_warnings(live: dict, engine: dict, pred: dict) -> list[str]:
    out = []
    options = (pred.get("config") or {}).get("policy_options") or {}
    slots = options.get("slots")
    if engine.get("unified_kv") and slots is not None:
        out.append(f"llama.cpp slots: {_label(live)} {engine.get('slots')} sharing one context, {_label(pred)} {slots} "
                   "with a context each (give no --slots for llama-server's default)")  # fmt: skip
    elif engine.get("unified_kv") is False and slots != engine.get("slots"):
        out.append(f"llama.cpp slots: {_label(live)} {engine.get('slots')}, {_label(pred)} {slots or 'the default 4'}")
    total = engine.get("total_context_tokens")
    bs = (pred.get("trace") or {}).get("block_size")
    for p in _points(pred, "llama-slot"):
        if total and bs and p.get("capacity_blocks") is not None and p["capacity_blocks"] * bs != total:
            out.append(f"llama.cpp context (tokens): {_label(live)} {total}, {_label(pred)} {p['name']} "
                       f"{p['capacity_blocks'] * bs} (--capacity {-(-total // bs)} at block size {bs})")  # fmt: skip
    return out


def _vllm_warnings(live: dict, engine: dict, pred: dict) -> list[str]:
    out = []
    bs = (pred.get("trace") or {}).get("block_size")
    if engine.get("block_size") and bs and engine["block_size"] != bs:
        out.append(f"block size (tokens): {_label(live)} {engine['block_size']}, {_label(pred)} {bs} (re-cut the "
                   f"trace with `kvbench trace rebase --block-size {engine['block_size']}`)")  # fmt: skip
    if engine.get("prefix_caching") is False:
        out.append(f"prefix caching: {_label(live)} off, {_label(pred)} predicts a prefix cache")
    blocks = engine.get("num_gpu_blocks")
    for p in _points(pred, "vllm"):
        have = p.get("capacity_blocks")
        if blocks and have is not None and have < 10**8 and have != blocks:  # 10**8: "unbounded", on purpose
            out.append(f"KV blocks: {_label(live)} {blocks}, {_label(pred)} {p['name']} {have}")
    return out


def warnings(runs: list[dict]) -> list[str]:
    """One line per setting on which the runs differ (see the module's text); [] when they agree."""
    out = _limit_warnings(runs) if len(runs) > 1 else []
    for live in runs:
        engine = live.get("engine_settings") or {}
        for pred in runs:
            if pred is live or pred.get("engine_settings"):
                continue
            if engine.get("engine") == "llama.cpp":
                out += _llama_warnings(live, engine, pred)
            elif engine.get("engine") == "vllm":
                out += _vllm_warnings(live, engine, pred)
    return out
