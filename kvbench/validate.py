"""Trace validation: every rule of DESIGN.md section 3, each violation named by column and row."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import ValidationFailed
from .schema import REQUIRED_COLUMNS, TRACE_SCHEMA

ROWS_SHOWN = 5  # rows listed per rule; the rest are counted


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
    return col.fill_null(fill).to_numpy(zero_copy_only=False)


def _check_types(table: pa.Table, report: ValidationReport) -> pa.Table | None:
    """Cast known columns to the schema; report columns that cannot be cast, with the first bad rows."""
    before = sum(v.count or 1 for v in report.violations)
    for name in REQUIRED_COLUMNS:
        if name not in table.column_names:
            report.add_file(name, "required column is missing")
    good = {}
    for f in TRACE_SCHEMA:
        if f.name not in table.column_names:
            continue
        col = table.column(f.name)
        try:
            good[f.name] = col.cast(f.type, safe=True) if not col.type.equals(f.type) else col
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            bad = []
            for i, v in enumerate(col.to_pylist()):
                try:
                    pa.array([v]).cast(f.type, safe=True)
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                    bad.append(i)
            rule = f"has type {col.type}, expected {f.type}"
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
            report.add(name, "must not be null", _np(t.column(name).is_null(), False))
    arrival = _np(t.column("arrival_s"), 0.0)
    report.add(
        "arrival_s", "must be finite and >= 0 (seconds since trace start)", ~np.isfinite(arrival) | (arrival < 0)
    )
    if n > 1:
        report.add(
            "arrival_s",
            "arrivals must be non-decreasing (sort the trace by arrival)",
            np.concatenate([[False], arrival[1:] < arrival[:-1]]),
        )
    inp = _np(t.column("input_tokens"), 1).astype(np.int64)
    out = _np(t.column("output_tokens"), 0).astype(np.int64)
    report.add("input_tokens", "must be > 0", inp <= 0)
    report.add("output_tokens", "must be >= 0", out < 0)

    lengths = block_lengths(t.column("block_hashes"))
    report.add("block_hashes", "must not be null", lengths < 0)
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
            report.add(name, rule, bad(values) & ~_np(col.is_null(), True))

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


def _id_hashes(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """64-bit hashes of request ids (null as ""): 8 bytes a row instead of the id's text."""
    import polars as pl  # loaded on use: the CLI starts faster without it

    return pl.Series(values.fill_null("")).cast(pl.Utf8).hash(seed=7).to_numpy()


@dataclass
class References:
    """What the rules across rows look at, with ids as 64-bit hashes (a 10M-row trace keeps 80 MB, not its
    ids' text): every request's id, and the rows that name other requests."""

    ids: np.ndarray | pa.Array  # request_id of every row: uint64 hashes, or the text (`hashed=False`)
    parent_rows: np.ndarray
    parents: np.ndarray | pa.Array  # parent_id of those rows, the same way
    dep_rows: np.ndarray  # one entry per depends_on element
    deps: np.ndarray | pa.Array

    @classmethod
    def of(cls, t: pa.Table, first_row: int = 0, hashed: bool = True) -> References:
        """`hashed=False` keeps the ids' text: exact, and no hashing (nor polars import) for a trace that is
        in memory anyway."""
        parent = t.column("parent_id").combine_chunks()
        has_parent = np.flatnonzero(_np(parent.is_valid(), False))
        deps = t.column("depends_on").combine_chunks()

        def ids(values):
            return _id_hashes(values) if hashed else pa.array(values.fill_null("")).cast(pa.string())

        return cls(
            ids=ids(t.column("request_id").combine_chunks()),
            parent_rows=has_parent + first_row,
            parents=ids(parent.take(pa.array(has_parent))),
            dep_rows=np.asarray(pc.list_parent_indices(deps), dtype=np.int64) + first_row,
            deps=ids(pc.list_flatten(deps)),
        )

    @classmethod
    def concat(cls, parts: list[References]) -> References:
        def cat(name, dtype):
            return np.concatenate([getattr(p, name) for p in parts] or [np.zeros(0, dtype)])

        names = ("ids", "parent_rows", "parents", "dep_rows", "deps")
        return cls(*(cat(n, np.uint64 if n in ("ids", "parents", "deps") else np.int64) for n in names))


def _repeated(values: pa.Array) -> np.ndarray:
    """True where an earlier element has the same value (index_in finds each value's first position)."""
    return _np(pc.index_in(values, value_set=values), -1) != np.arange(len(values))


def check_across_rows(refs: References, report: ValidationReport, id_text=None) -> None:
    """Rules that relate rows: unique request ids, parent_id and depends_on naming requests of the trace, no
    dependency cycles. `id_text(rows) -> list[str]` gives the ids of some rows, to tell a real duplicate
    from two ids whose hashes collide (odds ~1e-6 on 10M rows); without it hashes are trusted."""
    report.first_row = 0
    ids = pa.array(refs.ids)
    repeated = _repeated(ids)
    if repeated.any() and id_text is not None:
        # rows whose hash occurs more than once (the first occurrences included), checked on their text
        first = _np(pc.index_in(ids, value_set=ids), 0)
        shared = np.zeros(len(ids), bool)
        shared[first[repeated]] = True
        suspects = np.flatnonzero(shared | repeated)
        repeated[:] = False
        repeated[suspects[_repeated(pa.array(id_text(suspects)))]] = True
    report.add("request_id", "duplicate request_id (an earlier row has the same id)", repeated)
    if len(refs.parents):
        found = pc.index_in(pa.array(refs.parents), value_set=ids)
        dangling = refs.parent_rows[_np(found.is_null(), False)]
        report.add("parent_id", "refers to a request_id that is not in the trace", dangling)
    if not len(refs.deps):
        return
    targets = pc.index_in(pa.array(refs.deps), value_set=ids)
    missing = _np(targets.is_null(), False)
    report.add("depends_on", "refers to a request_id that is not in the trace", np.unique(refs.dep_rows[missing]))
    rows, targets = refs.dep_rows[~missing], _np(targets, 0)[~missing].astype(np.int64)
    if np.any(targets >= rows):  # only an edge to the same or a later row can close a cycle
        graph: dict[int, list[int]] = defaultdict(list)
        for row, target in zip(rows.tolist(), targets.tolist()):
            graph[row].append(target)
        report.add("depends_on", "dependency cycle (requests that wait for each other)", _rows_on_cycles(graph))


def _rows_on_cycles(graph: dict[int, list[int]]) -> list[int]:
    """Rows that lie on a dependency cycle (iterative DFS: a back edge to a node on the path closes one)."""
    state: dict[int, int] = {}  # 1 = on stack, 2 = done
    on_cycle: set[int] = set()
    for root in list(graph):
        if root in state:
            continue
        stack = [(root, iter(graph.get(root, ())))]
        path = [root]
        state[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                on_cycle.update(path[path.index(nxt) :])
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(graph.get(nxt, ()))))
    return sorted(on_cycle)


def block_lengths(hashes: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Blocks per request, -1 where block_hashes is null."""
    return _np(pc.list_value_length(hashes), -1).astype(np.int64)


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
    from .traceio import read_trace

    table, meta = read_trace(path)
    check(table, meta.block_size, str(path))
    return table, meta
