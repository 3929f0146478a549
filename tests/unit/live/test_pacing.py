"""Pacing: open-loop schedules, closed-loop sessions and dependencies, concurrency limits (fake server)."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from kvbench.errors import KvbenchError
from kvbench.live.dispatch import dispatch
from kvbench.run.pacing import Outcome, Pacing, open_loop_offsets, predecessors
from kvbench.run.runner import run_replay
from kvbench.trace.files import new_meta, write_trace

from ...conftest import CHAT, make_trace


def test_trace_mode_scales_timestamps():
    arrival = np.array([5.0, 5.5, 7.0])
    np.testing.assert_allclose(open_loop_offsets(arrival, Pacing(time_scale=2.0)), [0.0, 1.0, 4.0])


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_rate_mode_has_the_asked_rate_and_burstiness(burstiness):
    t = open_loop_offsets(np.zeros(20000), Pacing(mode="rate", rate=50.0, burstiness=burstiness, seed=3))
    gaps = np.diff(t)
    assert t[0] == 0 and np.all(gaps >= 0)
    assert abs(1 / gaps.mean() - 50.0) < 2.0
    # gamma(shape k): coefficient of variation 1/sqrt(k) (1 = Poisson)
    assert abs(gaps.std() / gaps.mean() - 1 / np.sqrt(burstiness)) < 0.05


def test_rate_mode_needs_a_rate():
    with pytest.raises(KvbenchError, match="--rate"):
        Pacing(mode="rate")


def test_predecessors_follow_sessions_and_dependencies():
    t = make_trace(n=5, session_id=["a", "b", "a", "b", "c"], depends_on=[[], [], [], [], ["r2", "r3"]])
    assert predecessors(t) == [[], [], [0], [1], [2, 3]]


def _write(tmp_path, table, name="t.parquet"):
    return write_trace(table, tmp_path / name, new_meta(4, {"kind": "test"}))


def test_sessions_mode_waits_for_the_previous_turn_and_think_time(fake_server, tmp_path):
    n = 8
    t = make_trace(
        n=n,
        session_id=["s0", "s1"] * (n // 2),
        think_time_s=[0.0, 0.0] + [0.05] * (n - 2),
        depends_on=[[]] * n,
        parent_id=[None] * n,
        arrival_s=[0.0] * n,
    )
    srv = fake_server(itl_ms=5)
    run_dir, summary = run_replay(
        _write(tmp_path, t), "openai", {"url": srv.url, "mode": "sessions"}, out=tmp_path / "r", report=False
    )
    rows = pq.read_table(run_dir / "requests.parquet").sort_by("request_id").to_pylist()
    assert all(r["status"] == "ok" for r in rows)
    by_id = {r["request_id"]: r for r in rows}
    for i in range(2, n):
        prev = by_id[f"r{i - 2}"]
        done = prev["actual_send_s"] + prev["e2el_s"]
        assert by_id[f"r{i}"]["scheduled_send_s"] >= done + 0.05 - 1e-6  # previous turn finished + think time
        assert by_id[f"r{i}"]["actual_send_s"] >= by_id[f"r{i}"]["scheduled_send_s"]


def test_agent_merge_waits_for_every_dependency(fake_server, tmp_path):
    t = make_trace(
        n=4,
        session_id=["m", "x", "y", "m2"],
        depends_on=[[], ["r0"], ["r0"], ["r1", "r2"]],
        parent_id=[None] * 4,
        arrival_s=[0.0] * 4,
    )
    srv = fake_server(itl_ms=5)
    run_dir, _ = run_replay(
        _write(tmp_path, t), "openai", {"url": srv.url, "mode": "sessions"}, out=tmp_path / "r", report=False
    )
    r = {x["request_id"]: x for x in pq.read_table(run_dir / "requests.parquet").to_pylist()}
    end = {k: v["actual_send_s"] + v["e2el_s"] for k, v in r.items()}
    assert r["r1"]["actual_send_s"] >= end["r0"] and r["r2"]["actual_send_s"] >= end["r0"]
    assert r["r3"]["actual_send_s"] >= max(end["r1"], end["r2"])


def test_max_concurrency_is_never_exceeded(fake_server, tmp_path):
    srv = fake_server(itl_ms=2)
    run_dir, summary = run_replay(
        CHAT,
        "openai",
        {"url": srv.url, "mode": "rate", "rate": 500.0, "max_requests": 60, "max_concurrency": 3},
        out=tmp_path / "r",
        report=False,
    )
    rows = pq.read_table(run_dir / "requests.parquet")
    start = rows.column("actual_send_s").to_numpy()
    end = start + rows.column("e2el_s").to_numpy()
    events = sorted([(s, 1) for s in start] + [(e, -1) for e in end], key=lambda x: (x[0], x[1]))
    assert max(np.cumsum([d for _, d in events])) <= 3
    # waiting for a slot is schedule lag, recorded, never hidden
    lag = rows.column("actual_send_s").to_numpy() - rows.column("scheduled_send_s").to_numpy()
    assert np.all(lag >= 0) and summary["points"][0]["latency"]["schedule_lag"]["max_ms"] > 0


def test_warmup_and_max_requests(fake_server, tmp_path):
    srv = fake_server()
    run_dir, summary = run_replay(
        CHAT,
        "openai",
        {"url": srv.url, "mode": "rate", "rate": 300.0, "max_requests": 30, "warmup_requests": 10},
        out=tmp_path / "r",
        report=False,
    )
    rows = pq.read_table(run_dir / "requests.parquet")
    assert rows.num_rows == 30 and pc.sum(rows.column("warmup")).as_py() == 10
    lat = summary["points"][0]["latency"]
    assert lat["requests"]["measured"] == 20 and lat["ttft"]["count"] == 20


def test_prompts_match_the_trace_and_cache_is_reported(fake_server, tmp_path):
    srv = fake_server(block_size=16)
    run_dir, summary = run_replay(
        CHAT,
        "openai",
        {"url": srv.url, "mode": "rate", "rate": 300.0, "max_requests": 50},
        out=tmp_path / "r",
        report=False,
    )
    rows = pq.read_table(run_dir / "requests.parquet")
    assert rows.column("server_prompt_tokens").to_pylist() == rows.column("input_tokens").to_pylist()
    point = summary["points"][0]
    assert point["prompt_tokens_mismatch"] == 0
    checks = point["server_counters"]["checks"]
    assert checks["cached_tokens"]["agree"] and checks["prompt_tokens"]["agree"]
    assert checks["cached_tokens"]["server"] == pc.sum(rows.column("cached_tokens")).as_py() > 0


@pytest.mark.parametrize("seed", range(5))
def test_requests_leave_in_trace_order_even_when_the_loop_is_late(seed):
    """One request in flight at a time, due every millisecond, on an event loop that a slow `send` keeps
    busy: every request must still leave in trace order (a hit depends on what was sent before)."""
    n = 300
    rng = random.Random(seed)
    table = pa.table({"arrival_s": np.arange(n) * 0.001})
    outcomes = [Outcome(row=i) for i in range(n)]
    order = []

    async def send(o):
        order.append(o.row)
        o.status = "ok"
        time.sleep(rng.random() * 0.002)  # blocks the loop: the next request's timer fires late
        await asyncio.sleep(0)

    pacing = Pacing(mode="trace", max_concurrency=1)
    asyncio.run(dispatch(table, pacing, outcomes, send, lambda o: None, time.perf_counter()))
    assert order == list(range(n))
