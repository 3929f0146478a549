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

# The package's surface: what `kvbench.cli.calibrate` and the tests use as `kvbench.calibrate.NAME`. The modules,
# in the order a run goes through them: plan (what to measure, the points), endpoint (requests, server facts),
# measurement (the TTFT and decode runs), fitting (least squares, the Calibration values), calibfile (the TOML).
from .calibfile import render, write
from .endpoint import RESERVED_TOKENS, Meter, host_port, shown
from .fitting import (
    Calibrated,
    Fit,
    fit,
    fit_decode,
    fit_prefill_line,
    fit_prefill_physical,
    fit_prefill_rate,
    least_squares,
    modeled_prefill_s,
    r_squared,
)
from .measurement import (
    DECODE_ATTEMPTS,
    MIN_WINDOW_STEPS,
    WARMUP_REQUESTS,
    measure,
    measure_async,
)
from .measurement import (
    _decode_step as _decode_step,  # private, but tests/unit/test_calibrate.py tests it directly
)
from .plan import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_CONTEXT_LENGTHS,
    DEFAULT_CONTEXT_NEW,
    DEFAULT_DECODE_CONTEXTS,
    DEFAULT_DECODE_TOKENS,
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

__all__ = [
    "DECODE_ATTEMPTS",
    "DEFAULT_BATCH_SIZES",
    "DEFAULT_CONTEXT_LENGTHS",
    "DEFAULT_CONTEXT_NEW",
    "DEFAULT_DECODE_CONTEXTS",
    "DEFAULT_DECODE_TOKENS",
    "DEFAULT_MAX_PROMPT",
    "DEFAULT_PROMPT_LENGTHS",
    "DEFAULT_REPEATS",
    "DEFAULT_VOCAB",
    "MIN_WINDOW_STEPS",
    "RESERVED_TOKENS",
    "WARMUP_REQUESTS",
    "Calibrated",
    "DecodePoint",
    "Fit",
    "Meter",
    "Plan",
    "PrefillPoint",
    "Progress",
    "Result",
    "fit",
    "fit_decode",
    "fit_prefill_line",
    "fit_prefill_physical",
    "fit_prefill_rate",
    "host_port",
    "least_squares",
    "measure",
    "measure_async",
    "modeled_prefill_s",
    "r_squared",
    "render",
    "shown",
    "write",
]
