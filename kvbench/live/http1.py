"""A lean HTTP/1.1 client for the live replay's streamed POSTs to a plain-http server.

Why not aiohttp for these: a request through aiohttp's ClientSession (request and response objects, header
multidicts, its stream reader waking the request's task once per read) cost ~60 % of the client's CPU at an
instant server, which caps the rate one client process can keep. Here a request is one prebuilt header block
and one write on a kept-alive connection, and its answer is parsed by the connection's protocol as it arrives
(`data_received`): the body goes straight into the request's `EventStream`, and the request's task wakes once,
when the answer is complete. aiohttp still does everything else (model discovery, /metrics, https, any
connection that cannot be opened here: `OpenAIClient` falls back to it, so its errors read as before).

Framing (Content-Length, chunked with trailers, read-to-close bodies, 1xx answers first, keep-alive or not) is
parsed by httptools, the llhttp parser uvicorn uses."""

from __future__ import annotations

import asyncio
import socket
import time

import httptools

from kvbench.live.sse import EventStream

DNS_TTL_S = 300.0  # as the aiohttp connector the client used before (ttl_dns_cache=300)


class ConnectionDropped(Exception):
    """The connection closed before the answer's head (aiohttp: ServerDisconnectedError)."""


class BodyCut(Exception):
    """The connection closed inside a framed body (aiohttp: ClientPayloadError)."""


class BadAnswer(Exception):
    """Bytes that are no HTTP/1.x answer."""


class Connection(asyncio.Protocol):
    """One kept-alive connection; it carries one exchange at a time. `post` writes a request and returns a
    future: (status, content type, body) once the answer is complete, body None for a 200 (streamed into the
    EventStream) and the whole body otherwise; or the fault. The answer's framing (head, Content-Length,
    chunked, 1xx answers first) is parsed by httptools (llhttp)."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.fut: asyncio.Future | None = None
        self.sse: EventStream | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:  # each streamed token is its own small write: no Nagle delay on the request either
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def post(self, request: bytes, sse: EventStream) -> asyncio.Future:
        self.fut = fut = self.pool.loop.create_future()
        self.sse, self.parser = sse, httptools.HttpResponseParser(self)
        self.head_done = self.complete = self.framed = False
        self.status, self.ctype = 0, b""
        self.body: bytearray | None = None
        self.transport.write(request)
        return fut

    def expire(self, fut: asyncio.Future) -> None:
        """The request's time is up (its timer): it fails with TimeoutError, the connection is dropped."""
        if self.fut is fut:
            self.abort()
            if not fut.done():
                fut.set_exception(TimeoutError())

    def abort(self) -> None:
        """The request gave up (timeout, cancelled): the connection is in an unknown state, never reused."""
        self.fut = None
        self.closed = True
        self.transport.abort()

    # ------------------------------------------------------------------------------- the parser's callbacks

    def on_message_begin(self) -> None:
        if self.complete:  # bytes past the answer's end: the connection is not reused
            raise _PastTheAnswer

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.ctype = value
        elif name in (b"content-length", b"transfer-encoding"):
            self.framed = True  # else the body runs to the connection's close

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # 1xx (100 Continue, 103 Early Hints) come before the real answer
            self.ctype, self.framed = b"", False
            return
        self.head_done, self.status = True, status
        self.content_type = self.ctype.split(b";")[0].strip().lower().decode("latin-1") or "application/octet-stream"
        self.charset = _charset(self.ctype)
        if status == 200:
            self.sse.start(self.content_type)
        else:
            self.body = bytearray()

    def on_body(self, data: bytes) -> None:
        if self.body is not None:
            self.body += data
        elif self.sse.feed(data) and self.fut is not None and not self.fut.done():
            self.fut.set_result((200, self.content_type, None))  # [DONE]: what follows it is not waited for

    def on_message_complete(self) -> None:
        if self.head_done:  # (llhttp forgets keep-alive once feed_data returns)
            self.complete, self.keep_alive = True, self.parser.should_keep_alive()

    # --------------------------------------------------------------------------------------------- bytes in

    def data_received(self, data: bytes) -> None:
        if self.fut is None:  # bytes after the answer (a [DONE]-ended stream that went on): not reusable
            self.closed = True
            self.transport.close()
            return
        reusable = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            cause = exc.__context__  # what one of the callbacks above raised (a StreamError, _PastTheAnswer)
            if isinstance(cause, _PastTheAnswer):
                reusable = False
            else:
                self._fail(cause if cause is not None else (BodyCut if self.head_done else BadAnswer)(str(exc)))
                return
        if self.complete:
            self._finish(reusable and self.keep_alive)

    def _finish(self, reusable: bool) -> None:
        """The answer ended (as framed, or by the connection closing on a read-to-close body)."""
        fut, self.fut = self.fut, None
        if self.body is None and not self.sse.done:
            try:
                self.sse.end()  # raises: no [DONE]
            except Exception as exc:  # noqa: BLE001
                self.fut = fut
                self._fail(exc)
                return
        if not fut.done():
            body = None if self.body is None else bytes(self.body).decode(self.charset, "replace")
            fut.set_result((self.status, self.content_type, body))
        if reusable and not self.closed:
            self.pool.release(self)
        else:
            self.closed = True
            self.transport.close()

    def _fail(self, exc: BaseException) -> None:
        fut, self.fut = self.fut, None
        self.closed = True
        self.transport.close()
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def eof_received(self) -> bool:
        return False  # close: connection_lost follows

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.pool.connections.discard(self)
        if self.fut is None:
            return
        if not self.head_done:
            self._fail(ConnectionDropped() if exc is None else exc)
        elif not self.framed:
            self._finish(False)  # a read-to-close body ends here
        else:
            self._fail(BodyCut("the connection closed inside the body"))


class _PastTheAnswer(Exception):
    """Raised from the parser's callback to stop at the end of the answer."""


def _charset(ctype: bytes) -> str:
    for param in ctype.split(b";")[1:]:
        name, _, value = param.partition(b"=")
        if name.strip().lower() == b"charset":
            charset = value.strip().strip(b'"').decode("latin-1")
            try:
                b"".decode(charset)
                return charset
            except LookupError:
                break
    return "utf-8"


class Pool:
    """Kept-alive connections to one host and port, opened as needed (no limit: --max-concurrency is the
    dispatcher's); the last one released is the next one used."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.loop = asyncio.get_running_loop()
        self.idle: list[Connection] = []
        self.connections: set[Connection] = set()
        self.addresses: list[tuple] = []
        self.resolved_at = -DNS_TTL_S

    def take(self) -> Connection | None:
        """An idle connection, or None (then `open` one)."""
        idle = self.idle
        while idle:
            c = idle.pop()
            if not c.closed and not c.transport.is_closing():
                return c
        return None

    async def open(self) -> Connection:
        """A new connection; OSError when none can be made (the caller's aiohttp fallback reports it)."""
        if time.monotonic() - self.resolved_at > DNS_TTL_S:
            infos = await self.loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            self.addresses = [(family, addr[0]) for family, _, _, _, addr in infos]
            self.resolved_at = time.monotonic()
        error: OSError | None = None
        for family, ip in self.addresses:
            try:
                _, c = await self.loop.create_connection(lambda: Connection(self), ip, self.port, family=family)
            except OSError as exc:
                error = exc
                continue
            self.connections.add(c)
            return c
        raise error or OSError(f"no address for {self.host}")

    def release(self, c: Connection) -> None:
        self.idle.append(c)

    def close(self) -> None:
        for c in list(self.connections):
            c.closed = True
            c.transport.close()
        self.connections.clear()
        self.idle.clear()
