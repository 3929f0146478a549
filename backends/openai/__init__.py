"""`openai`: live replay against an OpenAI-compatible server (vLLM, SGLang, TensorRT-LLM, llama.cpp, …).

Prompts are synthesised from the trace's block ids (`kvbench.live.prompts`): token-id prompts on /v1/completions
by default (block-exact prefixes on any model), or text made of one-token words on /v1/chat/completions for
engines serving kvbench's tiny word-level model. `max_tokens` = output_tokens with `ignore_eos`, the trace's
`cache_salt` goes in the request body (vLLM's extension), and `model` is the request's LoRA adapter when it
has one. Credentials (the API key's variable, `--header`s, user-info in `--url`) are sent with every request
and discovery call and never written anywhere: `config()` masks them (`kvbench.redact`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import click
import numpy as np
import pyarrow as pa
from kvbench.backends.openai.address import DEFAULT_KEY_ENV, ServerAddress, api_key, parse_headers, shown_headers

from kvbench import options
from kvbench.errors import KvbenchError
from kvbench.live.prompts import words
from kvbench.metrics.slo import parse_slo
from kvbench.options import option
from kvbench.redact import is_secret_name, redact
from kvbench.run.pacing import Outcome, Pacing
from kvbench.trace.files import TraceMeta
from kvbench.trace.tokens import DEFAULT_VOCAB

PROMPT_BATCH = 512  # at most this many requests' prompts are synthesised together…
PROMPT_BATCH_TOKENS = 1 << 18  # …and about this many tokens (~0.15 s of numpy: long agent prompts stay bounded)
PROMPT_BATCHES_KEPT = 8


@dataclass
class OpenAIConfig:
    """The options of `kvbench replay --backend openai` (kvbench.options); the pacing options are
    kvbench.run.pacing's."""

    url: str | None = option(
        None,
        "server base URL, e.g. http://127.0.0.1:8011 (a trailing /v1 is allowed; user:key@ in it is sent as basic "
        "auth, never recorded; env KVBENCH_URL; `kvbench engine status` shows local engines)",
        unit="URL",
        envvar="KVBENCH_URL",
    )
    served_model: str | None = option(
        None,
        "the served model's name to request [default: the first of GET /v1/models]; a request with a LoRA adapter "
        "asks for the adapter instead",
        unit="name",
    )
    endpoint: str = option(
        "completions",
        "completions: token-id prompts (exact on any model); chat: text of one-token words (exact only with "
        "kvbench's tiny word-level model)",
        unit="name",
        type=click.Choice(["completions", "chat"]),
    )
    api_key_env: str = option(
        DEFAULT_KEY_ENV,
        "environment variable that holds the API key, sent as a bearer token (never stored in results); the "
        "default may be unset (no key), another variable named here must be set",
        unit="name",
    )
    headers: tuple = option(
        (),
        "an HTTP header sent with every request and discovery call (repeatable), e.g. --header 'X-Api-Key: …'; "
        "values of secret-named headers (Authorization, *-Key, *-Token) are never recorded",
        unit="text",
        flag="--header",
        multiple=True,
        metavar="'NAME: VALUE'",
        show_default=False,
    )
    timeout_s: float = option(
        600.0, "time a request may take in all before it counts as a timeout", unit="s", flag="--timeout",
        type=click.FloatRange(min=0, min_open=True),
    )  # fmt: skip
    vocab: int = option(
        DEFAULT_VOCAB, "synthesised token ids are below this (at most the model's vocabulary size)", unit="token ids",
        type=click.IntRange(min=64),
    )  # fmt: skip
    send_salt: bool = option(
        True, "send the trace's cache_salt in the request body (vLLM's cache isolation)", unit="on/off",
        flag="--send-salt/--no-send-salt",
    )  # fmt: skip
    slo: str | None = option(None, "goodput targets, e.g. ttft=500,tpot=50,e2el=20000", unit="ms")
    engine_block_size: int | None = option(
        None,
        "the server's KV block size, recorded so that `kvbench compare` can re-cut the trace for a simulator "
        "prediction [default: from `kvbench engine` state]",
        unit="tokens",
        type=click.IntRange(min=1),
    )
    reset_prefix_cache: bool = option(
        False,
        "POST /reset_prefix_cache before the run (vLLM with VLLM_SERVER_DEV_MODE=1, SGLang /flush_cache), so that "
        "earlier traffic cannot hit",
        unit="on/off",
        is_flag=True,
    )
    send_lora: bool = option(
        True,
        "ask for the request's LoRA adapter as the model; --no-send-lora sends every request to the base model "
        "(simulate it with --share-lora-kv)",
        unit="on/off",
        flag="--send-lora/--no-send-lora",
    )


class OpenAIBackend:
    name = "openai"
    kind = "online"  # kvbench.run.backend.OnlineBackend
    Config = OpenAIConfig

    @classmethod
    def cli_options(cls) -> list[click.Option]:
        return options.cli_options(OpenAIConfig) + Pacing.cli_options()

    def __init__(self, config: OpenAIConfig | None = None, **kwargs):
        """`config`, or its fields as keyword arguments; the other keywords are the pacing options."""
        c, pacing = options.build(OpenAIConfig, config, kwargs)
        if not c.url:
            raise KvbenchError("give the server with --url http://HOST:PORT (or start one: kvbench engine up vllm-cpu)")
        self.options = c
        self.address = ServerAddress(c.url)
        # url: no credentials in it; model: the served name, found on the server when not given
        self.url, self.model, self.endpoint = self.address.base, c.served_model, c.endpoint
        self.headers = parse_headers(c.headers)
        self.api_key_env = c.api_key_env or DEFAULT_KEY_ENV
        api_key(self.api_key_env)  # an unset variable the user named stops here; the key is read again in connect()
        self.timeout_s, self.vocab, self.send_salt = c.timeout_s, c.vocab, c.send_salt
        self.slo = parse_slo(c.slo)
        self.engine_block_size = c.engine_block_size
        self.reset_prefix_cache = c.reset_prefix_cache
        self.send_lora = c.send_lora
        self.pacing = Pacing(**{k: v for k, v in pacing.items() if v is not None})
        self.server: dict = {}
        self.requests_resent = 0  # sent again on a fresh connection after a kept-alive one closed under them

    def config(self) -> dict:
        # summary.json holds this: credentials masked (the URL's user-info, secret headers), then every string
        # passed through redact() in case a value looks like a secret the rules above did not name
        return redact(
            options.record(
                self.options,
                url=self.address.shown(),
                api_key_env=self.api_key_env,  # the variable's name only, never its value
                headers=shown_headers(self.headers),
                slo=self.slo,
                pacing=vars(self.pacing),
            )
        )

    def engine_settings(self) -> dict:
        """What the server publishes of its cache and context (kvbench.live.engine_settings), read before the
        run: the replay checks prompts against the context before it sends any, and records the rest."""
        from kvbench.live.engine_settings import read_url

        key = api_key(self.api_key_env)
        headers = {**self.address.auth_headers, **self.headers, **({"Authorization": f"Bearer {key}"} if key else {})}
        return read_url(self.url, headers, timeout_s=min(self.timeout_s or 10.0, 10.0))

    @contextlib.asynccontextmanager
    async def connect(self, trace: pa.Table, meta: TraceMeta, origin: float):
        """Open the client for a run: resolve the model, read the server's counters before the run."""
        from kvbench.backends.openai import discovery

        from kvbench.live.client import OpenAIClient
        from kvbench.live.servercounters import poll_gauges, scrape

        self._prepare(trace, meta)
        key = api_key(self.api_key_env)  # read where the client runs (a distributed run's worker has its own env)
        headers = {**self.address.auth_headers, **self.headers}  # an explicit --header wins over the URL's
        sent_auth = bool(key or any(is_secret_name(h) for h in headers))
        async with OpenAIClient(
            self.url,
            endpoint=self.endpoint,
            timeout_s=self.timeout_s,
            api_key=key,
            origin=origin,
            headers=headers,
        ) as client:
            self._client = client
            if not self.model:
                self.model = await discovery.first_model(client.session, self.address, sent_auth)
            else:
                await discovery.check_reachable(client.session, self.address, sent_auth)
            if self.reset_prefix_cache:
                await discovery.reset_prefix_cache(client.session, self.address, sent_auth)
            problems: list[str] = []
            self.server["counters_before"] = await scrape(client.session, self.url, problems=problems)
            if problems:  # not fatal: the run is measured without the server's own counters
                self.server["metrics_error"] = problems[0]
                click.echo(f"kvbench: warning: {problems[0]}; server counters are left out", err=True)
            timeline = self.server.setdefault("timeline", {})
            now = lambda: time.perf_counter() - origin  # noqa: E731
            poller = asyncio.get_running_loop().create_task(poll_gauges(client.session, self.url, now, timeline))
            try:
                yield self
            finally:
                poller.cancel()
                self._synth.shutdown(wait=False, cancel_futures=True)
                self.requests_resent = client.pool.resent if client.pool is not None else 0
                self.server["counters_after"] = await scrape(client.session, self.url)

    def _prepare(self, trace: pa.Table, meta: TraceMeta) -> None:
        self._hashes = trace.column("block_hashes").combine_chunks()
        self._offsets = np.asarray(self._hashes.offsets)
        self._flat = np.asarray(self._hashes.flatten())
        self._inp = trace.column("input_tokens").to_numpy()
        self._out = trace.column("output_tokens").to_numpy()
        self._bs = meta.block_size

        def col(name):
            if name not in trace.column_names:
                return [None] * trace.num_rows
            c = trace.column(name)
            return (c.cast(pa.string()) if pa.types.is_dictionary(c.type) else c).to_pylist()

        self._salt, self._lora, self._mm = col("cache_salt"), col("lora"), col("mm_items")
        # contiguous batches of rows, capped in rows and in tokens; made on a worker thread (numpy releases the
        # GIL), the next one ahead of need, so that the event loop never waits for a batch being synthesised
        n = len(self._inp)
        before = np.concatenate([[0], np.cumsum(self._inp, dtype=np.int64)[:-1]])
        ids = before // PROMPT_BATCH_TOKENS + np.arange(n) // PROMPT_BATCH
        _, self._batch_lo, self._row_batch = np.unique(ids, return_index=True, return_inverse=True)
        self._batch_lo = np.append(self._batch_lo, n)
        self._batches: dict[int, Future] = {}
        self._synth = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbench-prompts")
        if n:
            self._batch(0)  # ready before the first send

    def _batch(self, batch: int) -> Future:
        from kvbench.trace.tokens import prompt_tokens_batch

        if batch not in self._batches:
            lo, hi = self._batch_lo[batch], self._batch_lo[batch + 1]
            first = self._offsets[lo:hi] - self._offsets[0]
            self._batches[batch] = self._synth.submit(
                prompt_tokens_batch, self._flat, first, self._inp[lo:hi], self._bs, self.vocab
            )
            if len(self._batches) > PROMPT_BATCHES_KEPT:  # closed-loop sessions send out of order: keep a few
                self._batches.pop(next(iter(self._batches)))
        return self._batches[batch]

    def _tokens(self, row: int) -> np.ndarray:
        """Token ids of row `row`, synthesised a batch of rows at a time (one vectorised pass instead of a
        dozen small numpy calls per request, which cost ~0.2 ms each on the event loop)."""
        from kvbench.trace.tokens import overlay_media

        batch = int(self._row_batch[row])
        tokens, starts = self._batch(batch).result()
        if batch + 1 < len(self._batch_lo) - 1:
            self._batch(batch + 1)  # ahead of need
        i = row - self._batch_lo[batch]
        out = tokens[starts[i] : starts[i + 1]]
        return overlay_media(out.copy(), self._mm[row], self.vocab) if self._mm[row] else out

    def payload(self, row: int) -> bytes:
        """The request body of trace row `row`, JSON-encoded (orjson: the prompt is thousands of ids)."""
        import orjson

        tokens = self._tokens(row)
        body = {
            "model": (self._lora[row] if self.send_lora else None) or self.model,
            "max_tokens": max(int(self._out[row]), 1),  # `replay --max-output-tokens` caps the trace's
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "completions":
            body["prompt"] = tokens
        else:
            body["messages"] = [{"role": "user", "content": words(tokens)}]
        if self.send_salt and self._salt[row]:
            body["cache_salt"] = self._salt[row]
        return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)

    async def send(self, o: Outcome) -> None:
        await self._client.send(self.payload(o.row), o)

    def extra(self) -> dict:
        return {"server": self.server, "model": self.model, "requests_resent": self.requests_resent}
