"""`scan_trace`: validation, block counts, fingerprint and the infinite-cache bound of a trace read chunk by
chunk agree with the whole-table path, whatever the chunking."""

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvbench.errors import ValidationFailed
from kvbench.stats import infinite_cache_hits
from kvbench.traceio import read_trace
from kvbench.tracescan import block_references, scan_trace, trace_fingerprint
from kvbench.validate import validate_table

from ..conftest import REPO, make_trace
from .test_validate import set_value

SAMPLES = sorted((REPO / "traces" / "samples").glob("*.parquet"))


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_scan_equals_whole_table(path):
    table, meta = read_trace(path)
    scanned = scan_trace(path, chunk_rows=333)
    assert scanned.fingerprint == trace_fingerprint(table)
    np.testing.assert_array_equal(scanned.infinite_hits, infinite_cache_hits(table.column("block_hashes")))
    assert (
        scanned.n_blocks.sum() == block_references(path) == len(table.column("block_hashes").combine_chunks().flatten())
    )
    assert scanned.requests.num_rows == table.num_rows
    assert scanned.requests.column("request_id").to_pylist() == table.column("request_id").to_pylist()


def test_violations_in_later_chunks_are_reported_like_the_whole_table(tmp_path):
    t = make_trace(n=40)
    t = set_value(t, "arrival_s", 21, 0.1)  # out of order, in the fourth chunk of 6 rows
    t = set_value(t, "output_tokens", 33, -1)
    t = set_value(t, "output_tokens", 2, -5)  # the same rule in another chunk: one entry, counted twice
    t = set_value(t, "request_id", 30, "r3")  # duplicate of a row in the first chunk
    t = set_value(t, "parent_id", 37, "ghost")
    t = set_value(t, "arrival_s", 12, 0.0)  # out of order across a chunk boundary (row 12 starts chunk 3)
    path = tmp_path / "bad.parquet"
    pq.write_table(t.replace_schema_metadata({b"kvbench.block_size": b"4", b"kvbench.schema_version": b"1"}), path)
    whole = validate_table(t, 4, str(path))
    with pytest.raises(ValidationFailed) as err:
        scan_trace(path, chunk_rows=6)
    streamed = err.value.report
    key = {(v.column, v.rule): (sorted(v.rows), v.count) for v in whole.violations}
    assert {(v.column, v.rule): (sorted(v.rows), v.count) for v in streamed.violations} == key
    assert ("output_tokens", "must be >= 0") in key and key[("output_tokens", "must be >= 0")] == ([2, 33], 2)
