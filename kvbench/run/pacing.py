"""When each request of a live replay is sent, and what happened to it (the runner's side of an online
backend, docs/architecture.md, Backend protocols).

Modes:
- `trace`: open loop on the trace's timestamps, times `--time-scale` (2 = half the rate).
- `rate`: open loop at `--rate` requests/s; gaps drawn from a gamma distribution of shape `--burstiness`
  (1 = Poisson, < 1 burstier, > 1 more regular, as `vllm bench serve`), in trace order.
- `sessions`: closed loop: a request is sent `think_time_s` after every request it waits for has finished:
  the previous turn of its session and its `depends_on` (agent merges). Requests that wait for nothing go
  at their (scaled) trace time.

Every request records its scheduled and its actual send time: the dispatcher times absolute targets
(no accumulated drift), and any lag (a slow client, `--max-concurrency`) shows up as schedule lag instead of
silently stretching the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import click
import numpy as np
import pyarrow as pa

from kvbench.options import cli_options, option

MODES = ("trace", "rate", "sessions")


@dataclass
class Pacing:
    """How a live run sends its requests; the fields are `kvbench replay`'s pacing options (kvbench.options)."""

    mode: str = option(
        "trace",
        "trace: open loop on trace timestamps; rate: open loop at --rate; sessions: closed loop, next turn "
        "think_time_s after the previous one (and its depends_on) finished",
        unit="name",
        type=click.Choice(MODES),
    )
    time_scale: float = option(
        1.0,
        "multiply trace times by this (2 = half the request rate)",
        unit="unitless factor",
        type=click.FloatRange(min=0, min_open=True),
    )
    rate: float | None = option(
        None, "requests/s for --mode rate", unit="requests/s", type=click.FloatRange(min=0, min_open=True)
    )
    burstiness: float = option(
        1.0,
        "gamma shape of the gaps in --mode rate: 1 = Poisson, <1 burstier",
        unit="unitless gamma shape",
        type=click.FloatRange(min=0, min_open=True),
    )
    max_concurrency: int | None = option(
        None,
        "most requests in flight at once (others wait; the wait counts as schedule lag)",
        unit="requests",
        type=click.IntRange(min=1),
    )
    duration_s: float | None = option(
        None,
        "stop sending new requests after this many seconds",
        unit="s",
        flag="--duration",
        type=click.FloatRange(min=0, min_open=True),
    )
    max_requests: int | None = option(
        None, "send at most this many requests", unit="requests", type=click.IntRange(min=1)
    )
    warmup_requests: int = option(
        0,
        "the first N requests sent are run but left out of latency metrics",
        unit="requests",
        type=click.IntRange(min=0),
    )
    seed: int = option(0, "seed of the --mode rate gaps", unit="unitless", type=int)

    @classmethod
    def cli_options(cls) -> list[click.Option]:
        return cli_options(cls)

    def __post_init__(self):
        if self.mode == "rate" and not self.rate:
            from kvbench.errors import KvbenchError

            raise KvbenchError("--mode rate needs --rate (requests/s), e.g. --rate 5")


@dataclass
class Outcome:
    """What happened to one request; times in seconds since the run started (time.perf_counter based)."""

    row: int
    scheduled_s: float = math.nan
    sent_s: float = math.nan
    first_chunk_s: float = math.nan  # first streamed chunk with content (TTFT)
    first_output_s: float = math.nan  # first chunk of visible (non-reasoning) output (TTFO)
    last_chunk_s: float = math.nan
    chunk_s: list[float] = field(default_factory=list)  # arrival of every content chunk
    prompt_tokens: int | None = None  # as the server counted them
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    status: str = "not_sent"  # ok, error, timeout, cancelled, not_sent
    error: str | None = None
    warmup: bool = False


def open_loop_offsets(arrival_s: np.ndarray, pacing: Pacing) -> np.ndarray:
    """Send time of each request, seconds after the start (modes trace and rate)."""
    if pacing.mode == "rate":
        rng = np.random.default_rng(pacing.seed)
        gaps = rng.gamma(pacing.burstiness, 1.0 / (pacing.rate * pacing.burstiness), size=arrival_s.size)
        gaps[0] = 0.0
        return np.cumsum(gaps)
    return (arrival_s - (arrival_s[0] if arrival_s.size else 0.0)) * pacing.time_scale


def schedule_offsets(table: pa.Table, pacing: Pacing) -> np.ndarray:
    """When each row of `table` is due, seconds after the start: its send time in open loop; in mode
    `sessions` its (scaled) trace time, before which it never goes even when its predecessors finished."""
    arrival = table.column("arrival_s").to_numpy().astype(np.float64)
    if pacing.mode == "sessions":
        return (arrival - (arrival[0] if arrival.size else 0.0)) * pacing.time_scale
    return open_loop_offsets(arrival, pacing)


def predecessors(table: pa.Table) -> list[list[int]]:
    """For `sessions` mode: the rows each row waits for (previous turn of its session, depends_on)."""
    n = table.num_rows
    preds: list[list[int]] = [[] for _ in range(n)]
    index = {rid: i for i, rid in enumerate(table.column("request_id").to_pylist())}
    last_in_session: dict[str, int] = {}
    sessions = table.column("session_id").to_pylist() if "session_id" in table.column_names else [None] * n
    deps = table.column("depends_on").to_pylist() if "depends_on" in table.column_names else [None] * n
    for i in range(n):
        s = sessions[i]
        if s is not None:
            if s in last_in_session:
                preds[i].append(last_in_session[s])
            last_in_session[s] = i
        for d in deps[i] or ():
            j = index.get(d)
            if j is not None and j != i and j not in preds[i]:
                preds[i].append(j)
    return preds


def request_count(table: pa.Table, pacing: Pacing) -> int:
    return table.num_rows if pacing.max_requests is None else min(table.num_rows, pacing.max_requests)
