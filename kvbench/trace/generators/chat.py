"""Multi-turn chat: each turn's prompt is the previous prompt + the previous answer + new user text."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbench.trace.blockhash import content_ids, name_key
from kvbench.trace.generators import generator, param
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


@dataclass(frozen=True)
class ChatParams:
    session_rate: float = param(1.0, "new conversations per second (Poisson)", unit="sessions/s", above=0)
    turns_mean: float = param(4.0, "mean turns per conversation (geometric)", unit="turns")
    max_turns: int = param(32, "cap on turns per conversation", unit="turns", at_least=1)
    system_prompts: int = param(16, "distinct system prompts shared across conversations", unit="count", at_least=1)
    system_zipf: float = param(1.0, "Zipf exponent of system-prompt popularity", unit="unitless")
    system_tokens_mean: float = param(1200.0, "mean system prompt length (tokens)", unit="tokens")
    user_tokens_mean: float = param(300.0, "mean new user text per turn (tokens, log-normal)", unit="tokens")
    user_tokens_sigma: float = param(1.2, "log-normal shape of user text length", unit="unitless")
    output_tokens_mean: float = param(343.0, "mean answer length (tokens; Mooncake conversation: 343)", unit="tokens")
    output_tokens_sigma: float = param(0.8, "log-normal shape of answer length", unit="unitless")
    think_time_mean_s: float = param(45.0, "mean human think time between an answer and the next turn (s)", unit="s")
    decode_s_per_token: float = param(
        0.03, "assumed server time per output token, to place later turns (s)", unit="s/token"
    )


@generator("chat", ChatParams, streamed=True)
def chat(p: ChatParams, n: int, seed: int, block_size: int, window_requests: int | None = None):
    """Multi-turn chat with shared system prompts and human think time."""
    rng = rng_for(seed, "chat")
    turns = geometric_counts(rng, p.turns_mean, p.max_turns, n)  # per session (what Conversations draws first)
    n_sessions = turns.size
    system_len = lognormal_ints(rng_for(seed, "chat", "sys-len"), p.system_tokens_mean, 0.5, p.system_prompts, lo=16)
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
                lambda r, k: lognormal_ints(r, p.output_tokens_mean, p.output_tokens_sigma, k, lo=1, hi=16_000),
            ),
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
        lambda conv, clock, carry: _chat_window(p, seed, block_size, conv, draws, clock, system_len, carry),
    )


def _chat_window(p: ChatParams, seed, block_size, conv: Conversations, draws, clock, system_len, carry):
    """The requests of one window of sessions, in request order, and the window's first session start."""
    m, session, turn, r0 = conv.turn.size, conv.session, conv.turn, conv.first_request
    system = draws.take("system", conv.n_sessions)
    user_len, out_len = draws.take("user_len", m), draws.take("out_len", m)
    think = draws.take("think", m) * (turn > 0)

    # Conversations start as a Poisson process; a turn follows the previous one after its decode + think time.
    start = clock.starts(draws.take("gap", conv.n_sessions))
    arrival = conv.arrivals(start, out_len * p.decode_s_per_token, think, carry)

    key_user, key_answer = name_key("chat", seed, "user"), name_key("chat", seed, "answer")
    segs = Segments()
    req = np.arange(m)
    segs.add(req, content_ids(name_key("chat", seed, "system"), system[session]), system_len[system[session]], order=0)
    # History: every earlier turn of the same conversation contributes its user text and its answer
    # (content ids number requests across the whole trace).
    hist_req, hist_turn, k = conv.earlier_turns()
    segs.add(hist_req, content_ids(key_user, hist_turn + r0), user_len[hist_turn], order=1 + 2 * k)
    segs.add(hist_req, content_ids(key_answer, hist_turn + r0), out_len[hist_turn], order=2 + 2 * k)
    segs.add(req, content_ids(key_user, req + r0), user_len, order=1 + 2 * turn)

    columns = {
        **conv.id_columns("chat"),
        "arrival_s": arrival,
        "output_tokens": out_len.astype(np.int32),
        "workload": np.full(m, "chat", dtype=object),
        "user_id": string_ids("chat-u", session + conv.first_session),
        "think_time_s": think.astype(np.float32),
    }
    return build_table(columns, segs, m, block_size), float(start[0])
