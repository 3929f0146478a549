"""Reading an OpenAI-compatible server's streamed answer (server-sent events) into a request's Outcome.

`EventStream` is fed the answer's body as it arrives, in pieces cut anywhere, and never waits itself: the
HTTP layer that owns the connection (`kvbench.live.http1`, or aiohttp's stream in `client`) calls `feed` with
each piece and `end` when the body ends. One clock reading per piece: every event in it arrived together."""

from __future__ import annotations

import time

import orjson

from kvbench.run.pacing import Outcome

BODY_SHOWN = 200  # characters of an unexpected answer's body quoted in an error
SSE_FIELDS = (b"data:", b":", b"event:", b"id:", b"retry:")  # what a line of an event stream starts with


class StreamError(Exception):
    """A fault found while reading an answer; its message is the request's error, class first."""


class EventStream:
    """The events of one answer, as they arrive: content chunks (their times), usage, errors, [DONE].
    `content_type` is the answer's media type (lower case, no parameters): anything but text/event-stream
    whose first line is no event-stream field is quoted from its start as 'not an event stream'."""

    __slots__ = ("o", "origin", "chat", "event_stream", "content_type", "first", "rest", "done", "shown")

    def __init__(self, o: Outcome, origin: float, endpoint: str):
        self.o, self.origin, self.chat = o, origin, endpoint != "completions"
        self.event_stream, self.content_type = True, "text/event-stream"
        self.first = True  # no line with anything on it yet
        self.rest = b""  # a line not ended yet
        self.done = False  # [DONE] seen
        self.shown: bytes | None = None  # the start of an answer that is no event stream, being collected

    def start(self, content_type: str) -> None:
        self.content_type = content_type
        self.event_stream = content_type == "text/event-stream"

    def feed(self, data: bytes) -> bool:
        """The next piece of the body; True once [DONE] has come (what follows it is ignored)."""
        if self.done:
            return True
        if self.shown is not None:
            self.shown += data
            if len(self.shown) >= BODY_SHOWN:
                raise self._not_events()
            return False
        lines = (self.rest + data if self.rest else data).split(b"\n")
        self.rest = lines.pop()  # b"" when the piece ends a line
        return self._lines(lines, time.perf_counter() - self.origin)

    def end(self) -> None:
        """The body ended: its last line ends with it. Raises unless [DONE] came."""
        if self.done:
            return
        if self.rest:
            lines, self.rest = [self.rest], b""
            if self._lines(lines, time.perf_counter() - self.origin):
                return
        if self.shown is not None:
            raise self._not_events()
        n = len(self.o.chunk_s)
        raise StreamError(f"stream cut: the server closed the stream after {n} chunks, before [DONE]")

    def _not_events(self) -> StreamError:
        text = self.shown.decode("utf-8", "replace")[:BODY_SHOWN]
        return StreamError(f"not an event stream: the server answered {self.content_type}: {text}")

    def _lines(self, lines: list[bytes], t: float) -> bool:
        o, loads = self.o, orjson.loads
        for k, raw in enumerate(lines):
            line = raw.strip()
            if self.first and line:
                self.first = False
                if not self.event_stream and not line.startswith(SSE_FIELDS):
                    # an HTML error page from a proxy, or a whole JSON answer from a server that ignored "stream"
                    self.shown = b"\n".join(lines[k:]) + (b"\n" + self.rest if self.rest else b"")
                    self.rest = b""
                    if len(self.shown) >= BODY_SHOWN:
                        raise self._not_events()
                    return False
            if not line.startswith(b"data:"):
                continue  # event separator, keep-alive comment, or SSE fields (event:, id:) we do not use
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                return True
            try:
                chunk = loads(payload)  # one parse per streamed token: orjson is ~3x faster than json
            except orjson.JSONDecodeError:
                raise StreamError(f"malformed event: data that is not JSON: {payload[:80]!r}") from None
            if "error" in chunk and not chunk.get("choices"):
                raise StreamError(f"error event: {chunk['error']}")
            text, reasoning = _content(chunk, self.chat)
            if text or reasoning:
                if not o.chunk_s:
                    o.first_chunk_s = t
                if text and o.first_output_s != o.first_output_s:  # NaN: first visible output
                    o.first_output_s = t
                o.chunk_s.append(t)
                o.last_chunk_s = t
            if "usage" in chunk or "timings" in chunk:
                _usage(chunk, o)
        return False


def _content(chunk: dict, chat: bool) -> tuple[str, str]:
    choices = chunk.get("choices")
    if not choices:
        return "", ""
    c = choices[0]
    if not chat:
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
