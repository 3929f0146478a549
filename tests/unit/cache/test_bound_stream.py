"""The Belady bound out of core (kvbench.cache.nextuse, kvbench.cache.bound_stream) gives exactly the in-memory
results: next uses, then hit blocks, evictions and the evictor/victim matrix at several capacities, with chunks
and partitions small enough that every trace spills to many files."""

from __future__ import annotations

import json
import subprocess
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from kvbench.cache import policies
from kvbench.cache.bound_stream import StreamBound
from kvbench.cache.nextuse import NextUseFile
from kvbench.cache.prepared import fold_isolation, prepare
from kvbench.trace.files import read_trace
from tests.conftest import REPO, without_fairness_views

SAMPLES = [REPO / "traces" / "samples" / f"{s}.parquet" for s in ("chat", "agent", "multi-tenant", "mix")]


def _next_uses(batches, n_requests, tmp_path, partition_refs, use_salt=True):
    refs = sum(len(pc.list_flatten(b.column("block_hashes"))) for b in batches)
    nu = NextUseFile(refs, n_requests, tmpdir=tmp_path, partition_refs=partition_refs)
    for b in batches:
        hashes = fold_isolation(pa.Table.from_batches([b]), use_salt=use_salt)
        offsets = np.asarray(hashes.offsets, np.int64)
        nu.add(np.asarray(hashes.flatten()), offsets - offsets[0])
    nu.finish()
    return nu


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_next_uses_equal_in_memory(path, tmp_path):
    """Next uses as `PreparedTrace.next_use()`; a last reference carries its block's first position."""
    table, meta = read_trace(path)
    prepared = prepare(table, meta.block_size)
    want = prepared.next_use().astype(np.int64)
    _, first = np.unique(prepared.keys, return_index=True)
    never = prepared.n_requests + 1
    want = np.where(want == never, never + first[prepared.keys], want)
    with _next_uses(table.to_batches(max_chunksize=97), table.num_rows, tmp_path, partition_refs=1000) as nu:
        assert nu.bits > 3  # many partitions, and many groups
        got = np.concatenate([nu.read(s, min(777, nu.m - s)) for s in range(0, nu.m, 777)])
    np.testing.assert_array_equal(got, want)
    assert not list(tmp_path.iterdir())  # the scratch directory is gone


@pytest.mark.parametrize("chunks", [1, 5, 40])
def test_next_uses_of_repeats_within_a_request(tmp_path, chunks):
    """A block referenced twice by one request (not in prefix-chained ids, but any ids are taken): both
    references' next use is the next request's, as in memory; an empty trace has none."""
    from kvbench.cache.densify import next_request_use

    rng = np.random.default_rng(5)
    offsets = np.concatenate(([0], np.cumsum(rng.integers(0, 9, 400))))
    ids = rng.integers(0, 60, offsets[-1]).astype(np.uint64)
    keys = np.unique(ids, return_inverse=True)[1].astype(np.int32)
    want = next_request_use(keys, offsets, int(keys.max()) + 1).astype(np.int64)
    first = np.array([np.flatnonzero(ids == x)[0] for x in ids])
    want = np.where(want == 401, 401 + first, want)
    with NextUseFile(ids.size, 400, tmpdir=tmp_path, partition_refs=100) as nu:
        for rows in np.array_split(np.arange(400), chunks):
            lo, hi = offsets[rows[0]], offsets[rows[-1] + 1]
            nu.add(ids[lo:hi], offsets[rows[0] : rows[-1] + 2] - lo)
        nu.finish()
        np.testing.assert_array_equal(nu.read(0, ids.size), want)
        assert nu.unique == np.unique(ids).size
    with NextUseFile(0, 0, tmpdir=tmp_path) as empty:
        empty.add(np.zeros(0, np.uint64), np.zeros(1, np.int64))
        empty.finish()
        assert empty.read(0, 0).size == 0


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_bound_equals_in_memory(path, tmp_path):
    table, meta = read_trace(path)
    prepared = prepare(table, meta.block_size)
    batches = table.to_batches(max_chunksize=97)  # many chunks, none aligned with anything in the trace
    n_blocks = [pc.list_value_length(b.column("block_hashes")).to_numpy(zero_copy_only=False) for b in batches]
    with _next_uses(batches, table.num_rows, tmp_path, partition_refs=5000) as nu:
        for capacity in (7, 300, 5000, prepared.n_keys):
            whole = policies.get("belady").kernel(prepared, capacity)
            run = StreamBound(
                nu,
                capacity,
                block_size=meta.block_size,
                tenant_names=prepared.tenant_names,
                chunk_refs=int(max(n.sum() for n in n_blocks)),
                longest=int(max(n.max(initial=0) for n in n_blocks)),
                use_salt=True,
                share_lora=False,
            )
            parts = [run.feed(b)[0] for b in batches]
            for key in ("hit_blocks", "evictions"):
                got = np.concatenate([getattr(out, key) for out in parts])
                np.testing.assert_array_equal(got, getattr(whole, key), err_msg=f"{key} at {capacity}")
            np.testing.assert_array_equal(run.evict_matrix, whole.evict_matrix)
            assert run.filled_at == whole.filled_at


@pytest.mark.parametrize("kind", ["chat", "agent"])
def test_streamed_bound_on_a_generated_trace(tmp_path, kind, monkeypatch):
    """`kvbench replay --stream` on freshly generated traces, with small row groups and partitions: the bound's
    points and rows are the in-memory run's, at several capacities."""
    from kvbench.cache import bound_stream
    from kvbench.run import runner

    trace = tmp_path / f"{kind}.parquet"
    gen = ["kvbench", "trace", "gen", kind, "-n", "3000", "--seed", "7", "-o", str(trace)]
    subprocess.run(gen, check=True, capture_output=True)
    real = bound_stream.next_uses
    monkeypatch.setattr(bound_stream, "next_uses", lambda *a, **k: real(*a, **{**k, "partition_refs": 4096}))
    scan = runner.scan_trace
    monkeypatch.setattr(runner, "scan_trace", lambda *a, **k: scan(*a, **k, chunk_rows=257))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the scratch directory's parent ($TMPDIR)
    opts = {"policy": "lru", "capacity": "50,2000,40000"}
    _, streamed = runner.run_replay(trace, "sim", opts, out=tmp_path / "s", stream=True, report=False)
    _, whole = runner.run_replay(trace, "sim", opts, out=tmp_path / "w", stream=False, report=False)
    assert streamed["trace"]["streamed"]
    assert [p["name"] for p in streamed["points"]][-3:] == [f"belady/{c}blocks" for c in (50, 2000, 40000)]
    assert streamed["points"] == whole["points"] and "skipped" not in streamed
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("kvbench-nextuse-")]  # scratch removed


def test_summary_says_the_bound_was_computed_streamed(tmp_path):
    r = subprocess.run(
        ["kvbench", "replay", str(REPO / "traces/samples/multi-tenant.parquet"), "--capacity", "300", "--stream",
         "--out", str(tmp_path / "r"), "--no-report"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["trace"]["streamed"] and "skipped" not in summary and "skipped" not in r.stderr
    assert [p["name"] for p in summary["points"]] == ["lru/300blocks", "belady/300blocks"]


def test_too_little_scratch_disk_skips_the_bound_and_says_why(tmp_path, monkeypatch):
    from kvbench.cache import bound_stream
    from kvbench.errors import KvbenchWarning
    from kvbench.run.runner import run_replay

    monkeypatch.setattr(bound_stream, "spill_bytes", lambda refs: 1 << 62)
    trace = REPO / "traces" / "samples" / "chat.parquet"
    with pytest.warns(KvbenchWarning, match="belady bound skipped: its next uses need up to .* of scratch disk"):
        _, summary = run_replay(trace, "sim", {"capacity": "300"}, out=tmp_path / "s", stream=True, report=False)
    assert [p["policy"] for p in summary["points"]] == ["lru"]
    [skipped] = summary["skipped"]
    assert skipped["what"] == "belady bound" and "TMPDIR" in skipped["why"] and "--no-bound" in skipped["why"]


def test_a_streamed_curve_and_its_bound_points_are_the_in_memory_ones(tmp_path):
    """--curve under --stream: the curve (kvbench.cache.curve_stream) and the Belady points --curve adds,
    computed out of core, at the in-memory run's capacities (the distinct blocks, isolation folded in)."""
    from kvbench.run.runner import run_replay

    trace = REPO / "traces" / "samples" / "multi-tenant.parquet"
    _, streamed = run_replay(trace, "sim", {"curve": True}, out=tmp_path / "s", stream=True, report=False)
    _, whole = run_replay(trace, "sim", {"curve": True}, out=tmp_path / "w", stream=False, report=False)
    assert "skipped" not in streamed and streamed["curves"] == whole["curves"]
    assert len(streamed["points"]) == 8 and streamed["points"] == without_fairness_views(whole["points"])
