"""A lean HTTP/1.1 client for the live replay's streamed POSTs to a plain-http server.

Why not aiohttp for these: a request through aiohttp's ClientSession (request and response objects, header
multidicts, its stream reader waking the request's task once per read) cost ~60 % of the client's CPU at an
instant server, which caps the rate one client process can keep. Here a request is one prebuilt header block
and one write on a kept-alive connection, and its answer is parsed by the connection's protocol as it arrives
(`data_received`): the body goes straight into the request's `EventStream`, and the request's task wakes once,
when the answer is complete. aiohttp still does everything else (model discovery, /metrics, https, any
connection that cannot be opened here: `OpenAIClient` falls back to it, so its errors read as before).

Framing handled: Content-Length, chunked (trailers skipped) and read-to-close bodies; 1xx answers skipped;
keep-alive unless the server says close or speaks HTTP/1.0."""

from __future__ import annotations

import asyncio
import socket
import time

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
    EventStream) and the whole body otherwise; or the fault."""

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
        self.sse, self.buf, self.head_done, self.status = sse, b"", False, 0
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

    # ---------------------------------------------------------------------------------------- parsing

    def data_received(self, data: bytes) -> None:
        if self.fut is None:  # bytes after the answer (a [DONE]-ended stream that went on): not reusable
            self.closed = True
            self.transport.close()
            return
        try:
            if not self.head_done:
                data = self._head(self.buf + data)
                if data is None:
                    return
            if self.chunked:
                data, ended = self._unchunk(self.buf + data if self.buf else data)
            elif self.left is not None:
                if len(data) > self.left:  # more than the answer's length: the connection is not reused
                    self.reusable, data = False, data[: self.left]
                self.left -= len(data)
                ended = self.left == 0
            else:
                ended = False  # read to close
            if data:
                self._deliver(data)
            if ended:
                self._finish(True)
        except Exception as exc:  # noqa: BLE001 - a StreamError from the EventStream, or bad framing
            self._fail(exc)

    def _head(self, buf: bytes) -> bytes | None:
        """Parse the answer's head once it is all there; the bytes after it, or None while it is not."""
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buf = buf
                return None
            lines = buf[:end].split(b"\r\n")
            version, _, rest = lines[0].partition(b" ")
            if not version.startswith(b"HTTP/1.") or not rest[:3].isdigit():
                raise BadAnswer(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
            status, buf = int(rest[:3]), buf[end + 4 :]
            if not 100 <= status < 200:
                break  # 1xx (100 Continue, 103 Early Hints) come before the real answer
        ctype, length, chunked, close = b"", None, False, version == b"HTTP/1.0"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-type":
                ctype = value
            elif name == b"content-length":
                if not value.strip().isdigit():
                    raise BadAnswer(f"Content-Length {value[:40]!r}")
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                close = b"close" in value.lower() or (close and b"keep-alive" not in value.lower())
        if status in (204, 304):
            length = 0
        self.head_done, self.status, self.buf = True, status, b""
        self.content_type = ctype.split(b";")[0].strip().lower().decode("latin-1") or "application/octet-stream"
        self.charset = _charset(ctype)
        self.chunked, self.left = chunked, None if chunked else length
        self.reusable = not close and (chunked or length is not None)
        self.size, self.trailers = 0, False  # chunked: what the current chunk still owes; past the last chunk
        if status == 200:
            self.sse.start(self.content_type)
        else:
            self.body = bytearray()
        if not chunked and length == 0:
            self._finish(True)
            return None
        return buf

    def _unchunk(self, buf: bytes) -> tuple[bytes, bool]:
        """The data of the chunks in `buf`, and whether the last chunk came. A chunk whose data and CRLF are
        all there (the usual case: one event, one chunk, one read) is taken in one step; `self.size` is what
        a chunk cut by the end of `buf` still owes (its data, then its CRLF), `self.buf` a partial size line."""
        out, pos, n = [], 0, len(buf)
        owed = self.size
        if owed > 0:
            pos = min(owed, n)
            if owed > 2:
                out.append(buf[: min(owed - 2, n)])
            self.size = owed - pos
            if self.size:
                self.buf = b""
                return b"".join(out), False
        while True:
            end = buf.find(b"\r\n", pos)
            if end < 0:
                break
            line, pos = buf[pos:end], end + 2
            if self.trailers:  # trailer fields, up to an empty line
                if not line:
                    self.buf = buf[pos:]
                    return b"".join(out), True
                continue
            try:
                size = int(line, 16)
            except ValueError:
                size = _chunk_size(line)
            if not size:
                self.trailers = True
                continue
            stop = pos + size
            if stop + 2 <= n:
                if buf[stop : stop + 2] != b"\r\n":
                    raise BodyCut("a chunk not followed by CRLF")
                out.append(buf[pos:stop])
                pos = stop + 2
            else:
                out.append(buf[pos:stop])
                self.size, pos = stop + 2 - n, n
                break
        self.buf = buf[pos:]
        return b"".join(out), False

    def _deliver(self, data: bytes) -> None:
        if self.body is not None:
            self.body += data
        elif self.sse.feed(data) and self.fut is not None and not self.fut.done():
            self.fut.set_result((200, self.content_type, None))  # [DONE]: what follows it is not waited for

    def _finish(self, clean: bool) -> None:
        """The body ended (clean: as framed, else by the connection closing on a read-to-close body)."""
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
        if clean and self.reusable and not self.buf and not self.closed:
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
        elif not self.chunked and self.left is None:
            self._finish(False)  # a read-to-close body ends here
        else:
            self._fail(BodyCut("the connection closed inside the body"))


def _chunk_size(line: bytes) -> int:
    """A chunk-size line with extensions ('1a;name=value'), or one that is no size."""
    try:
        return int(line.split(b";", 1)[0], 16)
    except ValueError:
        raise BodyCut(f"bad chunk size {line[:40]!r}") from None


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
