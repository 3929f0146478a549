"""Streamed replay (ids recycled between chunks, tenants coded against the whole trace's names) gives exactly
the in-memory kernels' results."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from kvbench.cache import policies
from kvbench.cache.prepared import prepare, prepare_requests
from kvbench.cache.stream import StreamReplay
from kvbench.trace.files import read_trace
from tests.conftest import REPO

SAMPLES = sorted((REPO / "traces" / "samples").glob("*.parquet")) + [
    REPO / "traces" / "mooncake" / "conversation_trace.parquet"
]
CARRY = [name for name, p in policies.registry().items() if p.carry is not None]


def test_lru_and_vllm_carry():
    assert {"lru", "vllm"} <= set(CARRY)


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
@pytest.mark.parametrize("name", CARRY)
@pytest.mark.parametrize("capacity", [7, 300, 5000])
def test_stream_equals_in_memory(path, name, capacity):
    table, meta = read_trace(path)
    pol = policies.get(name)
    vllm_cap = name == "vllm"
    prepared = prepare(table, meta.block_size, vllm_cap=vllm_cap)
    whole = pol.kernel(prepared, capacity)
    batches = table.to_batches(max_chunksize=97)  # many chunks, none aligned with anything in the trace
    n_blocks = [pc.list_value_length(b.column("block_hashes")).to_numpy(zero_copy_only=False) for b in batches]
    run = StreamReplay(
        pol.carry,
        capacity,
        block_size=meta.block_size,
        tenant_names=prepared.tenant_names,
        block_references=int(sum(n.sum() for n in n_blocks)),
        chunk_refs=int(max(n.sum() for n in n_blocks)),
        vllm_cap=vllm_cap,
        use_salt=True,
        share_lora=False,
    )
    parts = [run.feed(b) for b in batches]
    for key in ("hit_blocks", "evictions"):
        np.testing.assert_array_equal(np.concatenate([getattr(out, key) for out, _ in parts]), getattr(whole, key))
    np.testing.assert_array_equal(np.concatenate([chunk.tenant for _, chunk in parts]), prepared.tenant)
    np.testing.assert_array_equal(run.evict_matrix, whole.evict_matrix)
    assert run.filled_at == whole.filled_at


def test_tenant_codes_agree_across_chunks():
    """A chunk with no tenant at all still codes its requests as "(none)" of the whole trace's names."""
    table, meta = read_trace(REPO / "traces/samples/multi-tenant.parquet")
    half = table.num_rows // 2
    tenant = table.column("tenant").cast(pa.string()).combine_chunks()
    tenant = pa.concat_arrays([tenant[:half], pa.nulls(table.num_rows - half, pa.string())])
    table = table.set_column(table.schema.get_field_index("tenant"), "tenant", tenant)
    prepared = prepare(table, meta.block_size)
    assert prepared.tenant_names[-1] == "(none)"
    chunks = [table.slice(0, half), table.slice(half)]
    coded = [
        prepare_requests(c, meta.block_size, np.zeros(c.num_rows), vllm_cap=False, tenant_names=prepared.tenant_names)
        for c in chunks
    ]
    np.testing.assert_array_equal(np.concatenate([c.tenant for c in coded]), prepared.tenant)


def test_a_streamed_replay_has_the_bound(tmp_path):
    """A streamed replay computes the Belady bound out of core (kvbench.cache.bound_stream): the same points as
    the in-memory run, nothing skipped."""
    from kvbench.run.runner import run_replay

    trace = REPO / "traces" / "samples" / "chat.parquet"
    _, summary = run_replay(trace, "sim", {"capacity": "300"}, out=tmp_path / "s", stream=True, report=False)
    _, whole = run_replay(trace, "sim", {"capacity": "300"}, out=tmp_path / "w", stream=False, report=False)
    assert "skipped" not in summary and "skipped" not in whole
    assert [p["policy"] for p in summary["points"]] == ["lru", "belady"]
    assert summary["points"] == whole["points"]


def test_a_trace_over_the_limit_is_streamed_and_the_terminal_says_so(tmp_path, monkeypatch):
    from kvbench.errors import KvbenchWarning
    from kvbench.run import runner

    monkeypatch.setattr(runner, "STREAM_BLOCK_REFS", 1000)  # the chat sample has 118,255 block references
    trace = REPO / "traces" / "samples" / "chat.parquet"
    with pytest.warns(KvbenchWarning) as said:
        _, summary = runner.run_replay(trace, "sim", {"capacity": "300"}, out=tmp_path / "s", report=False)
    assert summary["trace"]["streamed"] is True
    messages = [str(w.message) for w in said]
    assert any("118,255 block references, over the 1,000 read whole" in m for m in messages)
    assert [p["policy"] for p in summary["points"]] == ["lru", "belady"]
