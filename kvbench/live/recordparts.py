"""Crash-safe storage of a recording (`kvbench trace record`). A Parquet file is readable only once its footer
is written, so the rows are committed as numbered part files in `OUT.parts/`, each written whole under a
temporary name, fsynced and renamed (`kvbench.run.resultparts.write_durably`): a proxy killed at any moment
keeps every part committed before. `finish` turns the parts into the trace OUT (sorted by arrival, since a
row is committed when its answer ends, validated by `TraceWriter`) and removes them; after a kill,
`kvbench trace record --finish --out OUT` does the same.

Beside the schema's columns a recording keeps two of its own: `recorded_cached_tokens` (the server's
usage.prompt_tokens_details.cached_tokens, null when it did not say) and `recorded_status` (ok, http NNN,
cut, upstream unreachable), which replays ignore and which let a replay be compared with what was seen."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvbench.errors import KvbenchError
from kvbench.run.resultparts import fsync_dir, write_durably
from kvbench.trace.files import new_meta
from kvbench.trace.schema import TRACE_SCHEMA, conform
from kvbench.trace.writer import TraceWriter

EXTRA = pa.schema([pa.field("recorded_cached_tokens", pa.int32()), pa.field("recorded_status", pa.string())])
META_KEY = b"kvbench.recording"  # each part carries the recording's block size and source


def parts_folder(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def list_parts(out: Path) -> list[Path]:
    """Whole parts, oldest first; a torn temporary file (a kill during a write) is not one."""
    folder = parts_folder(out)
    return sorted(folder.glob("part-*.parquet")) if folder.is_dir() else []


def rows_table(rows: list[dict], block_size: int, source: dict) -> pa.Table:
    """Rows as a table of the trace schema plus the recording's columns, every part with the same schema."""
    fields = [EXTRA.field(k) if k in EXTRA.names else TRACE_SCHEMA.field(k) for k in rows[0]]
    # typed up front: block ids are uint64, which inference from Python ints would overflow; dictionary
    # columns are built as text and encoded by `conform`
    fields = [pa.field(f.name, pa.string()) if pa.types.is_dictionary(f.type) else f for f in fields]
    table = conform(pa.Table.from_pylist(rows, schema=pa.schema(fields)))
    meta = {META_KEY: json.dumps({"block_size": block_size, "source": source}).encode()}
    return table.replace_schema_metadata(meta)


class RecordParts:
    """Rows added from the event loop, committed as a part by `commit` (called from a worker thread)."""

    def __init__(self, out: Path, block_size: int, source: dict):
        self.out, self.block_size, self.source = out, block_size, source
        self.folder = parts_folder(out)
        if list_parts(out):
            raise KvbenchError(
                f"{self.folder} holds an interrupted recording: write its trace with `kvbench trace record "
                f"--finish --out {out}`, or remove the folder"
            )
        self._rows: list[dict] = []
        self._lock = threading.Lock()  # the periodic commit and the last one may overlap at shutdown
        self.number = 0
        self.committed = 0

    def add(self, row: dict) -> None:
        self._rows.append(row)

    def commit(self) -> None:
        with self._lock:
            rows, self._rows = self._rows, []  # one swap: rows added meanwhile go to the next part
            if rows:
                self._write(rows)

    def _write(self, rows: list[dict]) -> None:
        if not self.folder.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.folder.parent)
        table = rows_table(rows, self.block_size, self.source)
        write_durably([table], table.schema, self.folder / f"part-{self.number:06d}.parquet", "lz4")
        self.number += 1
        self.committed += len(rows)


def finish(out: Path) -> int:
    """Write the trace OUT from the committed parts and remove them; returns its row count."""
    parts = list_parts(out)
    if not parts:
        raise KvbenchError(
            f"nothing was recorded into {out}: no request to /v1/completions or /v1/chat/completions came "
            "through the proxy (point the client's base URL at it)"
        )
    tables = [pq.read_table(p) for p in parts]  # a recording's rows are small: ids and counts, no text
    recording = json.loads(tables[0].schema.metadata[META_KEY])
    table = pa.concat_tables([t.replace_schema_metadata(None) for t in tables])
    table = table.sort_by([("arrival_s", "ascending")])
    if "parent_id" in table.column_names:
        # a parent whose prompt could not be tokenized was forwarded but not recorded: its child starts afresh
        parent = table.column("parent_id")
        recorded = pc.is_in(parent, value_set=table.column("request_id").combine_chunks())
        table = table.set_column(
            table.column_names.index("parent_id"),
            "parent_id",
            pc.if_else(recorded, parent, pa.scalar(None, pa.string())),
        )
    meta = new_meta(recording["block_size"], recording["source"])
    with TraceWriter(out, meta) as writer:
        writer.write(table)
    shutil.rmtree(parts_folder(out))
    fsync_dir(out.parent)
    return table.num_rows
