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
import pyarrow.compute as pc

from .errors import ValidationFailed
from .metrics import NO_LABEL, HitSums
from .schema import TRACE_SCHEMA
from .stats import DEFAULT_WARMUP
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
    replay and fill its summary, and `chunks()` to read the trace again. `scan_trace(keep_requests=True)`
    (trace info) also keeps the per-request columns and block statistics."""

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
    requests: pa.Table | None = None  # REPLAY_COLUMNS (but an empty mm_items), cast (keep_requests only)
    n_blocks: np.ndarray | None = None  # int64[n] (keep_requests only)
    infinite_hits: np.ndarray | None = None  # int64[n]: hit blocks with an unbounded cache (keep_requests only)

    def chunks(self, columns=REPLAY_COLUMNS, blocks: bool = True) -> Iterator[pa.RecordBatch]:
        """block_hashes (unless `blocks` is False) and the other `columns` the trace has, cast to the schema's
        types (validated castable), in row order, chunk by chunk."""
        names = set(_open(self.path).schema_arrow.names)
        wanted = (["block_hashes"] if blocks else []) + [c for c in columns if c in names]
        for batch in iter_batches(self.path, columns=wanted, batch_size=self.chunk_rows):
            for i, f in enumerate(batch.schema):
                typ = TRACE_SCHEMA.field(f.name).type
                if not f.type.equals(typ):
                    batch = batch.set_column(i, pa.field(f.name, typ), batch.column(i).cast(typ))
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
    keep_requests: bool = False,
) -> ScannedTrace:
    """Validate and summarise a trace in one pass, chunk by chunk (raises ValidationFailed). Memory: one
    chunk, the cross-row references (ids and dependencies, 8-24 bytes a request) while validating, and 12
    bytes a request while the infinite-cache bound (at `warmup`) is resolved; `keep_requests` keeps the
    REPLAY_COLUMNS and block statistics per request, for trace info."""
    from .outofcore import InfiniteCacheStream

    path = Path(path)
    meta, rows = read_meta(path), _open(path).metadata.num_rows
    report = ValidationReport(source=str(path), rows=rows)
    if rows == 0:
        report.add_file("request_id", "trace has no requests")
        raise ValidationFailed(report)
    fingerprint, names = Fingerprint(), _Names()
    refs, tokens, kept, last_arrival = [], [], [], None
    chunk_refs = longest = total_refs = 0
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
                lengths = np.maximum(block_lengths(hashes), 0)
                chunk_refs, total_refs = max(chunk_refs, int(lengths.sum())), total_refs + int(lengths.sum())
                longest = max(longest, int(lengths.max(initial=0)))
                fingerprint.update_table(typed)
                refs.append(References.of(typed, start))
                if report.ok:  # (an invalid trace is reported, never replayed: stop collecting for it)
                    stream.add(hashes.fill_null(pa.scalar([], _BLOCKS_TYPE)).combine_chunks())
                    tokens.append(typed.column("input_tokens").to_numpy().astype(np.int32))
                    names.add(typed)
                    if keep_requests:
                        kept.append(typed.select(list(REPLAY_COLUMNS)).combine_chunks())
            start += batch.num_rows
        if len(refs) == -(-rows // chunk_rows):  # every chunk could be read as the schema's types
            every = References.concat(refs)
            refs.clear()  # (not both the parts and their concatenation while checking)
            check_across_rows(every, report, lambda r: _rows_of(path, "request_id", r))
            del every
        refs.clear()
        if not report.ok:
            raise ValidationFailed(report)
        hits, unique = stream.finish(dtype=np.int32)
    n_blocks = stream.n_blocks
    infinite = _infinite_cache(hits, n_blocks, tokens, meta.block_size, int(rows * warmup), warmup)
    scanned = ScannedTrace(
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
    )
    if keep_requests:
        requests = pa.concat_tables(kept)  # chunked: combining would copy every column at once
        if "mm_items" not in scanned.filled:  # 8 bytes a row of nothing
            requests = requests.drop_columns(["mm_items"])
        scanned.requests = requests
        scanned.n_blocks, scanned.infinite_hits = n_blocks.astype(np.int64), hits.astype(np.int64)
    return scanned


def _infinite_cache(hits, n_blocks, tokens: list[np.ndarray], block_size: int, steady_from: int, warmup) -> dict:
    """The infinite cache's hit rates, summed one chunk of `tokens` at a time (int64 temporaries stay small)."""
    sums, start = HitSums(steady_from, warmup), 0
    for inp in tokens:
        stop = start + inp.size
        inp, hit = inp.astype(np.int64), hits[start:stop].astype(np.int64)
        sums.add(np.minimum(hit * block_size, inp), inp, hit, n_blocks[start:stop].astype(np.int64))
        start = stop
    return sums.rates()
