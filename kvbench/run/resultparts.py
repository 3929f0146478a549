"""Durable pieces of a run's results. A Parquet file is readable only once its footer is written, so a run
killed while appending to requests.parquet would lose everything; instead each flush of answers becomes one
complete part file, `requests.parts/part-NNNNNN.parquet`, written under a temporary name, fsynced and renamed
into place (then the directory fsynced). A part that exists under its final name is therefore always whole,
and a kill (SIGKILL, power loss) at any moment loses only the answers not yet flushed. When the run ends (or
is interrupted) the parts are merged into requests.parquet, again through a temporary file and a rename, and
removed; a reader finds requests.parquet alone, or, after a kill, requests.parquet (if any) and the parts.

Order matters to readers: requests.parquet holds the oldest rows, then parts in number order, a later row
superseding an earlier one of the same (point, request_id) (`results.read_requests`). The only moment both
hold the same rows is between merging and removing the parts, when they hold identical copies."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

PARTS_DIR = "requests.parts"  # next to requests.parquet
TEMP_SUFFIX = ".tmp"  # a file being written: never read, removed by the next writer
COMPRESSION = "zstd"  # of requests.parquet
PART_COMPRESSION = "lz4"  # of the parts, read once by the merge: cheaper to write and to read back


def parts_dir(results_path: Path) -> Path:
    return results_path.with_name(PARTS_DIR)


def list_parts(results_path: Path) -> list[Path]:
    """The complete parts next to `results_path`, oldest first (torn temporary files are not listed)."""
    folder = parts_dir(results_path)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("part-*.parquet") if p.name[5:-8].isdigit())


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (POSIX: the new entry lives in the directory, not the file)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without directory handles (Windows): renames are durable there already
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(
    batches: Iterable[pa.Table | pa.RecordBatch], schema: pa.Schema, path: Path, compression: str = COMPRESSION
) -> int:
    """Write `batches` as the Parquet file `path`, which appears whole or not at all; returns the row count.
    The temporary file is removed if writing fails or is interrupted (Ctrl-C)."""
    tmp = path.with_name(path.name + TEMP_SUFFIX)
    rows = 0
    try:
        with pq.ParquetWriter(tmp, schema, compression=compression) as writer:
            for batch in batches:
                table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
                writer.write_table(table)
                rows += table.num_rows
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return rows


class PartWriter:
    """Adds numbered parts to `requests.parts/` next to `results_path`, each durable when `write` returns."""

    def __init__(self, results_path: Path, schema: pa.Schema):
        self.folder, self.schema = parts_dir(results_path), schema
        existing = list_parts(results_path)
        self.next_number = int(existing[-1].name[5:-8]) + 1 if existing else 0
        self.rows = 0

    def write(self, table: pa.Table) -> Path:
        if not self.folder.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.folder.parent)
        path = self.folder / f"part-{self.next_number:06d}.parquet"
        self.next_number += 1
        self.rows += write_durably([table], self.schema, path, PART_COMPRESSION)
        return path


def remove_parts(results_path: Path) -> None:
    """Drop the parts (once requests.parquet holds their rows) and any torn temporary file."""
    folder = parts_dir(results_path)
    if folder.exists():
        shutil.rmtree(folder)
        fsync_dir(folder.parent)


def merge_parts(results_path: Path, schema: pa.Schema) -> None:
    """Fold requests.parquet (if any) and the parts, in that order, into a new requests.parquet, then remove
    the parts. Streams one file at a time (bounded memory, however many rows); the caller guarantees that
    no two of them hold the same request (a writer's own parts never do)."""
    parts = list_parts(results_path)
    if not parts and results_path.exists():
        remove_parts(results_path)  # only torn temporary files, if anything
        return
    sources = ([results_path] if results_path.exists() else []) + parts

    def batches():
        for source in sources:
            yield from pq.ParquetFile(source).iter_batches(batch_size=1 << 16)

    write_durably(batches(), schema, results_path)  # read whole before the new file takes its name
    remove_parts(results_path)
