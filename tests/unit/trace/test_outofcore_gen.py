"""Streamed generation (`Generator.write`, generators/_stream.py): window by window, the same trace as the
whole-table path, sorted by arrival across row groups, valid, deterministic per seed."""

import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.trace.files import read_trace
from kvbench.trace.generators import InMemoryLimit, get, registry
from kvbench.trace.generators import _stream as stream
from kvbench.trace.scan import trace_info_file, validate_file
from kvbench.trace.stats import trace_info
from tests.conftest import REPO

STREAMED = sorted(k for k, g in registry().items() if g.stream is not None)


def test_chat_and_reasoning_stream():
    assert {"chat", "reasoning"} <= set(STREAMED)


def row_group_arrivals(path):
    pf = pq.ParquetFile(path)
    return [pf.read_row_group(g, columns=["arrival_s"]).column(0).to_numpy() for g in range(pf.num_row_groups)]


@pytest.mark.parametrize("kind", STREAMED)
def test_streamed_file_is_the_whole_table_sorted_across_row_groups(kind, tmp_path):
    out = tmp_path / "t.parquet"
    rows = get(kind).write(out, 3000, seed=5, window_requests=211, row_group_size=500)
    groups = row_group_arrivals(out)
    assert rows == 3000 and len(groups) == 6
    for before, after in zip(groups, groups[1:]):
        assert before[-1] <= after[0]  # non-decreasing across every row-group boundary
    assert all(np.all(np.diff(g) >= 0) for g in groups)
    assert validate_file(out).ok
    table, meta = read_trace(out)
    whole, whole_meta = get(kind).run(3000, seed=5)
    assert table.equals(whole)
    assert meta.source == whole_meta.source and meta.block_size == 64


@pytest.mark.parametrize("kind", STREAMED)
def test_deterministic_per_seed(kind, tmp_path):
    paths = [tmp_path / f"{i}.parquet" for i in range(3)]
    for path, seed in zip(paths, (7, 7, 8)):
        get(kind).write(path, 1500, seed=seed, window_requests=100, row_group_size=400)
    a, b, c = (read_trace(p)[0] for p in paths)
    assert a.equals(b) and not a.equals(c)


def test_statistics_equal_the_in_memory_generator(tmp_path):
    out = tmp_path / "chat.parquet"
    get("chat").write(out, 20_000, seed=2, window_requests=1_500, row_group_size=4_096)
    whole, meta = get("chat").run(20_000, seed=2)
    assert trace_info_file(out, chunk_rows=3_000) == trace_info(whole, meta.block_size)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(STREAMED),
    n=st.integers(1, 300),
    window=st.integers(1, 120),
    seed=st.integers(0, 2**31),
)
def test_property_any_window_gives_the_whole_trace(kind, n, window, seed):
    g = get(kind)
    whole, _ = g.run(n, seed=seed)
    parts = list(g.stream(g.params_type(), n, seed, 64, window_requests=window))
    assert pa.concat_tables(parts).equals(whole)
    arrival = np.concatenate([p.column("arrival_s").to_numpy() for p in parts])
    assert np.all(np.diff(arrival) >= 0)


def test_windows_cover_whole_sessions():
    turns = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    windows = list(stream.session_windows(turns, 5))
    assert windows[0][:2] == (0, 2) and windows[-1][1] == turns.size
    assert [w[2] for w in windows[1:]] == [w[3] for w in windows[:-1]]  # contiguous requests
    assert sum(w[3] - w[2] for w in windows) == turns.sum()
    assert list(stream.session_windows(turns, None)) == [(0, 8, 0, 31)]


def test_merge_releases_rows_only_when_no_later_window_can_precede_them():
    def window(arrivals):
        return pa.table({"arrival_s": np.array(arrivals, float), "id": np.arange(len(arrivals))})

    windows = [(window([0.0, 9.0, 2.0]), 0.0), (window([2.0, 3.0]), 2.0), (window([5.0, 5.0]), 5.0)]
    parts = list(stream.in_arrival_order(iter(windows), slack=0.0))
    merged = pa.concat_tables(parts)
    assert merged.column("arrival_s").to_pylist() == [0.0, 2.0, 2.0, 3.0, 5.0, 5.0, 9.0]
    # ties keep request order: window 0's 2.0 (request 2) before window 1's 2.0 (request 3)
    assert merged.column("id").to_pylist() == [0, 2, 0, 1, 0, 1, 1]
    assert [p.num_rows for p in parts] == [1, 3, 3]  # 9.0 waits for the end


def test_in_memory_kinds_refuse_what_does_not_fit(monkeypatch, tmp_path):
    import kvbench.trace.generators as generators

    monkeypatch.setattr(generators, "_available_memory", lambda: 10 * get("agent").bytes_per_request)
    with pytest.raises(InMemoryLimit, match=r"agent builds the whole trace in memory.*chat, .*reasoning"):
        get("agent").write(tmp_path / "a.parquet", 11)
    assert not list(tmp_path.iterdir())
    assert get("agent").write(tmp_path / "a.parquet", 10) == 10
    assert get("chat").write(tmp_path / "c.parquet", 1000) == 1000  # streamed kinds are not limited


def test_cli_writes_the_committed_sample(tmp_path):
    out = tmp_path / "chat.parquet"
    r = subprocess.run(
        ["kvbench", "trace", "gen", "chat", "-n", "2000", "--seed", "1", "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    sample, _ = read_trace(REPO / "traces/samples/chat.parquet")
    if read_trace(out)[1].source["numpy"].split(".")[:2] != np.__version__.split(".")[:2]:
        pytest.skip("sample made with another numpy")
    assert read_trace(out)[0].equals(sample)
    r = subprocess.run(["kvbench", "trace", "validate", str(out)], capture_output=True, text=True)
    assert r.returncode == 0 and "valid (2000 requests)" in r.stdout


def test_a_failed_generation_leaves_no_file(tmp_path, monkeypatch):
    out = tmp_path / "bad.parquet"
    real = stream.in_arrival_order

    def broken(windows, slack):  # a generator bug: rows out of arrival order
        for part in real(windows, slack):
            yield part.take(pa.array(np.arange(part.num_rows)[::-1]))

    monkeypatch.setattr("kvbench.trace.generators._stream.in_arrival_order", broken)
    with pytest.raises(Exception, match="non-decreasing"):
        get("chat").write(out, 500, window_requests=100)
    assert not list(tmp_path.iterdir())
