"""Per-request result records (requests.parquet), written incrementally so an interrupted run keeps what
it measured. One schema for every backend; a backend leaves the columns it does not measure null."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .backend import PointResult

RESULT_SCHEMA = pa.schema(
    [
        pa.field("point", pa.string()),  # configuration point, e.g. "lru/10000"
        pa.field("request_id", pa.string()),
        pa.field("tenant", pa.string()),
        pa.field("workload", pa.string()),
        pa.field("input_tokens", pa.int32()),
        pa.field("output_tokens", pa.int32()),
        pa.field("hit_blocks", pa.int32()),
        pa.field("hit_tokens", pa.int32()),
        pa.field("hit_tokens_hbm", pa.int32()),
        pa.field("hit_tokens_dram", pa.int32()),
        pa.field("hit_tokens_ssd", pa.int32()),
        pa.field("hit_tokens_global", pa.int32()),  # from a KV pool shared by instances
        pa.field("evictions", pa.int32()),  # blocks this request's insertions evicted
        pa.field("scheduled_send_s", pa.float64()),
        pa.field("actual_send_s", pa.float64()),
        pa.field("ttft_s", pa.float64()),
        pa.field("tpot_s", pa.float64()),
        pa.field("e2el_s", pa.float64()),
        pa.field("queue_s", pa.float64()),  # arrival to first scheduled (modeled by engine-sim)
        pa.field("prefill_tokens", pa.int32()),  # prompt tokens computed, not found in any cache tier (torch)
        pa.field("itl_s", pa.list_(pa.float32())),
        pa.field("ttfo_s", pa.float64()),  # time to first visible (non-reasoning) output
        pa.field("cached_tokens", pa.int32()),  # as reported by the server
        pa.field("server_prompt_tokens", pa.int32()),  # prompt tokens as the server counted them
        pa.field("warmup", pa.bool_()),  # sent during warm-up: left out of latency metrics
        pa.field("status", pa.string()),
        pa.field("error", pa.string()),
    ]
)


def _text(col: pa.ChunkedArray) -> pa.ChunkedArray:
    return col.cast(pa.string()) if pa.types.is_dictionary(col.type) else col


WRITE_ROWS = 1 << 20
TRACE_COLUMNS = ["request_id", "tenant", "workload", "input_tokens", "output_tokens"]  # copied into results


class ResultWriter:
    """Appends rows to requests.parquet as they are answered (a point's rows in row order, in one or more
    calls); `close()` (also on interruption) seals the file. A point interrupted part-way keeps the rows it
    wrote; summary.json lists the points that finished."""

    def __init__(self, path: Path):
        self.path = path
        self._writer = pq.ParquetWriter(path, RESULT_SCHEMA, compression="zstd")

    def write(self, trace: pa.Table | pa.RecordBatch, point: PointResult) -> None:
        """Append `point`'s answers to the requests of `trace` (with TRACE_COLUMNS; `point.columns` aligned
        with its rows), built WRITE_ROWS rows at a time, never all at once."""
        if isinstance(trace, pa.RecordBatch):
            trace = pa.Table.from_batches([trace])
        batches = trace.to_batches(max_chunksize=WRITE_ROWS)
        start = 0
        for batch in batches:
            self._writer.write_table(self._rows(pa.Table.from_batches([batch]), point, start))
            start += batch.num_rows

    def _rows(self, trace: pa.Table, point: PointResult, start: int) -> pa.Table:
        n = trace.num_rows
        arrays = {
            "point": pa.repeat(pa.scalar(point.name, pa.string()), n),
            "request_id": trace.column("request_id"),
            "tenant": _text(trace.column("tenant")),
            "workload": _text(trace.column("workload")),
            "input_tokens": trace.column("input_tokens"),
            "output_tokens": trace.column("output_tokens"),
        }
        for f in RESULT_SCHEMA:
            if f.name in arrays:
                continue
            values = point.columns.get(f.name)
            arrays[f.name] = pa.nulls(n, f.type) if values is None else pa.array(values[start : start + n]).cast(f.type)
        return pa.table(arrays, schema=RESULT_SCHEMA)

    def close(self) -> None:
        self._writer.close()
