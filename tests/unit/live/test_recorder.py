"""`kvbench trace record`: the recording proxy in front of the fake server. Clients get the bytes a direct
request gets; the recorded trace validates, labels and shares prefixes as the requests did, keeps no text, and
a killed proxy keeps its committed rows."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvbench.live import recordparts
from kvbench.live.recorder import Recorder, RecordOptions, UsageReader
from kvbench.trace.keyed import hash_key
from kvbench.trace.validation import read_valid_trace

from .conftest import free_port

KEY = hash_key(environ={"KVBENCH_HASH_KEY": "test-secret"})
SECRET_WORDS = "zebra quartz lantern"  # text that must never reach the trace file


class RunningRecorder:
    """The proxy in a background thread; `stop()` ends it as Ctrl-C does and writes the trace."""

    def __init__(self, upstream: str, out: Path, tokenizer: Path | None = None, **options):
        self.recorder = Recorder(upstream, out, KEY, RecordOptions(**options), tokenizer)
        self.out, self.port = out, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(self._loop)
            self._runner = web.AppRunner(self.recorder.app(), access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        ready.wait(10)

    def stop(self) -> int:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        return recordparts.finish(self.out)


def post(base: str, path: str, body: dict, headers: dict | None = None) -> bytes:
    request = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return r.read()


def requests_sent() -> list[tuple[str, dict]]:
    words = " ".join(f"w{i}" for i in range(40)) + " " + SECRET_WORDS
    out = []
    for stream in (False, True):
        for turn in range(2):
            out.append(
                ("/v1/completions", {"model": "m", "prompt": f"{words} c{turn}", "max_tokens": 5, "stream": stream})
            )
            messages = [{"role": "user", "content": f"{words} turn{turn}"}]
            out.append(
                ("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 4, "stream": stream})
            )
    return out


def test_clients_get_the_direct_bytes_and_the_trace_records_them(fake_server, tmp_path):
    direct, upstream = fake_server(), fake_server()  # two identical servers: the same cache state for both
    out = tmp_path / "rec.parquet"
    proxy = RunningRecorder(upstream.url, out, session_header="X-Session-Id", commit_every_s=0.05)
    sent = requests_sent()
    for i, (path, body) in enumerate(sent):
        headers = {"X-Session-Id": f"s{i % 2}"}
        assert post(proxy.url, path, body, headers) == post(direct.url, path, body, headers), (path, body["stream"])
    with urllib.request.urlopen(proxy.url + "/v1/models") as r:  # any other path passes through
        assert json.loads(r.read())["data"][0]["id"] == "fake"
    assert proxy.stop() == len(sent)
    assert not recordparts.parts_folder(out).exists()

    table, meta = read_valid_trace(out)
    assert meta.block_size == 16
    rows = table.to_pylist()
    assert [r["session_id"] for r in rows] == [f"s{i % 2}" for i in range(len(sent))]
    assert [r["turn"] for r in rows] == [i // 2 for i in range(len(sent))]
    assert all(r["recorded_status"] == "ok" for r in rows)
    assert [r["output_tokens"] for r in rows] == [b["max_tokens"] for _, b in sent]
    assert [r["input_tokens"] for r in rows] == [44, 44] * 4
    # the completions prompts share their first 43 words: two whole blocks of 16 in common, then they differ
    first, second = rows[0]["block_hashes"], rows[2]["block_hashes"]
    assert first[:2] == second[:2] and first[2] != second[2]
    # the server's usage, streamed or not: after the first, every prompt hits its two shared whole blocks
    assert [r["recorded_cached_tokens"] for r in rows] == [0] + [32] * 7
    data = out.read_bytes()
    for word in SECRET_WORDS.split():
        assert word.encode() not in data


def test_stream_usage_is_recorded_when_the_client_asks_for_it(fake_server, tmp_path):
    upstream = fake_server()
    proxy = RunningRecorder(upstream.url + "/v1/", tmp_path / "u.parquet")  # the clients' base URL works too
    body = {"model": "m", "prompt": "a b c d", "max_tokens": 3, "stream": True}
    post(proxy.url, "/v1/completions", body)
    post(proxy.url, "/v1/completions", {**body, "stream_options": {"include_usage": True}, "user": "ann"})
    proxy.stop()
    rows = read_valid_trace(tmp_path / "u.parquet")[0].to_pylist()
    assert [r["output_tokens"] for r in rows] == [3, 3]
    assert [r["user_id"] for r in rows] == [None, "ann"]
    # the fake always reports usage in a stream; the proxy records it as it passes
    assert rows[1]["recorded_cached_tokens"] == 0


def test_streams_pass_through_as_they_come(fake_server, tmp_path):
    """The proxy forwards each event as the server sends it: when the client holds the first event, the
    upstream is still answering (a buffering proxy would pass nothing on before the upstream finished)."""
    upstream = fake_server(itl_ms=100)  # 5 tokens 100 ms apart: the upstream answers for ~0.5 s
    proxy = RunningRecorder(upstream.url, tmp_path / "s.parquet")

    async def read() -> tuple[int, int, bytes]:
        body = {"model": "m", "prompt": "a b c", "max_tokens": 5, "stream": True}
        async with aiohttp.ClientSession() as session, session.post(proxy.url + "/v1/completions", json=body) as r:
            first = await r.content.readline()
            answering_at_first = upstream.server.running
            rest = await r.read()
        return answering_at_first, upstream.server.running, first + rest

    answering_at_first, answering_at_end, stream = asyncio.run(read())
    proxy.stop()
    assert answering_at_first == 1 and answering_at_end == 0
    assert stream.startswith(b"data: {") and stream.rstrip().endswith(b"data: [DONE]")
    assert stream.count(b'"text"') == 5  # every token's event passed on


def test_local_tokenizer_and_labels(fake_server, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)} | {"[UNK]": 100}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    upstream = fake_server()
    options = {"tenant_header": "X-Tenant", "base_model": "base", "priority_field": "prio"}
    proxy = RunningRecorder(upstream.url, tmp_path / "l.parquet", tokenizer=tmp_path / "tokenizer.json", **options)
    body = {"model": "adapter-1", "prompt": words(20), "max_tokens": 1, "cache_salt": "s1", "prio": 80}
    post(proxy.url, "/v1/completions", body, {"X-Tenant": "acme"})
    post(proxy.url, "/v1/completions", {**body, "model": "base", "prio": 500}, {"X-Tenant": "acme"})
    proxy.stop()
    rows = read_valid_trace(tmp_path / "l.parquet")[0].to_pylist()
    assert [r["input_tokens"] for r in rows] == [20, 20]
    assert rows[0]["block_hashes"] == rows[1]["block_hashes"]
    assert [r["lora"] for r in rows] == ["adapter-1", None]
    assert [r["tenant"] for r in rows] == ["acme", "acme"] and rows[0]["cache_salt"] == "s1"
    assert [r["priority"] for r in rows] == [80, None]  # out of the schema's 0-100: not invented


def test_sessions_record_their_parent_and_think_time(fake_server, tmp_path):
    """A session's request names the previous one as its parent, and the time since that one's answer ended as
    think time, which `--pacing sessions` waits; a parent that was not recorded (untokenizable) is dropped."""
    upstream = fake_server()
    proxy = RunningRecorder(upstream.url, tmp_path / "s.parquet", session_header="X-Session-Id")
    body = {"model": "m", "prompt": words(20), "max_tokens": 2}
    post(proxy.url, "/v1/completions", body, {"X-Session-Id": "a"})
    time.sleep(0.3)  # the user reads the answer
    post(proxy.url, "/v1/completions", {**body, "prompt": words(30)}, {"X-Session-Id": "a"})
    post(proxy.url, "/v1/completions", {**body, "prompt": [words(3), "two"]}, {"X-Session-Id": "b"})  # not recorded
    post(proxy.url, "/v1/completions", body, {"X-Session-Id": "b"})
    proxy.stop()
    rows = read_valid_trace(tmp_path / "s.parquet")[0].to_pylist()
    assert [(r["session_id"], r["turn"]) for r in rows] == [("a", 0), ("a", 1), ("b", 1)]
    assert rows[0]["parent_id"] is None and rows[1]["parent_id"] == rows[0]["request_id"]
    assert rows[0]["think_time_s"] is None and rows[1]["think_time_s"] >= 0.3
    # the arrival gap is the answer's time plus the think time
    assert rows[1]["arrival_s"] - rows[0]["arrival_s"] >= rows[1]["think_time_s"]
    assert rows[2]["parent_id"] is None


def words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


def test_a_stream_without_usage_counts_its_content_events():
    reader = UsageReader(stream=True)
    events = [{"choices": [{"index": 0, "delta": {"content": "x"}}]}] * 3 + [{"choices": [{"delta": {}}]}]
    data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    for i in range(0, len(data), 7):  # events split anywhere across chunks
        reader.feed(data[i : i + 7])
    assert reader.finish() == (3, None)


def test_a_compressed_answer_is_read_for_its_usage():
    reader = UsageReader(stream=False, encoding="gzip")
    usage = {"completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 32}}
    reader.feed(gzip.compress(json.dumps({"usage": usage}).encode()))
    assert reader.finish() == (7, 32)


def test_http_errors_are_forwarded_and_recorded(fake_server, tmp_path):
    upstream = fake_server(faults=["0:http500"])
    proxy = RunningRecorder(upstream.url, tmp_path / "e.parquet")
    with pytest.raises(urllib.error.HTTPError) as caught:
        post(proxy.url, "/v1/completions", {"model": "m", "prompt": "a b", "max_tokens": 2})
    assert caught.value.code == 500
    proxy.stop()
    rows = read_valid_trace(tmp_path / "e.parquet")[0].to_pylist()
    assert rows[0]["recorded_status"] == "http 500"


def test_cut_streams_and_untokenizable_prompts(fake_server, tmp_path, capfd):
    upstream = fake_server(faults=["1:cut"])
    proxy = RunningRecorder(upstream.url, tmp_path / "c.parquet")
    body = {"model": "m", "prompt": "a b c", "max_tokens": 6, "stream": True}
    post(proxy.url, "/v1/completions", body)
    with pytest.raises((OSError, http.client.HTTPException)):  # the client sees the cut the upstream made
        post(proxy.url, "/v1/completions", body)
    batch = {"model": "m", "prompt": [SECRET_WORDS, "two"], "max_tokens": 1}  # forwarded, not recorded
    post(proxy.url, "/v1/completions", batch)
    proxy.stop()
    rows = read_valid_trace(tmp_path / "c.parquet")[0].to_pylist()
    assert [r["recorded_status"] for r in rows] == ["ok", "cut"]
    assert proxy.recorder.skipped == 1
    said = capfd.readouterr().err
    assert "could not be tokenized" in said and "zebra" not in said


def test_a_killed_recording_keeps_its_rows(fake_server, tmp_path):
    upstream = fake_server()
    out, port = tmp_path / "k.parquet", free_port()
    env = {**os.environ, "KVBENCH_HASH_KEY": "test-secret"}
    args = ["--upstream", upstream.url, "--out", str(out), "--port", str(port), "--commit-every", "0.05"]
    code = "from kvbench.cli import main; main()"
    proc = subprocess.Popen([sys.executable, "-c", code, "trace", "record", *args], env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(200):  # the proxy is up once /v1/models answers through it
            try:
                urllib.request.urlopen(base + "/v1/models", timeout=1).read()
                break
            except OSError:
                time.sleep(0.05)
        for i in range(3):
            post(base, "/v1/completions", {"model": "m", "prompt": f"x y z {i}", "max_tokens": 2})
        time.sleep(0.5)  # ten commit intervals
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert not out.exists() and recordparts.list_parts(out)
    done = subprocess.run([sys.executable, "-c", code, "trace", "record", "--out", str(out), "--finish"], env=env)
    assert done.returncode == 0
    table, _ = read_valid_trace(out)
    assert table.num_rows == 3


def test_sigterm_writes_the_trace(fake_server, tmp_path):
    upstream = fake_server()
    out, port = tmp_path / "t.parquet", free_port()
    env = {**os.environ, "KVBENCH_HASH_KEY": "test-secret"}
    code = "from kvbench.cli import main; main()"
    args = ["trace", "record", "--upstream", upstream.url, "--out", str(out), "--port", str(port)]
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    body = {"model": "m", "prompt": SECRET_WORDS, "max_tokens": 1}
    try:
        for _ in range(200):
            try:
                post(f"http://127.0.0.1:{port}", "/v1/completions", body)
                break
            except OSError:
                time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        said = proc.communicate(timeout=20)[0]
    assert proc.returncode == 0, said
    assert read_valid_trace(out)[0].num_rows == 1
    assert b"wrote" in said and not any(w.encode() in said for w in SECRET_WORDS.split())  # nor in its output
