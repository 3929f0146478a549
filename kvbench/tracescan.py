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

from .errors import TraceFormatError, ValidationFailed
from .schema import TRACE_SCHEMA
from .traceio import TraceMeta, _open, iter_batches, read_trace
from .validate import block_lengths, validate_table

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
        self._columns = {name: hashlib.blake2b(digest_size=16) for name in _FINGERPRINTED}

    def update(self, name: str, values: pa.Array | pa.ChunkedArray) -> None:
        h = self._columns[name]
        for arr in values.chunks if isinstance(values, pa.ChunkedArray) else [values]:
            if pa.types.is_list(arr.type):
                h.update(np.asarray(pc.list_value_length(arr).fill_null(-1), dtype=np.int64).tobytes())
                arr = pc.list_flatten(arr)
            if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
                h.update(np.asarray(pc.binary_length(arr).fill_null(-1), dtype=np.int64).tobytes())
                arr = arr.fill_null("").cast(pa.large_string())
                offsets = np.frombuffer(arr.buffers()[1], np.int64)[arr.offset : arr.offset + len(arr) + 1]
                if len(arr) and arr.buffers()[2] is not None:
                    h.update(memoryview(arr.buffers()[2])[offsets[0] : offsets[-1]])
            else:
                h.update(np.ascontiguousarray(arr.to_numpy(zero_copy_only=False)).tobytes())

    def update_table(self, table: pa.Table) -> None:
        for name in _FINGERPRINTED:
            if name in table.column_names:
                self.update(name, table.column(name))

    def hexdigest(self) -> str:
        total = hashlib.blake2b(digest_size=16)
        for h in self._columns.values():
            total.update(h.digest())
        return total.hexdigest()


def trace_fingerprint(table: pa.Table) -> str:
    fp = Fingerprint()
    fp.update_table(table)
    return fp.hexdigest()


@dataclass
class ScannedTrace:
    """A validated trace without its block ids in memory."""

    path: Path
    meta: TraceMeta
    requests: pa.Table  # every column but block_hashes
    n_blocks: np.ndarray  # int64[n]
    infinite_hits: np.ndarray  # int64[n]: hit blocks with an unbounded cache (prefix rule)
    unique_blocks: int
    fingerprint: str
    chunk_refs: int  # most block references in one chunk of `chunks()`

    def chunks(self, columns: list[str]) -> Iterator[pa.RecordBatch]:
        """block_hashes (and the other `columns` the trace has) in row order, chunk by chunk."""
        present = ["block_hashes"] + [c for c in columns if c in self.requests.column_names and c != "block_hashes"]
        for batch in iter_batches(self.path, columns=present):
            yield _with_block_type(batch, self.path)


def _with_block_type(batch: pa.RecordBatch, path) -> pa.RecordBatch:
    col = batch.column("block_hashes")
    if col.type.equals(_BLOCKS_TYPE):
        return batch
    try:
        cast = col.cast(_BLOCKS_TYPE, safe=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        raise TraceFormatError(
            f"{path}: column 'block_hashes' has type {col.type}, expected {_BLOCKS_TYPE} (unsigned 64-bit block "
            "ids); re-import the trace with `kvbench trace import`"
        ) from None
    return batch.set_column(batch.schema.get_field_index("block_hashes"), "block_hashes", cast)


def scan_trace(path: str | Path, tmpdir=None) -> ScannedTrace:
    """Validate and summarise a trace in one streamed pass over its block ids; raises ValidationFailed."""
    from .outofcore import InfiniteCacheStream

    path = Path(path)
    names = [n for n in _open(path).schema_arrow.names if n != "block_hashes"]
    requests, meta = read_trace(path, columns=names)
    fingerprint = Fingerprint()
    fingerprint.update_table(requests)
    lengths, chunk_refs = [], 0
    with InfiniteCacheStream(tmpdir=tmpdir) as stream:
        for batch in iter_batches(path, columns=["block_hashes"]):
            hashes = _with_block_type(batch, path).column("block_hashes")
            lengths.append(block_lengths(hashes))
            chunk_refs = max(chunk_refs, int(np.maximum(lengths[-1], 0).sum()))
            fingerprint.update("block_hashes", hashes)
            stream.add(hashes.fill_null(pa.scalar([], _BLOCKS_TYPE)) if hashes.null_count else hashes)
        n_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        report = validate_table(requests, meta.block_size, str(path), block_lengths=n_lengths)
        if not report.ok:
            raise ValidationFailed(report)
        hits, unique = stream.finish()
    return ScannedTrace(path, meta, requests, n_lengths, hits, unique, fingerprint.hexdigest(), chunk_refs)
