"""The live side of pacing (kvbench/run/pacing.py declares the modes, the options and each request's Outcome):
the asyncio dispatcher that sends a replay's requests at their scheduled times, with --max-concurrency, --duration
and the warm-up applied, and records what happened to each."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pyarrow as pa

from kvbench.run.pacing import Outcome, Pacing, predecessors, schedule_offsets


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
