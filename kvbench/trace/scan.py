"""What a replay needs from a trace file, in bounded memory: one pass over the block ids by row group.

A trace's block ids are almost all of its bytes (tens of ids per request); everything else is a few tens of
bytes per request, still too much to keep for a trace of any length. `scan_trace` streams the trace once to
validate it, count and fingerprint its blocks, name its tenants and compute the infinite-cache bound (spilled
to disk, `outofcore.InfiniteCacheStream`), and keeps only those totals. A streamed replay then reads the trace
again, chunk by chunk (`ScannedTrace.chunks`)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvbench.errors import ValidationFailed
from kvbench.trace.compute import call, cast, fill_null, pc
from kvbench.trace.files import ROW_GROUP_SIZE, TraceMeta, iter_batches, open_parquet, read_meta, request_ids_at
from kvbench.trace.hitsums import NO_LABEL, HitSums
from kvbench.trace.outofcore import GrowingArray, InfiniteCacheStream
from kvbench.trace.schema import TRACE_SCHEMA
from kvbench.trace.stats import DEFAULT_WARMUP
from kvbench.trace.summary import COLUMNS, TraceSummary
from kvbench.trace.validation import ChunkedValidation, ValidationReport, block_lengths

# Above this many block references a replay streams the trace (about 0.5 GB of block ids in memory).
STREAM_BLOCK_REFS = 60_000_000
_FINGERPRINTED = ("request_id", "arrival_s", "input_tokens", "output_tokens", "block_hashes")
_BLOCKS_TYPE = TRACE_SCHEMA.field("block_hashes").type


def block_references(path: str | Path) -> int:
    """Block references in a trace, from the Parquet footer (no data read)."""
    md = open_parquet(path).metadata
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
                # (`call` and the others, not Arrow's methods: those import pyarrow.compute, 70-120 ms)
                lengths = fill_null(call("list_value_length", arr), -1)
                self._feed(name, "lengths", np.asarray(lengths, np.int64).tobytes())
                arr = call("list_flatten", arr)
            if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
                self._feed(name, "lengths", np.asarray(fill_null(call("binary_length", arr), -1), np.int64).tobytes())
                arr = cast(fill_null(arr, ""), pa.large_string())
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


# The per-request columns a replay reads with the block ids, chunk by chunk: results, metrics, isolation
# (cache_salt, lora) and what policies look at. Everything else is only validated.
REPLAY_COLUMNS = (
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
    """A validated trace with nothing per request in memory: the counts and names that size a streamed
    replay and fill its summary, and `chunks()` to read the trace again. `scan_trace(keep_hits=True)`
    (trace info) also keeps the infinite cache's hit blocks per request."""

    path: Path
    meta: TraceMeta
    n_requests: int
    block_references: int
    longest: int  # most blocks in one request
    chunk_refs: int  # most block references in one chunk of `chunks()`
    tenant_names: list[str]  # distinct tenants (NO_LABEL for a null) in order of first appearance
    filled: frozenset[str]  # the REPLAY_COLUMNS with at least one value
    infinite_cache: dict  # `stats.hit_rates` of an unbounded cache (prefix rule), at the scan's warm-up
    unique_blocks: int
    fingerprint: str
    chunk_rows: int = ROW_GROUP_SIZE
    infinite_hits: np.ndarray | None = None  # int32[n]: hit blocks with an unbounded cache (keep_hits only)

    def chunks(self, columns=REPLAY_COLUMNS, blocks: bool = True) -> Iterator[pa.RecordBatch]:
        """block_hashes (unless `blocks` is False) and the other `columns` the trace has, cast to the schema's
        types (validated castable), in row order, chunk by chunk."""
        names = set(open_parquet(self.path).schema_arrow.names)
        wanted = (["block_hashes"] if blocks else []) + [c for c in columns if c in names]
        for batch in iter_batches(self.path, columns=wanted, batch_size=self.chunk_rows):
            for i, f in enumerate(batch.schema):
                typ = TRACE_SCHEMA.field(f.name).type
                if not f.type.equals(typ):
                    batch = batch.set_column(i, pa.field(f.name, typ), batch.column(i).cast(typ))
            yield batch


class _Names:
    """Distinct tenants in order of first appearance, and which replay columns have values, chunk by chunk."""

    def __init__(self):
        self.tenants: dict[str, None] = {}  # (a dict keeps insertion order)
        self.filled: set[str] = set()

    def add(self, typed: pa.Table) -> None:
        tenant = typed.column("tenant").cast(pa.string()).fill_null(NO_LABEL)
        self.tenants.update(dict.fromkeys(pc.unique(tenant).to_pylist()))
        self.filled.update(c for c in REPLAY_COLUMNS if typed.column(c).null_count < typed.num_rows)


def scan_trace(
    path: str | Path,
    tmpdir=None,
    chunk_rows: int = ROW_GROUP_SIZE,
    *,
    warmup: float = DEFAULT_WARMUP,
    keep_hits: bool = False,
) -> ScannedTrace:
    """Validate and summarise a trace in one pass, chunk by chunk (raises ValidationFailed). Memory: one
    chunk, the hashed cross-row references while validating (`validation.ChunkedValidation`, 8-24 bytes a
    request), and 12 bytes a request while the infinite-cache bound (at `warmup`) is resolved; `keep_hits`
    keeps its hit blocks per request (4 bytes a request), for trace info."""
    path = Path(path)
    meta = read_meta(path)
    validation = ChunkedValidation(meta.block_size, str(path))
    fingerprint, names, tokens = Fingerprint(), _Names(), GrowingArray(np.int32)
    chunk_refs = longest = total_refs = 0
    with InfiniteCacheStream(tmpdir=tmpdir) as stream:
        for batch in iter_batches(path, batch_size=chunk_rows):
            typed = validation.add(pa.Table.from_batches([batch]))
            if typed is None:
                continue
            hashes = typed.column("block_hashes")
            lengths = np.maximum(block_lengths(hashes), 0)
            chunk_refs, total_refs = max(chunk_refs, int(lengths.sum())), total_refs + int(lengths.sum())
            longest = max(longest, int(lengths.max(initial=0)))
            fingerprint.update_table(typed)
            if validation.report.ok:  # (an invalid trace is reported, never replayed: stop collecting for it)
                stream.add(hashes.fill_null(pa.scalar([], _BLOCKS_TYPE)).combine_chunks())
                tokens.extend(typed.column("input_tokens").to_numpy())
                names.add(typed)
        report = validation.finish(lambda r: request_ids_at(path, r))
        if not report.ok:
            raise ValidationFailed(report)
        hits, unique = stream.finish(dtype=np.int32)
    rows = report.rows
    infinite = _infinite_cache(hits, stream.n_blocks, tokens.values, meta.block_size, int(rows * warmup), warmup)
    return ScannedTrace(
        path,
        meta,
        rows,
        total_refs,
        longest,
        chunk_refs,
        list(names.tenants),
        frozenset(names.filled),
        infinite,
        unique,
        fingerprint.hexdigest(),
        chunk_rows,
        infinite_hits=hits if keep_hits else None,
    )


def trace_info_file(path, warmup: float = DEFAULT_WARMUP, tmpdir=None, chunk_rows: int | None = None) -> dict:
    """Validate the trace at `path` and return its `trace_info`, in bounded memory, reading it twice by row
    group: `scan_trace` validates it and resolves the infinite cache out of core (spilled to
    `tmpdir`), keeping its hit blocks per request (4 bytes a request); a second pass reads the light
    per-request columns (no block ids) into `summary.TraceSummary`. Raises ValidationFailed."""
    chunk_rows = chunk_rows or ROW_GROUP_SIZE
    scanned = scan_trace(path, tmpdir=tmpdir, warmup=warmup, keep_hits=True, chunk_rows=chunk_rows)
    block_size, hits = scanned.meta.block_size, scanned.infinite_hits
    summary = TraceSummary(scanned.n_requests, block_size, warmup)
    present = [c for c in COLUMNS if c in open_parquet(path).schema_arrow.names]
    start = 0
    for batch in iter_batches(path, columns=present, batch_size=chunk_rows):
        stop = start + batch.num_rows
        inp = batch.column("input_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
        n_blocks = -(-inp // block_size)  # validated: a request has ceil(input_tokens / block_size) blocks
        summary.add(batch, hits[start:stop], n_blocks)
        start = stop
    return summary.result(scanned.unique_blocks)


def validate_file(path: str | Path, chunk_rows: int = ROW_GROUP_SIZE) -> ValidationReport:
    """Every rule of the schema on a trace file, read chunk by chunk (`validation.ChunkedValidation`): the
    report `validate_table` gives on the whole table, in memory that does not hold the trace."""
    path = Path(path)
    validation = ChunkedValidation(read_meta(path).block_size, str(path))
    for batch in iter_batches(path, batch_size=chunk_rows):
        validation.add(pa.Table.from_batches([batch]))
    return validation.finish(lambda r: request_ids_at(path, r))


def _infinite_cache(hits, n_blocks, tokens: np.ndarray, block_size: int, steady_from: int, warmup) -> dict:
    """The infinite cache's hit rates, summed a row group at a time (int64 temporaries stay small)."""
    sums = HitSums(steady_from, warmup)
    for start in range(0, tokens.size, ROW_GROUP_SIZE):
        part = slice(start, start + ROW_GROUP_SIZE)
        inp, hit = tokens[part].astype(np.int64), hits[part].astype(np.int64)
        sums.add(np.minimum(hit * block_size, inp), inp, hit, n_blocks[part].astype(np.int64))
    return sums.rates()
