"""What `kvbench calibrate` measures and what the measuring yields: the plan (prompt lengths, cached contexts,
batch sizes, repeats), the default grid, the prefill and decode points and the run's result. Plain data: the
endpoint talk is in `endpoint`/`measurement`, the fits in `fitting`, the file in `calibfile`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import KvbenchError

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
class Result:
    """One run's measurements of one endpoint, ready for `fitting.fit` and `calibfile.write`."""

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
