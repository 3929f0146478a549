"""What a replay needs from a trace file, in bounded memory: one pass over the block ids by row group.

A trace's block ids are almost all of its bytes (tens of ids per request); everything else is a few tens of
bytes per request. `scan_trace` keeps the per-request columns, and streams `block_hashes` once to count
blocks, validate them, fingerprint them and compute the infinite-cache bound (spilled to disk,
`outofcore.InfiniteCacheStream`). A streaming backend then reads the block ids again, chunk by chunk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import ValidationFailed
from .schema import TRACE_SCHEMA
from .traceio import ROW_GROUP_SIZE, TraceMeta, _open, iter_batches, read_meta
from .validate import References, ValidationReport, block_lengths, check_across_rows, check_rows

# Above this many block references a replay streams the trace (about 0.5 GB of block ids in memory).
STREAM_BLOCK_REFS = 60_000_000
_FINGERPRINTED = ("request_id", "arrival_s", "input_tokens", "output_tokens", "block_hashes")
_BLOCKS_TYPE = TRACE_SCHEMA.field("block_hashes").type


def block_references(path: str | Path) -> int:
    """Block references in a trace, from the Parquet footer (no data read)."""
    md = _open(path).metadata
    leaf = next((i for i in range(md.num_columns) if md.schema.column(i).path.startswith("block_hashes.")), None)
    if leaf is None:
        return 0
    return sum(md.row_group(g).column(leaf).num_values for g in range(md.num_row_groups))


class Fingerprint:
    """Content hash of what a replay depends on (ids, times, lengths, block ids), not of the file's bytes:
    the same for a trace however it is chunked or written. Fed column by column, chunk by chunk."""

    def __init__(self):
        # one hash per column and part (lengths, values), so that how the column is chunked does not matter
        self._parts: dict[tuple[str, str], hashlib.blake2b] = {}

    def _feed(self, name: str, part: str, data) -> None:
        self._parts.setdefault((name, part), hashlib.blake2b(digest_size=16)).update(data)

    def update(self, name: str, values: pa.Array | pa.ChunkedArray) -> None:
        for arr in values.chunks if isinstance(values, pa.ChunkedArray) else [values]:
            if pa.types.is_list(arr.type):
                self._feed(name, "lengths", np.asarray(pc.list_value_length(arr).fill_null(-1), np.int64).tobytes())
                arr = pc.list_flatten(arr)
            if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
                self._feed(name, "lengths", np.asarray(pc.binary_length(arr).fill_null(-1), np.int64).tobytes())
                arr = arr.fill_null("").cast(pa.large_string())
                offsets = np.frombuffer(arr.buffers()[1], np.int64)[arr.offset : arr.offset + len(arr) + 1]
                if len(arr) and arr.buffers()[2] is not None:
                    self._feed(name, "values", memoryview(arr.buffers()[2])[offsets[0] : offsets[-1]])
            else:
                self._feed(name, "values", np.ascontiguousarray(arr.to_numpy(zero_copy_only=False)).tobytes())

    def update_table(self, table: pa.Table) -> None:
        for name in _FINGERPRINTED:
            if name in table.column_names:
                self.update(name, table.column(name))

    def hexdigest(self) -> str:
        total = hashlib.blake2b(digest_size=16)
        for key in sorted(self._parts):
            total.update(self._parts[key].digest())
        return total.hexdigest()


def trace_fingerprint(table: pa.Table) -> str:
    fp = Fingerprint()
    fp.update_table(table)
    return fp.hexdigest()


# The per-request columns a replay keeps (block counts aside); the rest is only validated.
KEPT_COLUMNS = (
    "request_id",
    "arrival_s",
    "input_tokens",
    "output_tokens",
    "workload",
    "tenant",
    "priority",
    "mm_items",
    "cache_salt",
    "lora",
)


@dataclass
class ScannedTrace:
    """A validated trace without its block ids in memory."""

    path: Path
    meta: TraceMeta
    requests: pa.Table  # KEPT_COLUMNS, cast to the schema
    n_blocks: np.ndarray  # int64[n]
    infinite_hits: np.ndarray  # int64[n]: hit blocks with an unbounded cache (prefix rule)
    unique_blocks: int
    fingerprint: str
    chunk_refs: int  # most block references in one chunk of `chunks()`
    chunk_rows: int = ROW_GROUP_SIZE

    def chunks(self, columns: list[str], blocks: bool = True) -> Iterator[pa.RecordBatch]:
        """block_hashes (unless `blocks` is False) and the other `columns` the trace has, in row order, chunk
        by chunk."""
        names = set(_open(self.path).schema_arrow.names)
        wanted = (["block_hashes"] if blocks else []) + [c for c in columns if c in names]
        for batch in iter_batches(self.path, columns=wanted, batch_size=self.chunk_rows):
            col = batch.column("block_hashes") if blocks else None
            if col is not None and not col.type.equals(_BLOCKS_TYPE):  # validated castable
                batch = batch.set_column(
                    batch.schema.get_field_index("block_hashes"), "block_hashes", col.cast(_BLOCKS_TYPE)
                )
            yield batch


def _rows_of(path, column: str, rows: np.ndarray) -> list:
    """Values of `column` at `rows` (sorted), read chunk by chunk."""
    out, start = [], 0
    for batch in iter_batches(path, columns=[column]):
        stop = start + batch.num_rows
        local = rows[(rows >= start) & (rows < stop)] - start
        out.extend(batch.column(0).take(pa.array(local)).to_pylist())
        start = stop
    return out


def scan_trace(path: str | Path, tmpdir=None, chunk_rows: int = ROW_GROUP_SIZE) -> ScannedTrace:
    """Validate and summarise a trace in one pass, chunk by chunk (raises ValidationFailed). Memory: one
    chunk, the kept per-request columns, and the cross-row references (ids and dependencies)."""
    from .outofcore import InfiniteCacheStream

    path = Path(path)
    meta, rows = read_meta(path), _open(path).metadata.num_rows
    report = ValidationReport(source=str(path), rows=rows)
    if rows == 0:
        report.add_file("request_id", "trace has no requests")
        raise ValidationFailed(report)
    fingerprint = Fingerprint()
    kept, lengths, refs, chunk_refs, last_arrival = [], [], [], 0, None
    with InfiniteCacheStream(tmpdir=tmpdir) as stream:
        start = 0
        for batch in iter_batches(path, batch_size=chunk_rows):
            typed = check_rows(pa.Table.from_batches([batch]), meta.block_size, report, first_row=start)
            if typed is not None:
                arrival = typed.column("arrival_s")
                if last_arrival is not None and len(arrival) and arrival[0].as_py() < last_arrival:
                    report.add("arrival_s", "arrivals must be non-decreasing (sort the trace by arrival)", [0])
                last_arrival = arrival[-1].as_py() if len(arrival) else last_arrival
                hashes = typed.column("block_hashes")
                lengths.append(block_lengths(hashes))
                chunk_refs = max(chunk_refs, int(np.maximum(lengths[-1], 0).sum()))
                fingerprint.update_table(typed)
                refs.append(References.of(typed, start))
                if report.ok:  # (an invalid trace is reported, never replayed: stop collecting for it)
                    stream.add(hashes.fill_null(pa.scalar([], _BLOCKS_TYPE)).combine_chunks())
                    kept.append(typed.select(list(KEPT_COLUMNS)).combine_chunks())
            start += batch.num_rows
        if len(refs) == -(-rows // chunk_rows):  # every chunk could be read as the schema's types
            check_across_rows(References.concat(refs), report, lambda r: _rows_of(path, "request_id", r))
        if not report.ok:
            raise ValidationFailed(report)
        hits, unique = stream.finish()
    requests = pa.concat_tables(kept)  # chunked: combining would copy every column at once
    if requests.column("mm_items").null_count == requests.num_rows:  # 8 bytes a row of nothing
        requests = requests.drop_columns(["mm_items"])
    n_blocks = np.concatenate(lengths)
    return ScannedTrace(path, meta, requests, n_blocks, hits, unique, fingerprint.hexdigest(), chunk_refs, chunk_rows)
