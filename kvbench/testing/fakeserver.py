"""A fake OpenAI-compatible streaming server (aiohttp): answers instantly (or with a set inter-token delay),
keeps vLLM-style prefix counters, and injects faults on request. Two uses: measuring a load generator's own
overhead (a server that costs nothing), and testing that a live run survives every fault.

    python -m kvbench.testing.fakeserver --port 8100 [--itl-ms 0] [--block-size 16]
        [--fault 5:http500 …] [--require-key K]

Prefix caching is modelled as an unbounded cache of `block_size`-token blocks with vLLM's cap (the last prompt
token is always computed), so `cached_tokens` and the `/metrics` counters behave like a real engine's.
Faults (`--fault N:KIND`: the N-th request received, counting from 0, or `every=K:KIND`): http500, http429,
http400, timeout (never answers), cut (drops the stream half-way), malformed (a line of invalid JSON), error
(an error object inside the stream), html (a 200 HTML page, as a proxy's error page), json (a whole JSON answer
where a stream was asked for), nodetails (usage without prompt_tokens_details, as servers that keep no prefix
cache report it). Kept-alive connections (`--keepalive-max N`, `--close-after N`, `--idle-timeout S`): a server that
answers the N-th request of a connection with `Connection: close` and closes it (cpp-httplib's keep-alive
count); one that closes a connection after N answers without saying so (llama.cpp's llama-server, after each
streamed answer), modelled as dropping unanswered the next request written on it, the request a client sends as
the close crosses it; one that closes connections idle for S seconds.
`--require-key K`: the /v1 routes answer 401 without a key and 403 with a wrong one, as vLLM's --api-key
does; the key may come as a bearer token, an X-Api-Key header or a basic-auth password.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import zlib
from collections.abc import Callable

from aiohttp import web

FAULTS = ("http500", "http429", "http400", "timeout", "cut", "malformed", "error", "html", "json", "nodetails")


class FakeServer:
    def __init__(
        self,
        block_size: int = 16,
        itl_s: float = 0.0,
        fault: Callable[[int], str | None] | None = None,
        ignore_salt: bool = False,
        require_key: str | None = None,
        keepalive_max: int | None = None,
        close_after: int | None = None,
        idle_timeout_s: float | None = None,
        max_model_len: int | None = None,
    ):
        self.block_size, self.itl_s, self.fault = block_size, itl_s, fault or (lambda n: None)
        self.ignore_salt = ignore_salt  # behave like llama.cpp, which shares its cache whatever the salt
        self.require_key = require_key
        self.keepalive_max, self.close_after, self.idle_timeout_s = keepalive_max, close_after, idle_timeout_s
        self.answered: dict = {}  # transport -> answers given on that connection (open connections only)
        self.dropped = 0  # requests dropped unanswered by close_after
        self.cache: set[int] = set()
        self.max_model_len = max_model_len  # published on /v1/models, as vLLM does, when given
        self.received = 0
        self.running = 0
        self.counters = {"prompt_tokens": 0, "cached_tokens": 0, "queries": 0, "hits": 0, "requests": 0}

    def app(self) -> web.Application:
        handler_args = {} if self.idle_timeout_s is None else {"keepalive_timeout": self.idle_timeout_s}
        app = web.Application(middlewares=[self._check_key] if self.require_key else [], handler_args=handler_args)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        app.router.add_post("/reset_prefix_cache", self.reset)
        app.router.add_post("/tokenize", self.tokenize)
        return app

    @web.middleware
    async def _check_key(self, request: web.Request, handler):
        if not request.path.startswith("/v1/"):
            return await handler(request)  # like vLLM: only the API routes want the key
        given = [request.headers.get("X-Api-Key")]
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            given.append(value.strip())
        elif scheme.lower() == "basic":
            with contextlib.suppress(ValueError):
                given.append(base64.b64decode(value).decode().partition(":")[2])
        given = [g for g in given if g]
        if self.require_key in given:
            return await handler(request)
        status = 403 if given else 401
        return web.json_response(
            {"error": {"message": "invalid API key" if given else "missing API key"}}, status=status
        )

    async def health(self, request):
        return web.Response(text="ok")

    async def models(self, request):
        card = {"id": "fake", "object": "model"}
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        return web.json_response({"object": "list", "data": [card]})

    async def tokenize(self, request):
        """vLLM's /tokenize, for the recording proxy's tests: a word is a token, its id a stable hash of it;
        chat messages are every message's words in order (no template)."""
        body = await request.json()
        if "messages" in body:
            words = [w for m in body["messages"] for w in str(m.get("content", "")).split()]
        else:
            prompt = body.get("prompt", "")
            words = prompt.split() if isinstance(prompt, str) else [str(t) for t in prompt]
        tokens = [zlib.crc32(w.encode()) % 100_000 for w in words]
        return web.json_response({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    async def reset(self, request):
        self.cache.clear()
        return web.Response(text="ok")

    async def metrics(self, request):
        c = self.counters
        lines = [
            f'vllm:prompt_tokens_total{{model_name="fake"}} {c["prompt_tokens"]}',
            f'vllm:prompt_tokens_cached_total{{model_name="fake"}} {c["cached_tokens"]}',
            f'vllm:prefix_cache_queries_total{{model_name="fake"}} {c["queries"]}',
            f'vllm:prefix_cache_hits_total{{model_name="fake"}} {c["hits"]}',
            f'vllm:request_success_total{{model_name="fake"}} {c["requests"]}',
            # gauges: the fake cache never evicts, so usage is its size over a nominal 65,536 blocks
            f'vllm:kv_cache_usage_perc{{model_name="fake"}} {min(1.0, len(self.cache) / 65536)}',
            f'vllm:num_requests_running{{model_name="fake"}} {self.running}',
            'vllm:num_requests_waiting{model_name="fake"} 0',
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    def _cached(self, tokens: list, salt: str | None = None) -> int:
        bs = self.block_size
        chain, keys = (0 if self.ignore_salt else hash(salt)), []  # vLLM folds the salt into the first block
        for b in range(len(tokens) // bs):  # a block's key covers its tokens and every block before it
            chain = hash((chain, tuple(tokens[b * bs : (b + 1) * bs])))
            keys.append(chain)
        hit = 0
        for b in range((len(tokens) - 1) // bs):  # vLLM: at least the last prompt token is computed
            if keys[b] not in self.cache:
                break
            hit = (b + 1) * bs
        self.cache.update(keys)
        return hit

    async def complete(self, request: web.Request):
        conn = request.transport
        self.answered = {t: n for t, n in self.answered.items() if not t.is_closing()}
        served = self.answered.get(conn, 0)
        if self.close_after is not None and served >= self.close_after:
            # the connection is closed, as it would have been after its last answer, and this request that
            # crossed the close gets no byte back (not counted as received: the server never took it)
            self.dropped += 1
            conn.close()
            raise asyncio.CancelledError  # aiohttp ends the handler without an answer
        self.answered[conn] = served + 1
        last = self.keepalive_max is not None and served + 1 >= self.keepalive_max
        self.running += 1
        try:
            resp = await self._complete(request, last)
        finally:
            self.running -= 1
        if last and not resp.prepared:
            resp.force_close()  # `Connection: close`, then the connection is closed
        return resp

    async def _complete(self, request: web.Request, last: bool = False):
        n = self.received
        self.received += 1
        fault = self.fault(n)
        if fault in ("http500", "http429", "http400"):
            return web.json_response({"error": {"message": f"injected {fault}"}}, status=int(fault[4:]))
        if fault == "html":
            return web.Response(text="<html><body><h1>502 Bad Gateway</h1></body></html>", content_type="text/html")
        body = await request.json()
        chat = "messages" in body
        prompt = body["messages"][-1]["content"].split() if chat else body["prompt"]
        if isinstance(prompt, str):
            prompt = prompt.split()
        cached = self._cached(list(prompt), body.get("cache_salt"))
        out = int(body.get("max_tokens") or 16)
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": out,
            "total_tokens": len(prompt) + out,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if fault == "nodetails":  # a server without prefix-cache accounting (no prompt_tokens_details)
            del usage["prompt_tokens_details"]
        self._count(len(prompt), cached)
        if not body.get("stream") or fault == "json":
            text = {"message": {"role": "assistant", "content": "x" * out}} if chat else {"text": "x" * out}
            return web.json_response({"choices": [{"index": 0, **text}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if last:
            resp.force_close()  # the connection's last allowed answer: `Connection: close`, then closed
        await resp.prepare(request)
        if fault == "timeout":
            await asyncio.sleep(3600)
        for i in range(out):
            if fault == "cut" and i == out // 2:
                request.transport.close()  # the connection drops mid-stream
                return resp
            if fault == "malformed" and i == out // 2:
                await resp.write(b"data: {not json\n\n")
            if fault == "error" and i == out // 2:
                await resp.write(b'data: {"error": {"message": "injected error", "code": 500}}\n\n')
                await resp.write(b"data: [DONE]\n\n")
                return resp
            choice = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
            await resp.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
            if self.itl_s:
                await asyncio.sleep(self.itl_s)
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _count(self, prompt: int, cached: int) -> None:
        c = self.counters
        c["prompt_tokens"] += prompt
        c["cached_tokens"] += cached
        c["queries"] += prompt
        c["hits"] += cached
        c["requests"] += 1


def fault_plan(specs: list[str]) -> Callable[[int], str | None]:
    """'5:cut' (request 5) or 'every=3:http500' (requests 0, 3, 6, …) -> a function of the request number."""
    exact, every = {}, []
    for spec in specs:
        where, _, kind = spec.partition(":")
        if kind not in FAULTS:
            raise SystemExit(f"--fault {spec!r}: kind must be one of {', '.join(FAULTS)}")
        if where.startswith("every="):
            every.append((int(where[6:]), kind))
        else:
            exact[int(where)] = kind
    return lambda n: exact.get(n) or next((k for step, k in every if n % step == 0), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--itl-ms", type=float, default=0.0, help="delay between streamed tokens, milliseconds")
    ap.add_argument("--block-size", type=int, default=16, help="prefix-cache block size, tokens")
    ap.add_argument("--ignore-salt", action="store_true", help="share the cache across cache_salt (like llama.cpp)")
    ap.add_argument("--require-key", help="the /v1 routes answer 401/403 unless this key is sent")
    ap.add_argument("--keepalive-max", type=int, help="answer a connection's N-th request with Connection: close")
    ap.add_argument("--close-after", type=int, help="close a connection after N answers, without saying so")
    ap.add_argument("--idle-timeout", type=float, help="close connections idle this many seconds")
    ap.add_argument("--fault", action="append", default=[], help="N:KIND or every=K:KIND; KIND in " + ", ".join(FAULTS))
    args = ap.parse_args()
    server = FakeServer(
        args.block_size,
        args.itl_ms / 1000.0,
        fault_plan(args.fault),
        args.ignore_salt,
        args.require_key,
        args.keepalive_max,
        args.close_after,
        args.idle_timeout,
    )
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(server.app(), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
