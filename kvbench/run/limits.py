"""What a replay asks of each request, the same for every backend (docs/semantics.md, Prompts longer than the
context): outputs capped at `--max-output-tokens`, and prompts checked against the engine's context before
anything is sent (`kvbench.trace.context`). Both change the trace every backend is fed, so a live run and a
prediction given the same options replay the same requests: a slot that keeps the tokens it generated, a pool
that caches them, and a prompt cut to fit are predicted as they are served."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pyarrow as pa

from kvbench.errors import KvbenchError
from kvbench.trace.context import FIT_MODES, fit_to_context
from kvbench.trace.schema import cap_outputs

MAX_OUTPUT_HELP = (  # in tokens: replay's option states it
    "cap each request's output tokens at N (its max_tokens), for every backend alike: a prediction given the same "
    "cap as the live run it is compared with sees the outputs that run asked for (a llama.cpp slot keeps the "
    "tokens it generated) [default: the trace's output_tokens]"
)
CONTEXT_HELP = (  # in tokens: replay's option states it
    "the engine's context: a request fits when its prompt plus its output tokens are within it [default: live: "
    "what the engine publishes (vLLM's max_model_len on /v1/models, llama.cpp's per-slot n_ctx on /slots); "
    "offline: no limit]"
)
FIT_HELP = (
    "what to do, before anything is sent, with requests that do not fit the context: refuse (exit 2, naming how "
    "many, the longest prompt and the context), truncate (keep each prompt's leading whole blocks, as many as fit "
    "beside its output), skip (leave those requests out); a prediction given the same option cuts the same"
)


@dataclass(frozen=True)
class RequestLimits:
    max_output_tokens: int | None = None  # tokens
    context: int | None = None  # tokens: prompt + output; None: the engine's, where a live backend reads it
    fit_context: str = "refuse"  # FIT_MODES

    def __post_init__(self):
        if self.fit_context not in FIT_MODES:
            raise KvbenchError(f"--fit-context must be one of {', '.join(FIT_MODES)}, not {self.fit_context!r}")
        for name in ("max_output_tokens", "context"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise KvbenchError(f"--{name.replace('_', '-')} must be at least 1, got {value}")

    def changes_trace(self) -> bool:
        """Whether these limits can change the trace (then it is read whole, without the trace cache)."""
        return self.max_output_tokens is not None or self.context is not None


def apply(
    table: pa.Table, block_size: int, limits: RequestLimits, engine: dict | None, source: str
) -> tuple[pa.Table, dict]:
    """`table` as the backend is to be fed it, and the record for summary.json (`limits`). `engine`: what the
    live backend read from the server (`context_tokens` among it), None offline."""
    if limits.max_output_tokens is not None:
        table = cap_outputs(table, limits.max_output_tokens)
    record = {k: v for k, v in asdict(limits).items() if k != "context"}
    context, where = limits.context, "--context"
    if context is None and engine and engine.get("context_tokens"):
        context, where = int(engine["context_tokens"]), f"published by {engine.get('engine', 'the server')}"
    if context is None:
        return table, {**record, "context_tokens": None}
    table, fitted = fit_to_context(table, context, block_size, limits.fit_context, source, where)
    return table, {**record, **fitted}
