"""Distributed load generation (`--workers 2 --executor ray`) against the fake server, on a local Ray cluster:
the merged run is the single client's, sessions stay whole, and a killed worker loses only its own part."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvbench.errors import KvbenchError
from kvbench.live import distributed
from kvbench.live.distributed import shard_sessions, sharding_units
from kvbench.run.runner import run_replay
from kvbench.trace.files import new_meta, write_trace

from ...conftest import make_trace
from .conftest import free_port

TURNS = [6, 5, 4, 4, 3, 3, 3, 2, 2, 1]  # sessions s0…s9 and their turns
LOOSE = 4  # requests without a session
N = sum(TURNS) + LOOSE + 2  # + a merge request (session m) that waits for s1 and s2, and its follow-up


def sessions_trace() -> pa.Table:
    """Multi-turn sessions whose turns extend the previous prompt, loose requests, and an agent-style merge
    (depends_on across sessions, which joins s1, s2 and m into one sharding unit)."""
    rows = []
    for s, turns in enumerate(TURNS):
        for k in range(turns):
            rows.append(
                {"arrival_s": 0.1 * s + 0.25 * k, "session_id": f"s{s}", "blocks": [1000 * s + b for b in range(3 + k)]}
            )
            rows[-1]["parent"] = len(rows) - 2 if k else None
    last = {r["session_id"]: i for i, r in enumerate(rows)}
    for j in range(LOOSE):
        rows.append({"arrival_s": 0.05 + 0.3 * j, "session_id": None, "blocks": [90_000 + j], "parent": None})
    rows.append({"arrival_s": 1.5, "session_id": "m", "blocks": [80_000], "parent": None, "deps": ["s1", "s2"]})
    rows.append({"arrival_s": 1.6, "session_id": "m", "blocks": [80_000, 80_001], "parent": len(rows) - 1})
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["arrival_s"], i))
    rid = {i: f"q{i}" for i in range(len(rows))}
    pick = [rows[i] for i in order]
    return make_trace(
        n=len(pick),
        request_id=[rid[i] for i in order],
        arrival_s=[r["arrival_s"] for r in pick],
        input_tokens=[4 * len(r["blocks"]) for r in pick],
        output_tokens=[4] * len(pick),
        block_hashes=[r["blocks"] for r in pick],
        session_id=[r["session_id"] for r in pick],
        parent_id=[rid[r["parent"]] if r["parent"] is not None else None for r in pick],
        depends_on=[[rid[last[s]] for s in r.get("deps", ())] for r in pick],
        think_time_s=[0.02] * len(pick),
    )


@pytest.fixture
def trace(tmp_path, monkeypatch):
    monkeypatch.setattr(distributed, "START_MARGIN_S", 0.5)  # a local fake server: workers connect at once
    return write_trace(sessions_trace(), tmp_path / "sessions.parquet", new_meta(4, {"kind": "test"}))


def replay(trace, url, out, **options):
    opts = {"url": url, "mode": "trace", "timeout_s": 10.0, **options}
    extra = {k: opts.pop(k) for k in ("workers", "executor", "progress") if k in opts}
    return run_replay(trace, "openai", opts, out=out, report=False, **extra)


def rows_of(run_dir):
    return {r["request_id"]: r for r in pq.read_table(run_dir / "requests.parquet").to_pylist()}


def test_sharding_keeps_linked_sessions_together_and_balances_requests():
    table = sessions_trace()
    ids = table.column("request_id").to_pylist()
    sessions = table.column("session_id").to_pylist()
    units = sharding_units(table)
    assert sorted(i for u in units for i in u) == list(range(N))
    merged = next(u for u in units if any(sessions[i] == "m" for i in u))
    assert {sessions[i] for i in merged} == {"s1", "s2", "m"}  # joined through depends_on
    assert sum(1 for u in units if sessions[u[0]] is None) == LOOSE  # a loose request is its own unit
    shards = shard_sessions(table, 2)
    assert shards == shard_sessions(table, 2)  # deterministic
    sizes = [len(s.rows) for s in shards]
    assert sum(sizes) == N and abs(sizes[0] - sizes[1]) <= 1
    owner = {sessions[r] or ids[r]: s.worker for s in shards for r in s.rows}
    assert all(owner[sessions[r] or ids[r]] == s.worker for s in shards for r in s.rows)  # no session split


def test_run_counters_come_from_the_scrapes_that_bound_every_worker():
    """The after-scrape is the one of the worker that stopped sending last, even when another worker's slower
    scrape ended later (that one could have missed the last worker's last answer)."""

    def final(connected, sent_until, before, after, resent=0):
        return {
            "connected_at_s": connected,
            "sent_until_s": sent_until,
            "extra": {
                "server": {"counters_before": {"prompt_tokens": before}, "counters_after": {"prompt_tokens": after}},
                "requests_resent": resent,
            },
        }

    early_slow = final(-0.2, 10.00, 100.0, 900.0, resent=2)  # stopped first, but its scrape took long
    late_fast = final(-0.1, 10.02, 150.0, 1000.0, resent=3)  # its last answer came after the other's scrape began
    merged = distributed._merged_extra([early_slow, late_fast])
    assert merged["requests_resent"] == 5  # each worker's own client: the run's count is their sum
    server = merged["server"]
    assert server["counters_before"] == {"prompt_tokens": 100.0}  # the scrape that ended first: before any send
    assert server["counters_after"] == {"prompt_tokens": 1000.0}


def test_workers_need_a_live_backend_and_ray(tmp_path, trace):
    with pytest.raises(KvbenchError, match="live backend"):
        run_replay(trace, "sim", {"policy": "lru", "capacity": "100"}, out=tmp_path / "sim", workers=2)
    with pytest.raises(KvbenchError, match="--executor ray"):
        replay(trace, "http://127.0.0.1:1", tmp_path / "local", workers=2)


def test_two_workers_replay_the_single_client_schedule(ray_cluster, fake_server, tmp_path, trace):
    srv = fake_server()
    # mode rate: its gaps are drawn over the whole trace, so a shard's own schedule would differ
    opts = {"mode": "rate", "rate": 40.0, "max_concurrency": 4}
    single, _ = replay(trace, srv.url, tmp_path / "single", **opts)
    run_dir, summary = replay(trace, srv.url, tmp_path / "ray", workers=2, executor="ray", **opts)
    one, two = rows_of(single), rows_of(run_dir)
    assert set(two) == set(one) and len(two) == N
    assert {r["status"] for r in two.values()} == {"ok"}
    # the same schedule: scheduled send times equal up to the start instant (the single client's starts
    # after it connected, the workers' at the shared start)
    ids = sorted(one)
    a = np.array([one[i]["scheduled_send_s"] for i in ids])
    b = np.array([two[i]["scheduled_send_s"] for i in ids])
    np.testing.assert_allclose(a - a.min(), b - b.min(), atol=1e-9)
    assert b.min() == 0.0  # the shared start is every worker's zero
    workers = summary["workers"]
    assert [w["id"] for w in workers] == [0, 1] and {w["status"] for w in workers} == {"alive"}
    assert sum(w["requests"] for w in workers) == N and sum(w["ok"] for w in workers) == N
    assert all(w["schedule_lag"]["p99_ms"] is not None and w["unfinished_requests"] == 0 for w in workers)
    listed = [u for w in workers for u in w["session_ids"]]
    assert len(listed) == len(set(listed))  # every session on exactly one worker
    assert summary["points"][0]["latency"]["requests"]["ok"] == N and summary["complete"]


def test_closed_loop_dependencies_hold_across_the_merged_run(ray_cluster, fake_server, tmp_path, trace):
    srv = fake_server(itl_ms=2)
    run_dir, summary = replay(trace, srv.url, tmp_path / "ray", workers=2, executor="ray", mode="sessions")
    rows = rows_of(run_dir)
    assert len(rows) == N and {r["status"] for r in rows.values()} == {"ok"}
    table = sessions_trace().to_pylist()
    for r in table:
        waits_for = ([r["parent_id"]] if r["parent_id"] else []) + list(r["depends_on"] or ())
        for p in waits_for:  # one clock: a predecessor on the same worker finished before this was sent
            done = rows[p]["actual_send_s"] + rows[p]["e2el_s"]
            assert rows[r["request_id"]]["scheduled_send_s"] >= done + 0.02 - 1e-6
    assert summary["workers_dead"] == 0


def test_a_killed_worker_is_reported_and_the_rest_is_kept(ray_cluster, fake_server, tmp_path, trace):
    from ray.util import list_named_actors

    srv = fake_server(itl_ms=40)  # ~0.2 s a request: the run lasts a few seconds
    run_id = "killed"
    seen = []

    def progress(outcome):
        seen.append(outcome)
        if len(seen) == 1:  # after the first batch: worker 1 still has sessions under way
            (name,) = [a for a in list_named_actors() if a.startswith(f"kvbench-{run_id}-") and a.endswith("-w1")]
            ray_cluster.kill(ray_cluster.get_actor(name))

    run_dir, summary = replay(
        trace, srv.url, tmp_path / run_id, workers=2, executor="ray", time_scale=2.0, progress=progress
    )
    rows = rows_of(run_dir)
    assert len(rows) == N  # every request is recorded
    arrival = dict(zip(*sessions_trace().select(["request_id", "arrival_s"]).to_pydict().values()))
    for rid, r in rows.items():  # mode trace: each worker sent on the trace's clock from the shared start
        if r["status"] != "worker_lost":
            assert r["scheduled_send_s"] == pytest.approx(2.0 * arrival[rid], abs=1e-9)
    w0, w1 = summary["workers"]
    assert w0["status"] == "alive" and w0["ok"] == w0["requests"] and w0["unfinished_sessions"] == []
    assert w1["status"] == "dead" and "ray.kill" in w1["error"]
    assert w1["unfinished_sessions"] and set(w1["unfinished_sessions"]) <= set(w1["session_ids"])
    lost = {rid: r for rid, r in rows.items() if r["status"] == "worker_lost"}
    assert len(lost) == w1["unfinished_requests"] > 0
    assert all(r["error"].startswith("worker 1 ") for r in lost.values())
    ok = sum(r["status"] == "ok" for r in rows.values())
    assert ok == N - len(lost) and ok >= w0["requests"]  # worker 0 all ok, worker 1's reported part kept
    assert summary["workers_dead"] == 1 and summary["complete"]
    lat = summary["points"][0]["latency"]["requests"]
    assert lat["ok"] == ok and lat["not_sent"] == len(lost)


def test_interrupted_distributed_run_keeps_what_was_measured_and_resumes(ray_cluster, fake_server, tmp_path, trace):
    srv = fake_server(itl_ms=20)
    seen = []

    def progress(outcome):
        seen.append(outcome)
        if len(seen) == 3:
            raise KeyboardInterrupt

    out = tmp_path / "r"
    run_dir, summary = replay(trace, srv.url, out, workers=2, executor="ray", progress=progress)
    rows = pq.read_table(run_dir / "requests.parquet")
    assert rows.num_rows == N and summary["interrupted"] and not summary["complete"]
    statuses = rows.column("status").to_pylist()
    assert statuses.count("ok") >= 3 and set(statuses) <= {"ok", "cancelled", "not_sent"}
    assert {w["status"] for w in summary["workers"]} == {"alive"}  # stopped, not lost
    answered = statuses.count("ok")
    assert answered == summary["points"][0]["latency"]["requests"]["ok"]
    received = srv.server.received
    # --resume sends only what was not answered, again over two workers, and the run is whole
    run_dir, summary = run_replay(
        trace, "openai", {"url": srv.url, "mode": "trace"}, out=out, report=False, resume=True, workers=2,
        executor="ray",
    )  # fmt: skip
    rows = pq.read_table(run_dir / "requests.parquet")
    assert rows.num_rows == N and set(rows.column("status").to_pylist()) == {"ok"}
    assert srv.server.received - received == N - answered
    assert summary["resumed_requests"] == answered and sum(w["requests"] for w in summary["workers"]) == N - answered


def test_a_worker_that_cannot_connect_fails_the_run_as_one_client_would(ray_cluster, tmp_path, trace):
    with pytest.raises(KvbenchError, match=r"worker 0 \(.*\): cannot list models"):
        replay(trace, f"http://127.0.0.1:{free_port()}", tmp_path / "r", workers=2, executor="ray")
    assert not (tmp_path / "r").exists()  # nothing was sent: no run directory is left behind (rundir.py)


def test_cli_reports_a_dead_worker(tmp_path, monkeypatch):
    from click.testing import CliRunner

    import kvbench.run.runner
    from kvbench.cli import main

    dead = {"id": 1, "host": "node-b", "status": "dead", "error": "killed", "unfinished_requests": 3}
    workers = [
        {"id": 0, "host": "node-a", "status": "alive", "schedule_lag": {"p99_ms": 1.5}},
        {**dead, "unfinished_sessions": ["s1", "s4"], "schedule_lag": {"p99_ms": None}},
    ]
    summary = {"points": [], "curves": [], "workers": workers}
    monkeypatch.setattr(kvbench.run.runner, "run_replay", lambda *a, **k: (tmp_path, summary))
    args = ["replay", "t.parquet", "--backend", "openai", "--url", "http://x", "--workers", "2", "--executor", "ray"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 4, result.output  # lost work is not success: --resume sends it
    assert "worker 1 on node-b died: killed; 3 requests of 2 sessions unfinished (s1, s4)" in result.output
    assert "3 requests were not answered (worker_lost); resume with: kvbench " in result.output
    assert result.output.rstrip().endswith("--resume")  # (the arguments are the test runner's here)
    assert "1 of 2 alive, schedule lag p99 at most 1.5 ms" in result.output
