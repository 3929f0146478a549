"""Multi-turn reasoning conversations: long decodes whose reasoning is stripped before the next turn."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbench.trace.blockhash import content_ids, name_key
from kvbench.trace.generators import BadParameter, generator, param
from kvbench.trace.generators._common import (
    Conversations,
    Segments,
    build_table,
    geometric_counts,
    lognormal_ints,
    rng_for,
    string_ids,
    zipf_indices,
)
from kvbench.trace.generators._stream import SequentialDraws, stream_conversations

# Output cap, a little above the largest completion budgets of reasoning APIs (OpenAI o-series: 100,000
# output tokens; deepseek-reasoner: max_tokens up to 64K, reasoning included).
MAX_OUTPUT_TOKENS = 128_000


@dataclass(frozen=True)
class ReasoningParams:
    session_rate: float = param(
        0.02, "new conversations per second (Poisson); low: each turn decodes for minutes", unit="sessions/s", above=0
    )
    turns_mean: float = param(3.0, "mean turns per conversation (geometric)", unit="turns")
    max_turns: int = param(16, "cap on turns per conversation", unit="turns", at_least=1)
    system_prompts: int = param(8, "distinct system prompts shared across conversations", unit="count", at_least=1)
    system_zipf: float = param(1.0, "Zipf exponent of system-prompt popularity", unit="unitless")
    system_tokens_mean: float = param(800.0, "mean system prompt length (tokens)", unit="tokens")
    user_tokens_mean: float = param(
        600.0, "mean new user text per turn: a problem or a follow-up (tokens, log-normal)", unit="tokens"
    )
    user_tokens_sigma: float = param(1.0, "log-normal shape of user text length", unit="unitless")
    output_tokens_mean: float = param(
        58_000.0, "mean decode per request, reasoning + answer (tokens, log-normal)", unit="tokens"
    )
    output_tokens_sigma: float = param(
        0.35, "log-normal shape of decode length (0.35: ~90% of requests in 30K-100K)", unit="unitless"
    )
    answer_tokens_mean: float = param(
        1_000.0, "mean visible answer (tokens, log-normal); the rest is reasoning", unit="tokens"
    )
    answer_tokens_sigma: float = param(0.8, "log-normal shape of visible answer length", unit="unitless")
    keep_reasoning: bool = param(
        False,
        "keep earlier turns' reasoning in later prompts (default: stripped, as "
        "the DeepSeek-R1 and OpenAI o-series APIs do)",
        unit="on/off",
        flag="--keep-reasoning/--no-keep-reasoning",
    )
    think_time_mean_s: float = param(
        60.0, "mean human think time between an answer and the next turn (s, exponential)", unit="s"
    )
    decode_s_per_token: float = param(
        0.02, "assumed server time per output token, to place later turns (s)", unit="s/token"
    )


@generator("reasoning", ReasoningParams, streamed=True)
def reasoning(p: ReasoningParams, n: int, seed: int, block_size: int, window_requests: int | None = None):
    """Multi-turn reasoning: 30K-100K-token decodes, reasoning stripped from the next turn's prompt."""
    if p.decode_s_per_token < 0 or p.think_time_mean_s < 0:
        raise BadParameter("decode_s_per_token and think_time_mean_s must be >= 0")
    rng = rng_for(seed, "reasoning")
    turns = geometric_counts(rng, p.turns_mean, p.max_turns, n)  # per session (what Conversations draws first)
    n_sessions = turns.size
    system_len = lognormal_ints(
        rng_for(seed, "reasoning", "sys-len"), p.system_tokens_mean, 0.5, p.system_prompts, lo=16
    )
    # Drawn in this order from one stream, so that the trace is the same whole or window by window.
    draws = SequentialDraws(
        rng,
        {
            "system": (n_sessions, lambda r, k: zipf_indices(r, p.system_prompts, p.system_zipf, k)),
            "user_len": (
                n,
                lambda r, k: lognormal_ints(r, p.user_tokens_mean, p.user_tokens_sigma, k, lo=1, hi=32_000),
            ),
            "out_len": (
                n,
                lambda r, k: lognormal_ints(
                    r, p.output_tokens_mean, p.output_tokens_sigma, k, lo=1, hi=MAX_OUTPUT_TOKENS
                ),
            ),
            "answer_len": (n, lambda r, k: lognormal_ints(r, p.answer_tokens_mean, p.answer_tokens_sigma, k, lo=1)),
            "think": (n, lambda r, k: r.exponential(p.think_time_mean_s, k)),
            "gap": (n_sessions, lambda r, k: r.exponential(1.0 / p.session_rate, k)),
        },
        whole=window_requests is None,
    )
    return stream_conversations(
        turns,
        window_requests,
        draws,
        p.decode_s_per_token,
        lambda conv, clock, carry: _reasoning_window(p, seed, block_size, conv, draws, clock, system_len, carry),
    )


def _reasoning_window(p: ReasoningParams, seed, block_size, conv: Conversations, draws, clock, system_len, carry):
    """The requests of one window of sessions, in request order, and the window's first session start."""
    m, session, turn, r0 = conv.turn.size, conv.session, conv.turn, conv.first_request
    system = draws.take("system", conv.n_sessions)
    user_len, out_len = draws.take("user_len", m), draws.take("out_len", m)
    # The visible answer comes last in the decode; a short output may be all answer (no reasoning).
    answer_len = np.minimum(draws.take("answer_len", m), out_len)
    reasoning_len = out_len - answer_len
    think = draws.take("think", m) * (turn > 0)

    # Arrivals: a turn can only be sent after the whole previous decode (reasoning included) finished,
    # so the long decodes, not the think time, dominate the spacing of turns.
    start = clock.starts(draws.take("gap", conv.n_sessions))
    arrival = conv.arrivals(start, out_len * p.decode_s_per_token, think, carry)

    key_user = name_key("reasoning", seed, "user")
    key_thought = name_key("reasoning", seed, "reasoning")
    key_answer = name_key("reasoning", seed, "answer")
    segs = Segments()
    req = np.arange(m)
    system_ids = content_ids(name_key("reasoning", seed, "system"), system[session])
    segs.add(req, system_ids, system_len[system[session]], order=0)
    # History: each earlier turn contributes its user text and its visible answer; its reasoning only when
    # keep_reasoning is set. The answer has the same content id either way, so the two variants share
    # every block up to the first dropped reasoning span. Content ids number requests across the trace.
    hist_req, hist_turn, k = conv.earlier_turns()
    segs.add(hist_req, content_ids(key_user, hist_turn + r0), user_len[hist_turn], order=1 + 3 * k)
    if p.keep_reasoning:
        segs.add(hist_req, content_ids(key_thought, hist_turn + r0), reasoning_len[hist_turn], order=2 + 3 * k)
    segs.add(hist_req, content_ids(key_answer, hist_turn + r0), answer_len[hist_turn], order=3 + 3 * k)
    segs.add(req, content_ids(key_user, req + r0), user_len, order=1 + 3 * turn)

    columns = {
        **conv.id_columns("reasoning"),
        "arrival_s": arrival,
        "output_tokens": out_len.astype(np.int32),
        "reasoning_tokens": reasoning_len.astype(np.int32),
        "workload": np.full(m, "reasoning", dtype=object),
        "user_id": string_ids("reasoning-u", session + conv.first_session),
        "think_time_s": think.astype(np.float32),
    }
    return build_table(columns, segs, m, block_size), float(start[0])
