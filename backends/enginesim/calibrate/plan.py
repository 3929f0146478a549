"""What `kvbench calibrate` measures and what the measuring yields: the plan (prompt lengths, cached contexts,
batch sizes, repeats, the server's prefill chunk size), the default grid, the prefill and decode points and the
run's result. Plain data: the endpoint talk is in `endpoint`/`measurement`, the step model's rows in `design`, the
fit in `fitting`, the file in `calibfile`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from kvbench.errors import KvbenchError
from kvbench.trace.tokens import DEFAULT_VOCAB

# Log-spaced lengths: the fit weighs every point's relative error alike, so the grid says which sizes the terms
# must serve; doublings from 32 to 8192 tokens cover short chat turns to long documents, and the prompts past the
# chunk size (2048 on vLLM's CPU engine) are prefilled in several steps, which tells the per-step cost apart from
# the per-request one and shows the attention term's growth.
DEFAULT_PROMPT_LENGTHS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DEFAULT_CONTEXT_LENGTHS = (512, 1024, 2048)  # cached prefix tokens for the prefill-after-context points
DEFAULT_CONTEXT_NEW = (64, 256, 1024)  # new tokens after each cached context
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)
DEFAULT_DECODE_CONTEXTS = (128, 1024)  # two lengths, so that a batch's KV and its size vary apart
DEFAULT_DECODE_TOKENS = 64
DEFAULT_MAX_PROMPT = 8192
DEFAULT_REPEATS = 3
# vLLM's default token budget of one step on CPU (--max-num-batched-tokens): a longer prefill runs as chunks of
# this many tokens, one step each
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# the join window's pairs (joining.py): offsets in seconds, from sent together to well past the few ms a server
# takes from taking a request to building its batch; prompts long enough that a second prefill is far slower
DEFAULT_JOIN_OFFSETS = (0.0, 0.002, 0.005, 0.01, 0.02, 0.04)
DEFAULT_JOIN_TOKENS = 512

Progress = Callable[[str, int], None]  # (what is being measured, requests just finished)


@dataclass
class Plan:
    """What to measure. Lengths in tokens; every point is measured `repeats` times, the points of each repeat in
    an order shuffled by `seed`, and the median is fitted. `max_num_batched_tokens` is the server's step budget:
    not measured (no server reports it), it says how the server cuts long prefills into steps."""

    prompt_lengths: tuple[int, ...] = DEFAULT_PROMPT_LENGTHS
    context_lengths: tuple[int, ...] = DEFAULT_CONTEXT_LENGTHS
    context_new_tokens: tuple[int, ...] = DEFAULT_CONTEXT_NEW
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    decode_contexts: tuple[int, ...] = DEFAULT_DECODE_CONTEXTS
    decode_tokens: int = DEFAULT_DECODE_TOKENS
    repeats: int = DEFAULT_REPEATS
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT
    vocab: int = DEFAULT_VOCAB
    # None: the server's own (llama-server's n_batch, vLLM's CPU default), resolved before measuring (servers.py)
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS
    seed: int | None = None  # None: a fresh seed each run (recorded), so no run repeats an earlier one's prompts
    join_offsets_s: tuple[float, ...] = DEFAULT_JOIN_OFFSETS  # () measures no join window (it is then 0)
    join_tokens: int = DEFAULT_JOIN_TOKENS

    def __post_init__(self):
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise KvbenchError(f"--max-num-batched-tokens must be ≥ 1, got {self.max_num_batched_tokens}")

    def bounded(self, max_model_len: int | None, max_batch: int | None = None) -> Plan:
        """The plan with every prompt (and its output) inside `max_prompt_tokens` and the server's context, and
        every decode batch at most `max_batch` sequences (llama-server's slots: a larger batch would queue and
        never decode as one; None: no bound)."""
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
        batches = self.batch_sizes
        if max_batch:
            batches = tuple(b for b in batches if b <= max_batch) or (max_batch,)
        return dataclasses.replace(
            self,
            join_offsets_s=self.join_offsets_s if max_batch != 1 else (),  # one slot never batches two prompts
            join_tokens=min(self.join_tokens, cap),
            batch_sizes=batches,
            prompt_lengths=lengths,
            context_lengths=contexts,
            context_new_tokens=news,
            decode_contexts=decode,
            max_prompt_tokens=cap,
        )

    def context_points(self) -> list[tuple[int, int]]:
        """(cached context, new tokens) of the prefill-after-context points that fit in the prompt cap."""
        return [
            (p, n) for p in self.context_lengths for n in self.context_new_tokens if p + n <= self.max_prompt_tokens
        ]

    @property
    def prefill_requests(self) -> int:
        return self.repeats * (len(self.prompt_lengths) + 2 * len(self.context_points()))

    @property
    def decode_requests(self) -> int:
        return self.repeats * sum(self.batch_sizes) * len(self.decode_contexts)

    @property
    def join_requests(self) -> int:
        return self.repeats * 2 * len(self.join_offsets_s)

    def record(self) -> dict:
        """The plan as the file records it."""
        return {
            "prompt_lengths": list(self.prompt_lengths),
            "context_lengths": list(self.context_lengths),
            "context_new_tokens": list(self.context_new_tokens),
            "batch_sizes": list(self.batch_sizes),
            "decode_contexts": list(self.decode_contexts),
            "decode_tokens": self.decode_tokens,
            "repeats": self.repeats,
            "max_prompt_tokens": self.max_prompt_tokens,
            "vocab": self.vocab,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "seed": self.seed,
            "join_offsets_s": list(self.join_offsets_s),
            "join_tokens": self.join_tokens,
            "order": "each repeat runs every point once, in an order shuffled by the seed",
        }


@dataclass
class PrefillPoint:
    """Median TTFT (s) of single requests of `new_tokens` uncached tokens after `cached_tokens` cached ones,
    max_tokens=1: the request's overhead plus its prefill step(s)."""

    cached_tokens: int
    new_tokens: int
    ttft_s: float
    samples_s: list[float]
    server_cached_tokens: int | None = None  # what the server reported as cached (None: it does not say)


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
    join: list = field(default_factory=list)  # joining.JoinPoint: pairs sent a set offset apart
    server: dict = field(default_factory=dict)  # what the server says of itself (vLLM: block size, KV blocks)
    warnings: list[str] = field(default_factory=list)  # points left out, and why
    seconds: float = 0.0
