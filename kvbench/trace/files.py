"""Reading and writing trace files (Parquet, zstd, row groups sized for streaming)."""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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


class TraceWriter:
    """Write a trace chunk by chunk, in row groups of `row_group_size` rows as `write_trace` does, to
    OUT.partial, renamed to OUT by `close()`; an error (or an invalid trace) removes the partial file. With
    `validate` (the default) every chunk is checked as it is written (`validate.ChunkedValidation`) and
    `close()` raises ValidationFailed, so a generator or importer bug never yields a file. Memory: one row
    group of buffered rows and the validation's hashed ids (8-24 bytes a request)."""

    def __init__(
        self, path: str | Path, meta: TraceMeta, *, row_group_size: int = ROW_GROUP_SIZE, validate: bool = True
    ):
        from kvbench.trace.validation import ChunkedValidation

        self.path, self.meta, self.row_group_size = Path(path), meta, row_group_size
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(self.path.name + ".partial")
        self._validation = ChunkedValidation(meta.block_size, str(self.path)) if validate else None
        self._writer: pq.ParquetWriter | None = None
        self._buffer: list[pa.Table] = []
        self._buffered = 0
        self.rows = 0

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def write(self, table: pa.Table) -> None:
        """Append rows (any columns of the schema, in trace order); they are conformed to the schema."""
        table = conform(table)
        if self._validation is not None:
            self._validation.add(table)
        self._buffer.append(table)
        self._buffered += table.num_rows
        self.rows += table.num_rows
        if self._buffered >= self.row_group_size:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        if not self._buffer:
            return
        rows = pa.concat_tables(self._buffer)
        keep = rows.num_rows if final else rows.num_rows // self.row_group_size * self.row_group_size
        if self._writer is None:
            schema = rows.schema.with_metadata({**(rows.schema.metadata or {}), **self.meta.to_arrow()})
            self._writer = pq.ParquetWriter(self._tmp, schema, compression="zstd")
        self._writer.write_table(rows.slice(0, keep), row_group_size=self.row_group_size)
        rest = rows.slice(keep)
        self._buffer, self._buffered = ([rest] if rest.num_rows else []), rest.num_rows

    def close(self) -> Path:
        """Write what is buffered, check the rules across rows, and move the file to its name."""
        try:
            self._flush(final=True)
            if self._writer is None:  # no rows: an empty file with the schema, which validation refuses
                from kvbench.trace.schema import TRACE_SCHEMA

                self._writer = pq.ParquetWriter(self._tmp, TRACE_SCHEMA.with_metadata(self.meta.to_arrow()))
            self._writer.close()
            if self._validation is not None:
                from kvbench.errors import ValidationFailed
                from kvbench.trace.scan import request_ids_at

                report = self._validation.finish(lambda rows: request_ids_at(self._tmp, rows))
                if not report.ok:
                    raise ValidationFailed(report)
        except BaseException:
            self.abort()
            raise
        self._tmp.replace(self.path)  # a crash never leaves a half-written trace under the final name
        return self.path

    def abort(self) -> None:
        """Drop everything written so far (on an error, Ctrl-C or SIGTERM, which the CLI raises as Ctrl-C)."""
        try:
            if self._writer is not None:
                self._writer.close()
        finally:
            self._tmp.unlink(missing_ok=True)


def _open(path: str | Path) -> pq.ParquetFile:
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
    return TraceMeta.from_arrow(_open(path).schema_arrow.metadata, path)


def read_trace(path: str | Path, columns: list[str] | None = None) -> tuple[pa.Table, TraceMeta]:
    """Read a whole trace. Does not validate: call `kvbench.trace.validation.check` before replaying."""
    pf = _open(path)
    meta = TraceMeta.from_arrow(pf.schema_arrow.metadata, path)
    try:
        table = pf.read(columns=columns)
    except (pa.ArrowInvalid, OSError) as exc:
        raise TraceFormatError(f"{path}: Parquet data is corrupt ({exc}); was it truncated?") from None
    return table, meta


def iter_batches(
    path: str | Path, columns: list[str] | None = None, batch_size: int = ROW_GROUP_SIZE
) -> Iterator[pa.RecordBatch]:
    """Stream a trace in record batches, so that traces larger than memory can be scanned."""
    pf = _open(path)
    TraceMeta.from_arrow(pf.schema_arrow.metadata, path)
    try:
        yield from pf.iter_batches(batch_size=batch_size, columns=columns)
    except (pa.ArrowInvalid, OSError) as exc:
        raise TraceFormatError(f"{path}: Parquet data is corrupt ({exc}); was it truncated?") from None
