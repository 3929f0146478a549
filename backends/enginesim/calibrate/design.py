"""The step-time model `kvbench calibrate` fits, written as rows of a linear design: what each measured point
consists of, counted in the units of the six terms of the engine simulator's `Calibration`
(backends/enginesim/roofline.py). A point's modeled time is its row · the terms, so the fit is linear.

One engine step costs

    step_overhead_s + s_per_seq · seqs + s_per_token · tokens + s_per_pair · pairs + s_per_kv_token · kv_read

and a request pays `request_overhead_s` once, before it reaches the scheduler. The rows, in TERMS order
(request, step, seqs, tokens, pairs, kv_read):

- prefill point (one request, max_tokens=1, N new tokens after P cached): its TTFT is the request's overhead plus
  the steps of its prefill. A server cuts a prefill longer than its step budget (max_num_batched_tokens, C) into
  chunks, one step each, every chunk attending the context that the chunks before it grew:
      [1, k, k, N, Σ_i (n_i·p_i + n_i(n_i+1)/2), Σ_i p_i]   for chunks i = 1..k of n_i tokens after p_i cached
  (p_1 = P, p_(i+1) = p_i + n_i). The last chunk's step samples the first token.
- decode point (B sequences decoding together, holding K KV tokens in all): the streamed inter-token time is one
  step that decodes one token of each:
      [0, 1, B, B, K + B, K]

So request_overhead_s appears in prefill rows only, s_per_seq and s_per_token move together in decode rows and
apart in prefill rows, step_overhead_s appears in both; `identifiability` checks that the points at hand tell all
six apart.
"""

from __future__ import annotations

import numpy as np
from kvbench.backends.enginesim.calibrate.plan import DecodePoint, PrefillPoint, Result

from kvbench.errors import KvbenchError

TERMS = ("request_overhead_s", "step_overhead_s", "s_per_seq", "s_per_token", "s_per_pair", "s_per_kv_token")
PER = {  # what each term is paid per, for tables: seconds per …
    "request_overhead_s": "request",
    "step_overhead_s": "step",
    "s_per_seq": "sequence",
    "s_per_token": "token",
    "s_per_pair": "pair",
    "s_per_kv_token": "KV token",
}
# What each term needs in the plan to be told apart from the others (for the identifiability error).
NEEDS = {
    "request_overhead_s": "prefill points at several prompt lengths (--prompt-lengths)",
    "step_overhead_s": "decode points at several batch sizes (--batch-sizes) and prompts past --max-num-batched-tokens",
    "s_per_seq": "decode points at several batch sizes (--batch-sizes)",
    "s_per_token": "prefill points at several prompt lengths (--prompt-lengths)",
    "s_per_pair": "prefill points at three or more prompt lengths (--prompt-lengths)",
    "s_per_kv_token": "decode points at two or more prompt lengths (--decode-contexts) or prefills after a cached "
    "context (--context-lengths)",
}


def step_row(seqs: float, tokens: float, pairs: float, kv_read: float) -> np.ndarray:
    """One engine step's counts in TERMS order (no request overhead: a step is not a request)."""
    return np.array([0.0, 1.0, seqs, tokens, pairs, kv_read])


def prefill_chunks(new_tokens: int, cached_tokens: int, max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """(new tokens, cached context before them) of each step a lone prefill takes: the server's scheduler gives a
    waiting prefill at most `max_num_batched_tokens` tokens a step (as engine-sim's does)."""
    chunks, done = [], 0
    while done < new_tokens:
        take = min(max_num_batched_tokens, new_tokens - done)
        chunks.append((take, cached_tokens + done))
        done += take
    return chunks


def prefill_row(new_tokens: int, cached_tokens: int, max_num_batched_tokens: int) -> np.ndarray:
    """The TTFT row of a lone request: its overhead plus the sum of its chunks' steps."""
    row = np.zeros(len(TERMS))
    row[0] = 1.0
    for n, context in prefill_chunks(new_tokens, cached_tokens, max_num_batched_tokens):
        # causal attention: new token i attends the context and the new tokens up to itself
        row += step_row(1, n, n * context + n * (n + 1) / 2, context)
    return row


def decode_row(batch: int, kv_tokens: float) -> np.ndarray:
    """The step row of `batch` sequences decoding one token each while holding `kv_tokens` KV tokens in all."""
    return step_row(batch, batch, kv_tokens + batch, kv_tokens)


class Design:
    """The fit's rows over a run's points: `x` (points × TERMS), the measured seconds `y`, and which rows are
    prefill points (the first `n_prefill`) and which decode points (the rest)."""

    def __init__(self, prefill: list[PrefillPoint], decode: list[DecodePoint], max_num_batched_tokens: int):
        self.prefill, self.decode = prefill, decode
        rows = [prefill_row(p.new_tokens, p.cached_tokens, max_num_batched_tokens) for p in prefill]
        rows += [decode_row(p.batch, p.kv_tokens) for p in decode]
        self.x = np.array(rows, dtype=np.float64).reshape(len(rows), len(TERMS))
        self.y = np.array([p.ttft_s for p in prefill] + [p.step_s for p in decode], dtype=np.float64)
        self.n_prefill = len(prefill)
        self.chunks = [len(prefill_chunks(p.new_tokens, p.cached_tokens, max_num_batched_tokens)) for p in prefill]
        # A server that never runs two sequences in one step (llama-server --parallel 1) gives every step one
        # sequence: s_per_seq is then step_overhead_s under another name, and no plan can tell them apart. It is
        # fixed at 0 (its cost stays in step_overhead_s, which is what such a server pays per step), not an error.
        seqs, steps = self.x[:, TERMS.index("s_per_seq")], self.x[:, TERMS.index("step_overhead_s")]
        self.folded = ("s_per_seq",) if len(self.y) and len(decode) and np.array_equal(seqs, steps) else ()

    @property
    def free(self) -> np.ndarray:
        """bool per term: fitted (True) or fixed at 0 (`folded`)."""
        return np.array([t not in self.folded for t in TERMS])

    @classmethod
    def of(cls, result: Result) -> Design:
        return cls(result.prefill, result.decode, result.plan.max_num_batched_tokens)

    @property
    def is_prefill(self) -> np.ndarray:
        return np.arange(len(self.y)) < self.n_prefill

    def labels(self) -> list[str]:
        """Each row's point in words, for messages."""
        out = []
        for p, k in zip(self.prefill, self.chunks, strict=True):
            what = f"prefill of {p.new_tokens} tokens" + (f" after {p.cached_tokens} cached" if p.cached_tokens else "")
            out.append(what + (f" ({k} chunks)" if k > 1 else ""))
        for p in self.decode:
            out.append(f"decode step of {p.batch} × {p.context_tokens}-token prompts ({p.kv_tokens:.0f} KV tokens)")
        return out

    def identifiability(self) -> None:
        """Raise if the points cannot tell some terms apart (the design is rank-deficient), naming the terms and
        the points that would separate them."""
        if self.n_prefill == 0 or len(self.decode) == 0:
            missing = "prefill" if self.n_prefill == 0 else "decode"
            raise KvbenchError(f"the fit needs both prefill and decode points; no {missing} point was measured")
        # relative weights and unit columns, as the fit sees them: a term is unidentified when a direction in
        # which the modeled times do not change (a near-null singular vector) moves it
        terms = [t for t in TERMS if t not in self.folded]
        scaled = self.x[:, self.free] / self.y[:, None]
        norms = np.linalg.norm(scaled, axis=0)
        unseen = [t for t, n in zip(terms, norms, strict=True) if n == 0]
        if not unseen:
            _, s, vt = np.linalg.svd(scaled / norms, full_matrices=True)
            s = np.concatenate([s, np.zeros(len(terms) - len(s))])
            null = vt[s < 1e-9 * s[0]]
            unseen = [t for j, t in enumerate(terms) if null.size and np.abs(null[:, j]).max() > 0.1]
        if unseen:
            raise KvbenchError(
                f"the measured points cannot tell apart {', '.join(unseen)} ({len(self.y)} points); measure "
                + "; ".join(dict.fromkeys(NEEDS[t] for t in unseen))
            )
