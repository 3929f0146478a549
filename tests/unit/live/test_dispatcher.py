"""The dispatcher on a virtual clock: each pacing mode's order and send times, exactly, and no polling.

The event loop below never waits: when it would sleep until its next timer, it moves its clock there instead
and counts one wake-up. A run of any length costs a few wake-ups per request, where a polling dispatcher
would cost one per polling period; and every time is exact, so no assertion depends on the machine's load.
"""

from __future__ import annotations

import asyncio
import selectors

import numpy as np
import pyarrow as pa
import pytest

from kvbench.live import dispatch as pacing
from kvbench.live.dispatch import Dispatcher, dispatch
from kvbench.run.pacing import Outcome, Pacing, open_loop_offsets

from ...conftest import make_trace


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to its next timer instead of waiting for it; `wakeups` counts the jumps."""

    def __init__(self):
        self.virtual_now = 0.0
        self.wakeups = 0
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self.virtual_now


class _JumpingSelector(selectors.SelectSelector):
    def __init__(self, loop: VirtualClockLoop):
        super().__init__()
        self.loop = loop

    def select(self, timeout=None):
        if timeout is None:  # nothing ready and no timer: a real loop would hang here
            raise AssertionError("the dispatcher waits for something that never comes")
        if timeout > 0:
            self.loop.wakeups += 1
            self.loop.virtual_now += timeout
        return super().select(0)


def replay(table: pa.Table, pace: Pacing, busy_s=lambda row: 0.0, n=None, cancel_at=None, **kwargs):
    """Dispatch `table` on a virtual clock; request `row` takes busy_s(row) virtual seconds. Returns the
    outcomes, the rows in the order they were sent, the rows on_done saw, and the loop."""
    loop = VirtualClockLoop()
    outcomes = [Outcome(row=i) for i in range(table.num_rows if n is None else n)]
    order, done = [], []

    async def send(o: Outcome) -> None:
        order.append(o.row)
        try:
            await asyncio.sleep(busy_s(o.row))
        except asyncio.CancelledError:
            o.status = "cancelled"
            raise
        o.status = "ok"

    async def main() -> None:
        d = Dispatcher(table, pace, outcomes, send, done.append, 0.0, clock=loop.time, **kwargs)
        running = asyncio.ensure_future(d.run())
        if cancel_at is not None:
            loop.call_at(cancel_at, running.cancel)
        try:
            await running
        except asyncio.CancelledError:
            pass

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return outcomes, order, [o.row for o in done], loop


def times(outcomes, field):
    return [getattr(o, field) for o in outcomes]


def test_trace_mode_sends_each_row_at_its_scaled_trace_time():
    table = pa.table({"arrival_s": [10.0, 11.0, 13.0, 13.0]})
    outcomes, order, done, _ = replay(table, Pacing(time_scale=2.0), busy_s=lambda r: 7.0)
    assert order == [0, 1, 2, 3] and sorted(done) == order
    assert times(outcomes, "scheduled_s") == pytest.approx([0.0, 2.0, 6.0, 6.0])
    assert times(outcomes, "sent_s") == pytest.approx([0.0, 2.0, 6.0, 6.0])


def test_rate_mode_follows_its_gamma_schedule_in_trace_order():
    pace = Pacing(mode="rate", rate=3.0, burstiness=0.5, seed=7)
    table = pa.table({"arrival_s": np.zeros(40)})
    outcomes, order, _, _ = replay(table, pace, busy_s=lambda r: 1.0)
    expected = open_loop_offsets(np.zeros(40), pace)
    assert order == list(range(40))
    assert times(outcomes, "sent_s") == pytest.approx(list(expected))


def test_sessions_mode_waits_for_the_previous_turn_its_dependencies_and_think_time():
    table = make_trace(
        n=4,
        arrival_s=[0.0, 1.0, 2.0, 3.0],
        session_id=["a", "b", "a", "c"],
        think_time_s=[0.0, 0.0, 5.0, 1.0],
        parent_id=[None] * 4,
        depends_on=[[], [], [], ["r0", "r1"]],
    )
    busy = {0: 10.0, 1: 2.0, 2: 1.0, 3: 1.0}
    outcomes, order, _, _ = replay(table, Pacing(mode="sessions"), busy_s=busy.get)
    # r2: its session's previous turn r0 ends at 10, then 5 s of think time; r3: r0 (10) and r1 (3), then 1 s
    assert times(outcomes, "scheduled_s") == pytest.approx([0.0, 1.0, 15.0, 11.0])
    assert times(outcomes, "sent_s") == pytest.approx([0.0, 1.0, 15.0, 11.0])
    assert order == [0, 1, 3, 2]


def test_sessions_mode_never_sends_before_the_trace_time():
    table = make_trace(n=2, arrival_s=[0.0, 50.0], session_id=["a", "a"], parent_id=[None] * 2, depends_on=[[], []])
    outcomes, _, _, _ = replay(table, Pacing(mode="sessions"), busy_s=lambda r: 1.0)
    assert times(outcomes, "sent_s") == pytest.approx([0.0, 50.0])


def test_waiting_for_a_concurrency_slot_is_recorded_as_lag():
    table = pa.table({"arrival_s": [0.0, 0.0, 0.0]})
    outcomes, order, _, _ = replay(table, Pacing(max_concurrency=1), busy_s=lambda r: 4.0)
    assert order == [0, 1, 2]
    assert times(outcomes, "scheduled_s") == pytest.approx([0.0, 0.0, 0.0])
    assert times(outcomes, "sent_s") == pytest.approx([0.0, 4.0, 8.0])


def test_duration_cuts_the_rows_due_after_it():
    table = pa.table({"arrival_s": [0.0, 5.0, 20.0]})
    outcomes, order, done, _ = replay(table, Pacing(duration_s=10.0, warmup_requests=1), busy_s=lambda r: 1.0)
    assert order == done == [0, 1]
    assert times(outcomes, "status") == ["ok", "ok", "not_sent"]
    assert times(outcomes, "warmup") == [True, False, False]
    assert outcomes[2].scheduled_s == pytest.approx(20.0)


def test_a_shard_keeps_its_rows_times_in_the_whole_schedule():
    table = pa.table({"arrival_s": [0.0, 0.0]})
    outcomes, _, _, _ = replay(table, Pacing(), offsets=np.array([3.0, 8.0]), start_at=2.0)
    assert times(outcomes, "sent_s") == pytest.approx([5.0, 10.0])


def test_cancelling_cancels_the_requests_in_flight_and_starts_no_more():
    table = pa.table({"arrival_s": [0.0, 1.0, 30.0]})
    outcomes, order, done, _ = replay(table, Pacing(), busy_s=lambda r: 10.0, cancel_at=5.0)
    assert order == [0, 1]
    assert times(outcomes, "status") == ["cancelled", "cancelled", "not_sent"]
    assert sorted(done) == [0, 1]


@pytest.mark.parametrize("mode", ["trace", "sessions"])
def test_a_long_run_costs_a_few_wakeups_per_request_not_one_per_millisecond(mode):
    """100 requests over 10,000 virtual seconds: a dispatcher that polled every millisecond would wake up
    ten million times; this one wakes for each send time and each answer."""
    n = 100
    table = make_trace(
        n=n,
        arrival_s=[100.0 * i for i in range(n)],
        session_id=[f"s{i % 10}" for i in range(n)],
        parent_id=[None] * n,
        depends_on=[[]] * n,
    )
    outcomes, order, _, loop = replay(table, Pacing(mode=mode), busy_s=lambda r: 3.0)
    assert order == list(range(n)) and all(o.status == "ok" for o in outcomes)
    assert loop.time() == pytest.approx(100.0 * (n - 1) + 3.0)
    assert loop.wakeups <= 2 * n


@pytest.mark.parametrize("mode", ["trace", "rate", "sessions"])
def test_the_dispatcher_never_sleeps_to_wait(monkeypatch, mode):
    """Every wait is a timer, an event or a completion, never `asyncio.sleep` (whose short, repeated form is
    polling); on the real clock, through the public `dispatch`."""
    slept = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay, *args, **kwargs):
        slept.append(delay)
        return await real_sleep(delay, *args, **kwargs)

    monkeypatch.setattr(pacing.asyncio, "sleep", recording_sleep)
    table = make_trace(
        n=4,
        arrival_s=[0.0, 0.01, 0.02, 0.03],
        session_id=["a", "a", "b", "b"],
        think_time_s=[0.0, 0.01, 0.0, 0.01],
        parent_id=[None] * 4,
        depends_on=[[]] * 4,
    )
    outcomes = [Outcome(row=i) for i in range(4)]

    async def send(o: Outcome) -> None:
        o.status = "ok"

    pace = Pacing(mode=mode, rate=100.0 if mode == "rate" else None)
    asyncio.run(dispatch(table, pace, outcomes, send, lambda o: None, pacing.time.perf_counter()))
    assert all(o.status == "ok" for o in outcomes)
    assert slept == []
