"""A live client that keeps its schedule (issue 18): uvloop for the run's loop, no request before its time,
the stream read as it arrives, the collector kept out of the run, results flushed by time (fake servers)."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time

import pyarrow.parquet as pq
import pytest
from aiohttp import web

import kvbench.live.replay as live
from kvbench.live.client import OpenAIClient
from kvbench.run.pacing import Outcome
from kvbench.run.resultparts import list_parts
from kvbench.run.runner import run_replay

from ...conftest import CHAT, make_trace
from .conftest import free_port
from .test_pacing import _write

N = 40


def test_the_run_loop_is_uvloop_when_installed_and_asyncio_otherwise(monkeypatch):
    uvloop = pytest.importorskip("uvloop")

    async def kind():
        return type(asyncio.get_running_loop())

    with live.event_loop() as runner:
        assert runner.run(kind()) is uvloop.Loop
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import fails: asyncio's own loop
    with live.event_loop() as runner:
        assert not issubclass(runner.run(kind()), uvloop.Loop)


@pytest.mark.parametrize("mode", ["rate", "sessions"])
def test_no_request_goes_before_its_scheduled_time(fake_server, tmp_path, mode):
    """uvloop's timers count whole milliseconds from the loop's cached time and may fire early: the dispatcher
    sets them again instead of sending early (a negative schedule lag)."""
    srv = fake_server(itl_ms=1)
    if mode == "rate":
        opts, trace = {"mode": "rate", "rate": 300.0, "max_requests": 120, "seed": 2}, CHAT
    else:
        n = 30
        t = make_trace(n=n, session_id=[f"s{i % 3}" for i in range(n)], think_time_s=[0.003] * n,
                       depends_on=[[]] * n, parent_id=[None] * n, arrival_s=[0.0] * n)  # fmt: skip
        opts, trace = {"mode": "sessions"}, _write(tmp_path, t)
    run_dir, _ = run_replay(trace, "openai", {"url": srv.url, **opts}, out=tmp_path / "r", report=False)
    rows = pq.read_table(run_dir / "requests.parquet").to_pylist()
    assert rows and all(r["status"] == "ok" for r in rows)
    early = [r["request_id"] for r in rows if r["actual_send_s"] < r["scheduled_send_s"]]
    assert not early


def test_the_collector_is_restored_after_a_run_and_after_an_interrupted_one(fake_server, tmp_path):
    srv = fake_server(itl_ms=1)
    threshold = gc.get_threshold()
    seen = []

    def progress(o):
        seen.append((gc.get_threshold()[0], gc.get_freeze_count() > 0))  # during the run: frozen, rarer

    opts = {"url": srv.url, "mode": "rate", "rate": 400.0, "max_requests": N}
    run_replay(CHAT, "openai", opts, out=tmp_path / "a", report=False, progress=progress)
    assert seen and all(t >= live.GC_YOUNG_THRESHOLD and frozen for t, frozen in seen)
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == 0

    def interrupt(o):
        raise KeyboardInterrupt

    _, summary = run_replay(CHAT, "openai", opts, out=tmp_path / "b", report=False, progress=interrupt)
    assert summary["interrupted"]
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == 0


def test_parts_are_written_by_time_while_the_run_goes_on_and_the_result_is_complete(fake_server, tmp_path, monkeypatch):
    """Fewer than FLUSH_EVERY answers still become a durable part FLUSH_SECONDS later (what a kill keeps),
    written by the writer thread while the loop goes on; the run's result holds every request once."""
    srv = fake_server(itl_ms=1)
    monkeypatch.setattr(live, "FLUSH_SECONDS", 0.05)
    assert live.FLUSH_EVERY > N
    out = tmp_path / "r"
    seen_parts = []

    def progress(o):
        if len(seen_parts) == 0 and o.row >= 5:  # the loop thread waits; the writer thread must not need it
            deadline = time.monotonic() + 30
            while not list_parts(out / "requests.parquet") and time.monotonic() < deadline:
                time.sleep(0.01)
            parts = list_parts(out / "requests.parquet")
            seen_parts.append(sum(pq.read_metadata(p).num_rows for p in parts))

    opts = {"url": srv.url, "mode": "rate", "rate": 200.0, "max_requests": N}
    run_dir, summary = run_replay(CHAT, "openai", opts, out=out, report=False, progress=progress)
    assert seen_parts and seen_parts[0] >= 1  # durable before the run ended
    rows = pq.read_table(run_dir / "requests.parquet")
    assert rows.num_rows == N and len(set(rows.column("request_id").to_pylist())) == N
    assert set(rows.column("status").to_pylist()) == {"ok"} and summary["complete"]
    assert not list_parts(run_dir / "requests.parquet")


# --- the stream, read as it arrives and cut into lines by the client ------------------------------------------


class PieceServer:
    """Answers every POST with `pieces`, each written and drained on its own (separate reads for the client)."""

    def __init__(self, pieces: list[bytes], content_type: str = "text/event-stream"):
        self.pieces, self.content_type = pieces, content_type
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def answer(request):
            await request.read()
            resp = web.StreamResponse(headers={"Content-Type": self.content_type})
            await resp.prepare(request)
            for piece in self.pieces:
                await resp.write(piece)
                await asyncio.sleep(0.002)  # the next piece in another segment
            await resp.write_eof()
            return resp

        def serve():
            asyncio.set_event_loop(self._loop)
            app = web.Application()
            app.router.add_post("/v1/completions", answer)
            self._runner = runner = web.AppRunner(app, access_log=None)
            self._loop.run_until_complete(runner.setup())
            self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        ready.wait(10)

    def stop(self):
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def fetch(pieces: list[bytes], content_type: str = "text/event-stream") -> Outcome:
    server = PieceServer(pieces, content_type)

    async def send():
        o = Outcome(row=0)
        async with OpenAIClient(server.url, endpoint="completions", timeout_s=10, api_key=None, origin=0.0) as c:
            await c.send(b"{}", o)
        return o

    try:
        with live.event_loop() as runner:
            return runner.run(send())
    finally:
        server.stop()


def token(text: str) -> bytes:
    return b'data: {"choices":[{"index":0,"text":"%s"}]}\n\n' % text.encode()


USAGE = (
    b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,'
    b'"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
)


@pytest.mark.parametrize("cut", [1, 3, 7, 13, 64])
def test_events_cut_anywhere_across_reads_are_all_counted(cut):
    body = (
        b": keep-alive\n\nevent: message\n"
        + token("a")
        + token("b")
        + b"id: 3\r\n"
        + token("c").replace(b"\n", b"\r\n")
        + USAGE
        + b"data: [DONE]"
    )  # the last line ends with the body
    o = fetch([body[i : i + cut] for i in range(0, len(body), cut)])
    assert o.status == "ok", o.error
    assert len(o.chunk_s) == 3 and o.first_chunk_s == o.chunk_s[0] <= o.chunk_s[1] <= o.chunk_s[2] == o.last_chunk_s
    assert (o.prompt_tokens, o.completion_tokens, o.cached_tokens) == (7, 3, 4)


def test_a_stream_that_ends_before_done_is_cut_after_what_arrived():
    o = fetch([token("a")[:10], token("a")[10:] + b": keep-al"])  # ends inside a comment line
    assert o.status == "error" and o.error.startswith("stream cut: ") and "after 1 chunks" in o.error


def test_an_answer_that_is_no_event_stream_is_quoted_from_its_start():
    page = b"<html><body><h1>502 Bad Gateway</h1>" + b"x" * 400 + b"</body></html>"
    o = fetch([page[:6], page[6:50], page[50:]], content_type="text/html")
    assert o.status == "error"
    assert o.error.startswith("not an event stream: the server answered text/html: <html><body><h1>502 Bad Gateway")
