"""`scan_trace`: validation, block counts, fingerprint and the infinite-cache bound of a trace read chunk by
chunk agree with the whole-table path, whatever the chunking."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from kvbench.errors import ValidationFailed
from kvbench.trace.files import read_trace
from kvbench.trace.scan import REPLAY_COLUMNS, block_references, scan_trace, trace_fingerprint
from kvbench.trace.stats import hit_rates, infinite_cache_hits
from kvbench.trace.validation import validate_table
from tests.conftest import REPO, make_trace
from tests.unit.trace.test_validate import set_value

SAMPLES = sorted((REPO / "traces" / "samples").glob("*.parquet"))


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_scan_equals_whole_table(path):
    table, meta = read_trace(path)
    scanned = scan_trace(path, chunk_rows=333, warmup=0.3)
    assert scanned.fingerprint == trace_fingerprint(table)
    hashes = table.column("block_hashes")
    n_blocks = pc.list_value_length(hashes).to_numpy(zero_copy_only=False)
    hits = infinite_cache_hits(hashes)
    inp = table.column("input_tokens").to_numpy().astype(np.int64)
    assert scanned.infinite_cache == hit_rates(hits, n_blocks, inp, meta.block_size, 0.3)
    assert scanned.n_requests == table.num_rows
    assert scanned.block_references == n_blocks.sum() == block_references(path)
    assert scanned.longest == n_blocks.max()
    tenants = table.column("tenant").cast(pa.string()).fill_null("(none)")
    assert scanned.tenant_names == pc.unique(tenants).to_pylist()  # in order of first appearance
    assert scanned.filled == {c for c in REPLAY_COLUMNS if table.column(c).null_count < table.num_rows}
    assert scanned.infinite_hits is None  # nothing per request by default
    chunks = list(scanned.chunks())
    assert [c.num_rows for c in chunks[:-1]] == [333] * (len(chunks) - 1)
    assert scanned.chunk_refs == max(
        int(pc.sum(pc.list_value_length(c.column("block_hashes"))).as_py()) for c in chunks
    )
    assert pa.Table.from_batches(chunks).equals(table.select(["block_hashes", *REPLAY_COLUMNS]))

    kept = scan_trace(path, chunk_rows=333, keep_hits=True)
    np.testing.assert_array_equal(kept.infinite_hits, hits)


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
