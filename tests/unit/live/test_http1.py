"""kvbench's own HTTP/1.1 client (kvbench/live/http1.py) against a raw server that answers with scripted bytes:
every framing (chunked cut anywhere, Content-Length, read to close, 1xx first), keep-alive reuse, and each fault
read as the aiohttp path reads it."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from yarl import URL

from kvbench.live.client import OpenAIClient, _request_head
from kvbench.run.pacing import Outcome

EVENTS = (
    b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
    b'data: {"choices":[{"index":0,"text":"b"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,'
    b'"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
    b"data: [DONE]\n\n"
)
SSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"


def chunked(body: bytes, size: int = 17) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


async def exchange(answers: list, n: int | None = None, timeout_s: float = 5.0, cut: int = 5):
    """Send len(answers) requests one after another; the server answers request i with answers[i] (bytes,
    written `cut` bytes at a time, then None: close the connection) and counts connections."""
    pending = list(answers)
    connections = []

    async def handle(reader, writer):
        connections.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await answer(reader, writer)

    async def answer(reader, writer):
        while pending:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            for piece in pending.pop(0):
                if piece is None:
                    writer.close()
                    return
                for i in range(0, len(piece), cut):
                    writer.write(piece[i : i + cut])
                    await writer.drain()
                    await asyncio.sleep(0)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    outcomes = []
    async with OpenAIClient(url, endpoint="completions", timeout_s=timeout_s, api_key=None, origin=0.0) as c:
        assert c.pool is not None  # plain http: kvbench's own client
        for _ in range(n or len(answers)):
            o = Outcome(row=0)
            await c.send(b'{"prompt":[1]}', o)
            outcomes.append(o)
    server.close()
    return outcomes, len(connections)


def run(*args, **kw):
    return asyncio.run(exchange(*args, **kw))


def assert_ok(o: Outcome):
    assert o.status == "ok", o.error
    assert len(o.chunk_s) == 2 and (o.prompt_tokens, o.completion_tokens, o.cached_tokens) == (7, 2, 4)


@pytest.mark.parametrize("cut", [1, 3, 7, 64, 4096])
def test_chunked_answers_cut_anywhere_are_read_and_the_connection_is_kept(cut):
    answer = SSE + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(EVENTS)
    outcomes, connections = run([[answer], [answer]], cut=cut)
    for o in outcomes:
        assert_ok(o)
    # a request is done at [DONE]; its connection is kept once the body's last chunk comes, which a second
    # request sent in between does not wait for
    assert connections == 1 if cut > len(answer) else connections <= 2


def test_content_length_and_read_to_close_bodies():
    sized = SSE + b"Content-Length: %d\r\n\r\n" % len(EVENTS) + EVENTS
    to_close = SSE + b"Connection: close\r\n\r\n" + EVENTS
    outcomes, connections = run([[sized], [b"HTTP/1.1 100 Continue\r\n\r\n" + sized], [to_close, None], [sized]])
    for o in outcomes:
        assert_ok(o)
    assert connections == 2  # a read-to-close answer ends its connection


def test_an_error_status_quotes_its_body():
    body = b'{"error":"too many"}'
    answer = b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    (o,), _ = run([[answer]])
    assert (o.status, o.error) == ("error", 'http 429: {"error":"too many"}')


def test_a_connection_closed_before_the_answer_is_a_dropped_connection():
    (o,), _ = run([[None]])
    assert o.status == "error" and o.error.startswith("connection dropped: ")


def test_a_connection_closed_inside_the_body_is_a_cut_stream():
    answer = SSE + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(EVENTS)[:60]
    (o,), _ = run([[answer, None]])
    assert o.status == "error" and o.error.startswith("stream cut: the connection dropped after 1 chunks")


def test_done_ends_the_request_even_if_the_body_goes_on():
    answer = SSE + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(EVENTS)[:-5]  # no last chunk
    sized = SSE + b"Content-Length: %d\r\n\r\n" % len(EVENTS) + EVENTS
    outcomes, connections = run([[answer], [sized]], timeout_s=2)
    for o in outcomes:
        assert_ok(o)


def test_no_answer_in_time_is_a_timeout():
    (o,), _ = run([[b"HTTP/1.1 200 OK\r\n"]], timeout_s=0.3)
    assert (o.status, o.error) == ("timeout", "timeout: no complete answer within 0.3 s")


def test_https_and_framing_headers_stay_with_aiohttp():
    assert _request_head(URL("https://h/v1/completions"), {}) is None
    assert _request_head(URL("http://h/v1/completions"), {"Accept-Encoding": "gzip"}) is None
    head = _request_head(URL("http://h:8000/v1/completions"), {"Authorization": "Bearer k", "content-type": "x"})
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: h:8000\r\n")
    assert b"Authorization: Bearer k\r\n" in head and head.endswith(
        b"Content-Type: application/json\r\nContent-Length: "
    )
    assert b"content-type: x" not in head
