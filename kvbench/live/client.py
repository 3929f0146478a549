"""Streaming client for OpenAI-compatible servers (aiohttp, server-sent events). One `send` per request; it
never raises for a server or network fault: the fault becomes the request's status and error, so a run goes
on and every request is accounted for.

A request's `error` starts with a short, stable class (`http 500`, `timeout`, `connection refused`, `stream
cut`, `not an event stream`, `malformed event`, `error event`, …) and a colon, so that failures can be counted
by kind (`kvbench.metrics.latency.error_class`); the rest is one line of detail, secrets masked."""

from __future__ import annotations

import asyncio
import errno

import aiohttp
from yarl import URL

from kvbench.live.http1 import BadAnswer, BodyCut, ConnectionDropped, Pool
from kvbench.live.sse import BODY_SHOWN, EventStream, StreamError
from kvbench.redact import redact_text
from kvbench.run.pacing import Outcome

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
JSON = {"Content-Type": "application/json"}
ERROR_TEXT = 300  # characters of an error kept in the record
# headers that change how an answer is framed or encoded: given by the caller, they leave requests to aiohttp
USER_AGENT = aiohttp.http.SERVER_SOFTWARE  # what aiohttp sends: a server sees the same client either way
FRAMING = {"host", "content-length", "transfer-encoding", "accept-encoding", "connection", "expect", "te", "upgrade"}


def one_line(text: str, limit: int = ERROR_TEXT) -> str:
    """`text` masked (a server may echo a key; aiohttp puts URLs in its messages), on one line, at most `limit`
    characters."""
    return " ".join(redact_text(text).split())[:limit]


def describe_exception(exc: BaseException) -> str:
    """A network-level fault as 'class: detail' (the detail never holds the URL's credentials)."""
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        kind = "dns"
    elif isinstance(exc, (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError)):
        kind = "tls"
    elif isinstance(exc, aiohttp.ClientConnectorError):
        refused = getattr(exc.os_error, "errno", None) == errno.ECONNREFUSED or "refused" in str(exc).lower()
        if refused:
            return f"connection refused: nothing listens on {exc.host}:{exc.port}"
        return one_line(f"connection failed: cannot connect to {exc.host}:{exc.port}: {exc.os_error}")
    elif isinstance(exc, aiohttp.ServerDisconnectedError):
        return "connection dropped: the server closed the connection before answering"
    elif isinstance(exc, aiohttp.ClientPayloadError):
        kind = "stream cut"
    else:
        kind = "client error"
    return one_line(f"{kind}: {type(exc).__name__}: {exc}")


class OpenAIClient:
    """Streams requests to an OpenAI-compatible server. Plain-http servers get kvbench's own HTTP/1.1 client
    (`kvbench.live.http1`, a fraction of aiohttp's CPU per request); https, and requests whose connection
    cannot be opened, go through aiohttp. `session` (aiohttp) is there for everything else a run asks."""

    def __init__(
        self,
        url: str,
        *,
        endpoint: str,
        timeout_s: float,
        api_key: str | None,
        origin: float,
        headers: dict[str, str] | None = None,
    ):
        self.url = url.rstrip("/") + ENDPOINTS[endpoint]
        self.endpoint = endpoint
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        # headers given by the caller (--header, basic auth from the URL) win over the API key's bearer token
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.headers.update(headers or {})
        self.origin = origin  # perf_counter value of the run's start: Outcome times are relative to it
        self.session: aiohttp.ClientSession | None = None
        self.pool: Pool | None = None
        self.request_head = _request_head(URL(self.url), self.headers)  # None: aiohttp sends every request

    async def __aenter__(self):
        # No connection limit: --max-concurrency is the dispatcher's; a pool limit here would hide queueing.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=connector, timeout=self.timeout, headers=self.headers)
        if self.request_head is not None:
            u = URL(self.url)
            self.pool = Pool(u.host, u.port)
        return self

    async def __aexit__(self, *exc):
        if self.pool is not None:
            self.pool.close()
        await self.session.close()

    async def send(self, payload: bytes, o: Outcome) -> None:
        """POST `payload` (a JSON body, already encoded) and stream the answer into `o`."""
        try:
            if self.pool is not None:
                await self._send_own(payload, o)
            else:
                await self._send_aiohttp(payload, o)
        except TimeoutError:
            o.status, o.error = "timeout", f"timeout: no complete answer within {self.timeout.total:g} s"
        except asyncio.CancelledError:
            o.status, o.error = "cancelled", "cancelled: run interrupted before the answer completed"
            raise
        except StreamError as exc:
            o.status, o.error = "error", one_line(str(exc))
        except (aiohttp.ClientPayloadError, BodyCut):
            o.status = "error"
            o.error = f"stream cut: the connection dropped after {len(o.chunk_s)} chunks, before [DONE]"
        except ConnectionDropped:
            o.status, o.error = "error", "connection dropped: the server closed the connection before answering"
        except aiohttp.ClientError as exc:
            o.status, o.error = "error", describe_exception(exc)
        except (BadAnswer, OSError) as exc:
            o.status, o.error = "error", one_line(f"client error: {type(exc).__name__}: {exc}")

    async def _send_own(self, payload: bytes, o: Outcome) -> None:
        pool = self.pool
        deadline = pool.loop.time() + self.timeout.total  # the whole exchange, connecting included (as aiohttp's)
        conn = pool.take()
        if conn is None:
            try:
                async with asyncio.timeout_at(deadline):
                    conn = await pool.open()
            except TimeoutError:
                raise  # an OSError too, but no connection in time is the request's timeout
            except OSError:
                # nothing was sent: aiohttp tries, and a failure reads as it always did (refused, DNS, …)
                return await self._send_aiohttp(payload, o)
        head = self.request_head + b"%d\r\n\r\n" % len(payload)
        fut = conn.post(head + payload, EventStream(o, self.origin, self.endpoint))
        # one timer, not a timeout context: the exchange's connection fails the future when it fires
        timer = pool.loop.call_at(deadline, conn.expire, fut)
        try:
            status, _, body = await fut
        except BaseException:
            if conn.fut is fut:  # cancelled while the answer was coming: the connection is never reused
                conn.abort()
            raise
        finally:
            timer.cancel()
        if status != 200:
            o.status, o.error = "error", one_line(f"http {status}: {body[:BODY_SHOWN]}")
            return
        o.status = "ok"

    async def _send_aiohttp(self, payload: bytes, o: Outcome) -> None:
        async with self.session.post(self.url, data=payload, headers=JSON) as resp:
            if resp.status != 200:
                body = (await resp.text(errors="replace"))[:BODY_SHOWN]
                o.status, o.error = "error", one_line(f"http {resp.status}: {body}")
                return
            sse = EventStream(o, self.origin, self.endpoint)
            sse.start(resp.content_type)
            content = resp.content
            while True:
                data = await content.readany()  # as it arrives: one call per read, not per line
                if not data:
                    sse.end()  # raises unless [DONE] came
                    break
                if sse.feed(data):
                    break
            o.status = "ok"


def _request_head(url: URL, headers: dict[str, str]) -> bytes | None:
    """The head of every streamed POST up to its Content-Length value; None when aiohttp must send them (https,
    a caller's header that changes the answer's framing, one that is not latin-1)."""
    if url.scheme != "http" or not url.host or any(k.lower() in FRAMING for k in headers):
        return None
    host = f"[{url.host}]" if ":" in url.host else url.host
    if not url.is_default_port():
        host += f":{url.port}"
    lines = [f"POST {url.raw_path_qs} HTTP/1.1", f"Host: {host}", "Accept: */*", f"User-Agent: {USER_AGENT}"]
    lines += [f"{k}: {v}" for k, v in headers.items() if k.lower() != "content-type"]
    lines += ["Content-Type: application/json", "Content-Length: "]
    if any(c in line for line in lines for c in "\r\n"):
        return None  # aiohttp refuses such a header, with its own error
    try:
        return "\r\n".join(lines).encode("latin-1")
    except UnicodeEncodeError:
        return None
