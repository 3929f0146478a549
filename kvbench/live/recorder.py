"""`kvbench trace record`: an OpenAI-compatible reverse proxy that records the traffic passing through it as
a trace (docs/semantics.md, Keyed block ids), with no prompt text kept anywhere.

Forwarding comes first: a request's bytes go to the upstream as they arrived, and the answer's bytes come back
chunk by chunk as the upstream sends them (a stream is never buffered), so a client cannot tell the proxy is
there. Recording runs beside it: once the answer's first bytes went to the client, the prompt is tokenized
(the upstream's /tokenize, or a local tokenizer.json in a worker thread), hashed into keyed block ids
(`kvbench.trace.keyed`) and dropped.

Usage, as chosen: the request is never changed, so a stream's usage (output and cached tokens) is recorded when
the client asked for it (stream_options.include_usage) and otherwise the output tokens are the stream's content
events counted (one token each, as vLLM and SGLang send them) and the cached tokens are unknown (null).
Injecting include_usage would change the bytes the client receives.

Rows are committed as the run goes (`recordparts`): a killed proxy keeps every row committed before the kill.
"""

from __future__ import annotations

import asyncio
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from kvbench.errors import KvbenchError
from kvbench.live.recordparts import RecordParts
from kvbench.redact import redact_url
from kvbench.trace.keyed import block_ids
from kvbench.trace.tokenizer import LocalTokenizer, NotTokenizable, prompt_of, token_ids, tokenize_payload

RECORDED_PATHS = ("/v1/completions", "/v1/chat/completions")
# hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp sets itself for the connection it makes
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}
TOKENIZE_TIMEOUT_S = 300.0  # off the critical path: a backlogged engine answers late, and a late row beats a lost one


@dataclass
class RecordOptions:
    """Where the trace's labels come from: a header (case-insensitive) or a top-level body field, for each."""

    block_size: int = 16
    session_header: str | None = None
    session_field: str | None = None
    user_header: str | None = None
    user_field: str | None = "user"
    tenant_header: str | None = None
    tenant_field: str | None = None
    priority_header: str | None = None
    priority_field: str | None = None
    base_model: str | None = None
    commit_every_s: float = 1.0
    upstream_headers: dict = field(default_factory=dict)


def _label(request: web.Request, body: dict, header: str | None, name: str | None) -> str | None:
    value = request.headers.get(header) if header else None
    if value is None and name and body.get(name) is not None:
        value = body[name]
    return None if value is None else str(value)


def _priority(text: str | None) -> int | None:
    """The schema's priority is 0-100; anything else is dropped rather than invented."""
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and 0 <= value <= 100 else None


class UsageReader:
    """Reads the answer as it passes (never holding a stream, only its last partial line): usage when present,
    and the count of content events of a stream."""

    def __init__(self, stream: bool, encoding: str = ""):
        self.stream, self.tail, self.events = stream, b"", 0
        self.encoding = encoding.lower()  # a compressed answer passes through compressed; only its copy is opened
        self.usage: dict | None = None
        self.body = bytearray()  # a non-streamed answer only, for its usage

    def feed(self, chunk: bytes) -> None:
        if not self.stream:
            if len(self.body) < 1 << 22:  # a sane answer is far smaller; a huge one is forwarded, not parsed
                self.body += chunk
            return
        lines = (self.tail + chunk).split(b"\n")
        self.tail = lines.pop()
        for line in lines:
            self._line(line.strip())

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            return
        try:
            event = orjson.loads(line[5:])  # the fast parser: this runs on every event of every stream
        except orjson.JSONDecodeError:
            return
        if not isinstance(event, dict):
            return
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if choice.get("text") or delta.get("content") or delta.get("reasoning_content"):
                self.events += 1

    def finish(self) -> tuple[int, int | None]:
        """(output tokens, cached tokens or None)."""
        if self.stream:
            self._line(self.tail.strip())
        else:
            try:
                body = bytes(self.body)
                if self.encoding in ("gzip", "deflate"):
                    body = zlib.decompress(body, 47)  # 47: a gzip or zlib header, whichever it has
                answer = orjson.loads(body)
                self.usage = answer.get("usage") if isinstance(answer, dict) else None
            except (ValueError, zlib.error):
                self.usage = None
        usage = self.usage if isinstance(self.usage, dict) else {}
        out = usage.get("completion_tokens")
        out = out if isinstance(out, int) else self.events
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return out, cached if isinstance(cached, int) else None


class Recorder:
    """The proxy: serve `app()` with an aiohttp runner; the runner's cleanup waits for the rows of requests in
    flight and commits them, and `recordparts.finish(out)` then writes the trace."""

    def __init__(self, upstream: str, out: Path, key: bytes, options: RecordOptions, tokenizer: Path | None = None):
        upstream = upstream.rstrip("/")
        # clients' paths start with /v1, so an upstream given as the clients' base URL (…/v1) loses its /v1
        self.upstream = upstream[:-3] if upstream.endswith("/v1") else upstream
        self.key, self.options = key, options
        self.local = LocalTokenizer(tokenizer) if tokenizer else None
        source = {"kind": "recorded", "tokenizer": self.local.name if self.local else "upstream /tokenize"}
        self.parts = RecordParts(Path(out), options.block_size, source)
        self.t0 = time.monotonic()
        self.seq = 0
        self.turns: dict[str, int] = {}
        # session -> [its latest request's id, when that request's answer ended (s) or None while it runs]
        self.latest: dict[str, list] = {}
        self.skipped = 0  # requests whose prompt could not be tokenized: forwarded, not recorded
        self.session: aiohttp.ClientSession | None = None
        self._pending: set[asyncio.Task] = set()
        self._committer: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)  # prompts may be long; the upstream sets its own limit
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app) -> None:
        # auto_decompress off: compressed answers pass through as the upstream sent them
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        connector = aiohttp.TCPConnector(limit=0)  # the client's concurrency, not ours, is the limit
        self.session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False, connector=connector)
        self._committer = asyncio.create_task(self._commit_loop())

    async def _stop(self, app) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._committer:
            self._committer.cancel()
        if self.session:
            await self.session.close()
        await asyncio.to_thread(self.parts.commit)

    async def _commit_loop(self) -> None:
        while True:  # off the event loop: a disk write never delays forwarding
            await asyncio.sleep(self.options.commit_every_s)
            await asyncio.to_thread(self.parts.commit)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic() - self.t0
        data = await request.read()
        body, tokens, row = None, None, None
        if request.method == "POST" and request.path in RECORDED_PATHS:
            try:
                body = orjson.loads(data)
                row = self._labels(arrival, request, body)  # at arrival: ids and turns in arrival order
            except (ValueError, NotTokenizable, AttributeError, TypeError):
                body = None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        url = self.upstream + request.rel_url.path_qs
        status = "ok"
        response, reader = None, UsageReader(False)
        try:
            async with self.session.request(request.method, url, data=data, headers=headers) as up:
                response = web.StreamResponse(status=up.status, reason=up.reason)
                for k, v in up.headers.items():
                    if k.lower() not in HOP_BY_HOP:
                        response.headers.add(k, v)
                if up.content_length is not None:  # the bytes pass undecoded, so the upstream's length holds
                    response.content_length = up.content_length
                await response.prepare(request)
                stream = bool(isinstance(body, dict) and body.get("stream"))
                reader = UsageReader(stream, up.headers.get("Content-Encoding", ""))
                if up.status >= 400:
                    status = f"http {up.status}"
                try:
                    async for chunk in up.content.iter_any():
                        await response.write(chunk)  # at once: the client sees each event when the upstream sends it
                        reader.feed(chunk)
                        if row is not None and tokens is None:
                            tokens = self._start_tokenizing(body, request)
                except aiohttp.ClientPayloadError:
                    status = "cut"
                    if request.transport is not None:
                        request.transport.close()  # the client sees the cut the upstream made
                    return response
                await response.write_eof()
                return response
        except (ConnectionResetError, asyncio.CancelledError):
            status = "cut"  # the client went away
            raise
        except aiohttp.ClientError as exc:
            status = "cut" if response is not None else "upstream unreachable"
            if response is not None:
                if request.transport is not None:
                    request.transport.close()
                return response
            why = f"cannot reach {redact_url(self.upstream)} ({type(exc).__name__})"
            return web.json_response(
                {"error": {"message": f"kvbench trace record: {why}; is the --upstream server running?"}},
                status=502,
            )
        finally:
            if row is not None:
                self._ended(row)
                tokens = tokens or self._start_tokenizing(body, request)
                task = asyncio.create_task(self._record(row, tokens, reader, status))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)

    def _ended(self, row: dict) -> None:
        latest = self.latest.get(row["session_id"]) if row["session_id"] is not None else None
        if latest is not None and latest[0] == row["request_id"]:
            latest[1] = time.monotonic() - self.t0

    def _start_tokenizing(self, body: dict, request: web.Request) -> asyncio.Task:
        """Tokenize once the first bytes of the answer went to the client (or the request ended): the
        upstream's /tokenize never competes with the request it is recording for the time to first token."""
        return asyncio.create_task(self._tokenize(body, request.headers))

    async def _tokenize(self, body: dict, headers) -> list[int]:
        kind, prompt = prompt_of(body)
        if kind == "prompt" and isinstance(prompt, list):
            return list(prompt)  # token ids already
        if self.local is not None:
            return await asyncio.to_thread(self.local.ids, body)
        auth = {k: v for k, v in headers.items() if k.lower() in ("authorization", "x-api-key")}
        payload = tokenize_payload(body)
        timeout = aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S)
        async with self.session.post(self.upstream + "/tokenize", json=payload, headers=auth, timeout=timeout) as r:
            if r.status != 200:
                raise KvbenchError(f"{self.upstream}/tokenize: HTTP {r.status}")
            return token_ids(await r.json(content_type=None), self.upstream + "/tokenize")

    def _labels(self, arrival: float, request: web.Request, body: dict) -> dict:
        """The row's fields known at arrival: its id, time and labels (no prompt text)."""
        o = self.options
        session = _label(request, body, o.session_header, o.session_field)
        self.seq += 1
        request_id = f"rec-{self.seq:09d}"
        turn = parent = think = None
        if session is not None:
            # the session's previous request is this one's parent; the time since its answer ended is the
            # client's think time, which a closed-loop replay (--pacing sessions) waits. A request sent while
            # the previous one still ran has no think time (null, read as 0).
            previous = self.latest.get(session)
            turn = self.turns.get(session, 0)
            self.turns[session] = turn + 1
            if previous is not None:
                parent = previous[0]
                think = max(0.0, arrival - previous[1]) if previous[1] is not None else None
            self.latest[session] = [request_id, None]
        model, salt = body.get("model"), body.get("cache_salt")
        return {
            "request_id": request_id,
            "arrival_s": arrival,
            "session_id": session,
            "turn": turn,
            "parent_id": parent,
            "think_time_s": think,
            "user_id": _label(request, body, o.user_header, o.user_field),
            "tenant": _label(request, body, o.tenant_header, o.tenant_field),
            "priority": _priority(_label(request, body, o.priority_header, o.priority_field)),
            "cache_salt": salt if isinstance(salt, str) else None,
            "lora": model if o.base_model and isinstance(model, str) and model != o.base_model else None,
        }

    async def _record(self, row: dict, tokens: asyncio.Task, reader: UsageReader, status: str) -> None:
        try:
            ids = await tokens
        except Exception as exc:  # only that one request is left out
            self.skipped += 1
            if self.skipped == 1:  # once, and never with the prompt: kvbench's messages name fields, not text
                why = str(exc) if isinstance(exc, KvbenchError) else type(exc).__name__
                print(
                    f"kvbench trace record: a request could not be tokenized ({why}); such requests are forwarded "
                    "but not recorded (give --tokenizer tokenizer.json if the upstream has no /tokenize)",
                    file=sys.stderr,
                )
            return
        if not ids:
            self.skipped += 1
            return
        out, cached = reader.finish()
        row.update(
            input_tokens=len(ids),
            output_tokens=max(0, int(out)),
            block_hashes=block_ids(ids, self.options.block_size, self.key).tolist(),
            recorded_cached_tokens=cached,
            recorded_status=status,
        )
        self.parts.add(row)
