"""Streaming client for OpenAI-compatible servers (aiohttp, server-sent events). One `send` per request; it
never raises for a server or network fault: the fault becomes the request's status and error, so a run goes
on and every request is accounted for.

A request's `error` starts with a short, stable class (`http 500`, `timeout`, `connection refused`, `stream
cut`, `not an event stream`, `malformed event`, `error event`, …) and a colon, so that failures can be counted
by kind (`kvbench.live.latency.error_class`); the rest is one line of detail, secrets masked."""

from __future__ import annotations

import asyncio
import errno
import time

import aiohttp
import orjson

from kvbench.live.pacing import Outcome
from kvbench.redact import redact_text

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
JSON = {"Content-Type": "application/json"}
ERROR_TEXT = 300  # characters of an error kept in the record
BODY_SHOWN = 200  # characters of an unexpected answer's body quoted in an error
SSE_FIELDS = (b"data:", b":", b"event:", b"id:", b"retry:")  # what a line of an event stream starts with


class StreamError(Exception):
    """A fault found while reading an answer; its message is the request's error, class first."""


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

    async def __aenter__(self):
        # No connection limit: --max-concurrency is the dispatcher's; a pool limit here would hide queueing.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=connector, timeout=self.timeout, headers=self.headers)
        return self

    async def __aexit__(self, *exc):
        await self.session.close()

    async def send(self, payload: bytes, o: Outcome) -> None:
        """POST `payload` (a JSON body, already encoded) and stream the answer into `o`."""
        try:
            async with self.session.post(self.url, data=payload, headers=JSON) as resp:
                if resp.status != 200:
                    body = (await resp.text(errors="replace"))[:BODY_SHOWN]
                    o.status, o.error = "error", one_line(f"http {resp.status}: {body}")
                    return
                await self._read_stream(resp, o)
                o.status = "ok"
        except TimeoutError:
            o.status, o.error = "timeout", f"timeout: no complete answer within {self.timeout.total:g} s"
        except asyncio.CancelledError:
            o.status, o.error = "cancelled", "cancelled: run interrupted before the answer completed"
            raise
        except StreamError as exc:
            o.status, o.error = "error", one_line(str(exc))
        except aiohttp.ClientPayloadError:
            o.status = "error"
            o.error = f"stream cut: the connection dropped after {len(o.chunk_s)} chunks, before [DONE]"
        except aiohttp.ClientError as exc:
            o.status, o.error = "error", describe_exception(exc)

    async def _read_stream(self, resp: aiohttp.ClientResponse, o: Outcome) -> None:
        # The stream is read as it arrives (readany) and cut into lines here: aiohttp's line iterator (a search
        # and a copy per line) took 9 % of the client's CPU at 16 tokens a request, readany takes 5 %.
        done, first, rest = False, True, b""
        clock, origin, endpoint = time.perf_counter, self.origin, self.endpoint
        event_stream = resp.content_type == "text/event-stream"
        content = resp.content
        while not done:
            data = await content.readany()
            if data:
                lines = (rest + data if rest else data).split(b"\n")
                rest = lines.pop()  # a line not ended yet (b"" when the data ends a line)
            elif rest:
                lines, rest = [rest], b""  # the end of the body ends its last line
            else:
                break
            for k, raw in enumerate(lines):
                line = raw.strip()
                if first and line and not event_stream and not line.startswith(SSE_FIELDS):
                    # an HTML error page from a proxy, or a whole JSON answer from a server that ignored "stream"
                    shown = b"\n".join(lines[k:]) + (b"\n" + rest if rest else b"")
                    if len(shown) < BODY_SHOWN:
                        shown += await content.read(BODY_SHOWN)
                    text = shown.decode("utf-8", "replace")[:BODY_SHOWN]
                    raise StreamError(f"not an event stream: the server answered {resp.content_type}: {text}")
                first = first and not line
                if not line.startswith(b"data:"):
                    continue  # event separator, keep-alive comment, or SSE fields (event:, id:) we do not use
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                try:
                    chunk = orjson.loads(payload)  # one parse per streamed token: orjson is ~3x faster than json
                except orjson.JSONDecodeError:
                    raise StreamError(f"malformed event: data that is not JSON: {payload[:80]!r}") from None
                if "error" in chunk and not chunk.get("choices"):
                    raise StreamError(f"error event: {chunk['error']}")
                t = clock() - origin
                text, reasoning = _content(chunk, endpoint)
                if text or reasoning:
                    if not o.chunk_s:
                        o.first_chunk_s = t
                    if text and o.first_output_s != o.first_output_s:  # NaN: first visible output
                        o.first_output_s = t
                    o.chunk_s.append(t)
                    o.last_chunk_s = t
                if "usage" in chunk or "timings" in chunk:
                    _usage(chunk, o)
        if not done:
            raise StreamError(f"stream cut: the server closed the stream after {len(o.chunk_s)} chunks, before [DONE]")


def _content(chunk: dict, endpoint: str) -> tuple[str, str]:
    choices = chunk.get("choices") or ()
    if not choices:
        return "", ""
    c = choices[0]
    if endpoint == "completions":
        return c.get("text") or "", ""
    delta = c.get("delta") or {}
    # vLLM names the reasoning stream reasoning_content (older) or reasoning; SGLang reasoning_content
    return delta.get("content") or "", delta.get("reasoning_content") or delta.get("reasoning") or ""


def _usage(chunk: dict, o: Outcome) -> None:
    usage = chunk.get("usage")
    if usage:
        o.prompt_tokens = usage.get("prompt_tokens", o.prompt_tokens)
        o.completion_tokens = usage.get("completion_tokens", o.completion_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            o.cached_tokens = details["cached_tokens"]
    timings = chunk.get("timings")  # llama.cpp: tokens reused from its prompt cache
    if timings and timings.get("cache_n") is not None and o.cached_tokens is None:
        o.cached_tokens = timings["cache_n"]
