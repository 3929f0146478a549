"""BurstGPT (HPMLL/BurstGPT): CSV of Timestamp (s), Model, Request tokens, Response tokens, Total tokens, Log Type.

Like Azure, the trace carries no prompt content, so every request gets block ids of its own
(`"prefix_identity": "none"` in the metadata). Failed requests (Response tokens == 0, present in the
`BurstGPT_*.csv` files and absent from the `*_without_fails_*` ones) are kept with output_tokens 0 and counted
in the metadata. Model becomes the extra column `model`; Log Type ("Conversation log", "API log") becomes the
workload label. Total tokens is redundant; rows where it differs from Request + Response are counted, not
rejected. Unknown columns (later releases announce e.g. session ids) are kept as string columns.

`kvbench trace import burstgpt` streams (`write_burstgpt`): a survey of the CSV block by block (checks and the
metadata's counts), then conversion block by block.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.errors import TraceFormatError
from kvbench.options import option
from kvbench.trace.blockhash import name_key
from kvbench.trace.files import new_meta
from kvbench.trace.importers import block_size_option, importer, time_unit_option, workload_option
from kvbench.trace.importers._csv import CsvFile, FirstErrors
from kvbench.trace.importers._ids import unique_block_ids
from kvbench.trace.schema import conform
from kvbench.trace.writer import TraceWriter

COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


NUMBERS = (("Timestamp", float), ("Request tokens", int), ("Response tokens", int), ("Total tokens", int))
FORMAT = "a BurstGPT"


@dataclass(frozen=True)
class BurstGptOptions:
    block_size: int = block_size_option(16)
    time_unit: str | None = time_unit_option()
    workload: str | None = workload_option()
    drop_empty_prompts: bool = option(
        False, "drop (and count) rows with 0 request tokens instead of failing", unit="on/off", is_flag=True
    )


def _parse(f: CsvFile, errors: FirstErrors | None = None) -> dict:
    """Every column of a file or part, checked in the order of the whole-file import (errors name the line);
    with `errors`, a failed check is recorded there and its column is None."""

    values = {c: FirstErrors.check(errors, c, lambda c=c, kind=kind: f.numbers(c, kind, lo=0)) for c, kind in NUMBERS}
    for name in ("Model", "Log Type"):
        values[name] = FirstErrors.check(errors, name, lambda name=name: _non_empty(f, name))
    return values


def _non_empty(f: CsvFile, name: str) -> pa.ChunkedArray:
    col = f.strings(name)
    empty = pc.equal(col, "")
    if pc.any(empty).as_py():
        raise f.error(int(pc.index(empty, True).as_py()), name, "is empty; every row needs a value")
    return col


def _empty_prompts_error(f: CsvFile, row: int, count: int) -> TraceFormatError:
    return f.error(
        row,
        "Request tokens",
        f"is 0 ({count} rows): a request needs a prompt; "
        "import with drop_empty_prompts=True to drop these rows (they are counted in the metadata)",
    )


def _table(f: CsvFile, v: dict, t0: float, scale: float, block_size: int, workload: str | None) -> pa.Table:
    """The kept rows (prompt > 0) of a file or part, in file order; ids follow the file's row numbers."""
    keep = v["Request tokens"] > 0
    take = pa.array(np.flatnonzero(keep))
    rows = np.arange(f.first_row, f.first_row + keep.size)[keep]
    inp, out = v["Request tokens"][keep], v["Response tokens"][keep]
    model, log_type = v["Model"].take(take), v["Log Type"].take(take)
    columns = {
        "request_id": pc.binary_join_element_wise(pa.scalar("bg-"), pc.cast(pa.array(rows), pa.string()), ""),
        "arrival_s": v["Timestamp"][keep] * scale - t0,
        "input_tokens": inp.astype(np.int32),
        "output_tokens": out.astype(np.int32),
        "block_hashes": unique_block_ids(name_key("import", "burstgpt", f.path.name), rows, inp, block_size),
        "workload": pa.array(np.full(rows.size, workload, dtype=object)) if workload else log_type,
        "model": model.dictionary_encode(),
    }
    if workload:  # the label replaces Log Type as workload; keep Log Type itself
        columns["log_type"] = log_type.dictionary_encode()
    extras = {k: v.take(take) for k, v in f.extra_columns().items()}
    return conform(pa.table({**columns, **extras}))


class _Totals:
    """What the metadata counts, over a file or its parts: kept rows' failures and mismatches, dropped
    prompts, the earliest arrival and whether arrivals are sorted."""

    def __init__(self):
        self.failed = self.dropped = self.mismatch = 0
        self.t0, self.last, self.in_order = np.inf, -np.inf, True
        self.first_empty: tuple[CsvFile, int] | None = None

    def add(self, f: CsvFile, v: dict, scale: float) -> None:
        empty = v["Request tokens"] == 0
        if empty.any() and self.first_empty is None:
            self.first_empty = (f, int(np.flatnonzero(empty)[0]))
        keep = ~empty
        inp, out, total = v["Request tokens"][keep], v["Response tokens"][keep], v["Total tokens"][keep]
        arrival = v["Timestamp"][keep] * scale
        self.dropped += int(empty.sum())
        self.failed += int(np.sum(out == 0))
        self.mismatch += int(np.sum(total != inp + out))
        if arrival.size:
            self.in_order &= bool(arrival[0] >= self.last) and bool(np.all(np.diff(arrival) >= 0))
            self.t0, self.last = min(self.t0, float(arrival.min())), float(arrival[-1])

    def check(self, drop_empty_prompts: bool) -> None:
        if self.first_empty is not None and not drop_empty_prompts:
            raise _empty_prompts_error(*self.first_empty, self.dropped)

    def meta(self, src: Path, unit: str, block_size: int):
        source = {
            "importer": "burstgpt",
            "file": src.name,
            "prefix_identity": "none",  # no content in the trace: every request has unique block ids
            "time_unit": unit,
            "time_offset_s": self.t0,  # arrivals are shifted to start at 0; the exporter adds this back
            "failed_requests": self.failed,  # Response tokens == 0, kept with output_tokens 0
            "dropped_empty_prompts": self.dropped,
            "total_tokens_mismatch": self.mismatch,
            "reordered": not self.in_order,
        }
        return new_meta(block_size, source)


def _options(time_unit: str | None, block_size: int) -> str:
    unit = time_unit or "s"
    if unit not in TIME_UNITS:
        raise TraceFormatError(f"time unit {unit!r} unknown; use one of {', '.join(TIME_UNITS)}")
    if block_size <= 0:
        raise TraceFormatError(f"block size {block_size} must be > 0")
    return unit


def write_burstgpt(
    src: Path,
    out: Path,
    block_size: int = 16,
    time_unit: str | None = None,
    workload: str | None = None,
    drop_empty_prompts: bool = False,
    block_bytes: int = 16 << 20,
) -> int:
    """`read_burstgpt` written to `out` a block of the CSV at a time (validated as it is written); returns the
    row count. Memory: one block. A file whose timestamps are out of order is sorted in memory."""
    src, unit = Path(src), _options(time_unit, block_size)
    f, errors, totals = CsvFile(src, COLUMNS, FORMAT, read=False), FirstErrors(), _Totals()
    for part in f.parts(block_bytes):  # survey: every value checked, the totals of the metadata
        v = _parse(part, errors)
        if not errors.first:
            totals.add(part, v, TIME_UNITS[unit])
    errors.raise_first(c for c, _ in NUMBERS + (("Model", 0), ("Log Type", 0)))
    totals.check(drop_empty_prompts)
    if not totals.in_order:
        table, meta = read_burstgpt(src, block_size, time_unit, workload, drop_empty_prompts)
        with TraceWriter(out, meta) as writer:
            writer.write(table)
        return writer.rows
    with TraceWriter(out, totals.meta(src, unit, block_size)) as writer:
        for part in f.parts(block_bytes):
            writer.write(_table(part, _parse(part), totals.t0, TIME_UNITS[unit], block_size, workload))
    return writer.rows


@importer("burstgpt", BurstGptOptions, write=write_burstgpt)
def read_burstgpt(
    src: Path,
    block_size: int = 16,
    time_unit: str | None = None,
    workload: str | None = None,
    drop_empty_prompts: bool = False,
):
    """BurstGPT CSV (Timestamp s, Model, Request/Response/Total tokens, Log Type; no prefix identity).

    `drop_empty_prompts`: rows with Request tokens == 0 cannot be replayed (a prompt needs a token); by
    default they are an error naming the first such line; with True they are dropped and counted in the
    metadata (`dropped_empty_prompts`).
    """
    src, unit = Path(src), _options(time_unit, block_size)
    f, totals = CsvFile(src, COLUMNS, FORMAT), _Totals()
    v = _parse(f)
    totals.add(f, v, TIME_UNITS[unit])
    totals.check(drop_empty_prompts)
    table = _table(f, v, totals.t0, TIME_UNITS[unit], block_size, workload)
    order = np.argsort(np.asarray(table.column("arrival_s")), kind="stable")
    return table.take(order), totals.meta(src, unit, block_size)
