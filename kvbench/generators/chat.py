"""Multi-turn chat: each turn's prompt is the previous prompt + the previous answer + new user text."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..blockhash import content_ids, name_key
from . import generator, param
from ._common import (
    Conversations,
    Segments,
    assemble,
    lognormal_ints,
    poisson_arrivals,
    rng_for,
    string_ids,
    zipf_indices,
)


@dataclass(frozen=True)
class ChatParams:
    session_rate: float = param(1.0, "new conversations per second (Poisson)")
    turns_mean: float = param(4.0, "mean turns per conversation (geometric)")
    max_turns: int = param(32, "cap on turns per conversation")
    system_prompts: int = param(16, "distinct system prompts shared across conversations")
    system_zipf: float = param(1.0, "Zipf exponent of system-prompt popularity")
    system_tokens_mean: float = param(1200.0, "mean system prompt length (tokens)")
    user_tokens_mean: float = param(300.0, "mean new user text per turn (tokens, log-normal)")
    user_tokens_sigma: float = param(1.2, "log-normal shape of user text length")
    output_tokens_mean: float = param(343.0, "mean answer length (tokens; Mooncake conversation: 343)")
    output_tokens_sigma: float = param(0.8, "log-normal shape of answer length")
    think_time_mean_s: float = param(45.0, "mean human think time between an answer and the next turn (s)")
    decode_s_per_token: float = param(0.03, "assumed server time per output token, to place later turns (s)")


@generator("chat", ChatParams)
def chat(p: ChatParams, n: int, seed: int, block_size: int):
    """Multi-turn chat with shared system prompts and human think time."""
    rng = rng_for(seed, "chat")
    conv = Conversations(rng, n, p.turns_mean, p.max_turns)
    n_sessions, session, turn = conv.n_sessions, conv.session, conv.turn

    system = zipf_indices(rng, p.system_prompts, p.system_zipf, n_sessions)
    system_len = lognormal_ints(rng_for(seed, "chat", "sys-len"), p.system_tokens_mean, 0.5, p.system_prompts, lo=16)
    user_len = lognormal_ints(rng, p.user_tokens_mean, p.user_tokens_sigma, n, lo=1, hi=32_000)
    out_len = lognormal_ints(rng, p.output_tokens_mean, p.output_tokens_sigma, n, lo=1, hi=16_000)
    think = rng.exponential(p.think_time_mean_s, n) * (turn > 0)

    # Conversations start as a Poisson process; a turn follows the previous one after its decode + think time.
    start = poisson_arrivals(rng, p.session_rate, n_sessions)
    arrival = conv.arrivals(start, out_len * p.decode_s_per_token, think)

    key_user, key_answer = name_key("chat", seed, "user"), name_key("chat", seed, "answer")
    segs = Segments()
    req = np.arange(n)
    segs.add(req, content_ids(name_key("chat", seed, "system"), system[session]), system_len[system[session]], order=0)
    # History: every earlier turn of the same conversation contributes its user text and its answer.
    hist_req, hist_turn, k = conv.earlier_turns()
    segs.add(hist_req, content_ids(key_user, hist_turn), user_len[hist_turn], order=1 + 2 * k)
    segs.add(hist_req, content_ids(key_answer, hist_turn), out_len[hist_turn], order=2 + 2 * k)
    segs.add(req, content_ids(key_user, req), user_len, order=1 + 2 * turn)

    columns = {
        **conv.id_columns("chat"),
        "arrival_s": arrival,
        "output_tokens": out_len.astype(np.int32),
        "workload": np.full(n, "chat", dtype=object),
        "user_id": string_ids("chat-u", session),
        "think_time_s": think.astype(np.float32),
    }
    return assemble(columns, segs, n, block_size)
