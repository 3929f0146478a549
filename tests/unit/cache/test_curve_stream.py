"""The lru curve of a streamed replay (kvbench.cache.curve_stream) is the in-memory one (kvbench.cache.curve) at
every sampled capacity: on its own over small chunks, at full depth and at depths that leave capacities out, and
through `kvbench replay --stream --curve`, whose summary records it as the in-memory run does."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from kvbench.cache import curve_stream
from kvbench.cache.curve import lru_curve
from kvbench.cache.curve_stream import StreamCurve
from kvbench.cache.prepared import prepare
from kvbench.trace.generators import get
from kvbench.trace.stats import DEFAULT_WARMUP
from tests.conftest import REPO


@pytest.fixture(scope="module", params=["chat", "agent"])
def generated(request):
    return get(request.param).run(3000, seed=11)


def _grid(n_keys):
    from kvbench.backends.sim import _curve_grid

    return _curve_grid(n_keys)


def test_stream_curve_equals_in_memory(generated):
    """Chunks of 257 requests (the window's time axis is compacted many times), depths from all to one block."""
    table, meta = generated
    prep = prepare(table, meta.block_size, use_salt=True, share_lora=False, vllm_cap=False)
    grid = _grid(prep.n_keys)
    want = lru_curve(prep).summary(grid)
    for depth in (int(grid[-1]), prep.n_keys // 7, 300, 1):
        run = StreamCurve(grid, depth, n_requests=table.num_rows, warmup=DEFAULT_WARMUP,
                          block_size=meta.block_size, use_salt=True, share_lora=False)  # fmt: skip
        for batch in table.to_batches(max_chunksize=257):
            run.feed(batch)
        got = run.summary()
        kept = grid[grid <= depth]
        assert got["capacity_blocks"] == [int(c) for c in kept]
        for key, values in want.items():
            assert got[key] == values[: kept.size], (key, depth)


def _replay(path, out, stream):
    from kvbench.run import runner

    return runner.run_replay(path, "sim", {"curve": True}, out=out, stream=stream, report=False)[1]


@pytest.mark.parametrize("kind", ["chat", "agent"])
def test_streamed_replay_records_the_whole_curve(kind, tmp_path, monkeypatch):
    """`kvbench replay --stream --curve` on a trace written in row groups of 200 rows: the summary's curve and
    Belady points are the in-memory run's, read in 15 chunks, nothing is skipped, and the curve wrote no rows."""
    from kvbench.run import runner
    from kvbench.run.results import read_requests

    small = tmp_path / f"{kind}.parquet"
    get(kind).write(small, 3000, seed=5, row_group_size=200)
    scan = runner.scan_trace
    monkeypatch.setattr(runner, "scan_trace", lambda *a, **k: scan(*a, **k, chunk_rows=200))  # 15 chunks
    assert pq.ParquetFile(small).metadata.num_row_groups == 15
    streamed = _replay(small, tmp_path / "s", True)
    whole = _replay(small, tmp_path / "w", False)
    assert streamed["trace"]["streamed"] and not whole["trace"]["streamed"]
    assert "skipped" not in streamed
    assert streamed["curves"] == whole["curves"] and len(streamed["curves"]) == 1
    assert streamed["points"] == whole["points"] and len(streamed["points"]) == 8  # the Belady points
    names = set(read_requests(tmp_path / "s", columns=["point"]).column("point").to_pylist())
    assert names == {p["name"] for p in streamed["points"]}
    assert json.loads((tmp_path / "s" / "summary.json").read_text())["curves"] == whole["curves"]


def test_capacities_past_the_memory_budget_are_skipped_and_said_to_be(tmp_path, monkeypatch):
    """With room for a window of 2000 blocks, the curve stops at the last sampled capacity under it (equal to
    the in-memory curve there), and the rest are skipped with the sizes that would take them."""
    from kvbench.errors import KvbenchWarning

    trace = REPO / "traces" / "samples" / "chat.parquet"
    monkeypatch.setattr(curve_stream, "memory_budget", lambda: 2000 * curve_stream.BYTES_PER_DEPTH)
    with pytest.warns(KvbenchWarning, match="lru curve above .* blocks skipped: a streamed curve keeps"):
        streamed = _replay(trace, tmp_path / "s", True)
    whole = _replay(trace, tmp_path / "w", False)
    [got], [want] = streamed["curves"], whole["curves"]
    k = len(got["capacity_blocks"])
    assert 0 < k < len(want["capacity_blocks"]) and got["capacity_blocks"][-1] <= 2000
    assert all(got[key] == want[key][:k] for key in want if key != "policy")
    [skipped] = streamed["skipped"]
    assert skipped["what"] == f"lru curve above {got['capacity_blocks'][-1]:,} blocks"
    assert "GiB" in skipped["why"] and "--no-stream" in skipped["why"]
