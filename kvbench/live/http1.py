"""A lean HTTP/1.1 client for the live replay's streamed POSTs to a plain-http server.

Why not aiohttp for these: a request through aiohttp's ClientSession (request and response objects, header
multidicts, its stream reader waking the request's task once per read) cost ~60 % of the client's CPU at an
instant server, which caps the rate one client process can keep. Here a request is one prebuilt header block
and one write on a kept-alive connection, and its answer is parsed by the connection's protocol as it arrives
(`data_received`): the body goes straight into the request's `EventStream`, and the request's task wakes once,
when the answer is complete. aiohttp still does everything else (model discovery, /metrics, https, any
connection that cannot be opened here: `OpenAIClient` falls back to it, so its errors read as before).

Framing (Content-Length, chunked with trailers, read-to-close bodies, 1xx answers first, keep-alive or not) is
parsed by httptools, the llhttp parser uvicorn uses.

Kept-alive connections go stale: a server may close one between two requests (an idle timeout, a cap on requests
per connection, or, as llama.cpp's llama-server does, after every streamed answer while its head still says
`Keep-Alive`), and a request written as that close crosses it sees the connection end before any byte of an
answer. Such a request is sent once more on a fresh connection (RFC 9112 §9.3.1, "retrying requests"); see
`Connection._may_resend`. A fault on a fresh connection, or once an answer began, is the request's fault."""

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
        self.uses = 0  # requests written on this connection: more than 1, it was reused from the pool
        self.request = b""  # the request in flight, kept to send it again (see `_may_resend`)
        self.resend: asyncio.Task | None = None  # opening the fresh connection that sends it again
        self.replacement: Connection | None = None  # that connection, once it carries the request

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:  # each streamed token is its own small write: no Nagle delay on the request either
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def post(self, request: bytes, sse: EventStream, fut: asyncio.Future | None = None) -> asyncio.Future:
        """`fut`: a request sent again here, after its reused connection went stale (the caller awaits it)."""
        self.fut = fut = fut or self.pool.loop.create_future()
        self.sse, self.parser = sse, httptools.HttpResponseParser(self)
        self.uses += 1
        self.request = request
        self.got_bytes = False  # any byte of an answer: from then on a fault is the request's, never resent
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
        """The request gave up (timeout, cancelled): the connection is in an unknown state, never reused. A
        request being sent again elsewhere gives up there too (the caller only knows this connection)."""
        fut, self.fut = self.fut, None
        self.closed = True
        self.transport.abort()
        if self.resend is not None:
            self.resend.cancel()
            r = self.replacement
            if fut is not None and r is not None and r.fut is fut:  # not once r has finished and serves others
                r.abort()

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
            # an answer with `Connection: close` (as cpp-httplib's on a connection's last allowed request), or an
            # HTTP/1.0 one without `Connection: keep-alive`: the server closes the connection, which is then
            # never put back in the pool (a request written on it would find it closed)
            self.complete, self.keep_alive = True, self.parser.should_keep_alive()

    # --------------------------------------------------------------------------------------------- bytes in

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
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
            if self._may_resend(exc):
                self.resend = self.pool.loop.create_task(self._send_again(self.fut, exc))
                return
            self._fail(ConnectionDropped() if exc is None else exc)
        elif not self.framed:
            self._finish(False)  # a read-to-close body ends here
        else:
            self._fail(BodyCut("the connection closed inside the body"))

    def _may_resend(self, exc: BaseException | None) -> bool:
        """Whether the request that saw this connection end is sent once more, on a fresh connection.

        Only when the connection was reused (a kept-alive one from the pool) and it ended (EOF, or reset / broken
        pipe) before a single byte of an answer: the server closed a connection it had stopped reading (idle, used
        up, or closed after its last answer as llama-server does) as our request crossed the close. That is a
        stale connection, not a server fault: RFC 9112 §9.3.1 expects clients to recover from such asynchronous
        closes, and RFC 9110 §9.2.2 lets a client retry a POST automatically when it knows the request is
        idempotent in effect, as a completion is (a second copy changes nothing but the prefix cache a first
        warmed). A fresh connection that ends so, or a connection that ends once an answer began, is the
        request's fault (`ConnectionDropped`, `BodyCut`) as before: a real one is never hidden. The request goes
        again on a fresh connection, so it is sent again at most once; `Pool.resent` counts these."""
        if self.uses < 2 or self.got_bytes:
            return False
        return exc is None or isinstance(exc, ConnectionError)  # EOF, reset, broken pipe, aborted

    async def _send_again(self, fut: asyncio.Future, exc: BaseException | None) -> None:
        """Send the request on a fresh connection; its answer (or fault) fulfils `fut`, which the caller awaits."""
        self.pool.resent += 1
        try:
            c = await self.pool.open()
        except OSError:
            c = None  # no new connection either: the server is gone, and the dropped connection is the fault
        if self.fut is not fut or fut.done():  # the request gave up meanwhile (its timeout, cancelled)
            if c is not None:
                self.pool.release(c)  # fresh and unused
            return
        if c is None:
            self._fail(ConnectionDropped() if exc is None else exc)
            return
        self.replacement = c  # self.fut stays fut: the caller's expire and abort reach the request through here
        c.post(self.request, self.sse, fut)


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
        self.resent = 0  # requests sent again after their reused connection went stale (Connection._may_resend)

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
