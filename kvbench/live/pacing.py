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

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import click
import numpy as np
import pyarrow as pa

from kvbench.options import with_units

MODES = ("trace", "rate", "sessions")


# the unit of each pacing option, added to its --help
UNITS = {
    "mode": "name",
    "time_scale": "unitless factor",
    "rate": "requests/s",
    "burstiness": "unitless gamma shape",
    "max_concurrency": "requests",
    "duration_s": "s",
    "max_requests": "requests",
    "warmup_requests": "requests",
    "seed": "unitless",
}


@dataclass
class Pacing:
    mode: str = "trace"
    time_scale: float = 1.0
    rate: float | None = None  # requests/s, mode "rate"
    burstiness: float = 1.0
    max_concurrency: int | None = None
    duration_s: float | None = None
    max_requests: int | None = None
    warmup_requests: int = 0
    seed: int = 0

    @classmethod
    def cli_options(cls) -> list[click.Option]:
        return with_units(
            [
                click.Option(
                    ["--mode"],
                    type=click.Choice(MODES),
                    default="trace",
                    show_default=True,
                    help="trace: open loop on trace timestamps; rate: open loop at --rate; sessions: closed "
                    "loop, next turn think_time_s after the previous one (and its depends_on) finished",
                ),
                click.Option(
                    ["--time-scale"],
                    type=click.FloatRange(min=0, min_open=True),
                    default=1.0,
                    show_default=True,
                    help="multiply trace times by this (2 = half the request rate)",
                ),
                click.Option(
                    ["--rate"], type=click.FloatRange(min=0, min_open=True), help="requests/s for --mode rate"
                ),
                click.Option(
                    ["--burstiness"],
                    type=click.FloatRange(min=0, min_open=True),
                    default=1.0,
                    show_default=True,
                    help="gamma shape of the gaps in --mode rate: 1 = Poisson, <1 burstier",
                ),
                click.Option(
                    ["--max-concurrency"],
                    type=click.IntRange(min=1),
                    help="most requests in flight at once (others wait; the wait counts as schedule lag)",
                ),
                click.Option(
                    ["--duration", "duration_s"],
                    type=click.FloatRange(min=0, min_open=True),
                    help="stop sending new requests after this many seconds",
                ),
                click.Option(["--max-requests"], type=click.IntRange(min=1), help="send at most this many requests"),
                click.Option(
                    ["--warmup-requests"],
                    type=click.IntRange(min=0),
                    default=0,
                    show_default=True,
                    help="the first N requests sent are run but left out of latency metrics",
                ),
                click.Option(["--seed"], type=int, default=0, show_default=True, help="seed of the --mode rate gaps"),
            ],
            UNITS,
        )

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


async def dispatch(
    table: pa.Table,
    pacing: Pacing,
    outcomes: list[Outcome],
    send: Callable[[Outcome], Awaitable[None]],
    on_done: Callable[[Outcome], None],
    origin: float,
    offsets: np.ndarray | None = None,
    start_at: float | None = None,
) -> None:
    """Send the trace's requests as `pacing` says, filling `outcomes` (one per row, `request_count` rows,
    made by the caller so that it keeps them if the run is interrupted). `send` fills an Outcome and must
    not raise, except CancelledError after marking it cancelled; `on_done` sees every request that was sent.
    Times are seconds since `origin` (a time.perf_counter() value). `offsets` (one per row, default
    `schedule_offsets`) and `start_at` (the schedule's zero on that clock, default now) let one shard of a
    distributed run keep its rows' times in the whole trace's schedule. Cancelled, it cancels the requests in
    flight and waits for each to record its cancellation."""
    await Dispatcher(table, pacing, outcomes, send, on_done, origin, offsets, start_at).run()


class Dispatcher:
    """One replay's sending (see `dispatch`). Nothing polls: a row starts from a timer set for its time, or, in
    mode `sessions`, from the completion of the last request it waits for; when every row has been sent or
    cut, `all_done` is set and `run` returns. The mode's strategy (`OpenLoop`, `ClosedLoopSessions`) decides
    when each row is due; the dispatcher starts it, applies --max-concurrency, --duration and the warm-up.
    `clock` is time.perf_counter unless a test drives the dispatcher on a virtual clock."""

    def __init__(self, table, pacing, outcomes, send, on_done, origin, offsets=None, start_at=None, clock=None):
        self.pacing = pacing
        self.outcomes = outcomes
        self.send = send
        self.on_done = on_done
        self.origin = origin
        self.clock = clock or time.perf_counter
        self.rows = table.slice(0, len(outcomes))
        self.offsets = schedule_offsets(self.rows, pacing) if offsets is None else offsets
        self.loop = asyncio.get_running_loop()
        self.gate = asyncio.Semaphore(pacing.max_concurrency) if pacing.max_concurrency else None
        self.tasks: set[asyncio.Task] = set()
        self.timers: dict[int, asyncio.TimerHandle] = {}  # rows waiting for their time (mode sessions)
        self.sent = 0
        self.remaining = len(outcomes)  # rows neither finished nor cut
        self.all_done = asyncio.Event()
        self.error: BaseException | None = None
        # the schedule starts now (a resumed run's clock goes on from where the previous one stopped)
        self.t0 = self.now() if start_at is None else start_at
        self.strategy = (ClosedLoopSessions if pacing.mode == "sessions" else OpenLoop)(self)

    def now(self) -> float:
        return self.clock() - self.origin

    async def run(self) -> None:
        try:
            if self.remaining:
                self.strategy.begin()
                await self.all_done.wait()
            if self.error is not None:
                raise self.error
        finally:
            await self._stop()

    def start(self, i: int, at: float, due: bool = False) -> None:
        """Run request i at time `at`: a task now if it is `due`, else a timer that creates it then (tasks are
        never made ahead: making thousands at once stalls the loop and delays the first sends)."""
        self.outcomes[i].scheduled_s = at
        if self.pacing.duration_s is not None and at > self.pacing.duration_s:
            self.finished(i)
            return
        delay = at - self.now()
        if delay > 0 and not due:
            self.timers[i] = self.loop.call_later(delay, self._launch_when_due, i)
        else:
            self._launch(i)

    def _launch_when_due(self, i: int) -> None:
        # A loop's timers may fire a little early (uvloop's count whole milliseconds from the loop's cached
        # time): a request never goes before its time, the timer is set again for what is left.
        delay = self.outcomes[i].scheduled_s - self.now()
        if delay > 0:
            self.timers[i] = self.loop.call_later(delay, self._launch_when_due, i)
        else:
            self._launch(i)

    def finished(self, i: int) -> None:
        """Row i was answered, failed or cut: the strategy may start what waited for it."""
        self.remaining -= 1
        self.strategy.finished(i)
        if self.remaining == 0:
            self.all_done.set()

    def fail(self, error: BaseException) -> None:
        """A timer's callback raised: `run` re-raises it instead of waiting forever."""
        self.error = error
        self.all_done.set()

    def _launch(self, i: int) -> None:
        self.timers.pop(i, None)
        task = self.loop.create_task(self._request(i))
        self.tasks.add(task)
        task.add_done_callback(self._request_done)

    def _request_done(self, task: asyncio.Task) -> None:
        # `send` never raises, but `on_done` (the caller's progress, a Ctrl-C inside it) may: the error stops
        # the run through `run`, and is retrieved here so that asyncio never logs it as lost on top of that
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.fail(task.exception())

    async def _request(self, i: int) -> None:
        o = self.outcomes[i]
        if self.gate is not None:
            await self.gate.acquire()
        try:
            if self.pacing.duration_s is not None and self.now() > self.pacing.duration_s:
                return
            o.warmup = self.sent < self.pacing.warmup_requests
            self.sent += 1
            o.sent_s = self.now()
            await self.send(o)
        finally:
            if self.gate is not None:
                self.gate.release()
            try:
                if o.status != "not_sent":
                    self.on_done(o)
            finally:
                self.finished(i)

    async def _stop(self) -> None:
        # Stopped early (cancelled, or an error): no request may start after this returns, and each one in
        # flight records its cancellation before the caller collects the outcomes.
        self.strategy.cancel()
        for handle in self.timers.values():
            handle.cancel()
        self.timers.clear()
        for t in self.tasks:
            t.cancel()
        if self.tasks:
            await asyncio.wait(set(self.tasks))


class InOrder:
    """Starts `rows` at their absolute times `at`, in that order, from one timer at a time (no accumulated
    drift: each timer aims at an absolute target). A row is launched directly when its timer fires, never
    from a timer of its own: a timer that fires late would let the next row overtake it, and the order of
    requests is what a cache hit depends on. A burst of rows already due costs no wake-up, and no row starts
    before its time."""

    def __init__(self, dispatcher: Dispatcher, rows, at: np.ndarray):
        self.dispatcher = dispatcher
        self.rows = list(rows)
        self.at = at
        self.next = 0
        self.timer: asyncio.TimerHandle | None = None

    def step(self) -> None:
        """Start every row that is due, then set the timer for the next one."""
        d = self.dispatcher
        try:
            while self.next < len(self.rows):
                delay = float(self.at[self.next]) - d.now()
                if delay > 0:
                    self.timer = d.loop.call_later(delay, self._due)
                    return
                self._start_next()
        except Exception as e:  # a callback's exception would otherwise leave `run` waiting
            d.fail(e)

    def _due(self) -> None:
        # Timers may fire a little early (uvloop's count whole milliseconds from the loop's cached time): `step`
        # starts the row only once its time has come, and otherwise sets the timer again for what is left
        # (below a millisecond that is the loop's next turn, which still serves the requests in flight).
        self.timer = None
        self.step()

    def _start_next(self) -> None:
        i, t = self.rows[self.next], float(self.at[self.next])
        self.next += 1
        self.dispatcher.start(i, t, due=True)

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


class OpenLoop:
    """Modes `trace` and `rate`: every row at its precomputed time, in trace order, whatever the answers."""

    def __init__(self, dispatcher: Dispatcher):
        self.order = InOrder(dispatcher, range(len(dispatcher.outcomes)), dispatcher.t0 + dispatcher.offsets)

    def begin(self) -> None:
        self.order.step()

    def finished(self, i: int) -> None:
        pass

    def cancel(self) -> None:
        self.order.cancel()


class ClosedLoopSessions:
    """Mode `sessions`: rows that wait for nothing go at their (scaled) trace time, in order; any other row
    goes `think_time_s` after the last of its predecessors (`predecessors`) finished, never before its trace
    time."""

    def __init__(self, dispatcher: Dispatcher):
        self.dispatcher = d = dispatcher
        n, rows = len(d.outcomes), d.rows
        preds = predecessors(rows)
        self.waiting = [len(p) for p in preds]
        self.successors: list[list[int]] = [[] for _ in range(n)]
        for i, p in enumerate(preds):
            for j in p:
                self.successors[j].append(i)
        self.think = (
            rows.column("think_time_s").fill_null(0.0).to_numpy().astype(np.float64)
            if "think_time_s" in rows.column_names
            else np.zeros(n)
        )
        self.ready = d.t0 + d.offsets  # earliest start of each row, raised as its predecessors finish
        roots = [i for i in range(n) if not preds[i]]
        self.roots = InOrder(d, roots, self.ready[roots])

    def begin(self) -> None:
        self.roots.step()

    def finished(self, i: int) -> None:
        t = self.dispatcher.now()
        for s in self.successors[i]:
            self.waiting[s] -= 1
            self.ready[s] = max(self.ready[s], t)
            if self.waiting[s] == 0:
                self.dispatcher.start(s, self.ready[s] + self.think[s])

    def cancel(self) -> None:
        self.roots.cancel()
