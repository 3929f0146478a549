"""engine-sim says which part of a request did not fit the KV pool: its prompt, or the output it grew to."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from kvbench.run.runner import run_replay
from kvbench.trace.files import read_trace, write_trace
from tests.conftest import REPO


def _one_request(tmp_path, output_tokens: int):
    table, meta = read_trace(REPO / "traces/samples/chat.parquet")
    row = table.slice(0, 1)
    row = row.set_column(
        row.schema.get_field_index("output_tokens"), "output_tokens", pa.array([output_tokens], pa.int32())
    )
    path = tmp_path / f"out{output_tokens}.parquet"
    write_trace(row, path, meta)
    return path, row.column("input_tokens")[0].as_py(), meta.block_size


def _error(tmp_path, trace, capacity) -> str | None:
    run_dir, _ = run_replay(
        trace, "engine-sim", {"hbm_capacity": str(capacity)}, out=tmp_path / f"r{capacity}", report=False
    )
    return pq.read_table(run_dir / "requests.parquet").column("error")[0].as_py()


def test_an_output_that_outgrows_the_pool_is_blamed_not_the_prompt(tmp_path):
    trace, n_in, bs = _one_request(tmp_path, output_tokens=100_000)
    pool = -(-n_in // bs) + 2  # the prompt fits with room for two blocks of output
    reason = _error(tmp_path, trace, pool)
    assert reason is not None and reason.startswith("output does not fit"), reason
    assert "prompt (" in reason and f"{pool} blocks" in reason


def test_a_prompt_larger_than_the_pool_is_blamed(tmp_path):
    trace, n_in, bs = _one_request(tmp_path, output_tokens=10)
    reason = _error(tmp_path, trace, max(1, n_in // bs // 2))
    assert reason is not None and reason.startswith(f"prompt ({n_in} tokens) larger than"), reason
