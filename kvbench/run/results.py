"""Per-request result records (requests.parquet), written in durable parts as they are answered so that an
interrupted or killed run keeps what it measured (`resultparts`), and read back by `read_requests`, the one
reader every command uses. One schema for every backend; a backend leaves the columns it does not measure
null."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvbench.errors import KvbenchError
from kvbench.run.backend import PointResult
from kvbench.run.resultparts import PartWriter, list_parts, merge_parts, remove_parts, write_durably
from kvbench.trace.compute import pc, to_text

REQUESTS_FILE = "requests.parquet"

RESULT_SCHEMA = pa.schema(
    [
        pa.field("point", pa.string()),  # configuration point, e.g. "lru/10000blocks" (run.pointnames)
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


WRITE_ROWS = 1 << 20
BUFFER_ROWS = WRITE_ROWS  # rows an offline run holds before a commit, whatever the time: one chunk's memory


class ResultWriter:
    """Records rows as they are answered (a point's rows in row order, in one or more calls) as durable parts
    next to requests.parquet; `close()` (also on interruption) merges them into it. A point interrupted
    part-way keeps the rows it wrote; summary.json lists the points that finished. `base`: rows a resumed run
    keeps, which replace what the previous run left (made durable before it is dropped).

    `commit_every_s` 0 (live runs) makes every `write` durable on return. Above 0 (offline runs, whose points
    come fast) rows are held until `commit()`, which the caller makes when `commit_due()` (that long since the
    last one, or BUFFER_ROWS held), and then records the points the rows belong to: a run killed meanwhile
    loses at most that long of work, and a run shorter than that writes requests.parquet once, without parts
    and merge (which were half of a fast simulation's time)."""

    def __init__(self, path: Path, base: pa.Table | None = None, commit_every_s: float = 0.0):
        self.path, self.commit_every_s = path, commit_every_s
        write_durably([] if base is None else [base], RESULT_SCHEMA, path)
        remove_parts(path)  # an earlier run's parts: `base` holds what is kept of them
        self._parts = PartWriter(path, RESULT_SCHEMA)
        self._base_rows = 0 if base is None else base.num_rows
        self._held: list[pa.Table] = []
        self._held_rows = 0
        self._last_commit = time.monotonic()

    def write(self, trace: pa.Table | pa.RecordBatch, point: PointResult) -> None:
        """Record `point`'s answers to the requests of `trace` (its request_id, tenant, workload, input_tokens
        and output_tokens are copied; `point.columns` aligned with its rows), built WRITE_ROWS rows at a time,
        never all at once; durable on return unless rows are held (`commit_every_s`)."""
        for rows in self.rows(trace, point):
            if self.commit_every_s <= 0:
                self._parts.write(rows)
                continue
            self._held.append(rows)
            self._held_rows += rows.num_rows
            if self._held_rows >= BUFFER_ROWS:  # bounded memory, whatever the time
                self.commit()

    def commit_due(self) -> bool:
        """Whether the caller should `commit()` now (and then record the points whose rows it made durable)."""
        return self.commit_every_s <= 0 or time.monotonic() - self._last_commit >= self.commit_every_s

    def commit(self) -> None:
        """Make the held rows durable (one part)."""
        if self._held:
            self._parts.write(pa.concat_tables(self._held))
            self._held, self._held_rows = [], 0
        self._last_commit = time.monotonic()

    def rows(self, trace: pa.Table | pa.RecordBatch, point: PointResult):
        """The result rows of `point`'s answers to `trace`, WRITE_ROWS at a time."""
        if isinstance(trace, pa.RecordBatch):
            trace = pa.Table.from_batches([trace])
        start = 0
        for batch in trace.to_batches(max_chunksize=WRITE_ROWS):
            yield _rows(pa.Table.from_batches([batch]), point, start)
            start += batch.num_rows

    def close(self) -> None:
        if self._held and not self._base_rows and not list_parts(self.path):
            # everything is held: one write, no merge, one row group (each point its own took twice as long:
            # 130 against 61 ms for 16 points of 12k requests, half of an 8-capacity Mooncake run's work)
            write_durably([pa.concat_tables(self._held)], RESULT_SCHEMA, self.path)
            self._held, self._held_rows = [], 0
            return
        self.commit()
        merge_parts(self.path, RESULT_SCHEMA)


def _rows(trace: pa.Table, point: PointResult, start: int) -> pa.Table:
    n = trace.num_rows
    arrays = {
        "point": pa.repeat(pa.scalar(point.name, pa.string()), n),
        "request_id": trace.column("request_id"),
        "tenant": to_text(trace.column("tenant")),
        "workload": to_text(trace.column("workload")),
        "input_tokens": trace.column("input_tokens"),
        "output_tokens": trace.column("output_tokens"),
    }
    for f in RESULT_SCHEMA:
        if f.name in arrays:
            continue
        values = point.columns.get(f.name)
        arrays[f.name] = pa.nulls(n, f.type) if values is None else _arrow(values[start : start + n], f.type)
    return pa.table(arrays, schema=RESULT_SCHEMA)


def _arrow(values, typ: pa.DataType) -> pa.Array:
    """`values` as an Arrow array of `typ`, refused where Arrow's safe cast refuses. An integer NumPy array is
    handed over by its buffer: `pa.array` imports numpy.ma (15 ms of a 0.5 s simulator run) to ask whether an
    array is masked."""
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in "iu" and pa.types.is_integer(typ):
        want = np.dtype(typ.to_pandas_dtype())
        fits = values.dtype == want or not values.size
        if not fits:
            info = np.iinfo(want)
            fits = info.min <= values.min() and values.max() <= info.max
        if fits:
            data = np.ascontiguousarray(values, dtype=want)
            return pa.Array.from_buffers(typ, data.size, [None, pa.py_buffer(data)])
    return pa.array(values).cast(typ)


def result_rows(trace: pa.Table, point: PointResult) -> pa.Table:
    """All result rows of `point`'s answers to `trace`, in memory (a resumed live run's kept rows)."""
    return _rows(trace, point, 0)


# --- reading ----------------------------------------------------------------------------------------------

KEY = ["point", "request_id"]  # a row supersedes an earlier one with the same key (resume, merge)


class ResultsUnreadable(KvbenchError, ValueError):
    """A run's results that are missing or not Parquet, the file named."""


def result_files(run_dir: Path) -> list[Path]:
    """The files holding a run's rows, oldest first: requests.parquet (if any), then parts a killed run left."""
    path = Path(run_dir) / REQUESTS_FILE
    return ([path] if path.exists() else []) + list_parts(path)


def _open(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except FileNotFoundError:
        raise ResultsUnreadable(f"{path}: no such file (the run recorded no results)") from None
    except (pa.ArrowException, OSError) as exc:
        raise ResultsUnreadable(
            f"{path}: not a readable Parquet file ({exc}); a run killed while kvbench still appended to "
            "one file (before results were written in parts) leaves it so, its rows lost"
        ) from None


def requests_schema(run_dir: Path) -> pa.Schema:
    files = result_files(run_dir) or [Path(run_dir) / REQUESTS_FILE]
    return _open(files[0]).schema_arrow


def read_requests(run_dir: Path, columns: list[str] | None = None, max_rows: int | None = None) -> pa.Table:
    """A run's result rows (`columns` of them; the first `max_rows`), from requests.parquet or, after a
    kill, from it and the parts the run left, each request once (its latest row). Raises ResultsUnreadable,
    naming the file, when there are none or one is not Parquet."""
    return _read(run_dir, columns, max_rows)


def _read(run_dir: Path, columns: list[str] | None, max_rows: int | None) -> pa.Table:
    files = result_files(run_dir) or [Path(run_dir) / REQUESTS_FILE]
    if len(files) == 1:
        f = _open(files[0])
        if max_rows is None or f.metadata.num_rows <= max_rows:
            return f.read(columns=columns)
        batches, n = [], 0
        for batch in f.iter_batches(batch_size=min(max_rows, 1 << 18), columns=columns):
            batches.append(batch.slice(0, max_rows - n))
            n += batches[-1].num_rows
            if n >= max_rows:
                break
        return pa.Table.from_batches(batches)
    wanted = None if columns is None else list(dict.fromkeys([*columns, *KEY]))
    tables = []
    for path in files:
        f = _open(path)
        tables.append(f.read(columns=[c for c in wanted if c in f.schema_arrow.names] if wanted else None))
    rows = _latest(pa.concat_tables(tables, promote_options="default"))
    if columns is not None:  # (as ParquetFile.read does, a column no file has is left out)
        rows = rows.select([c for c in columns if c in rows.column_names])
    return rows if max_rows is None else rows.slice(0, max_rows)


def _latest(rows: pa.Table) -> pa.Table:
    """`rows` with only the last of the rows sharing a KEY, in their order."""
    if not all(k in rows.column_names for k in KEY):
        return rows
    order = pa.array(np.arange(rows.num_rows, dtype=np.int64))
    keyed = pa.table({"point": rows.column("point"), "request_id": rows.column("request_id"), "row": order})
    last = keyed.group_by(KEY, use_threads=False).aggregate([("row", "max")]).column("row_max")
    return rows.take(pc.take(last, pc.sort_indices(last)))
