import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvbench.errors import TraceFormatError
from kvbench.trace.files import iter_batches, new_meta, read_meta, read_trace, write_trace
from kvbench.trace.schema import TRACE_SCHEMA, conform


def test_round_trip_keeps_schema_metadata_and_extra_columns(tmp_path, small_trace):
    table = small_trace.append_column("my_extra", pa.array(list(range(small_trace.num_rows))))
    meta = new_meta(4, {"generator": "hand", "seed": 1})
    path = write_trace(table, tmp_path / "t.parquet", meta)
    back, meta_back = read_trace(path)
    assert meta_back.block_size == 4 and meta_back.source == {"generator": "hand", "seed": 1}
    assert meta_back.schema_version == "1" and meta_back.created
    assert back.column_names[: len(TRACE_SCHEMA)] == TRACE_SCHEMA.names
    assert back.column("my_extra").to_pylist() == list(range(small_trace.num_rows))
    assert back.select(TRACE_SCHEMA.names).equals(conform(small_trace))
    md = pq.ParquetFile(path).metadata
    assert md.row_group(0).column(0).compression == "ZSTD"


def test_streaming_reads_row_groups(tmp_path, small_trace):
    path = write_trace(small_trace, tmp_path / "t.parquet", new_meta(4, {}), row_group_size=2)
    batches = list(iter_batches(path, columns=["request_id"], batch_size=2))
    assert [b.num_rows for b in batches] == [2, 2, 2]
    assert pq.ParquetFile(path).num_row_groups == 3


def test_conform_casts_and_fills_missing_columns():
    t = pa.table(
        {"request_id": ["a"], "arrival_s": [0], "input_tokens": [5], "output_tokens": [1], "block_hashes": [[1, 2]]}
    )
    c = conform(t)
    assert c.schema.field("input_tokens").type == pa.int32()
    assert c.column("tenant").null_count == 1
    with pytest.raises(pa.ArrowInvalid):
        conform(pa.table({"input_tokens": [2**40]}))


@pytest.mark.parametrize("content", [b"", b"PAR1garbage", b"not parquet at all"])
def test_unreadable_files_raise_clear_errors(tmp_path, content):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(content)
    with pytest.raises(TraceFormatError, match="bad.parquet"):
        read_trace(bad)


def test_truncated_parquet(tmp_path, small_trace):
    path = write_trace(small_trace, tmp_path / "t.parquet", new_meta(4, {}))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceFormatError, match="truncated"):
        read_trace(path)


def test_plain_parquet_without_kvbench_metadata_is_refused(tmp_path, small_trace):
    pq.write_table(small_trace, tmp_path / "plain.parquet")
    with pytest.raises(TraceFormatError, match="kvbench trace import"):
        read_meta(tmp_path / "plain.parquet")
