"""`kvbench trace record` in front of the real vLLM CPU engine (`@pytest.mark.engine`): a chat session
recorded through the proxy, then replayed from the trace alone (`--backend openai`, one request at a time,
the prefix cache reset first) gets from the engine the same cached tokens per request as the recording saw.

That holds because the recorded block ids are the engine's own token ids (its /tokenize, with its chat
template) cut at its block size: equal ids where the engine's prefixes were equal. Each answer is one token
long: the engine caches the blocks it computes, and a longer answer's blocks would be hit by the next turn's
prompt through the recorded text of the reply, which a replay (with its own answers) cannot reproduce.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pyarrow.parquet as pq
import pytest

from kvbench.run.limits import RequestLimits
from kvbench.run.runner import run_replay
from kvbench.trace.validation import read_valid_trace

from ..conftest import free_port

pytestmark = pytest.mark.engine
CLI = [sys.executable, "-c", "from kvbench.cli import main; main()"]


def post(url: str, body: dict, headers: dict | None = None) -> dict:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def words(start: int, n: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))  # the tiny model's tokenizer: one word, one token


def chat_session(base: str, model: str, session: str, system: str, turns: int, first_word: int) -> None:
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": words(first_word + 40 * turn, 25)})
        body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0}
        if turn % 2:  # streamed turns, usage asked for as a client that wants it does
            body = {**body, "stream": True, "stream_options": {"include_usage": True}}
            request = urllib.request.Request(
                base + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", "X-Session-Id": session},
            )
            with urllib.request.urlopen(request, timeout=120) as r:
                events = [json.loads(line[5:]) for line in r.read().split(b"\n") if line.startswith(b"data: {")]
            reply = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
        else:
            answer = post(base + "/v1/chat/completions", body, {"X-Session-Id": session})
            reply = answer["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": reply})


def test_a_recorded_chat_session_replays_with_the_same_cached_tokens(vllm, tmp_path):
    out, port = tmp_path / "recorded.parquet", free_port()
    env = {**os.environ, "KVBENCH_HASH_KEY": "integration-test"}
    args = ["trace", "record", "--upstream", vllm.url, "--out", str(out), "--port", str(port)]
    args += ["--block-size", str(vllm.block_size), "--session-header", "X-Session-Id", "--commit-every", "0.2"]
    proc = subprocess.Popen([*CLI, *args], env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):  # up once the engine's /v1/models answers through it
            try:
                urllib.request.urlopen(base + "/v1/models", timeout=2).read()
                break
            except OSError:
                time.sleep(0.1)
        urllib.request.urlopen(urllib.request.Request(base + "/reset_prefix_cache", method="POST"), timeout=30)
        system = words(1000, 100)  # a shared system prompt: both sessions hit it
        chat_session(base, vllm.model, "alice", system, 4, 2000)
        chat_session(base, vllm.model, "bob", system, 3, 3000)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0

    table, meta = read_valid_trace(out)
    assert table.num_rows == 7 and meta.block_size == vllm.block_size
    assert table.column("session_id").to_pylist() == ["alice"] * 4 + ["bob"] * 3
    assert set(table.column("recorded_status").to_pylist()) == {"ok"}
    recorded = dict(zip(table.column("request_id").to_pylist(), table.column("recorded_cached_tokens").to_pylist()))
    assert sum(recorded.values()) > 0  # the session shares prefixes: a test that could not fail proves nothing

    opts = {
        "url": vllm.url,
        "mode": "rate",
        "rate": 1000.0,
        "max_concurrency": 1,
        "reset_prefix_cache": True,
        "send_lora": False,
    }
    run_dir, _ = run_replay(
        out, "openai", opts, out=tmp_path / "replay", report=False, limits=RequestLimits(max_output_tokens=1)
    )
    rows = pq.read_table(run_dir / "requests.parquet")
    assert set(rows.column("status").to_pylist()) == {"ok"}, rows.column("error")
    lengths = dict(zip(table.column("request_id").to_pylist(), table.column("input_tokens").to_pylist()))
    served = dict(zip(rows.column("request_id").to_pylist(), rows.column("server_prompt_tokens").to_pylist()))
    assert served == lengths  # the engine counted the recorded prompt lengths
    replayed = dict(zip(rows.column("request_id").to_pylist(), rows.column("cached_tokens").to_pylist()))
    assert replayed == recorded
