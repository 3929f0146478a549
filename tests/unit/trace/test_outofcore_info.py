"""`trace info` and `trace validate` by row group: every number equals the whole-table computation (done here
independently, with numpy/pyarrow), and every violation equals `validate_table`'s."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.trace.files import read_trace
from kvbench.trace.references import References, check_across_rows
from kvbench.trace.scan import trace_info_file, validate_file
from kvbench.trace.stats import hit_rates, infinite_cache_hits, trace_info
from kvbench.trace.summary import percentiles_of_counts
from kvbench.trace.validation import ValidationReport, validate_table
from tests.conftest import REPO, make_trace
from tests.unit.trace.test_validate import set_value

SAMPLES = sorted((REPO / "traces/samples").glob("*.parquet")) + [REPO / "traces/mooncake/conversation_trace.parquet"]


def reference_info(table: pa.Table, block_size: int, warmup: float) -> dict:
    """What trace info must print, computed on the whole table without kvbench's summary code."""
    inp = table.column("input_tokens").to_numpy().astype(np.int64)
    out = table.column("output_tokens").to_numpy().astype(np.int64)
    arrival = table.column("arrival_s").to_numpy()
    hashes = table.column("block_hashes")
    n_blocks = pc.list_value_length(hashes).to_numpy().astype(np.int64)
    hits = infinite_cache_hits(hashes)
    duration = float(arrival[-1] - arrival[0])

    def dist(x):
        return {
            "total": int(x.sum()),
            "mean": float(x.mean()),
            **{f"p{p}": float(v) for p, v in zip((50, 90, 99), np.percentile(x, (50, 90, 99)))},
            "max": float(x.max()),
        }

    def distinct(name):
        col = table.column(name)
        col = col.cast(pa.string()) if pa.types.is_dictionary(col.type) else col
        return pc.count_distinct(col).as_py() if col.null_count < len(col) else 0

    def by(key):
        col = table.column(key)
        if col.null_count == len(col):
            return []
        labels = (col.cast(pa.string()) if pa.types.is_dictionary(col.type) else col).fill_null("(none)")
        frame = pa.table({"k": labels, "i": inp, "o": out, "h": np.minimum(hits * block_size, inp)})
        g = frame.group_by("k").aggregate([("i", "count"), ("i", "sum"), ("o", "sum"), ("h", "sum")]).to_pylist()
        rows = [
            {
                key: r["k"],
                "requests": r["i_count"],
                "input_tokens": r["i_sum"],
                "mean_input": r["i_sum"] / r["i_count"],
                "mean_output": r["o_sum"] / r["i_count"],
                "hit_tokens": r["h_sum"],
                "token_share": r["i_sum"] / int(inp.sum()),
                "infinite_cache_token_hit_rate": r["h_sum"] / r["i_sum"],
            }
            for r in g
        ]
        return sorted(rows, key=lambda r: (-r["requests"], r[key]))

    return {
        "requests": table.num_rows,
        "block_size": block_size,
        "duration_s": duration,
        "rates": {
            "requests_per_s": table.num_rows / duration,
            "input_tokens_per_s": float(inp.sum()) / duration,
            "output_tokens_per_s": float(out.sum()) / duration,
        },
        "input_tokens": dist(inp),
        "output_tokens": dist(out),
        "blocks": {"references": int(n_blocks.sum()), "unique": len(np.unique(pc.list_flatten(hashes)))},
        "sessions": distinct("session_id"),
        "users": distinct("user_id"),
        "tenants": distinct("tenant"),
        "infinite_cache_hit_rate": hit_rates(hits, n_blocks, inp, block_size, warmup),
        "by_workload": by("workload"),
        "by_tenant": by("tenant"),
    }


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
@pytest.mark.parametrize("chunk_rows", [333, 65_536])
def test_streamed_info_equals_whole_table_for_every_number(path, chunk_rows, tmp_path):
    table, meta = read_trace(path)
    streamed = trace_info_file(path, warmup=0.3, tmpdir=tmp_path, chunk_rows=chunk_rows)
    assert streamed == trace_info(table, meta.block_size, 0.3)
    assert streamed == reference_info(table, meta.block_size, 0.3)
    assert list(tmp_path.iterdir()) == []  # the spilled partitions are gone


def test_streamed_info_of_a_file_with_many_row_groups(tmp_path):
    table, meta = read_trace(REPO / "traces/samples/mix.parquet")
    path = tmp_path / "mix.parquet"
    pq.write_table(table.replace_schema_metadata(meta.to_arrow()), path, row_group_size=128)
    assert pq.ParquetFile(path).metadata.num_row_groups > 10
    assert trace_info_file(path) == reference_info(table, meta.block_size, 0.5)


@settings(max_examples=300, deadline=None)
@given(
    data=st.lists(st.integers(0, 10**9) | st.integers(0, 40), min_size=1, max_size=400),
    qs=st.lists(st.floats(0, 100), min_size=1, max_size=5),
)
def test_percentiles_of_counts_equal_numpy(data, qs):
    x = np.asarray(data, dtype=np.int64)
    values, counts = np.unique(x, return_counts=True)
    assert percentiles_of_counts(values, counts, qs) == [float(v) for v in np.percentile(x, qs)]


BROKEN = [
    ("arrival_s", 21, 0.1),
    ("output_tokens", 33, -1),
    ("request_id", 30, "r3"),
    ("request_id", 31, "r3"),
    ("parent_id", 37, "ghost"),
    ("depends_on", 5, ["r9"]),  # a cycle: r9 depends on r8 ... on r5, which depends on r9
    ("depends_on", 12, ["nobody"]),
    ("arrival_s", 12, 0.0),
]


@pytest.mark.parametrize("chunk_rows", [1, 6, 13, 1000])
def test_validate_file_equals_validate_table(chunk_rows, tmp_path):
    t = make_trace(n=40)
    for column, row, value in BROKEN:
        t = set_value(t, column, row, value)
    path = tmp_path / "bad.parquet"
    pq.write_table(t.replace_schema_metadata({b"kvbench.block_size": b"4", b"kvbench.schema_version": b"1"}), path)
    whole, streamed = validate_table(t, 4, str(path)), validate_file(path, chunk_rows=chunk_rows)
    key = {(v.column, v.rule): (sorted(v.rows), v.count) for v in whole.violations}
    assert {(v.column, v.rule): (sorted(v.rows), v.count) for v in streamed.violations} == key
    assert len(key) == 6  # arrival order, output_tokens, duplicate id, dangling parent, dangling dep, cycle


ids = st.lists(st.sampled_from([f"r{i}" for i in range(12)]), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(ids=ids, parents=st.lists(st.sampled_from(["r0", "r5", "x", None]), max_size=30), data=st.data())
def test_hashed_cross_row_checks_equal_the_text_checks(ids, parents, data):
    n = len(ids)
    parents = (parents + [None] * n)[:n]
    deps = [data.draw(st.lists(st.sampled_from(["r1", "r7", "r11", "y"]), max_size=2)) for _ in range(n)]
    t = make_trace(n=n, request_id=ids, parent_id=parents, depends_on=deps)
    reports = []
    for hashed in (False, True):
        report = ValidationReport("t", n)
        refs = References.of(t, hashed=hashed)
        check_across_rows(refs, report, (lambda rows: [ids[r] for r in rows]) if hashed else None)
        reports.append({(v.column, v.rule): (v.rows, v.count) for v in report.violations})
    assert reports[0] == reports[1]


@settings(max_examples=100, deadline=None)
@given(chunks=st.lists(st.lists(st.integers(0, 2**63), max_size=50), max_size=30), capacity=st.integers(1, 8))
def test_growing_array_holds_every_chunk_in_order(chunks, capacity):
    from kvbench.trace.outofcore import GrowingArray

    grown = GrowingArray(np.uint64, capacity)
    for chunk in chunks:
        grown.extend(np.asarray(chunk, dtype=np.uint64))
    expected = [v for chunk in chunks for v in chunk]
    assert grown.values.tolist() == expected and grown.size == len(expected)
