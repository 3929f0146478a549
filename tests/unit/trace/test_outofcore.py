"""The out-of-core infinite-cache computation equals the in-memory one (trace.outofcore, trace.stats)."""

import json
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.trace.files import read_trace
from kvbench.trace.outofcore import InfiniteCacheStream
from kvbench.trace.scan import trace_info_file
from kvbench.trace.stats import infinite_cache_hits, trace_info
from tests.conftest import REPO

SAMPLES = sorted((REPO / "traces/samples").glob("*.parquet"))
MOONCAKE = REPO / "traces/mooncake/conversation_trace.parquet"


def stream_hits(column, batch_rows, partition_refs, tmpdir=None):
    """Feed `column` in slices of `batch_rows` rows; returns (hits, unique, n_blocks)."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    with InfiniteCacheStream(tmpdir=tmpdir, partition_refs=partition_refs) as s:
        for start in range(0, len(column), batch_rows):
            s.add(column.slice(start, batch_rows))
        hits, unique = s.finish()
    return hits, unique, s.n_blocks


def distinct(column) -> int:
    return len(np.unique(np.asarray(pc.list_flatten(column))))


@pytest.mark.parametrize("path", SAMPLES + [MOONCAKE], ids=lambda p: p.stem)
def test_equals_in_memory_on_committed_traces(path, tmp_path):
    table, _ = read_trace(path, columns=["block_hashes"])
    column = table.column("block_hashes")
    # A tiny partition size forces nested splits; batches that do not divide the trace evenly.
    hits, unique, n_blocks = stream_hits(column, batch_rows=777, partition_refs=500, tmpdir=tmp_path)
    assert hits.dtype == np.int64
    np.testing.assert_array_equal(hits, infinite_cache_hits(column))
    assert unique == distinct(column)
    np.testing.assert_array_equal(n_blocks, np.asarray(pc.list_value_length(column)))
    assert list(tmp_path.iterdir()) == []


def test_mooncake_reference_numbers():
    info = trace_info_file(MOONCAKE)
    assert info["blocks"] == {"references": 288500, "unique": 182790}
    assert round(info["infinite_cache_hit_rate"]["token"]["all"], 5) == 0.37362
    assert round(info["infinite_cache_hit_rate"]["token"]["steady"], 5) == 0.39811


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_trace_info_file_equals_trace_info(path):
    table, meta = read_trace(path)
    assert trace_info_file(path) == trace_info(table, meta.block_size)
    assert trace_info_file(path, warmup=0.2) == trace_info(table, meta.block_size, 0.2)


def test_cli_info_json_unchanged():
    path = REPO / "traces/samples/mix.parquet"
    r = subprocess.run(["kvbench", "trace", "info", str(path), "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    table, meta = read_trace(path)
    expected = {"trace": str(path), "source": meta.source, **trace_info(table, meta.block_size)}
    assert r.stdout == json.dumps(expected, indent=2) + "\n"


# Small ids repeat often; a few huge ones exercise the top bits the partitioning reads.
hash_values = st.one_of(
    st.integers(0, 12), st.sampled_from([2**63, 2**64 - 1, 0x9E3779B97F4A7C15, 2**32]), st.integers(0, 2**64 - 1)
)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.lists(hash_values, max_size=8), max_size=40),
    batch_rows=st.integers(1, 12),
    partition_refs=st.integers(1, 6),
)
def test_property_equals_in_memory(rows, batch_rows, partition_refs):
    column = pa.array(rows, type=pa.list_(pa.uint64()))
    hits, unique, n_blocks = stream_hits(column, batch_rows, partition_refs)
    np.testing.assert_array_equal(hits, infinite_cache_hits(column))
    assert unique == len({h for row in rows for h in row})
    np.testing.assert_array_equal(n_blocks, [len(r) for r in rows])


def test_one_hash_in_every_batch_cannot_be_split():
    # 30 batches all referencing block 7: its partition exceeds partition_refs and no split can divide it.
    column = pa.array([[7, i + 100] for i in range(30)], type=pa.list_(pa.uint64()))
    hits, unique, _ = stream_hits(column, batch_rows=1, partition_refs=2)
    np.testing.assert_array_equal(hits, [0] + [1] * 29)
    assert unique == 31


def test_chunked_input_and_empty_stream(tmp_path):
    column = pa.chunked_array(
        [pa.array([[1, 2], []], pa.list_(pa.uint64())), pa.array([[1, 3]], pa.list_(pa.uint64()))]
    )
    with InfiniteCacheStream(tmpdir=tmp_path) as s:
        s.add(column)
        assert s.finish()[0].tolist() == [0, 0, 1]
    with InfiniteCacheStream(tmpdir=tmp_path) as s:
        hits, unique = s.finish()
    assert hits.size == 0 and unique == 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_temp_dir_removed_on_exception(tmp_path, exc):
    with pytest.raises(exc):
        with InfiniteCacheStream(tmpdir=tmp_path) as s:
            s.add(pa.array([[1, 2, 3]] * 10, pa.list_(pa.uint64())))
            assert len(list(tmp_path.iterdir())) == 1  # the spill directory exists while streaming
            raise exc
    assert list(tmp_path.iterdir()) == []


def test_misuse_is_an_error(tmp_path):
    with InfiniteCacheStream(tmpdir=tmp_path) as s:
        s.finish()
        with pytest.raises(RuntimeError):
            s.add(pa.array([[1]], pa.list_(pa.uint64())))
        with pytest.raises(RuntimeError):
            s.finish()
    with pytest.raises(ValueError):
        InfiniteCacheStream(partition_refs=0)
