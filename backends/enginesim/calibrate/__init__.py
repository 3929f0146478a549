"""`kvbench calibrate`: measure a live OpenAI-compatible endpoint's prefill and decode timing, fit the six terms of
the engine simulator's step-time model (`backends/enginesim/roofline.py`, `Calibration`) and write them to a TOML
file that `kvbench replay … --backend engine-sim --calibration FILE` reads.

What is measured (every prompt is token ids drawn at random below the vocabulary, a new draw for every request, so
nothing is served from the prefix cache unless a point asks for it); every point `repeats` times, each repeat's
points in a seeded random order, the medians fitted:

- prefill: the TTFT of single requests (max_tokens=1, nothing else in flight) at several prompt lengths, and of
  prompts whose first tokens were cached by the request just before (a cached context, as in chat turns and agent
  calls). TTFT = the request's overhead + the prefill's steps: a prompt longer than the server's step budget
  (--max-num-batched-tokens) is prefilled in chunks, one step each;
- decode: B concurrent requests (ignore_eos, a fixed number of output tokens) of several prompt lengths; once all
  B have their first token and until the first one ends, every engine step decodes one token of each, so the
  streamed inter-token time is the step time of a batch of B holding the batch's KV tokens;
- join (`joining`): pairs of fresh prompts, the second sent a set offset after the first to the idle server;
  whether their first tokens come together says whether the server prefilled them in one step, and the offset
  at which most pairs stop joining is the join window (`join_window_s`, measured, not fitted).

The fit (`design`, `fitting`): one non-negative least squares of the relative error over all points for
request_overhead_s, step_overhead_s, s_per_seq, s_per_token, s_per_pair and s_per_kv_token, each point's row the
sum of the features of the steps it consists of. A poor fit (R² of the prefill or decode points below --min-r2, or
their median relative error above --max-median-error) is an error unless --force.

The file holds the [calibration] table (exactly Calibration's fields: six terms and the join window) and a
[measurements] table: the endpoint as host:port only (never a key or a path), the model, the server's facts, the
plan, the fit's R² values, each term's share and standard error, and every point measured and modeled.
"""

# The package's surface: what `command` (the `kvbench calibrate` command) and the tests use as `calibrate.NAME`.
# The modules, in the order a run goes through them: plan (what to measure, the points), kvbench.live.endpoint
# (requests, server facts),
# measurement (the TTFT and decode runs), design (the step model's rows), fitting (the fit and its verdict),
# calibfile (the TOML).
from kvbench.backends.enginesim.calibrate.calibfile import render, write
from kvbench.backends.enginesim.calibrate.design import (
    PER,
    TERMS,
    Design,
    decode_row,
    prefill_chunks,
    prefill_row,
    step_row,
)
from kvbench.backends.enginesim.calibrate.fitting import (
    DEFAULT_MAX_MEDIAN_ERROR,
    DEFAULT_MIN_R2,
    Calibrated,
    fit,
    fit_terms,
    judge,
    problems,
    r_squared,
    relative_nnls,
    standard_errors,
)
from kvbench.backends.enginesim.calibrate.joining import JoinPoint, join_window
from kvbench.backends.enginesim.calibrate.measurement import (
    DECODE_ATTEMPTS,
    MIN_WINDOW_STEPS,
    WARMUP_REQUESTS,
    decode_step,
    measure,
    measure_async,
)
from kvbench.backends.enginesim.calibrate.plan import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_CONTEXT_LENGTHS,
    DEFAULT_CONTEXT_NEW,
    DEFAULT_DECODE_CONTEXTS,
    DEFAULT_DECODE_TOKENS,
    DEFAULT_JOIN_OFFSETS,
    DEFAULT_JOIN_TOKENS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_PROMPT,
    DEFAULT_PROMPT_LENGTHS,
    DEFAULT_REPEATS,
    DEFAULT_VOCAB,
    DecodePoint,
    Plan,
    PrefillPoint,
    Progress,
    Result,
)

from kvbench.live.endpoint import RESERVED_TOKENS, Meter, host_port, shown

__all__ = [
    "DECODE_ATTEMPTS",
    "DEFAULT_BATCH_SIZES",
    "DEFAULT_CONTEXT_LENGTHS",
    "DEFAULT_CONTEXT_NEW",
    "DEFAULT_DECODE_CONTEXTS",
    "DEFAULT_DECODE_TOKENS",
    "DEFAULT_JOIN_OFFSETS",
    "DEFAULT_JOIN_TOKENS",
    "DEFAULT_MAX_MEDIAN_ERROR",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_PROMPT",
    "DEFAULT_MIN_R2",
    "DEFAULT_PROMPT_LENGTHS",
    "DEFAULT_REPEATS",
    "DEFAULT_VOCAB",
    "MIN_WINDOW_STEPS",
    "PER",
    "RESERVED_TOKENS",
    "TERMS",
    "WARMUP_REQUESTS",
    "Calibrated",
    "DecodePoint",
    "Design",
    "JoinPoint",
    "Meter",
    "Plan",
    "PrefillPoint",
    "Progress",
    "Result",
    "decode_row",
    "decode_step",
    "fit",
    "fit_terms",
    "host_port",
    "join_window",
    "judge",
    "measure",
    "measure_async",
    "prefill_chunks",
    "prefill_row",
    "problems",
    "r_squared",
    "relative_nnls",
    "render",
    "shown",
    "standard_errors",
    "step_row",
    "write",
]
