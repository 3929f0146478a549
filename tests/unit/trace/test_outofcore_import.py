"""Streamed import (`kvbench trace import mooncake`, `write_mooncake`): batch by batch, row groups on a large
source, the same trace and metadata as the in-memory import, the same errors."""

import json
import subprocess

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvbench.errors import TraceFormatError
from kvbench.trace.files import ROW_GROUP_SIZE, read_trace
from kvbench.trace.importers import get
from kvbench.trace.importers.mooncake import write_mooncake
from tests.conftest import REPO


def mooncake_lines(n: int, seed: int = 0, shuffle: bool = False) -> list[str]:
    """n records in a few conversations: each prompt extends an earlier one of its conversation."""
    rng = np.random.default_rng(seed)
    lines, next_id, prompts = [], 0, {}
    for i in range(n):
        conv = int(rng.integers(0, 50))
        base = prompts.get(conv, [])
        base = base if len(base) < 30 else []  # the conversation ends, a new one starts
        new = list(range(next_id, next_id + int(rng.integers(1, 4))))
        next_id += len(new)
        prompts[conv] = ids = base + new
        rec = {"timestamp": i * 3, "input_length": 4 * len(ids) - 1, "output_length": int(rng.integers(0, 9))}
        if i % 7 == 0:
            rec["tag"] = None if i % 2 else i  # an extra field: null in some batches, int or float in others
        if i % 11 == 0:
            rec["tag"] = i + 0.5
        lines.append(json.dumps({**rec, "hash_ids": ids}))
    if shuffle:
        rng.shuffle(lines)
    return lines


def both(src, tmp_path, batch_records, **options):
    out = tmp_path / "streamed.parquet"
    rows = write_mooncake(src, out, batch_records=batch_records, **options)
    streamed, streamed_meta = read_trace(out)
    whole, whole_meta = get("mooncake").read(src, **options)
    assert rows == whole.num_rows
    assert {k: v for k, v in streamed_meta.source.items()} == whole_meta.source
    return out, streamed, whole


def test_large_source_streams_in_row_groups_and_equals_the_in_memory_import(tmp_path):
    src = tmp_path / "big.jsonl"
    src.write_text("\n".join(mooncake_lines(2 * ROW_GROUP_SIZE + 1000)) + "\n")
    out, streamed, whole = both(src, tmp_path, batch_records=10_000, block_size=4)
    assert pq.ParquetFile(out).metadata.num_row_groups == 3
    assert streamed.equals(whole)
    assert streamed.column("tag").type == "double"


@pytest.mark.parametrize("batch_records", [1, 3, 1000])
def test_small_batches_equal_the_in_memory_import(tmp_path, batch_records):
    src = tmp_path / "x.jsonl"
    src.write_text("\n".join(mooncake_lines(200, seed=1)) + "\n")
    _, streamed, whole = both(src, tmp_path, batch_records, block_size=4)
    assert streamed.equals(whole)


def test_non_chained_ids_are_chained_the_same_way(tmp_path):
    src = tmp_path / "x.jsonl"
    lines = mooncake_lines(300, seed=2)
    lines.append(json.dumps({"timestamp": 10**6, "input_length": 8, "output_length": 1, "hash_ids": [5, 1]}))
    src.write_text("\n".join(lines) + "\n")
    _, streamed, whole = both(src, tmp_path, batch_records=16, block_size=4)
    assert streamed.equals(whole)
    assert read_trace(tmp_path / "streamed.parquet")[1].source["rechained"]


def test_out_of_order_timestamps_are_sorted(tmp_path):
    src = tmp_path / "x.jsonl"
    src.write_text("\n".join(mooncake_lines(500, seed=3, shuffle=True)) + "\n")
    _, streamed, whole = both(src, tmp_path, batch_records=64, block_size=4)
    assert streamed.equals(whole)
    assert np.all(np.diff(streamed.column("arrival_s").to_numpy()) >= 0)


def test_committed_conversation_trace(mooncake_path, tmp_path):
    _, streamed, whole = both(mooncake_path, tmp_path, batch_records=1000)
    assert streamed.equals(whole)
    assert streamed.equals(read_trace(REPO / "traces/mooncake/conversation_trace.parquet")[0])


@pytest.mark.parametrize(
    "bad_line, match",
    [
        ({"timestamp": 9, "input_length": 0, "output_length": 1, "hash_ids": []}, "'input_length' must be >= 1"),
        ({"timestamp": 9, "input_length": 1, "output_length": -1, "hash_ids": [7]}, "'output_length' must be >= 0"),
        ({"timestamp": 9, "input_length": 9, "output_length": 1, "hash_ids": [7]}, "has 1 ids but input_length 9"),
        ({"timestamp": 9, "input_length": 1, "output_length": 1, "hash_ids": [7], "tag": "x"}, "incompatible types"),
    ],
)
def test_errors_in_a_later_batch_match_the_in_memory_import(tmp_path, bad_line, match):
    src = tmp_path / "bad.jsonl"
    lines = mooncake_lines(100, seed=4)
    lines[90] = json.dumps(bad_line)
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError, match=match) as streamed:
        write_mooncake(src, tmp_path / "o.parquet", block_size=4, batch_records=8)
    with pytest.raises(TraceFormatError) as whole:
        get("mooncake").read(src, block_size=4)
    assert str(streamed.value) == str(whole.value)
    assert not list(tmp_path.glob("o.parquet*"))
    assert "line 91" in str(streamed.value) or "types" in match


def test_cli_import_streams(tmp_path):
    src = tmp_path / "x.jsonl"
    src.write_text("\n".join(mooncake_lines(300, seed=5)) + "\n")
    out = tmp_path / "x.parquet"
    r = subprocess.run(
        ["kvbench", "trace", "import", "mooncake", str(src), "--block-size", "4", "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "300 requests" in r.stdout
    assert read_trace(out)[0].equals(get("mooncake").read(src, block_size=4)[0])


# --- CSV importers: read a block of text at a time ------------------------------------------------------

AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
BURST_HEAD = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def azure_csv(n: int, shuffle: bool = False) -> str:
    rng = np.random.default_rng(n)
    ns = np.sort(rng.integers(0, 10**12, n))
    if shuffle:
        rng.shuffle(ns)
    stamps = np.datetime_as_string(np.datetime64("2023-11-16T18:00:00", "ns") + ns.astype("timedelta64[ns]"))
    inp, out = rng.integers(1, 3000, n), rng.integers(0, 500, n)
    return AZURE_HEAD + "".join(f"{t.replace('T', ' ')},{i},{o}\n" for t, i, o in zip(stamps, inp, out))


def burst_csv(n: int, shuffle: bool = False) -> str:
    rng = np.random.default_rng(n)
    ts = np.sort(rng.integers(0, 10**6, n))
    if shuffle:
        rng.shuffle(ts)
    inp, out = rng.integers(0, 3000, n), rng.integers(0, 500, n)
    kind = np.where(rng.random(n) < 0.5, "API log", "Conversation log")
    return BURST_HEAD + "".join(
        f"{t},GPT-4,{i},{o},{i + o + (k == 'API log')},{k}\n" for t, i, o, k in zip(ts, inp, out, kind)
    )


def streamed_and_whole(name, src, tmp_path, block_bytes, **options):
    out = tmp_path / "streamed.parquet"
    rows = get(name).write(src, out, block_bytes=block_bytes, **options)
    streamed, meta = read_trace(out)
    whole, whole_meta = get(name).read(src, **options)
    assert rows == whole.num_rows and meta.source == whole_meta.source
    return out, streamed, whole


@pytest.mark.parametrize("name, make", [("azure", azure_csv), ("burstgpt", burst_csv)])
def test_large_csv_streams_in_row_groups_and_equals_the_in_memory_import(name, make, tmp_path):
    src = tmp_path / "big.csv"
    src.write_text(make(ROW_GROUP_SIZE + 5000))
    options = {"drop_empty_prompts": True} if name == "burstgpt" else {}
    out, streamed, whole = streamed_and_whole(name, src, tmp_path, 1 << 16, **options)
    assert pq.ParquetFile(out).metadata.num_row_groups == 2
    assert streamed.equals(whole)


@pytest.mark.parametrize("name, make", [("azure", azure_csv), ("burstgpt", burst_csv)])
def test_unsorted_csv_is_sorted_like_the_in_memory_import(name, make, tmp_path):
    src = tmp_path / "x.csv"
    src.write_text(make(3000, shuffle=True))
    options = {"drop_empty_prompts": True, "workload": "w"} if name == "burstgpt" else {"workload": "w"}
    _, streamed, whole = streamed_and_whole(name, src, tmp_path, 4096, **options)
    assert streamed.equals(whole) and read_trace(tmp_path / "streamed.parquet")[1].source["reordered"]


def test_azure_real_file_streams(tmp_path):
    from tests.conftest import shared_trace

    src = shared_trace("azure/AzureLLMInferenceTrace_conv.csv")
    _, streamed, whole = streamed_and_whole("azure", src, tmp_path, 1 << 15)
    assert streamed.equals(whole) and streamed.num_rows == 19_366


CSV_ERRORS = [
    ("azure", AZURE_HEAD),
    ("azure", AZURE_HEAD + "2023-11-16 18:15:46.0,5,1\n" * 30 + "2023-11-16 18:15:47.0,abc,1\n"),
    ("azure", AZURE_HEAD + "2023-11-16 18:15:46.0,5,1\n" * 30 + "2023-11-16 18:15:47.0,5\n"),
    ("azure", AZURE_HEAD + "2023-11-16 18:15:46.0,5,1\n" * 30 + "2023-11-16 18:15:46.0,0,1\nyesterday,5,1\n"),
    ("burstgpt", BURST_HEAD),
    ("burstgpt", BURST_HEAD + "5,GPT-4,1,1,2,API log\n" * 30 + "6,GPT-4,1,many,2,API log\n"),
    ("burstgpt", BURST_HEAD + "5,GPT-4,1,1,2,API log\n" * 30 + "5,,1,1,2,API log\n-5,GPT-4,1,1,2,API log\n"),
    ("burstgpt", BURST_HEAD + "5,GPT-4,1,1,2,API log\n" * 30 + "5,GPT-4,0,1,1,API log\n" * 3),
]


@pytest.mark.parametrize("name, text", CSV_ERRORS)
def test_csv_errors_in_a_later_block_match_the_in_memory_import(tmp_path, name, text):
    src = tmp_path / "bad.csv"
    src.write_text(text)
    with pytest.raises(TraceFormatError) as streamed:
        get(name).write(src, tmp_path / "o.parquet", block_bytes=256)
    with pytest.raises(TraceFormatError) as whole:
        get(name).read(src)
    assert str(streamed.value) == str(whole.value)
    assert not list(tmp_path.glob("o.parquet*"))
