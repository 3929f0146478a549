"""Reading and writing trace files (Parquet, zstd, row groups sized for streaming). The lowest layer of the
trace files: it checks the file and its metadata, not the rows (`validation`; `writer.TraceWriter` writes a trace
chunk by chunk and validates it as it goes)."""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvbench.errors import TraceFormatError
from kvbench.trace.schema import (
    META_BLOCK_SIZE,
    META_CREATED,
    META_SOURCE,
    META_VERSION,
    SCHEMA_VERSION,
    conform,
)

# ~64K requests per row group keeps a group at a few MB, small enough to stream, large enough to compress well.
ROW_GROUP_SIZE = 65_536


@dataclass(frozen=True)
class TraceMeta:
    block_size: int
    source: dict
    created: str
    schema_version: str = SCHEMA_VERSION

    def to_arrow(self) -> dict[bytes, bytes]:
        return {
            META_VERSION.encode(): self.schema_version.encode(),
            META_BLOCK_SIZE.encode(): str(self.block_size).encode(),
            META_SOURCE.encode(): json.dumps(self.source, sort_keys=True).encode(),
            META_CREATED.encode(): self.created.encode(),
        }

    @classmethod
    def from_arrow(cls, metadata: dict[bytes, bytes] | None, path: str | Path) -> TraceMeta:
        md = {k.decode(): v.decode() for k, v in (metadata or {}).items()}
        if META_VERSION not in md or META_BLOCK_SIZE not in md:
            raise TraceFormatError(
                f"{path}: not a kvbench trace (file metadata lacks {META_VERSION}/{META_BLOCK_SIZE}); "
                "convert it with `kvbench trace import`"
            )
        if md[META_VERSION] != SCHEMA_VERSION:
            raise TraceFormatError(
                f"{path}: trace schema version {md[META_VERSION]!r} is not supported "
                f"(this kvbench reads version {SCHEMA_VERSION})"
            )
        try:
            block_size = int(md[META_BLOCK_SIZE])
        except ValueError:
            value = md[META_BLOCK_SIZE]
            raise TraceFormatError(f"{path}: metadata {META_BLOCK_SIZE}={value!r} is not an integer") from None
        if block_size <= 0:
            raise TraceFormatError(f"{path}: metadata {META_BLOCK_SIZE}={block_size} must be > 0")
        try:
            source = json.loads(md.get(META_SOURCE, "{}"))
        except json.JSONDecodeError:
            source = {"raw": md.get(META_SOURCE)}
        return cls(block_size=block_size, source=source, created=md.get(META_CREATED, ""))


def new_meta(block_size: int, source: dict) -> TraceMeta:
    created = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    return TraceMeta(block_size=block_size, source=source, created=created)


def write_trace(table: pa.Table, path: str | Path, meta: TraceMeta, row_group_size: int = ROW_GROUP_SIZE) -> Path:
    """Write `table` (conformed to the v1 schema) with `meta` as file metadata. Returns the path."""
    path = Path(path)
    table = conform(table)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta.to_arrow()})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    try:
        pq.write_table(table, tmp, compression="zstd", row_group_size=row_group_size)
    except BaseException:  # an error, Ctrl-C, SIGTERM (raised as Ctrl-C by the CLI): no partial file is left
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)  # a crash never leaves a half-written trace under the final name
    return path


def open_parquet(path: str | Path) -> pq.ParquetFile:
    """The Parquet file at `path` (its trace metadata not checked: see `read_meta`); TraceFormatError when it is
    missing, empty or not Parquet."""
    path = Path(path)
    if not path.exists():
        raise TraceFormatError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise TraceFormatError(f"{path}: file is empty")
    try:
        # pre_buffer=False: with pre-buffering, pyarrow keeps the compressed bytes of every row group read
        # so far while iterating batches, so memory grows with the trace (measured: 155 MB after 122 groups)
        return pq.ParquetFile(path, pre_buffer=False)
    except (pa.ArrowInvalid, OSError) as exc:
        raise TraceFormatError(f"{path}: not a readable Parquet file ({exc}); was it truncated?") from None


def read_meta(path: str | Path) -> TraceMeta:
    return TraceMeta.from_arrow(open_parquet(path).schema_arrow.metadata, path)


def read_trace(path: str | Path, columns: list[str] | None = None) -> tuple[pa.Table, TraceMeta]:
    """Read a whole trace. Does not validate: call `kvbench.trace.validation.check` before replaying."""
    pf = open_parquet(path)
    meta = TraceMeta.from_arrow(pf.schema_arrow.metadata, path)
    try:
        # One row group at a time, handing Arrow's decoding buffers back to the allocator after each: read whole,
        # the decoder's transient buffers held 2.2x the table at the peak (a 300k-request chat trace: 526 MB
        # for a 163 MB table; by row group 251 MB). docs/architecture.md, Memory.
        pool = pa.default_memory_pool()
        groups = []
        for i in range(pf.num_row_groups):
            groups.append(pf.read_row_group(i, columns=columns))
            pool.release_unused()
        table = pa.concat_tables(groups) if groups else pf.read(columns=columns)
    except (pa.ArrowInvalid, OSError) as exc:
        raise TraceFormatError(f"{path}: Parquet data is corrupt ({exc}); was it truncated?") from None
    return table, meta


def iter_batches(
    path: str | Path, columns: list[str] | None = None, batch_size: int = ROW_GROUP_SIZE
) -> Iterator[pa.RecordBatch]:
    """Stream a trace in record batches, so that traces larger than memory can be scanned."""
    pf = open_parquet(path)
    TraceMeta.from_arrow(pf.schema_arrow.metadata, path)
    try:
        yield from pf.iter_batches(batch_size=batch_size, columns=columns)
    except (pa.ArrowInvalid, OSError) as exc:
        raise TraceFormatError(f"{path}: Parquet data is corrupt ({exc}); was it truncated?") from None


def column_at_rows(path, column: str, rows: np.ndarray) -> list:
    """Values of `column` at `rows` (sorted) of a Parquet file, read chunk by chunk."""
    out, start = [], 0
    # (a plain ParquetFile: the file may still be a .partial without trace metadata checks passing)
    for batch in open_parquet(path).iter_batches(columns=[column], batch_size=ROW_GROUP_SIZE):
        stop = start + batch.num_rows
        local = rows[(rows >= start) & (rows < stop)] - start
        out.extend(batch.column(0).take(pa.array(local)).to_pylist())
        start = stop
    return out


def request_ids_at(path, rows: np.ndarray) -> list:
    """request_id of a trace file at `rows` (sorted), read chunk by chunk: the text behind hashed ids."""
    return column_at_rows(path, "request_id", rows)
