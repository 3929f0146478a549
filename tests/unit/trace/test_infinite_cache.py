"""The infinite-cache bound (`stats.infinite_cache_hits`) against a plain Python reading of its definition, on
generated traces cut into chunks and slices at awkward places (the numbering of ids runs across both), with
Arrow's numbering and the compiled one the replay uses."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvbench.cache.densify import numbered_chunks
from kvbench.trace import stats
from kvbench.trace.files import read_trace, write_trace
from kvbench.trace.generators import get


def reference_hits(rows: list[list[int]]) -> list[int]:
    """Each request hits its blocks up to the first one no earlier request had."""
    seen: set[int] = set()
    out = []
    for ids in rows:
        n = 0
        while n < len(ids) and ids[n] in seen:
            n += 1
        out.append(n)
        seen.update(ids)
    return out


@pytest.fixture(scope="module", params=["chat", "agent"])
def hashes(request) -> pa.ChunkedArray:
    table, _ = get(request.param).run(600, seed=3)
    return table.column("block_hashes")


@pytest.mark.parametrize("number", [None, numbered_chunks], ids=["arrow", "compiled"])
@pytest.mark.parametrize("cuts", [[], [1], [5, 5, 300], [17, 250, 599]])
@pytest.mark.parametrize("slice_rows", [1, 7, 16384])
def test_equals_the_definition_however_the_column_is_cut(hashes, cuts, slice_rows, number, monkeypatch):
    monkeypatch.setattr(stats, "_SLICE_ROWS", slice_rows)
    whole = hashes.combine_chunks()
    bounds = [0, *cuts, len(whole)]
    chunked = pa.chunked_array([whole.slice(a, b - a) for a, b in zip(bounds, bounds[1:])], whole.type)
    expected = reference_hits(whole.to_pylist())
    assert stats.infinite_cache_hits(chunked, number=number).tolist() == expected
    assert sum(expected) > 0


def test_a_file_read_by_row_group_gives_the_same_hits(tmp_path):
    """read_trace reads one row group at a time: the column arrives in chunks."""
    table, meta = get("chat").run(3000, seed=4)
    path = tmp_path / "t.parquet"
    write_trace(table, path, meta, row_group_size=700)
    read, _ = read_trace(path)
    assert read.column("block_hashes").num_chunks > 1
    assert read.equals(pq.read_table(path))  # the same table as read whole, schema and metadata included
    expected = reference_hits(table.column("block_hashes").to_pylist())
    assert stats.infinite_cache_hits(read.column("block_hashes")).tolist() == expected
    assert stats.infinite_cache_hits(read.column("block_hashes"), number=numbered_chunks).tolist() == expected
    assert np.array_equal(stats.infinite_cache_hits(table.column("block_hashes")), expected)
