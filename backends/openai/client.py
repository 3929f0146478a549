"""Streaming client for OpenAI-compatible servers (aiohttp, server-sent events). One `send` per request; it
never raises for a server or network fault: the fault becomes the request's status and error, so a run goes
on and every request is accounted for."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson

from kvbench.pacing import Outcome

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
JSON = {"Content-Type": "application/json"}
ERROR_TEXT = 300  # characters of a server's error body kept in the record


class StreamError(Exception):
    pass


class OpenAIClient:
    def __init__(self, url: str, *, endpoint: str, timeout_s: float, api_key: str | None, origin: float):
        self.url = url.rstrip("/") + ENDPOINTS[endpoint]
        self.endpoint = endpoint
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
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
                    body = (await resp.text())[:ERROR_TEXT]
                    o.status, o.error = "error", f"HTTP {resp.status}: {body}"
                    return
                await self._read_stream(resp, o)
                o.status = "ok"
        except TimeoutError:
            o.status, o.error = "timeout", f"no complete answer within {self.timeout.total:g} s"
        except asyncio.CancelledError:
            o.status, o.error = "cancelled", "run interrupted before the answer completed"
            raise
        except StreamError as exc:
            o.status, o.error = "error", str(exc)
        except aiohttp.ClientPayloadError as exc:
            o.status = "error"
            o.error = f"stream ended before [DONE] after {len(o.chunk_s)} chunks: connection dropped ({exc})"[
                :ERROR_TEXT
            ]
        except aiohttp.ClientError as exc:
            o.status, o.error = "error", f"{type(exc).__name__}: {exc}"[:ERROR_TEXT]

    async def _read_stream(self, resp: aiohttp.ClientResponse, o: Outcome) -> None:
        done = False
        clock, origin = time.perf_counter, self.origin
        async for raw in resp.content:
            line = raw.strip()
            if not line or line.startswith(b":"):
                continue  # keep-alive comment or event separator
            if not line.startswith(b"data:"):
                continue  # other SSE fields (event:, id:) carry nothing we use
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            try:
                chunk = orjson.loads(data)  # one parse per streamed token: orjson is ~3x faster than json
            except orjson.JSONDecodeError:
                raise StreamError(f"malformed SSE data: {data[:80]!r}") from None
            if "error" in chunk and not chunk.get("choices"):
                raise StreamError(f"server error in stream: {str(chunk['error'])[:ERROR_TEXT]}")
            t = clock() - origin
            text, reasoning = _content(chunk, self.endpoint)
            if text or reasoning:
                if not o.chunk_s:
                    o.first_chunk_s = t
                if text and o.first_output_s != o.first_output_s:  # NaN: first visible output
                    o.first_output_s = t
                o.chunk_s.append(t)
                o.last_chunk_s = t
            _usage(chunk, o)
        if not done:
            raise StreamError(
                f"stream ended before [DONE] after {len(o.chunk_s)} chunks (connection dropped or server crashed)"
            )


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
