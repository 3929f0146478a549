"""Trace validation: every rule of docs/semantics.md (Validation rules), each violation named by column and row."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvbench.errors import ValidationFailed
from kvbench.trace.compute import call, fill_null, pc
from kvbench.trace.files import read_trace
from kvbench.trace.references import GrowingReferences, References, check_across_rows
from kvbench.trace.schema import REQUIRED_COLUMNS, TRACE_SCHEMA, type_mismatch

ROWS_SHOWN = 5  # rows listed per rule; the rest are counted
ARRIVAL_ORDER_RULE = "arrivals must be non-decreasing (sort the trace by arrival)"


@dataclass
class Violation:
    column: str
    rule: str
    rows: list[int]  # first ROWS_SHOWN offending rows (0-based); empty for a file-level problem
    count: int  # how many rows break the rule in total

    def describe(self) -> str:
        if not self.rows:
            return f"column {self.column!r}: {self.rule}"
        more = f" (and {self.count - len(self.rows)} more)" if self.count > len(self.rows) else ""
        rows = ", ".join(map(str, self.rows))
        noun = "row" if len(self.rows) == 1 else "rows"
        return f"column {self.column!r} {noun} {rows}{more}: {self.rule}"


@dataclass
class ValidationReport:
    source: str
    rows: int
    violations: list[Violation] = field(default_factory=list)
    first_row: int = 0  # added to row numbers: the chunk being checked starts at this row of the trace

    @property
    def ok(self) -> bool:
        return not self.violations

    def add(self, column: str, rule: str, mask_or_rows) -> None:
        """Record a violation for a boolean row mask or a list of row numbers (nothing if none). The same rule
        broken again (in a later chunk of a streamed trace) extends one entry."""
        if isinstance(mask_or_rows, np.ndarray) and mask_or_rows.dtype == np.bool_:
            rows = np.flatnonzero(mask_or_rows)
        else:
            rows = np.asarray(mask_or_rows, dtype=np.int64)
        if not rows.size:
            return
        shown = (rows[:ROWS_SHOWN] + self.first_row).tolist()
        for v in self.violations:
            if (v.column, v.rule) == (column, rule):
                v.rows = (v.rows + shown)[:ROWS_SHOWN]
                v.count += int(rows.size)
                return
        self.violations.append(Violation(column, rule, shown, int(rows.size)))

    def add_file(self, column: str, rule: str) -> None:
        if all((v.column, v.rule) != (column, rule) for v in self.violations):
            self.violations.append(Violation(column, rule, [], 0))

    def summary(self) -> str:
        if self.ok:
            return f"{self.source}: valid ({self.rows} requests)"
        head = f"{self.source}: {len(self.violations)} rule(s) violated"
        return head + "\n" + "\n".join("  - " + v.describe() for v in self.violations)


def _np(col: pa.ChunkedArray, fill) -> np.ndarray:
    return fill_null(col, fill).to_numpy(zero_copy_only=False)


def _null(col) -> np.ndarray:
    """bool per value: is it null (through `call`: a first run's validation never imports pyarrow.compute)."""
    return _np(call("is_null", col), False)


_CAST_ERRORS = (pa.ArrowException, ValueError, TypeError)


def _rows_that_do_not_convert(col: pa.ChunkedArray, to: pa.DataType) -> list[int]:
    """Rows whose value cannot be cast safely to `to`, tried one by one (only when the column's cast failed)."""
    bad = []
    for i, v in enumerate(col.to_pylist()):
        try:
            pa.array([v]).cast(to, safe=True)
        except _CAST_ERRORS:
            bad.append(i)
    return bad


def _check_types(table: pa.Table, report: ValidationReport) -> pa.Table | None:
    """Cast known columns to the schema; report columns that cannot be cast, with the first bad rows. A column of
    the wrong kind (text where numbers belong) is refused even where its values would convert: the rows that
    would not are named first, then every row that holds a value."""
    before = sum(v.count or 1 for v in report.violations)
    for name in REQUIRED_COLUMNS:
        if name not in table.column_names:
            report.add_file(name, "required column is missing")
    good = {}
    for f in TRACE_SCHEMA:
        if f.name not in table.column_names:
            continue
        col = table.column(f.name)
        rule = f"has type {col.type}, expected {f.type}"
        mismatch = type_mismatch(col.type, f.type)
        if mismatch is not None and col.null_count < len(col):
            report.add(f.name, f"value cannot be converted ({rule})", _rows_that_do_not_convert(col, f.type))
            report.add(f.name, mismatch, ~_np(col.is_null(), True))
            continue
        try:
            good[f.name] = col.cast(f.type, safe=True) if not col.type.equals(f.type) else col
        except _CAST_ERRORS:
            bad = _rows_that_do_not_convert(col, f.type)
            if bad:
                report.add(f.name, f"value cannot be converted ({rule})", bad)
            else:
                report.add_file(f.name, rule)
    if sum(v.count or 1 for v in report.violations) > before:
        return None
    return pa.table(good)


def _check_numbers(t: pa.Table, block_size: int, report: ValidationReport) -> None:
    n = t.num_rows
    for name in REQUIRED_COLUMNS:
        if name != "block_hashes":
            report.add(name, "must not be null", _null(t.column(name)))
    arrival = _np(t.column("arrival_s"), 0.0)
    report.add(
        "arrival_s", "must be finite and >= 0 (seconds since trace start)", ~np.isfinite(arrival) | (arrival < 0)
    )
    if n > 1:
        report.add(
            "arrival_s",
            ARRIVAL_ORDER_RULE,
            np.concatenate([[False], arrival[1:] < arrival[:-1]]),
        )
    inp = _np(t.column("input_tokens"), 1).astype(np.int64)
    out = _np(t.column("output_tokens"), 0).astype(np.int64)
    report.add("input_tokens", "must be > 0", inp <= 0)
    report.add("output_tokens", "must be >= 0", out < 0)

    lengths = block_lengths(t.column("block_hashes"))
    report.add("block_hashes", "must not be null", lengths < 0)
    first_row = 0
    for hashes in t.column("block_hashes").chunks:  # chunk by chunk: a combined copy is 8 bytes a reference
        ids = call("list_flatten", hashes)
        if ids.null_count:  # a null id would be read as some number and hit whatever block has it
            parents = np.asarray(call("list_parent_indices", hashes)) + first_row
            report.add("block_hashes", "block ids must not be null", np.unique(parents[_null(ids)]))
        first_row += len(hashes)
    expected = -(-np.maximum(inp, 0) // block_size)
    report.add(
        "block_hashes",
        f"length must be ceil(input_tokens / block_size={block_size})",
        (lengths != expected) & (inp > 0) & (lengths >= 0),
    )

    def optional(name, fill, rule, bad):
        col = t.column(name)
        if col.null_count < n:
            values = _np(col, fill)
            report.add(name, rule, bad(values) & ~_null(col))

    optional("turn", 0, "must be >= 0", lambda v: v < 0)
    optional("think_time_s", 0.0, "must be finite and >= 0 (seconds)", lambda v: ~np.isfinite(v) | (v < 0))
    optional("reasoning_tokens", 0, "must be between 0 and output_tokens", lambda v: (v < 0) | (v > out))
    optional("priority", 35, "must be between 0 and 100", lambda v: (v < 0) | (v > 100))
    for slo in ("slo_ttft_ms", "slo_tpot_ms"):
        optional(slo, 1.0, "must be > 0 (milliseconds)", lambda v: ~(v > 0))

    mm = t.column("mm_items")
    if mm.null_count < n:
        mm = mm.combine_chunks()
        flat = pc.list_flatten(mm)
        parents = np.asarray(pc.list_parent_indices(mm))
        if len(flat):
            off = _np(pc.struct_field(flat, "offset"), -1)
            tok = _np(pc.struct_field(flat, "tokens"), 0)
            bad = (off < 0) | (tok <= 0) | (off + tok > inp[parents])
            bad |= _np(pc.struct_field(flat, "hash").is_null(), True) | _np(
                pc.struct_field(flat, "modality").is_null(), True
            )
            report.add(
                "mm_items",
                "each item needs a hash, a modality, offset >= 0, tokens > 0 and offset + tokens <= input_tokens",
                np.unique(parents[bad]),
            )


def block_lengths(hashes: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Blocks per request, -1 where block_hashes is null."""
    return _np(call("list_value_length", hashes), -1).astype(np.int64)


def check_rows(table: pa.Table, block_size: int, report: ValidationReport, first_row: int = 0) -> pa.Table | None:
    """Rules that look at one row at a time, on `table` (all of a trace, or a chunk of it starting at
    `first_row`). Returns the table cast to the schema, with absent columns as nulls; None if a column
    cannot be cast."""
    report.first_row = first_row
    typed = _check_types(table, report)
    if typed is None:
        return None
    for f in TRACE_SCHEMA:
        if f.name not in typed.column_names:
            typed = typed.append_column(f.name, pa.nulls(typed.num_rows, f.type))
    _check_numbers(typed, block_size, report)
    return typed


class ChunkedValidation:
    """Validation of a trace given chunk by chunk in row order (a file read by row group, a generator's or
    importer's output as it is written), with the same violations as `validate_table` on the whole: the
    rules of one row per chunk, arrival order across chunk boundaries, and the rules across rows at `finish`.
    Memory: one chunk, plus the hashed references (8 bytes a request, 16 more per parent_id and per
    depends_on element)."""

    def __init__(self, block_size: int, source: str):
        self.block_size = block_size
        self.report = ValidationReport(source=source, rows=0)
        self._refs = GrowingReferences()
        self._last_arrival = np.nan
        self._all_typed = True  # the rules across rows need every chunk cast to the schema

    @property
    def rows(self) -> int:
        return self.report.rows

    def add(self, table: pa.Table) -> pa.Table | None:
        """Check the next rows; returns them cast to the schema (absent columns as nulls), None if a column
        cannot be cast."""
        typed = check_rows(table, self.block_size, self.report, first_row=self.rows)
        if typed is None:
            self._all_typed = False
        elif typed.num_rows:
            arrival = _np(typed.column("arrival_s"), np.nan)
            if arrival[0] < self._last_arrival:  # (NaN, for none or a null, compares False)
                self.report.add("arrival_s", ARRIVAL_ORDER_RULE, [0])
            self._last_arrival = arrival[-1]
            self._refs.add(References.of(typed, self.rows))
        self.report.rows += table.num_rows
        return typed

    def finish(self, id_text=None) -> ValidationReport:
        """The report, with the rules across rows checked (`id_text(rows) -> list[str]`: see
        `references.check_across_rows`)."""
        if self.rows == 0:
            self.report.add_file("request_id", "trace has no requests")
        elif self._all_typed:
            check_across_rows(self._refs.result(), self.report, id_text)
        self._refs = None
        return self.report


def validate_table(table: pa.Table, block_size: int, source: str = "<table>") -> ValidationReport:
    report = ValidationReport(source=source, rows=table.num_rows)
    if table.num_rows == 0:
        report.add_file("request_id", "trace has no requests")
        return report
    typed = check_rows(table, block_size, report)
    if typed is not None:
        check_across_rows(References.of(typed, hashed=False), report)
    return report


def check(table: pa.Table, block_size: int, source: str) -> None:
    """Raise ValidationFailed unless the trace is valid."""
    report = validate_table(table, block_size, source)
    if not report.ok:
        raise ValidationFailed(report)


def read_valid_trace(path: str | Path):
    """Read a trace and validate it; what replays and reports load, since an invalid trace is never replayed."""
    table, meta = read_trace(path)
    check(table, meta.block_size, str(path))
    return table, meta
