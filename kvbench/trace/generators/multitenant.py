"""Multi-tenant serving: Zipf-skewed tenants sharing public prefixes, with salts, priorities and LoRA adapters.

A prompt is: [public system prompt, if the tenant builds on one] + tenant-private prefix (its own system
prompt and documents) + [user-private memory, in a returning user's session] + the conversation so far +
new user text. Public prompts are identical by id across tenants; everything after them is private to
one tenant. Block ids are content only (docs/semantics.md, Block ids and prompts): the tenant's
`cache_salt` and `lora` are separate columns that backends fold into their cache keys, so one trace replays
with isolation on or off.

Users belong to one tenant and come back: each user has several sessions spread over the trace span
(days), optionally with a diurnal rate, and every returning session starts with that user's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.trace.blockhash import content_ids, name_key
from kvbench.trace.generators import BadParameter, generator, param
from kvbench.trace.generators._common import (
    Conversations,
    Segments,
    assemble,
    geometric_counts,
    group_ranks,
    lognormal_ints,
    rng_for,
    string_ids,
    zipf_indices,
)
from kvbench.trace.schema import DEFAULT_PRIORITY

DAY_S = 86_400.0
TIERS = ("premium", "standard", "free")


@dataclass(frozen=True)
class MultiTenantParams:
    tenants: int = param(200, "number of tenants", unit="count", at_least=1)
    tenant_zipf: float = param(
        1.1, "Zipf exponent of tenant traffic shares (users are assigned to tenants by it)", unit="unitless"
    )
    span_days: float = param(3.0, "span over which sessions start (days)", unit="days", above=0)
    diurnal_amplitude: float = param(
        0.0, "relative day/night swing of the session rate (0 = flat, < 1)", unit="fraction", below=1
    )
    diurnal_peak_hour: float = param(14.0, "hour of the day with the highest session rate (h)", unit="h", below=24)
    sessions_per_user_mean: float = param(
        4.0, "mean sessions per user (geometric), spread over the span", unit="sessions"
    )
    max_sessions_per_user: int = param(64, "cap on sessions per user", unit="sessions", at_least=1)
    turns_mean: float = param(3.0, "mean turns per session (geometric)", unit="turns")
    max_turns: int = param(32, "cap on turns per session", unit="turns", at_least=1)
    public_prompts: int = param(
        8, "distinct public system prompts (identical across the tenants that use them)", unit="count", at_least=1
    )
    public_zipf: float = param(1.0, "Zipf exponent of public-prompt popularity among tenants", unit="unitless")
    public_share: float = param(
        0.6, "share of tenants whose prompts start with a public system prompt (0..1)", unit="fraction", at_most=1
    )
    public_tokens_mean: float = param(1500.0, "mean public system prompt length (tokens)", unit="tokens")
    public_tokens_sigma: float = param(0.5, "log-normal shape of public prompt length (0 = all equal)", unit="unitless")
    private_tokens_mean: float = param(
        2000.0, "mean tenant-private prefix: its system prompt and documents (tokens)", unit="tokens"
    )
    memory_tokens_mean: float = param(
        500.0, "mean user-private memory/profile opening each returning session (tokens)", unit="tokens"
    )
    user_tokens_mean: float = param(200.0, "mean new user text per turn (tokens, log-normal)", unit="tokens")
    user_tokens_sigma: float = param(1.2, "log-normal shape of user text length", unit="unitless")
    output_tokens_mean: float = param(343.0, "mean answer length (tokens; Mooncake conversation: 343)", unit="tokens")
    output_tokens_sigma: float = param(0.8, "log-normal shape of answer length", unit="unitless")
    think_time_mean_s: float = param(45.0, "mean human think time between an answer and the next turn (s)", unit="s")
    decode_s_per_token: float = param(
        0.03, "assumed server time per output token, to place later turns (s)", unit="s/token"
    )
    unsalted_share: float = param(
        0.1, "share of tenants that send no cache_salt (they opt into cross-tenant sharing)", unit="fraction", at_most=1
    )
    premium_share: float = param(0.1, "share of tenants in the premium tier", unit="fraction", at_most=1)
    free_share: float = param(
        0.3, "share of tenants in the free tier (the rest are standard)", unit="fraction", at_most=1
    )
    premium_priority: int = param(
        80,
        "retention priority of premium tenants (0-100, TensorRT-LLM semantics)",
        unit="priority (0-100)",
        at_most=100,
    )
    standard_priority: int = param(
        DEFAULT_PRIORITY,
        "retention priority of standard tenants (TensorRT-LLM default 35)",
        unit="priority (0-100)",
        at_most=100,
    )
    free_priority: int = param(
        10, "retention priority of free-tier tenants (0-100)", unit="priority (0-100)", at_most=100
    )
    slo: bool = param(True, "attach per-tier TTFT/TPOT SLOs to every request", unit="on/off", flag="--slo/--no-slo")
    premium_ttft_ms: float = param(500.0, "TTFT SLO of premium tenants (ms)", unit="ms", above=0)
    standard_ttft_ms: float = param(2000.0, "TTFT SLO of standard tenants (ms)", unit="ms", above=0)
    free_ttft_ms: float = param(10000.0, "TTFT SLO of free-tier tenants (ms)", unit="ms", above=0)
    premium_tpot_ms: float = param(30.0, "TPOT SLO of premium tenants (ms per output token)", unit="ms/token", above=0)
    standard_tpot_ms: float = param(
        50.0, "TPOT SLO of standard tenants (ms per output token)", unit="ms/token", above=0
    )
    free_tpot_ms: float = param(100.0, "TPOT SLO of free-tier tenants (ms per output token)", unit="ms/token", above=0)
    lora_tenant_share: float = param(0.3, "share of tenants that own LoRA adapters (0..1)", unit="fraction", at_most=1)
    lora_adapters: int = param(100, "most LoRA adapters in total, all on one base model", unit="count")
    lora_per_tenant_max: int = param(3, "most adapters one tenant owns (uniform 1..max)", unit="count", at_least=1)
    lora_session_share: float = param(
        0.8, "share of an adapter-owning tenant's sessions that use one of its adapters", unit="fraction", at_most=1
    )

    def __post_init__(self):
        if self.premium_share + self.free_share > 1:
            raise BadParameter(
                f"--premium-share {self.premium_share} and --free-share {self.free_share} add up to more than 1 "
                "(the rest of the tenants are standard)"
            )


def _session_starts(p: MultiTenantParams, rng: np.random.Generator, size: int) -> np.ndarray:
    """Start times (s) over the span, by inverting the CDF of a (optionally diurnal) rate on a 1-minute grid."""
    span = max(p.span_days, 1e-6) * DAY_S
    grid = np.linspace(0.0, span, max(int(span / 60.0), 1) + 1)
    amplitude = min(max(p.diurnal_amplitude, 0.0), 0.99)
    rate = 1.0 + amplitude * np.cos(2 * np.pi * (grid / DAY_S - p.diurnal_peak_hour / 24.0))
    cdf = np.concatenate([[0.0], np.cumsum((rate[1:] + rate[:-1]) / 2 * np.diff(grid))])
    return np.interp(rng.random(size) * cdf[-1], cdf, grid)


def _salts(names: list[str], unsalted: np.ndarray, seed: int) -> pa.Array:
    """One salt string per tenant, derived from its name (null for tenants that send none). One entry per
    tenant, not per request, so the Python loop stays small."""
    return pa.array(
        [
            None if off else f"salt-{int(name_key('multi-tenant', seed, 'salt', nm)):016x}"
            for nm, off in zip(names, unsalted)
        ],
        pa.string(),
    )


def _adapters(p: MultiTenantParams, rng: np.random.Generator, n_tenants: int) -> tuple[np.ndarray, np.ndarray]:
    """First adapter index and adapter count per tenant; the total never exceeds p.lora_adapters."""
    owns = rng.random(n_tenants) < p.lora_tenant_share
    wanted = np.where(owns, rng.integers(1, max(p.lora_per_tenant_max, 1) + 1, n_tenants), 0)
    first = np.cumsum(wanted) - wanted
    # Tenants past the cap fall back to the base model; the adapters that exist are numbered 0..total-1.
    count = np.clip(max(p.lora_adapters, 0) - first, 0, wanted)
    return first, count


@generator("multi-tenant", MultiTenantParams, bytes_per_request=7_000)
def multi_tenant(p: MultiTenantParams, n: int, seed: int, block_size: int):
    """Zipf-skewed tenants with public/private prefixes, salts, priorities, LoRA and returning users."""
    rng = rng_for(seed, "multi-tenant")
    n_tenants = max(p.tenants, 1)
    conv = Conversations(rng, n, p.turns_mean, p.max_turns)
    n_sessions = conv.n_sessions
    user_sessions = geometric_counts(rng, p.sessions_per_user_mean, p.max_sessions_per_user, n_sessions)
    n_users = user_sessions.size
    session_user = np.repeat(np.arange(n_users), user_sessions)  # sessions grouped by user
    user_tenant = zipf_indices(rng, n_tenants, p.tenant_zipf, n_users)  # tenant index = traffic rank
    session_tenant = user_tenant[session_user]

    # A user's sessions in time order: sort the drawn start times inside each user's group.
    starts = _session_starts(p, rng_for(seed, "multi-tenant", "starts"), n_sessions)
    starts = starts[np.lexsort((starts, session_user))]
    returning = group_ranks(session_user) > 0

    # Tenant configuration; each property from its own stream so that changing, say, the LoRA share
    # leaves every block id unchanged.
    names = [f"tenant-{i}" for i in range(n_tenants)]
    t_rng = rng_for(seed, "multi-tenant", "tenant-config")
    public_of_tenant = np.where(
        t_rng.random(n_tenants) < p.public_share,
        zipf_indices(t_rng, max(p.public_prompts, 1), p.public_zipf, n_tenants),
        -1,
    )
    public_len = lognormal_ints(t_rng, p.public_tokens_mean, p.public_tokens_sigma, max(p.public_prompts, 1), lo=16)
    private_len = lognormal_ints(t_rng, p.private_tokens_mean, 0.7, n_tenants, lo=16, hi=64_000)
    tier_draw = rng_for(seed, "multi-tenant", "tier").random(n_tenants)
    tier = np.where(tier_draw < p.premium_share, 0, np.where(tier_draw < p.premium_share + p.free_share, 2, 1))
    unsalted = rng_for(seed, "multi-tenant", "salt").random(n_tenants) < p.unsalted_share
    lora_rng = rng_for(seed, "multi-tenant", "lora")
    lora_first, lora_count = _adapters(p, lora_rng, n_tenants)
    lora_names = [f"{names[t]}-lora{j}" for t in np.flatnonzero(lora_count) for j in range(lora_count[t])]
    s_count = lora_count[session_tenant]
    s_uses = (s_count > 0) & (lora_rng.random(n_sessions) < p.lora_session_share)
    # A session sticks to one of its tenant's adapters (or the base model, -1).
    pick = (lora_rng.random(n_sessions) * s_count).astype(np.int64)
    s_adapter = np.where(s_uses, lora_first[session_tenant] + pick, -1)

    # Requests: sessions in order, turns in order.
    session, turn = conv.session, conv.turn
    req = np.arange(n)
    tenant = session_tenant[session]
    user = session_user[session]
    memory_len = lognormal_ints(rng_for(seed, "multi-tenant", "memory"), p.memory_tokens_mean, 0.7, n_users, lo=1)
    user_len = lognormal_ints(rng, p.user_tokens_mean, p.user_tokens_sigma, n, lo=1, hi=32_000)
    out_len = lognormal_ints(rng, p.output_tokens_mean, p.output_tokens_sigma, n, lo=1, hi=16_000)
    think = rng.exponential(p.think_time_mean_s, n) * (turn > 0)
    arrival = conv.arrivals(starts, out_len * p.decode_s_per_token, think)

    segs = Segments()
    pub = public_of_tenant[tenant]
    uses_public = pub >= 0
    segs.add(
        req[uses_public],
        content_ids(name_key("multi-tenant", seed, "public"), pub[uses_public]),
        public_len[pub[uses_public]],
        order=0,
    )
    segs.add(req, content_ids(name_key("multi-tenant", seed, "private"), tenant), private_len[tenant], order=1)
    with_memory = returning[session] & (p.memory_tokens_mean > 0)
    segs.add(
        req[with_memory],
        content_ids(name_key("multi-tenant", seed, "memory"), user[with_memory]),
        memory_len[user[with_memory]],
        order=2,
    )
    # Conversation so far: every earlier turn's user text and answer, then the new user text.
    key_user, key_answer = name_key("multi-tenant", seed, "user"), name_key("multi-tenant", seed, "answer")
    hist_req, hist_turn, k = conv.earlier_turns()
    segs.add(hist_req, content_ids(key_user, hist_turn), user_len[hist_turn], order=3 + 2 * k)
    segs.add(hist_req, content_ids(key_answer, hist_turn), out_len[hist_turn], order=4 + 2 * k)
    segs.add(req, content_ids(key_user, req), user_len, order=3 + 2 * turn)

    priorities = np.clip([p.premium_priority, p.standard_priority, p.free_priority], 0, 100)
    adapter = s_adapter[session]
    columns = {
        "request_id": string_ids("mt-", req),
        "arrival_s": arrival,
        "output_tokens": out_len.astype(np.int32),
        "workload": np.full(n, "multi-tenant", dtype=object),
        "tenant": pa.DictionaryArray.from_arrays(pa.array(tenant.astype(np.int32)), pa.array(names)),
        "user_id": string_ids("mt-u", user),
        "session_id": string_ids("mt-s", session),
        "turn": turn.astype(np.int32),
        "parent_id": pc.if_else(pa.array(turn > 0), string_ids("mt-", np.maximum(req - 1, 0)), None),
        "think_time_s": think.astype(np.float32),
        "cache_salt": _salts(names, unsalted, seed).take(pa.array(tenant)),
        "priority": priorities[tier[tenant]].astype(np.int8),
        "lora": pa.DictionaryArray.from_arrays(
            pa.array(adapter.astype(np.int32), mask=adapter < 0), pa.array(lora_names, pa.string())
        ),
    }
    if p.slo:
        ttft = np.array([p.premium_ttft_ms, p.standard_ttft_ms, p.free_ttft_ms], dtype=np.float32)
        tpot = np.array([p.premium_tpot_ms, p.standard_tpot_ms, p.free_tpot_ms], dtype=np.float32)
        columns["slo_ttft_ms"] = ttft[tier[tenant]]
        columns["slo_tpot_ms"] = tpot[tier[tenant]]
    return assemble(columns, segs, n, block_size)
