"""`kvbench trace import openai-log`: request logs of each supported shape become valid traces of keyed block
ids, with no prompt text in the file. The tokenizer is a word-level one trained here, so nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.errors import KvbenchError, TraceFormatError
from kvbench.run.runner import run_replay
from kvbench.trace import keyed
from kvbench.trace.files import read_trace, write_trace
from kvbench.trace.importers.openai_log import read_openai_log
from kvbench.trace.tokenizer import LocalTokenizer
from kvbench.trace.validation import check, read_valid_trace

DATA = Path(__file__).resolve().parents[2] / "data" / "openai_log"
SHAPES = ["bare.jsonl", "wrapped.jsonl", "gateway.jsonl"]
SYSTEM = "You are a helpful assistant for the shop. Answer briefly and politely, and never invent an order number."


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setenv(keyed.KEY_ENV, "test-secret")


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> str:
    """A word-level tokenizer.json trained on the fixtures' words (unknown words map to [UNK])."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = [p.read_text() for p in DATA.glob("*.jsonl")] + [SYSTEM, "<|system|> <|user|> <|assistant|>"]
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _import(src, tokenizer_json, **options):
    table, meta = read_openai_log(Path(src), tokenizer=tokenizer_json, **options)
    check(table, meta.block_size, str(src))
    return table, meta


@pytest.mark.parametrize("name", SHAPES)
def test_each_shape_imports_to_a_valid_trace(name, tokenizer_json, tmp_path):
    table, meta = _import(DATA / name, tokenizer_json, block_size=4)
    out = write_trace(table, tmp_path / "t.parquet", meta)
    table, meta = read_valid_trace(out)
    assert meta.block_size == 4 and meta.source["importer"] == "openai-log"
    arrival = table.column("arrival_s").to_numpy()
    assert arrival[0] == 0 and np.all(np.diff(arrival) >= 0)
    n_in = table.column("input_tokens").to_numpy()
    assert [len(h) for h in table.column("block_hashes").to_pylist()] == list(-(-n_in // 4))


def test_bare_bodies_use_the_requested_budget_and_the_user(tokenizer_json):
    table, meta = _import(DATA / "bare.jsonl", tokenizer_json, gap_s=0.5)
    assert table.column("output_tokens").to_pylist() == [64, 32, 16]  # max_tokens, max_completion_tokens
    assert table.column("user_id").to_pylist() == ["alice", None, "bob"]
    assert table.column("arrival_s").to_pylist() == [0.0, 0.5, 1.0]  # no times: file order, --gap-s apart
    assert table.column("request_id").to_pylist() == ["L1", "L2", "L4"]  # line numbers (line 3 is blank)
    assert meta.source["output_tokens_from"] == {"usage": 0, "max_tokens": 3, "default": 0}


def test_wrapped_records_sorted_with_usage_cached_tokens_and_sessions(tokenizer_json):
    table, meta = _import(DATA / "wrapped.jsonl", tokenizer_json)
    rows = table.to_pylist()
    assert [r["request_id"] for r in rows] == ["L2", "L1", "L3"]  # sorted by time (ISO 8601 and epoch s)
    assert [r["arrival_s"] for r in rows] == [0.0, 2.5, 5.0]
    assert [r["output_tokens"] for r in rows] == [20, 12, 41]  # usage.completion_tokens, not max_tokens
    assert [r["recorded_cached_tokens"] for r in rows] == [0, 16, None]
    assert [r["session_id"] for r in rows] == ["s1", "s1", None]
    assert [r["turn"] for r in rows] == [0, 1, None] and rows[1]["parent_id"] == "L2"
    assert [r["tenant"] for r in rows] == ["shop", "shop", "notes"]
    assert rows[0]["log_id"] == "chatcmpl-1" and meta.source["reordered"] is True
    assert meta.source["output_tokens_from"] == {"usage": 3, "max_tokens": 0, "default": 0}


def test_gateway_records_with_headers_and_ms_times(tokenizer_json):
    table, _ = _import(DATA / "gateway.jsonl", tokenizer_json)
    rows = table.to_pylist()
    assert [r["arrival_s"] for r in rows] == [0.0, 1.5]
    assert [r["session_id"] for r in rows] == ["chat-9"] * 2 and rows[0]["tenant"] == "acme"
    assert [r["recorded_cached_tokens"] for r in rows] == [0, 9]
    first, second = (r["block_hashes"] for r in rows)
    assert second[: len(first) - 1] == first[:-1]  # the second turn extends the first conversation


def test_shared_system_prompt_shares_leading_blocks_only(tokenizer_json, tmp_path):
    bodies = [{"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], "max_tokens": 5}
              for q in ("where is my order", "can I return shoes")]  # fmt: skip
    src = tmp_path / "log.jsonl"
    src.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    table, _ = _import(src, tokenizer_json, block_size=4)
    a, b = table.column("block_hashes").to_pylist()
    tok = LocalTokenizer(tokenizer_json)
    ta, tb = (tok.ids(body) for body in bodies)
    common = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)
    k = common // 4
    assert k >= 5  # the system prompt spans several whole blocks
    assert a[:k] == b[:k]
    assert all(x != y for x, y in zip(a[k:], b[k:], strict=False)) and not set(a[k:]) & set(b[k:])


def test_bad_lines_name_file_and_line(tokenizer_json):
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl: line 2: not valid JSON"):
        read_openai_log(DATA / "bad.jsonl", tokenizer=tokenizer_json)


def test_skip_bad_lines_counts_and_reports_them(tokenizer_json, capsys):
    table, meta = _import(DATA / "bad.jsonl", tokenizer_json, skip_bad_lines=True)
    assert table.column("request_id").to_pylist() == ["L1", "L4"]
    assert meta.source["skipped_lines"] == 2 and meta.source["skipped_line_numbers"] == [2, 3]
    assert "skipped 2 unreadable lines" in capsys.readouterr().err


def test_a_line_without_a_prompt_is_named(tokenizer_json, tmp_path):
    src = tmp_path / "log.jsonl"
    src.write_text('{"prompt": "fine", "max_tokens": 1}\n{"model": "x", "max_tokens": 1}\n')
    with pytest.raises(TraceFormatError, match=r"log\.jsonl: line 2: no 'messages'"):
        read_openai_log(src, tokenizer=tokenizer_json)


def test_unknown_output_length_is_an_error_unless_assumed(tokenizer_json, tmp_path):
    src = tmp_path / "log.jsonl"
    src.write_text('{"prompt": "a cat"}\n')
    with pytest.raises(TraceFormatError, match="line 1: no usage.completion_tokens"):
        read_openai_log(src, tokenizer=tokenizer_json)
    table, meta = _import(src, tokenizer_json, output_tokens=100)
    assert table.column("output_tokens").to_pylist() == [100]
    assert meta.source["output_tokens_from"]["default"] == 1


def test_missing_secret_is_one_clear_error(tokenizer_json, monkeypatch):
    monkeypatch.delenv(keyed.KEY_ENV)
    with pytest.raises(KvbenchError, match=f"set {keyed.KEY_ENV}"):
        read_openai_log(DATA / "bare.jsonl", tokenizer=tokenizer_json)


def test_no_prompt_text_in_the_parquet_bytes(tokenizer_json, tmp_path):
    out = tmp_path / "t.parquet"
    result = CliRunner().invoke(
        main, ["trace", "import", "openai-log", str(DATA / "wrapped.jsonl"), "-o", str(out),
               "--tokenizer", tokenizer_json, "--block-size", "4"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    # the file's bytes are zstd-compressed, so the decoded values and metadata are searched as well
    table = pq.read_table(out)
    decoded = json.dumps(table.to_pylist(), default=str).encode() + repr(table.schema.metadata).encode()
    for text in (b"helpful", b"assistant for", b"blue shoes", b"my order", b"meeting", b"Summarise", b"test-secret"):
        assert text not in out.read_bytes() and text not in decoded
    assert table.num_rows == 3


def test_cli_help_explains_every_option():
    result = CliRunner().invoke(main, ["trace", "import", "openai-log", "--help"])
    assert result.exit_code == 0
    for flag in ("--tokenizer", "--tokenize-url", "--block-size", "--time-field", "--gap-s", "--output-tokens",
                 "--session-field", "--tenant-field", "--skip-bad-lines"):  # fmt: skip
        assert flag in result.output
    assert "seconds" in result.output and "tokens" in result.output


def test_time_field_option(tokenizer_json, tmp_path):
    src = tmp_path / "log.jsonl"
    src.write_text('{"meta": {"ts": 1700000010.0}, "prompt": "b", "max_tokens": 1}\n'
                   '{"meta": {"ts": 1700000000.0}, "prompt": "a", "max_tokens": 1}\n')  # fmt: skip
    table, _ = _import(src, tokenizer_json, time_field="meta.ts")
    assert table.column("arrival_s").to_pylist() == [0.0, 10.0]
    with pytest.raises(TraceFormatError, match="line 1: field 'nope'"):
        read_openai_log(src, tokenizer=tokenizer_json, time_field="nope")


def test_sim_backend_replays_the_imported_trace(tokenizer_json, tmp_path):
    table, meta = _import(DATA / "gateway.jsonl", tokenizer_json, block_size=4)
    path = write_trace(table, tmp_path / "t.parquet", meta)
    run_dir, summary = run_replay(path, "sim", {"policy": "lru", "capacity": "100"}, out=tmp_path / "run")
    assert Path(run_dir).exists()
    assert read_trace(path)[0].num_rows == 2
    assert summary is not None


def test_cli_output_tokens_and_upstream_tokenizer(tmp_path):
    """--output-tokens arrives as text from the command line; --tokenize-url calls the engine's /tokenize (a
    stand-in server here, answering one token per character)."""
    import http.server
    import threading

    class Tokenize(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the http.server API)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = body.get("prompt") or "".join(m["content"] for m in body["messages"])
            answer = json.dumps({"tokens": [ord(c) for c in text]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Tokenize)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        src, out = tmp_path / "log.jsonl", tmp_path / "t.parquet"
        src.write_text('{"prompt": "abcdefghij"}\n{"messages": [{"role": "user", "content": "abcdefgh"}]}\n')
        url = f"http://127.0.0.1:{server.server_address[1]}"
        args = ["trace", "import", "openai-log", str(src), "-o", str(out), "--tokenize-url", url]
        result = CliRunner().invoke(main, [*args, "--output-tokens", "7", "--block-size", "4"])
        assert result.exit_code == 0, result.output
        table, meta = read_valid_trace(out)
        assert table.column("input_tokens").to_pylist() == [10, 8]
        assert table.column("output_tokens").to_pylist() == [7, 7] and meta.source["tokenizer"] == "upstream"
        a, b = table.column("block_hashes").to_pylist()
        assert a[:2] == b  # "abcdefgh" is the first two blocks of "abcdefghij"
        bad = CliRunner().invoke(main, [*args, "--output-tokens", "many"])
        assert bad.exit_code != 0 and "--output-tokens 'many'" in bad.output
    finally:
        server.shutdown()


def test_times_missing_on_some_lines_or_unreadable_are_named(tokenizer_json, tmp_path):
    src = tmp_path / "log.jsonl"
    src.write_text('{"time": 1700000000, "prompt": "a", "max_tokens": 1}\n{"prompt": "b", "max_tokens": 1}\n')
    with pytest.raises(TraceFormatError, match=r"log\.jsonl: line 2: no timestamp"):
        read_openai_log(src, tokenizer=tokenizer_json)
    src.write_text('{"time": "yesterday", "prompt": "a", "max_tokens": 1}\n')
    with pytest.raises(TraceFormatError, match=r"line 1: field 'time' 'yesterday' is neither ISO 8601"):
        read_openai_log(src, tokenizer=tokenizer_json)


def test_a_logger_record_with_messages_and_response_at_top_level(tokenizer_json, tmp_path):
    """SDK loggers often write the request's fields and the response side by side on one object."""
    src = tmp_path / "log.jsonl"
    line = {"startTime": 1700000001.25, "model": "m", "messages": [{"role": "user", "content": "a cat"}],
            "metadata": {"conversation_id": "c7"}, "response": {"usage": {"completion_tokens": 3}}}  # fmt: skip
    src.write_text(json.dumps(line) + "\n")
    table, _ = _import(src, tokenizer_json)
    row = table.to_pylist()[0]
    assert (row["output_tokens"], row["session_id"], row["turn"]) == (3, "c7", 0)
