"""A live run survives every server fault, records it per request, and loses no request (fake server)."""

from __future__ import annotations

import json

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from kvbench.errors import KvbenchError
from kvbench.metrics.latency import error_class
from kvbench.run.runner import run_replay

from ...conftest import CHAT
from .conftest import free_port

N = 40


def replay(url, out, **options):
    opts = {"url": url, "mode": "rate", "rate": 400.0, "max_requests": N, "timeout_s": 3.0, **options}
    return run_replay(CHAT, "openai", opts, out=out, report=False)


@pytest.mark.parametrize(
    ("fault", "status", "error"),
    [  # each error starts with its class (what a count of failures by kind reads) and a colon
        ("http500", "error", "http 500: "),
        ("http429", "error", "http 429: "),
        ("http400", "error", "http 400: "),
        ("timeout", "timeout", "timeout: no complete answer within 3 s"),
        ("cut", "error", "stream cut: "),
        ("malformed", "error", "malformed event: "),
        ("error", "error", "error event: "),
        ("html", "error", "not an event stream: the server answered text/html: <html><body><h1>502 Bad Gateway"),
        ("json", "error", 'not an event stream: the server answered application/json: {"choices"'),
    ],
)
def test_each_fault_is_recorded_and_the_run_goes_on(fake_server, tmp_path, fault, status, error):
    srv = fake_server(faults=[f"every=5:{fault}"])
    run_dir, summary = replay(srv.url, tmp_path / "run")
    rows = pq.read_table(run_dir / "requests.parquet")
    assert rows.num_rows == N  # no request lost
    assert sorted(rows.column("request_id").to_pylist()) == sorted(
        pq.read_table(CHAT, columns=["request_id"]).column(0).to_pylist()[:N]
    )
    bad = rows.filter(pc.not_equal(rows.column("status"), "ok"))
    assert bad.num_rows == N // 5  # requests 0, 5, 10, … as received
    assert set(bad.column("status").to_pylist()) == {status}
    assert all(e.startswith(error) for e in bad.column("error").to_pylist()), bad.column("error")[0]
    assert {error_class(e) for e in bad.column("error").to_pylist()} == {error.split(":")[0]}
    ok = rows.filter(pc.equal(rows.column("status"), "ok"))
    assert ok.num_rows == N - N // 5 and pc.min(ok.column("ttft_s")).as_py() > 0
    lat = summary["points"][0]["latency"]
    assert lat["requests"]["failed"] == N // 5 and lat["requests"]["ok"] == N - N // 5
    assert lat["ttft"]["count"] == N - N // 5  # failed requests left out of latency metrics
    assert summary["complete"]


def test_an_unreachable_server_stops_the_run_before_any_request(tmp_path):
    """With --served-model given no model list is needed, but a server that is not there is still found at once."""
    port = free_port()
    with pytest.raises(KvbenchError, match=rf"cannot reach the server: .*connection refused: .*127.0.0.1:{port}"):
        replay(f"http://127.0.0.1:{port}", tmp_path / "run", served_model="m")


def test_a_server_that_goes_away_is_recorded_as_connection_refused():
    import asyncio

    from kvbench.live.client import OpenAIClient
    from kvbench.run.pacing import Outcome

    async def send():
        o = Outcome(row=0)
        url = f"http://127.0.0.1:{free_port()}"
        async with OpenAIClient(url, endpoint="completions", timeout_s=3, api_key=None, origin=0.0) as client:
            await client.send(b"{}", o)
        return o

    o = asyncio.run(send())
    assert o.status == "error" and o.error.startswith("connection refused: nothing listens on 127.0.0.1:")


def test_interrupted_run_keeps_a_readable_partial_result(fake_server, tmp_path, monkeypatch):
    """Ctrl-C in the middle: requests.parquet and summary.json are complete files with every request."""
    import kvbench.live.replay as live

    srv = fake_server(itl_ms=2)
    done = []
    real = live.run_live

    def progress(outcome):
        done.append(outcome)
        if len(done) == 10:
            raise KeyboardInterrupt

    monkeypatch.setattr(live, "FLUSH_EVERY", 4)
    run_dir, summary = run_replay(
        CHAT,
        "openai",
        {"url": srv.url, "mode": "rate", "rate": 50.0, "max_requests": N},
        out=tmp_path / "r",
        report=False,
        progress=progress,
    )
    assert real is live.run_live
    assert summary["interrupted"] and not summary["complete"]
    rows = pq.read_table(run_dir / "requests.parquet")
    assert rows.num_rows == N
    statuses = rows.column("status").to_pylist()
    assert statuses.count("ok") >= 9 and set(statuses) <= {"ok", "cancelled", "not_sent"}
    assert json.loads((run_dir / "summary.json").read_text())["interrupted"]


def test_resume_sends_only_what_an_interrupted_run_did_not_answer(fake_server, tmp_path):
    srv = fake_server(itl_ms=2)
    done = []

    def progress(outcome):
        done.append(outcome)
        if len(done) == 12:
            raise KeyboardInterrupt

    opts = {"url": srv.url, "mode": "rate", "rate": 50.0, "max_requests": N}
    out = tmp_path / "r"
    _, first = run_replay(CHAT, "openai", opts, out=out, report=False, progress=progress)
    assert first["interrupted"]
    before = pq.read_table(out / "requests.parquet")
    answered = before.filter(pc.equal(before.column("status"), "ok"))
    received = srv.server.received
    run_dir, summary = run_replay(CHAT, "openai", opts, out=out, report=False, resume=True)
    rows = pq.read_table(run_dir / "requests.parquet")
    assert rows.num_rows == N and set(rows.column("status").to_pylist()) == {"ok"}
    assert sorted(rows.column("request_id").to_pylist()) == sorted(before.column("request_id").to_pylist())
    assert srv.server.received - received == N - answered.num_rows  # answered requests were not sent again
    kept = rows.filter(pc.is_in(rows.column("request_id"), answered.column("request_id")))
    assert sorted(kept.column("ttft_s").to_pylist()) == sorted(answered.column("ttft_s").to_pylist())
    assert summary["resumed_requests"] == answered.num_rows and summary["complete"]
    assert summary["points"][0]["latency"]["requests"]["ok"] == N
