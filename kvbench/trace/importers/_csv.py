"""CSV reading shared by the CSV importers (azure, burstgpt).

Columns are read as strings by Arrow (fast for millions of rows) and converted here, so that every bad value
is reported with file, line and column instead of a raw Arrow error.
"""

from __future__ import annotations

import copy
import csv
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from kvbench.errors import TraceFormatError

_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError)


def _norm(name: str) -> str:
    return " ".join(name.strip().lower().split())


class CsvFile:
    """A CSV file read with Arrow, every column as strings; conversions name file, line and column on error.

    Data row r (0-based, header and blank lines not counted) is reported by its 1-based line number in the file.
    """

    def __init__(self, path: Path, required: tuple[str, ...], fmt: str, read: bool = True):
        """Check the header; `read` also reads every row (`parts()` reads them a block at a time instead)."""
        self.path = path = Path(path)
        if not path.exists():
            raise TraceFormatError(f"{path}: no such file")
        if path.is_dir():
            raise TraceFormatError(f"{path}: is a directory; pass {fmt} CSV file itself")
        if path.stat().st_size == 0:
            raise TraceFormatError(f"{path}: file is empty; expected {fmt} CSV with header {','.join(required)}")
        with path.open("r", encoding="utf-8-sig", newline="") as fh:
            try:
                header = next(csv.reader([fh.readline()]), [])
            except UnicodeDecodeError:
                raise TraceFormatError(f"{path}: line 1 (header) is not UTF-8 text; is this {fmt} CSV?") from None
        header = [h.strip() for h in header]
        by_norm = {_norm(h): h for h in header}
        missing = [c for c in required if _norm(c) not in by_norm]
        if missing:
            raise TraceFormatError(
                f"{path}: line 1 (header): column {missing[0]!r} is missing "
                f"(header has {','.join(header) or 'nothing'}); "
                f"{fmt} CSV needs the columns {','.join(required)}"
            )
        self.header = header
        self.names = {c: by_norm[_norm(c)] for c in required}  # canonical name -> name in this file
        self.extra = [h for h in header if _norm(h) not in {_norm(c) for c in required}]
        self.first_row = 0  # data row of the file where `table` starts (a part of it: `parts()`)
        self._lines: np.ndarray | None = None
        self.table: pa.Table | None = None
        if read:
            try:
                self.table = pacsv.read_csv(path, read_options=self._read_options(), convert_options=self._convert())
            except _ARROW_ERRORS as exc:
                raise self._locate_parse_error(exc) from None
            if self.table.num_rows == 0:
                raise self._no_rows()

    def _read_options(self, **kw) -> pacsv.ReadOptions:
        return pacsv.ReadOptions(column_names=self.header, skip_rows=1, **kw)

    def _convert(self) -> pacsv.ConvertOptions:
        return pacsv.ConvertOptions(column_types={h: pa.string() for h in self.header})

    def _no_rows(self) -> TraceFormatError:
        return TraceFormatError(f"{self.path}: file has a header but no data rows; nothing to import")

    def parts(self, block_bytes: int = 16 << 20) -> Iterator[CsvFile]:
        """The file a block (`block_bytes` of text) at a time, each part a CsvFile of those rows whose
        conversions and errors work as on the whole file (lines are counted from the file's start)."""
        try:
            reader = pacsv.open_csv(
                self.path, read_options=self._read_options(block_size=block_bytes), convert_options=self._convert()
            )
        except _ARROW_ERRORS as exc:
            raise self._locate_parse_error(exc) from None
        first = 0
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except _ARROW_ERRORS as exc:
                raise self._locate_parse_error(exc) from None
            part = copy.copy(self)
            part.table, part.first_row = pa.Table.from_batches([batch]), first
            first += batch.num_rows
            yield part
        if first == 0:
            raise self._no_rows()

    def _locate_parse_error(self, exc: Exception) -> TraceFormatError:
        """Arrow names no line for a malformed row: find it with the csv module (only on this error path)."""
        with self.path.open("rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                try:
                    text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError:
                    return TraceFormatError(
                        f"{self.path}: line {lineno} is not valid UTF-8 text; fix or remove the line"
                    )
                if lineno == 1 or not text.rstrip("\r\n"):
                    continue
                fields = next(csv.reader([text]), [])
                if len(fields) != len(self.header):
                    return TraceFormatError(
                        f"{self.path}: line {lineno} has {len(fields)} fields but the header has {len(self.header)} "
                        f"({','.join(self.header)}); fix or remove the line"
                    )
        return TraceFormatError(f"{self.path}: cannot parse the CSV ({exc}); check quoting and line endings")

    def line(self, row: int) -> int:
        """1-based line number of data row `row` (0-based), skipping the header and blank lines as Arrow does."""
        if self._lines is None:
            lines = []
            with self.path.open("rb") as fh:
                next(fh, None)
                for lineno, raw in enumerate(fh, start=2):
                    if raw.rstrip(b"\r\n"):
                        lines.append(lineno)
            self._lines = np.asarray(lines, dtype=np.int64)
        return int(self._lines[row]) if row < self._lines.size else row + 2

    def error(self, row: int, column: str, problem: str) -> TraceFormatError:
        """An error at row `row` of `table`."""
        return TraceFormatError(
            f"{self.path}: line {self.line(self.first_row + row)}: column {self.names.get(column, column)!r} {problem}"
        )

    def strings(self, column: str) -> pa.ChunkedArray:
        col = self.table.column(self.names.get(column, column))
        return pc.utf8_trim_whitespace(col)

    def _first_bad(self, col: pa.ChunkedArray, ok) -> int:
        for row, value in enumerate(col.to_pylist()):
            if not ok(value):
                return row
        return 0

    def numbers(self, column: str, kind: type, lo: float | None = None, what: str = "") -> np.ndarray:
        """Column as int64 (kind=int; "12.0" is accepted) or float64 (kind=float); checks finite and >= lo."""
        col = self.strings(column)
        empty = pc.equal(col, "")
        if pc.any(empty).as_py():
            raise self.error(int(pc.index(empty, True).as_py()), column, "is empty; every row needs a value")
        try:
            values = col.cast(pa.float64())
        except _ARROW_ERRORS:
            row = self._first_bad(col, _parses_as_float)
            kind_name = "an integer" if kind is int else "a number"
            raise self.error(row, column, f"should be {kind_name}, got {col[row].as_py()!r}") from None
        arr = values.to_numpy()
        bad = ~np.isfinite(arr)
        if kind is int:
            bad |= arr != np.round(arr)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise self.error(
                row, column, f"should be {'an integer' if kind is int else 'a finite number'}, got {col[row].as_py()!r}"
            )
        if lo is not None and np.any(arr < lo):
            row = int(np.flatnonzero(arr < lo)[0])
            raise self.error(row, column, f"must be >= {lo:g}{what}, got {col[row].as_py()!r}")
        if kind is int:
            if np.any(np.abs(arr) > 2**31 - 1):
                row = int(np.flatnonzero(np.abs(arr) > 2**31 - 1)[0])
                raise self.error(row, column, f"is out of range, got {col[row].as_py()!r}")
            return arr.astype(np.int64)
        return arr

    def extra_columns(self) -> dict[str, pa.ChunkedArray]:
        """Unknown columns, kept as strings under their own names (docs/semantics.md, Trace schema)."""
        return {h: self.table.column(h) for h in self.extra}


class FirstErrors:
    """The first error of each column over a file read in parts, raised after the whole file was read in the
    order a whole-file import checks the columns, so that both report the same error."""

    def __init__(self):
        self.first: dict[str, TraceFormatError] = {}

    def run(self, column: str, check):
        """`check()`'s result, or None if it raised (kept when it is the column's first error)."""
        try:
            return check()
        except TraceFormatError as exc:
            self.first.setdefault(column, exc)
            return None

    @staticmethod
    def check(errors: FirstErrors | None, column: str, check):
        """`check()` as is without `errors` (a whole file: the first error is raised), else `errors.run`."""
        return check() if errors is None else errors.run(column, check)

    def raise_first(self, columns) -> None:
        for column in columns:
            if column in self.first:
                raise self.first[column]


def _parses_as_float(value) -> bool:
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


def parse_datetimes(f: CsvFile, column: str) -> np.ndarray:
    """Datetime strings ("2023-11-16 18:15:46.6805900", optionally with a zone offset) -> int64 epoch ns."""
    col = f.strings(column)
    for tz in (None, "UTC"):
        try:
            ns = col.cast(pa.timestamp("ns", tz=tz)).cast(pa.int64())
            break
        except _ARROW_ERRORS:
            continue
    else:

        def ok(v):
            for tz in (None, "UTC"):
                try:
                    pa.array([v]).cast(pa.timestamp("ns", tz=tz))
                    return True
                except _ARROW_ERRORS:
                    pass
            return False

        row = f._first_bad(col, ok)
        raise f.error(
            row, column, f"should be a date-time like '2023-11-16 18:15:46.6805900', got {col[row].as_py()!r}"
        )
    if ns.null_count:
        raise f.error(int(pc.index(ns.is_null(), True).as_py()), column, "is empty; every row needs a value")
    return ns.to_numpy()
