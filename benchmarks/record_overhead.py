"""TTFT added by the recording proxy (`kvbench trace record`, issue 17: at most 1 ms at p99 at 100 req/s).

One client sends streamed /v1/completions requests at a fixed rate (`--rate` req/s, evenly spaced, for
`--duration` s), alternating between the upstream directly and the proxy in front of it, so both see the
same load, the same engine state and the same machine noise (interleaved, not one run after the other).
TTFT = send to the first content event, per request. Prompts are distinct (`--input-len` words, a fresh
random start each), so the engine's prefix cache does not favour either side.

The upstream is `--upstream URL` (e.g. the vLLM CPU engine) or, by default, the fake server
(`python -m kvbench.testing.fakeserver`, instant answers: the proxy's own cost with nothing to hide it). The
proxy is the real command (`kvbench trace record`, a subprocess) tokenizing with the upstream's /tokenize.
At the end the proxy is stopped with SIGTERM and its trace must hold one row per proxied request.
`--no-recording` runs the same proxy with recording switched off: the hop alone, to set its cost apart.

Prints p50/p99 of both and their differences; writes benchmarks/results/record_overhead.json.

    python benchmarks/record_overhead.py [--upstream URL] [--rate 100] [--duration 30] [--input-len 200]
        [--output-len 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

RESULTS = Path(__file__).parent / "results" / "record_overhead.json"
CLI = [sys.executable, "-c", "from kvbench.cli import main; main()"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not answer /v1/models within {seconds:.0f} s; is it up?") from None
            time.sleep(0.1)


def model_of(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


async def one(session: aiohttp.ClientSession, url: str, body: dict) -> float | None:
    """TTFT in seconds, or None when the request failed."""
    start = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return None
            async for line in r.content:
                if line.startswith(b"data: {") and b'"text"' in line:
                    ttft = time.perf_counter() - start
                    await r.read()
                    return ttft
    except aiohttp.ClientError:
        return None
    return None


async def drive(direct: str, proxy: str, model: str, args) -> dict[str, list[float | None]]:
    n = int(args.rate * args.duration)
    rng = random.Random(args.seed)
    results: dict[str, list] = {"direct": [], "proxy": []}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = []
        t0 = time.perf_counter()
        for i in range(n):
            delay = t0 + i / args.rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            start = rng.randrange(0, max(1, args.vocab - args.input_len))
            prompt = " ".join(f"w{start + j}" for j in range(args.input_len))
            body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "stream": True}
            side = "proxy" if i % 2 else "direct"  # interleaved: both sides see the same moments
            tasks.append((side, asyncio.create_task(one(session, proxy if i % 2 else direct, body))))
        for side, task in tasks:
            results[side].append(await task)
    return results


def stats(values: list[float | None]) -> dict:
    ok = np.array([v for v in values if v is not None]) * 1000.0
    return {
        "requests": len(values),
        "failed": sum(v is None for v in values),
        "p50_ms": float(np.percentile(ok, 50)) if ok.size else None,
        "p99_ms": float(np.percentile(ok, 99)) if ok.size else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", help="OpenAI-compatible server URL [default: start the fake server]")
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second, both sides together")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of sending")
    ap.add_argument(
        "--input-len", type=int, default=200, help="prompt length, words (one token each on the tiny model)"
    )
    ap.add_argument("--output-len", type=int, default=8, help="max_tokens of every request")
    ap.add_argument("--vocab", type=int, default=4096, help="prompt words are w0 … w{vocab-1}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-recording",
        action="store_true",
        help="the same proxy with recording switched off: the cost of the hop alone, to set the recording's apart",
    )
    ap.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON results")
    args = ap.parse_args()

    procs = []
    work = Path(tempfile.mkdtemp(prefix="record-overhead-"))
    try:
        upstream = args.upstream
        if not upstream:
            port = free_port()
            fake = [sys.executable, "-m", "kvbench.testing.fakeserver", "--port", str(port)]
            procs.append(subprocess.Popen(fake))
            upstream = f"http://127.0.0.1:{port}"
        wait_up(upstream)
        port = free_port()
        trace = work / "recorded.parquet"
        env = {**os.environ, "KVBENCH_HASH_KEY": os.urandom(16).hex()}
        cli = CLI
        if args.no_recording:  # no path is recorded: every request is only forwarded
            code = "import kvbench.live.recorder as r; r.RECORDED_PATHS = (); from kvbench.cli import main; main()"
            cli = [sys.executable, "-c", code]
        record = [*cli, "trace", "record", "--upstream", upstream, "--out", str(trace), "--port", str(port)]
        proxy_proc = subprocess.Popen(record, env=env)
        procs.append(proxy_proc)
        proxy = f"http://127.0.0.1:{port}"
        wait_up(proxy)
        model = model_of(upstream)
        results = asyncio.run(drive(upstream, proxy, model, args))
        proxy_proc.send_signal(signal.SIGTERM)
        proxy_proc.wait(60)
        import pyarrow.parquet as pq

        rows = pq.read_metadata(trace).num_rows if trace.exists() else 0  # (none without recording)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(30)
    direct, proxied = stats(results["direct"]), stats(results["proxy"])
    report = {
        "upstream": "fake server" if not args.upstream else "given",
        "recording": not args.no_recording,
        "rate": args.rate,
        "duration_s": args.duration,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "direct": direct,
        "proxy": proxied,
        "added_p50_ms": proxied["p50_ms"] - direct["p50_ms"] if direct["p50_ms"] is not None else None,
        "added_p99_ms": proxied["p99_ms"] - direct["p99_ms"] if direct["p99_ms"] is not None else None,
        "recorded_rows": rows,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for side in ("direct", "proxy"):
        s = report[side]
        ttft = f"TTFT p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms"
        print(f"{side:>7}: {s['requests']} requests, {s['failed']} failed, {ttft}")
    print(f"added by the proxy: p50 {report['added_p50_ms']:+.2f} ms, p99 {report['added_p99_ms']:+.2f} ms")
    print(f"recorded {rows} rows for {proxied['requests'] - proxied['failed']} proxied requests")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
