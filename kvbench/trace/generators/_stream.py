"""Generating a conversation trace window by window, in bounded memory, with the rows of the whole-trace draw.

A conversation generator (chat, reasoning) draws every random array over the whole trace, builds the
prompts and sorts the requests by arrival. Streamed, it takes the sessions a window at a time (sessions
start in time order, a Poisson process) and gets exactly the same rows:

- `SequentialDraws` hands each window its slice of every array drawn from the shared random generator: the
  generator's state at the start of each array is found once by drawing through the arrays before it (numpy
  gives the same values drawn at once or piece by piece);
- `PoissonClock` and `Conversations.arrivals(carry=...)` continue their running sums across windows;
- `in_arrival_order` merges the windows: a session's later turns arrive after later sessions start, so the
  rows of a window wait in a pending table until no later window can arrive before them. The pending rows
  are the sessions still talking when the next window starts (arrival rate x session length), not the trace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa

from kvbench.trace.generators._common import Conversations

# Requests per window of a streamed generator: hashing a window's prompts takes ~20 KB a request (measured on
# chat: 16K requests peak at 460 MB RSS, 64K at 1 GB), so windows stay well below a row group.
WINDOW_REQUESTS = 16_384
_SKIP_CHUNK = 1 << 20  # values drawn per call while drawing through an array


def _clone(rng: np.random.Generator) -> np.random.Generator:
    bits = type(rng.bit_generator)()
    bits.state = rng.bit_generator.state
    return np.random.Generator(bits)


class SequentialDraws:
    """Arrays drawn one after another from `rng` (`plan`: name -> (size, draw(rng, k) -> k values), in draw
    order), read back in order, `take(name, k)` at a time. `whole=True` draws each array at once (the
    in-memory path); otherwise each array gets its own generator, positioned by drawing through the arrays
    before it. `totals[name]` is the sum of each array (used to bound rounding in arrival times)."""

    def __init__(self, rng: np.random.Generator, plan: dict[str, tuple[int, Callable]], whole: bool):
        self._arrays: dict[str, np.ndarray] = {}
        self._streams: dict[str, tuple[np.random.Generator, Callable]] = {}
        self._taken = dict.fromkeys(plan, 0)
        self.totals: dict[str, float] = {}
        for name, (size, draw) in plan.items():
            if whole:
                self._arrays[name] = draw(rng, size)
                self.totals[name] = float(np.sum(self._arrays[name]))
                continue
            self._streams[name] = (_clone(rng), draw)
            total = 0.0
            for lo in range(0, size, _SKIP_CHUNK):
                total += float(np.sum(draw(rng, min(_SKIP_CHUNK, size - lo))))
            self.totals[name] = total

    def take(self, name: str, k: int) -> np.ndarray:
        lo = self._taken[name]
        self._taken[name] = lo + k
        if name in self._arrays:
            return self._arrays[name][lo : lo + k]
        rng, draw = self._streams[name]
        return draw(rng, k)


class PoissonClock:
    """`_common.poisson_arrivals` continued across windows: start times from exponential gaps, the first
    start at 0."""

    def __init__(self):
        self._t = 0.0  # running sum of the gaps
        self._t0: float | None = None  # the first one, subtracted from every time

    def starts(self, gaps: np.ndarray) -> np.ndarray:
        t = np.cumsum(np.concatenate([[self._t], gaps]))[1:]
        if t.size:
            self._t = t[-1]
            self._t0 = t[0] if self._t0 is None else self._t0
        return t - (self._t0 if self._t0 is not None else 0.0)


def session_windows(turns: np.ndarray, window_requests: int | None) -> Iterator[tuple[int, int, int, int]]:
    """(first session, end session, first request, end request) of consecutive windows of whole sessions,
    each of at most `window_requests` requests unless one session has more (None: one window)."""
    ends = np.cumsum(turns)
    n_sessions, n = turns.size, int(ends[-1]) if turns.size else 0
    if window_requests is None or n <= window_requests:
        yield 0, n_sessions, 0, n
        return
    s0 = r0 = 0
    while s0 < n_sessions:
        # the sessions that end within the window (at least one: a long session makes a window of its own)
        s1 = max(int(np.searchsorted(ends, r0 + window_requests, side="right")), s0 + 1)
        s1 = min(s1, n_sessions)
        r1 = int(ends[s1 - 1])
        yield s0, s1, r0, r1
        s0, r0 = s1, r1


def conversation_windows(
    turns: np.ndarray, window_requests: int | None, build: Callable
) -> Iterator[tuple[pa.Table, float]]:
    """`build(conv, carry) -> (rows, first session start)` for each window of sessions (`turns` per
    session), `carry` being the running sum of steps the previous window ended with."""
    carry = 0.0
    for s0, s1, r0, _ in session_windows(turns, window_requests):
        conv = Conversations.window(turns[s0:s1], s0, r0)
        yield build(conv, carry)
        carry = conv.step_total


def in_arrival_order(windows: Iterable[tuple[pa.Table, float]], slack: float) -> Iterator[pa.Table]:
    """Rows of consecutive windows in arrival order (ties: in request order, as a stable sort of the whole
    trace). `windows` yields (the window's rows in request order, its first session's start); every row of a
    window and of the windows after it arrives at or after that start, up to `slack` (rounding: an arrival is
    start + steps - steps, which can round below start by an ulp of the total)."""
    pending: pa.Table | None = None
    index = np.zeros(0, np.int64)  # request number of each pending row, to break ties as the whole sort does
    next_index = 0
    for table, earliest in windows:
        if pending is not None:
            released, pending, index = _release(pending, index, earliest - slack)
            if released.num_rows:
                yield released
        rows = np.arange(next_index, next_index + table.num_rows)
        next_index += table.num_rows
        pending = table if pending is None else pa.concat_tables([pending, table]).combine_chunks()
        index = np.concatenate([index, rows])
    if pending is not None:
        released, _, _ = _release(pending, index, np.inf)
        yield released


def _release(pending: pa.Table, index: np.ndarray, before: float) -> tuple[pa.Table, pa.Table, np.ndarray]:
    """(rows arriving before `before`, sorted; the rest, sorted; their request numbers)."""
    arrival = np.asarray(pending.column("arrival_s"))
    order = np.lexsort((index, arrival))
    cut = int(np.searchsorted(arrival[order], before, side="left")) if before < np.inf else order.size
    if cut == order.size:
        return pending.take(order), pending.slice(0, 0), index[:0]
    return pending.take(order[:cut]), pending.take(order[cut:]), index[order[cut:]]


def arrival_slack(*bounds: float) -> float:
    """An upper bound on how far an arrival can round below its session's start, given upper bounds on the
    session starts and on the running sum of steps: a few ulps of their sum."""
    return 4 * float(np.spacing(np.float64(sum(abs(b) for b in bounds) + 1.0)))


def stream_conversations(turns, window_requests, draws, decode_s_per_token: float, window) -> Iterator[pa.Table]:
    """The requests of multi-turn conversations in arrival order, built a window of sessions at a time by
    `window(conv, clock, carry)`; a turn follows its predecessor after its decode and think time, which bounds
    how late a later window's rows can arrive (chat and reasoning share this)."""
    steps = decode_s_per_token * draws.totals["out_len"] + draws.totals["think"]
    clock = PoissonClock()
    windows = conversation_windows(turns, window_requests, lambda conv, carry: window(conv, clock, carry))
    return in_arrival_order(windows, arrival_slack(draws.totals["gap"], steps))
