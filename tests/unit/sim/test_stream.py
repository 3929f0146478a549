"""Streamed replay (ids recycled between chunks) gives exactly the in-memory kernels' results."""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc
import pytest
from kvbench.backends.sim import policies
from kvbench.backends.sim.prepared import prepare, prepare_requests
from kvbench.backends.sim.stream import replay_stream

from kvbench.traceio import read_trace

from ...conftest import REPO

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
    whole = pol.kernel(prepare(table, meta.block_size, vllm_cap=vllm_cap), capacity)
    n_blocks = pc.list_value_length(table.column("block_hashes")).to_numpy(zero_copy_only=False)
    columns = prepare_requests(table, meta.block_size, n_blocks, vllm_cap=vllm_cap)
    chunk_rows = 97  # many chunks, none aligned with anything in the trace
    batches = table.to_batches(max_chunksize=chunk_rows)
    chunk_refs = max(int(pc.sum(pc.list_value_length(b.column("block_hashes"))).as_py() or 0) for b in batches)
    streamed = replay_stream(pol.carry, capacity, columns, iter(batches), chunk_refs, use_salt=True, share_lora=False)
    np.testing.assert_array_equal(streamed.hit_blocks, whole.hit_blocks)
    np.testing.assert_array_equal(streamed.evictions, whole.evictions)
    np.testing.assert_array_equal(streamed.evict_matrix, whole.evict_matrix)
    assert streamed.filled_at == whole.filled_at
