"""The validating trace writer generators and importers write through: chunk by chunk, each chunk checked as it
is written, so that a bug never yields a trace file. Above `files` (the file format) and `validation` (the rules)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvbench.errors import ValidationFailed
from kvbench.trace.files import ROW_GROUP_SIZE, TraceMeta, request_ids_at
from kvbench.trace.schema import TRACE_SCHEMA, conform
from kvbench.trace.validation import ChunkedValidation


class TraceWriter:
    """Write a trace chunk by chunk, in row groups of `row_group_size` rows as `write_trace` does, to
    OUT.partial, renamed to OUT by `close()`; an error (or an invalid trace) removes the partial file. With
    `validate` (the default) every chunk is checked as it is written (`validation.ChunkedValidation`) and
    `close()` raises ValidationFailed, so a generator or importer bug never yields a file. Memory: one row
    group of buffered rows and the validation's hashed ids (8-24 bytes a request)."""

    def __init__(
        self, path: str | Path, meta: TraceMeta, *, row_group_size: int = ROW_GROUP_SIZE, validate: bool = True
    ):
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
                self._writer = pq.ParquetWriter(self._tmp, TRACE_SCHEMA.with_metadata(self.meta.to_arrow()))
            self._writer.close()
            if self._validation is not None:
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
