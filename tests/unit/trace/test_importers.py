"""Importers of public trace formats: Bailian, Azure, BurstGPT, kv-cache-tester (mapping, validity, errors)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from kvbench.errors import TraceFormatError
from kvbench.trace.importers import get
from kvbench.trace.validation import validate_table
from tests.conftest import SHARED_TRACES as TRACES

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
AZURE_CONV = TRACES / "azure" / "AzureLLMInferenceTrace_conv.csv"
KVCT = TRACES / "kv-cache-tester"
KVCT_COUNTS = {"trace_0012": 14, "trace_0274": 105, "trace_0277": 53, "trace_0291": 32}

needs_azure = pytest.mark.skipif(not AZURE_CONV.exists(), reason="shared Azure trace not present")
needs_kvct = pytest.mark.skipif(not KVCT.exists(), reason="shared kv-cache-tester traces not present")


def load(name: str, path, **options):
    table, meta = get(name).read(Path(path), **options)
    report = validate_table(table, meta.block_size, source=str(path))
    assert report.ok, report.summary()
    return table, meta


def rows(table: pa.Table) -> dict[str, dict]:
    return {r["request_id"]: r for r in table.to_pylist()}


def hits(table: pa.Table) -> tuple[int, int]:
    """(hits, blocks) of an infinite cache replaying the trace in order: every repeat of an id is a hit."""
    values = pc.list_flatten(table.column("block_hashes"))
    return len(values) - pc.count_distinct(values).as_py(), len(values)


def error_of(fn, *parts: str) -> str:
    """Run fn, expect a one-line TraceFormatError whose message contains every part."""
    with pytest.raises(TraceFormatError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------- bailian

BAILIAN = FIXTURES / "bailian_sample.jsonl"


def bailian_line(**over) -> str:
    rec = {
        "chat_id": 1,
        "parent_chat_id": -1,
        "timestamp": 1.0,
        "input_length": 20,
        "output_length": 3,
        "type": "text",
        "turn": 1,
        "hash_ids": [1, 2],
    }
    rec.update(over)
    return json.dumps(rec)


def test_bailian_maps_every_field():
    table, meta = load("bailian", BAILIAN)
    src = [json.loads(line) for line in BAILIAN.read_text().splitlines()]
    assert table.num_rows == len(src) == 10
    got = rows(table)
    for rec in src:
        r = got[str(rec["chat_id"])]
        assert r["arrival_s"] == pytest.approx(rec["timestamp"] - 61.114)
        assert (r["input_tokens"], r["output_tokens"]) == (rec["input_length"], rec["output_length"])
        assert r["workload"] == rec["type"] and r["turn"] == rec["turn"]
        assert r["block_hashes"] == rec["hash_ids"]  # already prefix-consistent: kept as is
    assert table.column("request_id").to_pylist() == [str(i) for i in range(1, 11)]  # stable on the tie 4/5
    assert {k: got[k]["session_id"] for k in got} == {
        "1": "1",
        "4": "1",
        "7": "1",
        "2": "2",
        "6": "2",
        "3": "3",
        "5": "99",
        "8": "99",
        "9": "9",
        "10": "10",
    }
    assert {k: got[k]["parent_id"] for k in got if got[k]["parent_id"]} == {"4": "1", "7": "4", "6": "2", "8": "5"}
    assert {k: got[k]["external_parent_id"] for k in got if got[k]["external_parent_id"]} == {"5": "99"}
    assert meta.block_size == 16
    assert meta.source["missing_parents"] == 1 and meta.source["rechained"] is False
    assert meta.source["time_offset_s"] == pytest.approx(61.114)
    assert set(table.column("workload").to_pylist()) == {"text", "image", "search", "file"}
    assert hits(table) == (13, 38)  # 2 + 1 + 5 + 4 + 1: chats 4, 6, 7, 8, 9 reuse their parents' (and chat 1's) blocks


def test_bailian_rechains_ids_that_are_not_prefix_consistent(tmp_path):
    # Block 5 follows block 1 in one prompt and block 2 in another: content hashes, not prefix hashes.
    path = write(
        tmp_path,
        "t.jsonl",
        "\n".join(
            [
                bailian_line(chat_id=1, hash_ids=[1, 5]),
                bailian_line(chat_id=2, hash_ids=[2, 5], timestamp=2.0),
                bailian_line(chat_id=3, hash_ids=[1, 5], timestamp=3.0),
            ]
        ),
    )
    table, meta = load("bailian", path)
    assert meta.source["rechained"] is True
    h = table.column("block_hashes").to_pylist()
    assert h[0] == h[2] and h[0][1] != h[1][1] and h[0][0] != h[1][0]


def test_bailian_options(tmp_path):
    table, meta = load("bailian", BAILIAN, workload="chat", time_unit="ms")
    assert set(table.column("workload").to_pylist()) == {"chat"}
    assert table.column("type").to_pylist()[:3] == ["text", "image", "search"]  # type kept when relabelled
    assert meta.source["time_unit"] == "ms" and table.column("arrival_s")[6].as_py() == pytest.approx(0.028886)
    path = write(
        tmp_path,
        "t.jsonl",
        "\n".join([bailian_line(chat_id=7, timestamp=5.0, region="cn"), bailian_line(chat_id=8, timestamp=1.0)]),
    )
    table, meta = load("bailian", path)
    assert table.column("request_id").to_pylist() == ["8", "7"] and meta.source["reordered"] is True
    assert table.column("region").to_pylist() == [None, "cn"]  # unknown fields are kept


@pytest.mark.parametrize(
    "lines, parts",
    [
        ([], ["no records"]),
        ([bailian_line(), "{not json"], ["line 2", "not valid JSON"]),
        ([bailian_line(), bailian_line(chat_id=2).replace('"turn": 1, ', "")], ["line 2", "'turn'", "missing"]),
        ([bailian_line(input_length="20")], ["line 1", "'input_length'", "should be int"]),
        ([bailian_line(hash_ids="1,2")], ["line 1", "'hash_ids'", "should be list"]),
        ([bailian_line(hash_ids=[1, 2, 3])], ["line 1", "'hash_ids'", "3 ids", "ceil(20/16) = 2"]),
        ([bailian_line(), bailian_line()], ["line 2", "'chat_id'", "repeats line 1"]),
        ([bailian_line(chat_id=1, parent_chat_id=2), bailian_line(chat_id=2, parent_chat_id=1)], ["line 1", "cycle"]),
        ([bailian_line(input_length=0, hash_ids=[])], ["line 1", "'input_length'", ">= 1"]),
        ([bailian_line(type=3)], ["line 1", "'type'", "should be str"]),
    ],
)
def test_bailian_bad_input(tmp_path, lines, parts):
    path = write(tmp_path, "bad.jsonl", "\n".join(lines))
    error_of(lambda: get("bailian").read(path), str(path), *parts)


# ---------------------------------------------------------------- azure


@needs_azure
def test_azure_real_file():
    table, meta = load("azure", AZURE_CONV)
    assert table.num_rows == 19_366  # 19,367 lines: header + 19,366 requests (no newline after the last)
    arrival = np.asarray(table.column("arrival_s"))
    assert arrival[0] == 0 and arrival[-1] == pytest.approx(3501.721937, abs=1e-6)
    first = table.slice(0, 1).to_pylist()[0]
    assert (first["request_id"], first["input_tokens"], first["output_tokens"]) == ("az-0", 374, 44)
    assert len(first["block_hashes"]) == math.ceil(374 / 16)
    assert hits(table)[0] == 0  # no prefix identity: an infinite cache never hits
    assert meta.block_size == 16 and meta.source["prefix_identity"] == "none"
    assert meta.source["time_origin"].startswith("2023-11-16T18:15:46.68059")
    assert int(pc.sum(table.column("input_tokens")).as_py()) > 0
    table64, meta64 = load("azure", AZURE_CONV, block_size=64, workload="conv")
    assert meta64.block_size == 64 and len(table64.column("block_hashes")[0]) == math.ceil(374 / 64)
    assert set(table64.column("workload").to_pylist()) == {"conv"}


def test_azure_small_file(tmp_path):
    path = write(
        tmp_path,
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:50.0000000,16,1\n\n2023-11-16 18:15:46.5000000,17,0\n"
        "2023-11-16 18:15:46.5000000,17,0\n",
    )
    table, meta = load("azure", path)
    assert table.column("request_id").to_pylist() == ["az-1", "az-2", "az-0"]
    assert table.column("arrival_s").to_pylist() == [0.0, 0.0, 3.5]
    assert hits(table) == (0, 5)  # equal lengths, still distinct ids
    assert meta.source["reordered"] is True


HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize(
    "text, parts",
    [
        ("", ["file is empty"]),
        (HEADER, ["no data rows"]),
        ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.0,5\n", ["line 1", "'GeneratedTokens'", "missing"]),
        (HEADER + "2023-11-16 18:15:46.0,5,1\n2023-11-16 18:15:47.0,abc,1\n", ["line 3", "'ContextTokens'", "'abc'"]),
        (
            HEADER + "2023-11-16 18:15:46.0,5,1\n\n2023-11-16 18:15:47.0,5,1.5\n",
            ["line 4", "'GeneratedTokens'", "integer"],
        ),
        (HEADER + "yesterday,5,1\n", ["line 2", "'TIMESTAMP'", "'yesterday'"]),
        (HEADER + "2023-11-16 18:15:46.0,5,1\n2023-11-16 18:15:47.0,5\n", ["line 3", "2 fields", "header has 3"]),
        (HEADER + "2023-11-16 18:15:46.0,0,1\n", ["line 2", "'ContextTokens'", ">= 1"]),
        (HEADER + "2023-11-16 18:15:46.0,,1\n", ["line 2", "'ContextTokens'", "empty"]),
    ],
)
def test_azure_bad_input(tmp_path, text, parts):
    path = write(tmp_path, "bad.csv", text)
    error_of(lambda: get("azure").read(path), str(path), *parts)


# ---------------------------------------------------------------- burstgpt

BURST = FIXTURES / "burstgpt_sample.csv"


def test_burstgpt_maps_every_field():
    table, meta = load("burstgpt", BURST)
    src = [line.split(",") for line in BURST.read_text().splitlines()[1:]]
    assert table.num_rows == len(src) == 10
    got = rows(table)
    for i, (ts, model, req, resp, _total, log_type) in enumerate(src):
        r = got[f"bg-{i}"]
        assert r["arrival_s"] == pytest.approx(float(ts) - 5)
        assert (r["input_tokens"], r["output_tokens"]) == (int(req), int(resp))
        assert (r["model"], r["workload"]) == (model, log_type)
        assert len(r["block_hashes"]) == math.ceil(int(req) / 16)
    assert table.column("request_id").to_pylist() == [f"bg-{i}" for i in range(10)]  # stable on the tie at 118
    assert hits(table)[0] == 0
    assert meta.source["prefix_identity"] == "none" and meta.source["failed_requests"] == 2
    assert meta.source["time_offset_s"] == 5 and meta.source["total_tokens_mismatch"] == 0


def test_burstgpt_options(tmp_path):
    table, meta = load("burstgpt", BURST, workload="chat", block_size=64, time_unit="ms")
    assert set(table.column("workload").to_pylist()) == {"chat"}
    assert set(table.column("log_type").to_pylist()) == {"Conversation log", "API log"}
    assert table.column("arrival_s")[1].as_py() == pytest.approx(0.040)
    head = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type,Session ID\n"
    path = write(tmp_path, "b.csv", head + "3,GPT-4,0,5,5,API log,s1\n4,GPT-4,10,5,16,API log,s2\n")
    error_of(lambda: get("burstgpt").read(path), str(path), "line 2", "'Request tokens'", "drop_empty_prompts")
    table, meta = load("burstgpt", path, drop_empty_prompts=True)
    assert table.column("request_id").to_pylist() == ["bg-1"] and table.column("Session ID").to_pylist() == ["s2"]
    assert meta.source["dropped_empty_prompts"] == 1 and meta.source["total_tokens_mismatch"] == 1


BG_HEAD = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


@pytest.mark.parametrize(
    "text, parts",
    [
        ("", ["file is empty"]),
        (BG_HEAD, ["no data rows"]),
        ("Timestamp,Model,Request tokens,Response tokens,Total tokens\n5,GPT-4,1,1,2\n", ["line 1", "'Log Type'"]),
        (BG_HEAD + "5,GPT-4,1,1,2,API log\n6,GPT-4,1,many,2,API log\n", ["line 3", "'Response tokens'", "'many'"]),
        (BG_HEAD + "5,GPT-4,12.5,1,2,API log\n", ["line 2", "'Request tokens'", "integer"]),
        (BG_HEAD + "5,,1,1,2,API log\n", ["line 2", "'Model'", "empty"]),
        (BG_HEAD + "-5,GPT-4,1,1,2,API log\n", ["line 2", "'Timestamp'", ">= 0"]),
        (BG_HEAD + "5,GPT-4,1,1,2,API log\n5,GPT-4,1,1,2,API,log\n", ["line 3", "7 fields", "header has 6"]),
    ],
)
def test_burstgpt_bad_input(tmp_path, text, parts):
    path = write(tmp_path, "bad.csv", text)
    error_of(lambda: get("burstgpt").read(path), str(path), *parts)


# ---------------------------------------------------------------- kv-cache-tester


def kvct_requests(doc: dict):
    """(request_id, absolute t, request, parent_id, agent) in listing order, as the README describes them."""
    out = []

    def walk(reqs, base, chain, parent, agent):
        last, k = parent, 0
        for r in reqs:
            if r["type"] == "subagent":
                walk(r["requests"], base + r["t"], f"{doc['id']}-{r['agent_id']}", last, r["agent_id"])
                continue
            rid = f"{chain}-{k}"
            out.append((rid, base + r["t"], r, last, agent))
            last, k = rid, k + 1

    walk(doc["requests"], 0.0, doc["id"], None, None)
    return out


@needs_kvct
def test_kv_cache_tester_real_files():
    table, meta = load("kv-cache-tester", KVCT)
    assert table.num_rows == sum(KVCT_COUNTS.values()) == 204
    assert meta.block_size == 64 and meta.source["conversations"] == 4 and meta.source["subagents"] == 9
    assert meta.source["rechained"] == [] and meta.source["hash_id_scope"] == {"local": 4}
    counts = pc.value_counts(table.column("session_id")).to_pylist()
    assert {c["values"]: c["counts"] for c in counts} == KVCT_COUNTS
    got = rows(table)
    tails = 0
    for path in sorted(KVCT.glob("*.json")):
        doc = json.loads(path.read_text())
        listed = kvct_requests(doc)
        assert len(listed) == KVCT_COUNTS[doc["id"]]
        for rid, t, r, parent, agent in listed:
            g = got[rid]
            assert g["arrival_s"] == pytest.approx(t) and g["session_id"] == doc["id"]
            assert (g["input_tokens"], g["output_tokens"]) == (r["in"], r["out"])
            assert g["parent_id"] == parent and g["agent_id"] == agent and g["workload"] == "agent"
            assert g["turn"] == int(rid.rsplit("-", 1)[1])
            assert g["think_time_s"] == pytest.approx(r["think_time"]) and g["model"] == r["model"]
            assert g["has_thinking"] == ("thinking" in r["output_types"]) and g["reasoning_tokens"] is None
            assert g["stop_reason"] == r["stop"] and g["output_types"] == r["output_types"]
            assert len(g["block_hashes"]) == math.ceil(r["in"] / 64)
            assert len(r["hash_ids"]) == r["in"] // 64  # the released files hash full blocks only
            tails += r["in"] % 64 != 0
            if parent is not None:
                assert got[parent]["arrival_s"] <= g["arrival_s"]
        # Within-conversation reuse survives the import exactly: same hits, one more (unique) block per tail.
        conv = table.filter(pc.equal(table.column("session_id"), doc["id"]))
        raw = [x for _, _, r, _, _ in sorted(listed, key=lambda e: e[1]) for x in r["hash_ids"]]
        raw_hits = len(raw) - len(set(raw))
        h, n = hits(conv)
        assert h == raw_hits and n == len(raw) + sum(r["in"] % 64 != 0 for _, _, r, _, _ in listed)
        assert h / n > 0.85
    assert meta.source["tail_blocks_added"] == tails == 199
    assert sum(1 for r in got.values() if r["agent_id"]) == 104
    assert hits(table) == (164_992, 179_336)  # no block shared across conversations


@needs_kvct
def test_kv_cache_tester_single_file_and_stagger(tmp_path):
    table, meta = load("kv-cache-tester", KVCT / "trace_0012.json")
    assert table.num_rows == 14 and meta.source["subagents"] == 0
    assert table.column("parent_id").to_pylist() == [None] + [f"trace_0012-{k}" for k in range(13)]
    # The same conversation under another id shares no block with the first one (ids scoped per conversation).
    doc = json.loads((KVCT / "trace_0012.json").read_text())
    doc["id"] = "copy"
    shutil.copy(KVCT / "trace_0012.json", tmp_path / "a.json")
    (tmp_path / "b.json").write_text(json.dumps(doc))
    table, meta = load("kv-cache-tester", tmp_path, stagger_s=1000.0)
    assert hits(table)[0] == 2 * hits(table.filter(pc.equal(table.column("session_id"), "copy")))[0]
    first = table.filter(pc.equal(table.column("turn"), 0)).column("arrival_s").to_pylist()
    assert first == [0.0, 1000.0] and meta.source["stagger_s"] == 1000.0


def kvct_doc(**over) -> dict:
    doc = {
        "id": "c1",
        "models": ["m"],
        "block_size": 64,
        "hash_id_scope": "local",
        "requests": [
            {
                "t": 0.0,
                "type": "n",
                "model": "m",
                "in": 130,
                "out": 5,
                "hash_ids": [1, 2],
                "input_types": ["text"],
                "output_types": ["text"],
                "stop": "end_turn",
                "api_time": 1.0,
                "think_time": 0.0,
            },
            {
                "t": 2.0,
                "type": "subagent",
                "agent_id": "a1",
                "subagent_type": "Explore",
                "duration_ms": 900,
                "requests": [
                    {"t": 0.5, "type": "n", "model": "m", "in": 64, "out": 2, "hash_ids": [1], "think_time": 0.0}
                ],
            },
            {
                "t": 3.0,
                "type": "n",
                "model": "m",
                "in": 192,
                "out": 7,
                "hash_ids": [1, 2, 3],
                "think_time": 1.5,
                "output_types": ["thinking", "text"],
            },
        ],
    }
    doc.update(over)
    return doc


def test_kv_cache_tester_small_conversation(tmp_path):
    path = write(tmp_path, "c.json", json.dumps(kvct_doc()))
    table, meta = load("kv-cache-tester", path)
    assert table.column("request_id").to_pylist() == ["c1-0", "c1-a1-0", "c1-1"]
    assert table.column("arrival_s").to_pylist() == [0.0, 2.5, 3.0]
    assert table.column("parent_id").to_pylist() == [None, "c1-0", "c1-0"]
    assert table.column("has_thinking").to_pylist() == [False, None, True]
    assert table.column("subagent_type").to_pylist() == [None, "Explore", None]
    h = table.column("block_hashes").to_pylist()
    assert h[0][:2] == h[2][:2] and h[1][0] == h[0][0] and len(set(h[0]) | set(h[1]) | set(h[2])) == 4
    assert meta.source["tail_blocks_added"] == 1 and meta.source["rechained"] == []
    # Local ids that are content hashes (2 after 1, and 2 first) are chained instead.
    doc = kvct_doc()
    doc["requests"][1]["requests"][0]["hash_ids"] = [2]
    table, meta = load("kv-cache-tester", write(tmp_path, "c.json", json.dumps(doc)))
    assert meta.source["rechained"] == ["c1"]


def _bad(**edit):
    doc = kvct_doc()
    for key, value in edit.items():
        target = doc["requests"][2] if key != "top" else doc
        target.update(value if key == "top" else {key: value})
    return json.dumps(doc)


@pytest.mark.parametrize(
    "text, parts",
    [
        ("", ["file is empty"]),
        ('{"id": "c1",\n "requests": [}', ["line 2", "not valid JSON"]),
        ("[1, 2]", ["top level is not a JSON object"]),
        (_bad(top={"block_size": 16}), ["'block_size' is 16", "block size 64"]),
        (_bad(top={"requests": []}), ["no requests"]),
        (_bad(out="7"), ["requests[2]", "'out'", "should be int"]),
        (_bad(hash_ids=[1, 2]), ["requests[2]", "'hash_ids' has 2 ids", "'in' = 192"]),
        (_bad(**{"in": 300}), ["requests[2]", "has 3 ids", "needs 4 (full blocks only) or 5"]),
        (_bad(type="x"), ["requests[2]", "'type'", "'x'"]),
        (_bad(think_time=-1.0), ["requests[2]", "'think_time'", ">= 0"]),
        (json.dumps(kvct_doc()).replace('"in": 64, ', ""), ["requests[1].requests[0] (a1)", "'in'", "missing"]),
    ],
)
def test_kv_cache_tester_bad_input(tmp_path, text, parts):
    path = write(tmp_path, "bad.json", text)
    error_of(lambda: get("kv-cache-tester").read(path, block_size=64), str(path), *parts)


def test_kv_cache_tester_bad_sources(tmp_path):
    error_of(lambda: get("kv-cache-tester").read(tmp_path), str(tmp_path), "no *.json")
    error_of(lambda: get("kv-cache-tester").read(tmp_path / "nope.json"), "no such file")
    write(tmp_path, "a.json", json.dumps(kvct_doc()))
    write(tmp_path, "b.json", json.dumps(kvct_doc()))
    error_of(lambda: get("kv-cache-tester").read(tmp_path), "b.json", "'id' 'c1' repeats a.json")


def test_importers_registered():
    from kvbench.trace.importers import registry

    assert {"azure", "bailian", "burstgpt", "kv-cache-tester", "mooncake"} <= set(registry())
