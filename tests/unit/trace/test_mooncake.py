"""The Mooncake importer and exporter against the FAST'25 conversation trace (docs/semantics.md, Reference figures)."""

import json

import pytest

from kvbench.errors import TraceFormatError
from kvbench.trace.export import export_mooncake
from kvbench.trace.files import read_trace
from kvbench.trace.importers import get
from kvbench.trace.stats import trace_info
from tests.conftest import REPO, kvbench


def test_reference_numbers_through_the_cli(mooncake_path, tmp_path):
    out = tmp_path / "c.parquet"
    r = kvbench("trace", "import", "mooncake", mooncake_path, "-o", out)
    assert r.returncode == 0, r.stderr
    r = kvbench("trace", "info", out, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["requests"] == 12031
    assert info["blocks"] == {"references": 288500, "unique": 182790}
    assert round(info["infinite_cache_hit_rate"]["token"]["all"], 4) == 0.3736
    assert round(info["infinite_cache_hit_rate"]["token"]["steady"], 4) == 0.3981
    assert info["input_tokens"]["mean"] == pytest.approx(12035, abs=1)
    assert info["output_tokens"]["mean"] == pytest.approx(343, abs=1)


def test_round_trip_preserves_every_field(mooncake_path, tmp_path):
    table, meta = get("mooncake").read(mooncake_path)
    assert meta.block_size == 512 and not meta.source["rechained"]
    assert table.column("arrival_s")[-1].as_py() == pytest.approx(3536.999)
    back = export_mooncake(table, meta, tmp_path / "back.jsonl")
    original = [json.loads(line) for line in mooncake_path.read_text().splitlines() if line.strip()]
    exported = [json.loads(line) for line in back.read_text().splitlines()]
    assert exported == original


def test_round_trip_keeps_extra_fields_and_time_origin(tmp_path):
    src = tmp_path / "x.jsonl"
    src.write_text(
        '{"timestamp": 1000, "input_length": 5, "output_length": 2, "hash_ids": [3, 4], "tag": "a"}\n'
        '{"timestamp": 2500, "input_length": 3, "output_length": 0, "hash_ids": [3]}\n'
    )
    table, meta = get("mooncake").read(src, block_size=4)
    assert table.column("arrival_s").to_pylist() == [0.0, 1.5]
    out = export_mooncake(table, meta, tmp_path / "y.jsonl")
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        json.loads(line) for line in src.read_text().splitlines()
    ]


def test_non_chained_ids_are_chained(tmp_path):
    src = tmp_path / "x.jsonl"
    # id 9 follows 1 in the first request and 2 in the second: not prefix-consistent
    src.write_text(
        '{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 9]}\n'
        '{"timestamp": 1, "input_length": 8, "output_length": 1, "hash_ids": [2, 9]}\n'
    )
    table, meta = get("mooncake").read(src, block_size=4)
    assert meta.source["rechained"]
    a, b = table.column("block_hashes").to_pylist()
    assert a[1] != b[1]
    assert trace_info(table, 4)["blocks"]["unique"] == 4


def test_generated_trace_exports_integer_ms(tmp_path):
    from kvbench.trace.generators import get as gen

    table, meta = gen("chat").run(50, seed=1)
    out = export_mooncake(table, meta, tmp_path / "g.jsonl", renumber=True)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(isinstance(r["timestamp"], int) for r in recs)
    ids = sorted({h for r in recs for h in r["hash_ids"]})
    assert ids == list(range(len(ids)))


@pytest.mark.parametrize(
    "content, match",
    [
        ("", "no records"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1,', "line 2"),
        ('{"timestamp": 0.25, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n', "--time-unit s"),
        ('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1]}\n', "fit --block-size 1024"),
        ('{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [1]}\n', "input_length"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [1]}\n', "'input_length' is missing"),
        ("[1, 2]\n", "not a JSON object"),
    ],
)
def test_bad_input_names_file_and_line(tmp_path, content, match):
    src = tmp_path / "bad.jsonl"
    src.write_text(content)
    with pytest.raises(TraceFormatError, match=match) as info:
        get("mooncake").read(src, block_size=512)
    assert "bad.jsonl" in str(info.value)


def test_committed_parquet_matches_reference_numbers():
    table, meta = read_trace(REPO / "traces/mooncake/conversation_trace.parquet")
    info = trace_info(table, meta.block_size)
    assert (info["requests"], info["blocks"]["references"], info["blocks"]["unique"]) == (12031, 288500, 182790)
    assert round(info["infinite_cache_hit_rate"]["token"]["all"], 4) == 0.3736
    assert round(info["infinite_cache_hit_rate"]["token"]["steady"], 4) == 0.3981
