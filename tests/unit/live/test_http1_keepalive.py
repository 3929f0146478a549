"""Kept-alive connections that the server closes (kvbench/live/http1.py): an answer with `Connection: close` ends
its connection; a request that crosses the close of a reused connection (no byte of an answer back) is sent once
more on a fresh one and is no fault; a connection that drops on a fresh connection, or once an answer began,
stays the request's fault. Against the fake server's keep-alive modes and the raw scripted server of
test_http1.py."""

from __future__ import annotations

import asyncio

from kvbench.live.client import OpenAIClient
from kvbench.run.pacing import Outcome
from kvbench.testing.fakeserver import FakeServer, fault_plan

from .conftest import RunningServer
from .test_http1 import EVENTS, SSE, assert_ok, chunked, run

PAYLOAD = b'{"prompt":[1,2,3,4],"max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}'


async def _send_all(url: str, n: int, settle) -> tuple[list[Outcome], int]:
    """n requests one after another; `settle(pool)` is awaited between them. Returns the outcomes and how many
    requests the client sent again."""
    outcomes = []
    async with OpenAIClient(url, endpoint="completions", timeout_s=5.0, api_key=None, origin=0.0) as c:
        assert c.pool is not None  # plain http: kvbench's own client
        for _ in range(n):
            o = Outcome(row=0)
            await c.send(PAYLOAD, o)
            outcomes.append(o)
            await settle(c.pool)
        return outcomes, c.pool.resent


async def _until(condition) -> None:
    """Wait (event-loop turns, bounded) until condition() holds; no timing is asserted."""
    for _ in range(5000):
        if condition():
            return
        await asyncio.sleep(0.001)


async def _kept(pool) -> None:
    # a request is done at [DONE]; its connection goes back to the pool once the body's last chunk came: wait for
    # that, so that the next request reuses it
    await _until(lambda: pool.idle or not pool.connections)


def serve(**kw) -> RunningServer:
    return RunningServer(FakeServer(**kw))


def statuses(outcomes: list[Outcome]) -> list[str]:
    return [o.status for o in outcomes]


def test_connection_close_answers_end_their_connection_and_nothing_is_resent():
    """cpp-httplib's keep-alive count: the N-th answer on a connection says `Connection: close` and closes it."""
    srv = serve(keepalive_max=3)
    try:
        outcomes, resent = asyncio.run(_send_all(srv.url, 10, _kept))
    finally:
        srv.stop()
    assert statuses(outcomes) == ["ok"] * 10, [o.error for o in outcomes]
    assert srv.server.received == 10 and resent == 0  # never written on a closed connection


def test_a_request_crossing_a_reused_connections_close_is_resent_once_and_is_no_fault():
    """llama-server's way: the connection closes after each answer while the answer says Keep-Alive; the next
    request written on it gets no byte back. It goes again on a fresh connection, is answered once and is ok."""
    srv = serve(close_after=1)
    try:
        outcomes, resent = asyncio.run(_send_all(srv.url, 10, _kept))
    finally:
        srv.stop()
    assert statuses(outcomes) == ["ok"] * 10, [o.error for o in outcomes]
    for o in outcomes:
        assert o.completion_tokens == 3 and o.prompt_tokens == 4
    assert srv.server.dropped > 0 and resent == srv.server.dropped  # each dropped request sent again, once
    assert srv.server.received == 10  # every request answered exactly once: none lost, none doubled


def test_connections_closed_while_idle_are_not_reused():
    srv = serve(idle_timeout_s=0.05)

    async def idle_out(pool):  # until the server's idle timeout closed the connection and the client saw it
        await _kept(pool)
        await _until(lambda: not pool.connections)

    try:
        outcomes, resent = asyncio.run(_send_all(srv.url, 4, idle_out))
    finally:
        srv.stop()
    assert statuses(outcomes) == ["ok"] * 4, [o.error for o in outcomes]
    assert srv.server.received == 4


def test_a_drop_on_a_fresh_connection_is_still_a_fault():
    srv = serve(close_after=0)  # every connection is closed before its first answer: no stale connection
    try:
        outcomes, resent = asyncio.run(_send_all(srv.url, 3, _kept))
    finally:
        srv.stop()
    for o in outcomes:
        assert o.status == "error" and o.error.startswith("connection dropped: "), o.error
    assert resent == 0 and srv.server.received == 0 and srv.server.dropped == 3


def test_faults_on_reused_connections_stay_faults():
    """A stream cut on a kept-alive connection (an answer began) is recorded, never resent."""
    srv = RunningServer(FakeServer(fault=fault_plan(["3:cut", "5:http500"])))
    try:
        outcomes, resent = asyncio.run(_send_all(srv.url, 8, _kept))
    finally:
        srv.stop()
    assert statuses(outcomes) == ["ok"] * 3 + ["error", "ok", "error", "ok", "ok"]
    assert outcomes[3].error.startswith("stream cut: ") and outcomes[5].error.startswith("http 500: ")
    assert resent == 0 and srv.server.received == 8


ANSWER = SSE + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(EVENTS)


def test_a_resent_request_that_drops_again_is_a_fault():
    # request 2 crosses the close of the reused connection; sent again on a fresh one, that drops it too
    outcomes, connections = run([[ANSWER], [None], [None]], n=2, cut=4096)
    assert_ok(outcomes[0])
    assert outcomes[1].status == "error" and outcomes[1].error.startswith("connection dropped: ")
    assert connections == 2  # sent again once, not more


def test_a_reused_connection_that_drops_after_answer_bytes_is_not_resent():
    for partial, error in [(b"HTTP/1.1 200 OK\r\nContent-", "connection dropped: "), (ANSWER[:120], "stream cut: ")]:
        outcomes, connections = run([[ANSWER], [partial, None], [ANSWER]], n=2, cut=4096)
        assert_ok(outcomes[0])
        assert outcomes[1].status == "error" and outcomes[1].error.startswith(error), outcomes[1].error
        assert connections == 1


def test_http10_answers_without_keep_alive_end_their_connection():
    sized = b"Content-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(EVENTS) + EVENTS
    outcomes, connections = run([[b"HTTP/1.0 200 OK\r\n" + sized], [b"HTTP/1.1 200 OK\r\n" + sized]], cut=4096)
    for o in outcomes:
        assert_ok(o)
    assert connections == 2


def test_a_replay_records_how_many_requests_it_sent_again(tmp_path):
    """The count reaches summary.json (per point), and every trace request has one ok row."""
    import pyarrow.parquet as pq

    from kvbench.run.runner import run_replay

    from ...conftest import CHAT

    srv = serve(close_after=1)
    try:
        opts = {"url": srv.url, "mode": "rate", "rate": 200.0, "max_requests": 40, "max_concurrency": 1}
        run_dir, summary = run_replay(CHAT, "openai", opts, out=tmp_path / "r", report=False)
    finally:
        srv.stop()
    rows = pq.read_table(run_dir / "requests.parquet")
    assert set(rows.column("status").to_pylist()) == {"ok"}
    point = summary["points"][0]
    assert srv.server.dropped > 0 and point["requests_resent"] == srv.server.dropped
