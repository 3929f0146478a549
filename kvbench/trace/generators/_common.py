"""Shared pieces of the generators: distributions, segment lists and table assembly."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.trace.blockhash import name_key, prompt_block_ids
from kvbench.trace.schema import conform


def rng_for(seed: int, *names: object) -> np.random.Generator:
    """An independent random stream per (seed, purpose), so adding a draw elsewhere changes nothing here."""
    return np.random.default_rng([seed, int(name_key(*names)) & 0x7FFFFFFF])


def lognormal_ints(
    rng: np.random.Generator, mean: float, sigma: float, size, lo: int = 1, hi: int | None = None
) -> np.ndarray:
    """Integers from a log-normal with the given *mean* (not median) and shape sigma, clipped to [lo, hi]."""
    mu = np.log(max(mean, 1e-9)) - sigma**2 / 2
    x = np.rint(rng.lognormal(mu, sigma, size)).astype(np.int64)
    return np.clip(x, lo, hi if hi is not None else np.iinfo(np.int32).max // 4)


def zipf_indices(rng: np.random.Generator, n_items: int, alpha: float, size) -> np.ndarray:
    """Draw item ranks 0..n_items-1 with P(k) proportional to 1/(k+1)**alpha (bounded Zipf)."""
    weights = 1.0 / np.arange(1, n_items + 1, dtype=np.float64) ** alpha
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(size), side="right"), n_items - 1)


def geometric_counts(rng: np.random.Generator, mean: float, cap: int, total: int) -> np.ndarray:
    """Geometric counts (mean `mean`, capped) that sum to exactly `total` (the last one truncated)."""
    q = 1.0 / max(mean, 1.0)
    counts = np.empty(0, dtype=np.int64)
    while counts.sum() < total:
        more = np.minimum(rng.geometric(q, size=max(16, int(total * q * 1.2))), max(cap, 1))
        counts = np.concatenate([counts, more])
    cut = np.searchsorted(np.cumsum(counts), total)
    counts = counts[: cut + 1].copy()
    counts[-1] -= counts.sum() - total
    return counts


class Conversations:
    """n requests grouped into multi-turn sessions: request i is turn `turn[i]` of session `session[i]`,
    requests ordered by session then turn (so the previous turn of request i > 0 is request i - 1).

    A window of a larger trace (`Conversations.window`) numbers its sessions and requests from 0 like a
    whole trace; `first_session` and `first_request` place them in the trace, for ids and content ids."""

    def __init__(self, rng: np.random.Generator, n: int, turns_mean: float, max_turns: int):
        self._set(geometric_counts(rng, turns_mean, max_turns, n), 0, 0)

    @classmethod
    def window(cls, turns: np.ndarray, first_session: int, first_request: int) -> Conversations:
        """The sessions with `turns` turns each, starting at session `first_session`, request `first_request`."""
        conv = cls.__new__(cls)
        conv._set(np.asarray(turns, dtype=np.int64), first_session, first_request)
        return conv

    def _set(self, turns: np.ndarray, first_session: int, first_request: int) -> None:
        self.turns = turns  # per session
        self.first_session, self.first_request = first_session, first_request
        self.session = np.repeat(np.arange(self.turns.size), self.turns)
        self.turn = group_ranks(self.session)
        self.step_total = 0.0  # sum of the steps between turns so far: what `arrivals` carries to the next window

    @property
    def n_sessions(self) -> int:
        return self.turns.size

    def arrivals(
        self, session_start: np.ndarray, decode_s: np.ndarray, think_s: np.ndarray, carry: float = 0.0
    ) -> np.ndarray:
        """Arrival of each request: its session's start, then for each later turn the previous turn's
        (assumed) server time `decode_s` plus this turn's think time. The steps are summed in one running
        total over the trace; a window continues the previous window's (`carry` = its `step_total`), so
        that windows give bit for bit the arrivals of the whole trace."""
        step = np.where(self.turn > 0, np.roll(decode_s, 1) + think_s, 0.0)
        csum = np.cumsum(np.concatenate([[carry], step]))[1:]  # (cumsum adds in order: same as one long sum)
        self.step_total = float(csum[-1]) if csum.size else carry
        return session_start[self.session] + csum - np.repeat(csum[self.turn == 0], self.turns)

    def id_columns(self, prefix: str) -> dict[str, pa.Array]:
        """request_id, session_id, turn and parent_id (the previous turn) for ids like 'chat-12', 'chat-s3'."""
        req = np.arange(self.turn.size) + self.first_request
        return {
            "request_id": string_ids(f"{prefix}-", req),
            "session_id": string_ids(f"{prefix}-s", self.session + self.first_session),
            "turn": pa.array(self.turn.astype(np.int32)),
            "parent_id": pc.if_else(pa.array(self.turn > 0), string_ids(f"{prefix}-", np.maximum(req - 1, 0)), None),
        }

    def earlier_turns(self, include_current: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pairs (request, k-th turn of its session before it): (request index, that turn's request index, k).
        Every prompt replays its session's earlier turns; `include_current` adds the request itself last.
        Indices count from the window's first request."""
        req = np.repeat(np.arange(self.turn.size), self.turn + int(include_current))
        k = group_ranks(req)
        return req, req - self.turn[req] + k, k


def poisson_arrivals(rng: np.random.Generator, rate: float, size: int) -> np.ndarray:
    """Arrival times (s) of a Poisson process with `rate` per second, starting at 0."""
    t = np.cumsum(rng.exponential(1.0 / rate, size))
    return t - t[0] if size else t


def group_ranks(group: np.ndarray) -> np.ndarray:
    """Position of each element inside its run of equal consecutive `group` values (0, 1, 2, ...)."""
    group = np.asarray(group)
    if group.size == 0:
        return group.astype(np.int64)
    start = np.ones(group.size, dtype=bool)
    start[1:] = group[1:] != group[:-1]
    first = np.flatnonzero(start)
    return np.arange(group.size) - np.repeat(first, np.diff(np.append(first, group.size)))


def string_ids(prefix: str, numbers) -> pa.Array:
    """Strings like 'chat-s12' for integer arrays, built in Arrow (fast for millions of rows)."""
    nums = pc.cast(pa.array(np.asarray(numbers, dtype=np.int64)), pa.string())
    return pc.binary_join_element_wise(pa.scalar(prefix), nums, "")


class Segments:
    """Accumulates prompt segments (request index, content id, tokens) from several vectorised sources."""

    def __init__(self) -> None:
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, request, content, tokens, order=0) -> None:
        """Add segments; within one request, segments are laid out by `order` then by insertion."""
        request = np.asarray(request, dtype=np.int64)
        b = np.broadcast_arrays(
            request,
            np.asarray(content, dtype=np.uint64),
            np.asarray(tokens, dtype=np.int64),
            np.asarray(order, dtype=np.int64),
        )
        self._parts.append(tuple(np.ascontiguousarray(x) for x in b))

    def block_ids(self, n_requests: int, block_size: int) -> tuple[np.ndarray, pa.ListArray]:
        req, content, tokens, order = (np.concatenate([p[i] for p in self._parts]) for i in range(4))
        seq = np.arange(req.size)
        idx = np.lexsort((seq, order, req))
        return prompt_block_ids(req[idx], content[idx], tokens[idx], n_requests, block_size)


def assemble(columns: dict[str, object], segments: Segments, n_requests: int, block_size: int) -> pa.Table:
    """Build the trace table: compute input_tokens and block_hashes from the segments, then sort by arrival.

    `columns` holds per-request arrays (numpy or Arrow) for any schema column except input_tokens and
    block_hashes. Rows are sorted stably by arrival_s, so request_ids are assigned before sorting.
    """
    table = build_table(columns, segments, n_requests, block_size)
    order = np.argsort(np.asarray(table.column("arrival_s")), kind="stable")
    return table.take(order)


def build_table(columns: dict[str, object], segments: Segments, n_requests: int, block_size: int) -> pa.Table:
    """`assemble` without the sort: the rows in request order, conformed to the schema."""
    input_tokens, hashes = segments.block_ids(n_requests, block_size)
    if np.any(input_tokens <= 0):
        raise ValueError("a generated request has an empty prompt")
    arrays = {"input_tokens": pa.array(input_tokens.astype(np.int32)), "block_hashes": hashes}
    for name, value in columns.items():
        arrays[name] = value if isinstance(value, (pa.Array, pa.ChunkedArray)) else pa.array(value)
    return conform(pa.table(arrays))
