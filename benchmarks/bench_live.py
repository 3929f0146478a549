"""Speed of the live client (`openai` backend) against kvbench's fake server (asv).

- `LiveReplay.track_max_rate`: completed requests/s of a live replay of `MAX_RATE_REQUESTS` short requests
  (100-token prompts, 16 streamed tokens) sent at an unlimited rate, at most `CONCURRENCY` in flight.
- `LiveReplay.track_p99_lag_ms`: p99 schedule lag (actual - scheduled send, ms) of a Poisson run at
  `LAG_RATE` req/s for `LAG_SECONDS` s.
- `Payload.time_payload_1000`: building the JSON bodies (`OpenAIBackend.payload`) of 1,000 requests.

The fake server (`kvbench.testing.fakeserver`, instant streaming) runs in a thread of the benchmark process, as in
tests/unit/live/conftest.py, so client and server share one interpreter (and its GIL): the figures track
kvbench's client from commit to commit, they are not the client's absolute ceiling (for that, and for the
side-by-side with `vllm bench serve`, run benchmarks/client_overhead.py). Each track takes a few seconds.
Run with `asv run --bench bench_live` or, without asv, `python -m benchmarks.bench_live`.
"""

from __future__ import annotations

import asyncio
import socket
import tempfile
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvbench.trace.files import new_meta

INPUT_TOKENS, OUTPUT_TOKENS, BLOCK_SIZE = 100, 16, 16
MAX_RATE_REQUESTS = 1000
CONCURRENCY = 64
LAG_RATE, LAG_SECONDS = 200.0, 3.0
PAYLOADS = 1000


def short_trace(n: int, seed: int = 1) -> tuple[pa.Table, object]:
    """n requests of INPUT_TOKENS distinct tokens (no shared prefixes) and OUTPUT_TOKENS output tokens."""
    nb = -(-INPUT_TOKENS // BLOCK_SIZE)
    hashes = np.random.default_rng(seed).integers(1, 2**63, size=(n, nb), dtype=np.uint64)
    table = pa.table(
        {
            "request_id": [f"r{i}" for i in range(n)],
            "arrival_s": np.arange(n, dtype=np.float64) * 1e-3,
            "input_tokens": np.full(n, INPUT_TOKENS, np.int32),
            "output_tokens": np.full(n, OUTPUT_TOKENS, np.int32),
            "block_hashes": pa.ListArray.from_arrays(
                pa.array(np.arange(0, n * nb + 1, nb, dtype=np.int32)), pa.array(hashes.ravel())
            ),
        }
    )
    from kvbench.trace.schema import conform

    return conform(table), new_meta(BLOCK_SIZE, {"generator": "benchmarks/bench_live.py"})


class ServerThread:
    """kvbench's fake OpenAI server on its own event loop in a daemon thread."""

    def __init__(self):
        from aiohttp import web

        from kvbench.testing.fakeserver import FakeServer

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._app, self._web = FakeServer(BLOCK_SIZE).app(), web
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake server thread did not start")

    def _serve(self):
        asyncio.set_event_loop(self._loop)
        runner = self._web.AppRunner(self._app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(self._web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def stop(self):
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def live_run(url: str, table: pa.Table, meta, **pacing) -> dict:
    """One live replay through the openai backend; the run's summary.json `latency` block."""
    from kvbench.backends.openai import OpenAIBackend

    from kvbench.live.replay import run_live

    backend = OpenAIBackend(url=url, served_model="fake", **pacing)
    summary: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvb-bench-live-") as d:
        run_live(backend, table, meta, Path(d), summary, 0.0)
    latency = summary["points"][0]["latency"]
    failed = latency["requests"]["failed"]
    if failed:
        raise RuntimeError(f"{failed} requests failed against the fake server")
    return latency


class LiveReplay:
    timeout = 120
    number = 1
    repeat = 1
    processes = 1

    def setup(self):
        self.server = ServerThread()
        n = max(MAX_RATE_REQUESTS, round(LAG_RATE * LAG_SECONDS))
        self.table, self.meta = short_trace(n)
        live_run(self.server.url, self.table, self.meta, mode="rate", rate=1e9, max_requests=50)  # warm up

    def teardown(self):
        self.server.stop()

    def track_max_rate(self):
        lat = live_run(
            self.server.url,
            self.table,
            self.meta,
            mode="rate",
            rate=1e9,
            max_concurrency=CONCURRENCY,
            max_requests=MAX_RATE_REQUESTS,
        )
        return lat["request_throughput"]

    track_max_rate.unit = "req/s"

    def track_p99_lag_ms(self):
        n = round(LAG_RATE * LAG_SECONDS)
        lat = live_run(self.server.url, self.table, self.meta, mode="rate", rate=LAG_RATE, max_requests=n)
        return lat["schedule_lag"]["p99_ms"]

    track_p99_lag_ms.unit = "ms"


class Payload:
    """JSON request bodies: token-id prompts synthesised from the trace's block ids, orjson-encoded."""

    params = ["completions", "chat"]
    param_names = ["endpoint"]

    def setup(self, endpoint):
        from kvbench.backends.openai import OpenAIBackend

        self.table, self.meta = short_trace(PAYLOADS)
        self.backend = OpenAIBackend(url="http://127.0.0.1:1", served_model="fake", endpoint=endpoint)
        self.backend._prepare(self.table, self.meta)

    def time_payload_1000(self, endpoint):
        payload = self.backend.payload
        for row in range(PAYLOADS):
            payload(row)


if __name__ == "__main__":  # a quick look without asv
    import time

    bench = LiveReplay()
    bench.setup()
    try:
        print(f"max rate (concurrency {CONCURRENCY}): {bench.track_max_rate():8.0f} req/s")
        print(f"p99 schedule lag at {LAG_RATE:g} req/s: {bench.track_p99_lag_ms():8.2f} ms")
    finally:
        bench.teardown()
    for endpoint in Payload.params:
        p = Payload()
        p.setup(endpoint)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            p.time_payload_1000(endpoint)
            times.append(time.perf_counter() - t0)
        best = min(times)
        print(f"payload x {PAYLOADS} ({endpoint}): {best * 1e3:8.2f} ms ({best / PAYLOADS * 1e6:.1f} us each)")
