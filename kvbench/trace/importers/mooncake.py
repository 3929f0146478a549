"""Mooncake traces (FAST'25 release): JSONL of {timestamp ms, input_length, output_length, hash_ids}.

The file is read twice, batch by batch: a survey checks every record and learns what depends on the whole
file (the earliest timestamp, whether the ids are already prefix-consistent, whether timestamps are
sorted, the types of extra fields); then each batch is converted, and written as row groups by
`write_mooncake`. Memory: one batch, plus 24 bytes per distinct block id for the prefix-consistency check.
A file whose timestamps are out of order is converted in memory, since the trace must be sorted by arrival.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvbench.errors import TraceFormatError
from kvbench.trace.blockhash import chain_ids, name_key
from kvbench.trace.files import ROW_GROUP_SIZE, new_meta
from kvbench.trace.importers import block_size_option, importer, read_jsonl, require, time_unit_option, workload_option
from kvbench.trace.importers._ids import BlockCounts, PrefixConsistency
from kvbench.trace.schema import conform
from kvbench.trace.writer import TraceWriter

KNOWN_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
TIME_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}
BATCH_RECORDS = ROW_GROUP_SIZE


@dataclass
class _Batch:
    first_row: int
    lines: list[int] = field(default_factory=list)
    ts: list[float] = field(default_factory=list)
    inp: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)
    hashes: list[list[int]] = field(default_factory=list)
    extras: list[dict] = field(default_factory=list)


def _batches(src: Path, time_unit: str | None, size: int) -> Iterator[_Batch]:
    """The records, checked one by one (errors name file, line and field), `size` at a time."""
    batch = _Batch(0)
    for lineno, rec in read_jsonl(src):
        where = f"line {lineno}"
        t = require(rec, "timestamp", float, src, where)
        if time_unit is None and not t.is_integer():
            raise TraceFormatError(
                f"{src}: {where}: 'timestamp' {t} has a fractional part, but Mooncake timestamps are integer "
                "milliseconds; if the file is in seconds pass --time-unit s (or --time-unit ms to accept it)"
            )
        ids = require(rec, "hash_ids", list, src, where)
        if not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids):
            raise TraceFormatError(f"{src}: {where}: field 'hash_ids' must be a list of non-negative integers")
        batch.lines.append(lineno)
        batch.ts.append(t)
        batch.inp.append(require(rec, "input_length", int, src, where))
        batch.out.append(require(rec, "output_length", int, src, where))
        batch.hashes.append(ids)
        batch.extras.append({k: v for k, v in rec.items() if k not in KNOWN_FIELDS})
        if len(batch.lines) == size:
            yield batch
            batch = _Batch(batch.first_row + size)
    if batch.lines:
        yield batch


@dataclass
class _Survey:
    """What the conversion needs from the whole file."""

    unit: str
    t0: float = np.inf  # earliest arrival (s): arrivals are shifted to start at 0
    last: float = -np.inf
    in_order: bool = True  # arrivals already non-decreasing in file order
    consistent: bool = True  # source ids already prefix-consistent (kept) or not (chained)
    extra_types: dict[str, pa.DataType] = field(default_factory=dict)


def _survey(src: Path, block_size: int, time_unit: str | None, batch_records: int) -> _Survey:
    survey, counts, prefix = _Survey(time_unit or "ms"), BlockCounts(src, block_size), PrefixConsistency()
    first_bad: dict[str, tuple[int, int]] = {}  # field -> (line, value) of its first out-of-range record
    for b in _batches(src, time_unit, batch_records):
        arrival = np.asarray(b.ts, dtype=np.float64) * TIME_UNITS[survey.unit]
        survey.in_order &= bool(arrival[0] >= survey.last) and bool(np.all(arrival[1:] >= arrival[:-1]))
        survey.t0, survey.last = min(survey.t0, float(arrival.min())), float(arrival[-1])
        for name, values, lo in (("input_length", b.inp, 1), ("output_length", b.out, 0)):
            bad = np.flatnonzero(np.asarray(values, dtype=np.int64) < lo)
            if bad.size and name not in first_bad:
                first_bad[name] = (b.lines[bad[0]], values[bad[0]])
        counts.add(b.lines, np.asarray(b.inp, dtype=np.int64), b.hashes)
        prefix.add(pa.array(b.hashes, type=pa.list_(pa.uint64())))
        for key in {k for r in b.extras for k in r}:
            survey.extra_types[key] = _unify(src, key, survey.extra_types.get(key), _values(b, key))
    for name, lo in (("input_length", 1), ("output_length", 0)):  # in this order, as the whole-file check
        if name in first_bad:
            line, value = first_bad[name]
            raise TraceFormatError(f"{src}: line {line}: field {name!r} must be >= {lo}, got {value}")
    counts.check()
    survey.consistent = prefix.ok
    return survey


def _values(b: _Batch, key: str) -> list:
    return [r.get(key) for r in b.extras]


def _unify(src: Path, key: str, known: pa.DataType | None, values: list) -> pa.DataType:
    """The type of an extra field over all batches, as Arrow infers it over the whole column (ints and floats
    make floats; a null is any type)."""
    try:
        new = pa.array(values).type
        if known is None or known.equals(new):
            return new
        merged = pa.unify_schemas([pa.schema([(key, known)]), pa.schema([(key, new)])], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        raise TraceFormatError(
            f"{src}: extra field {key!r} has values of incompatible types; make the field one type or remove it"
        ) from None
    return merged.field(key).type


def _table(b: _Batch, survey: _Survey, src: Path, workload: str | None) -> pa.Table:
    """One batch as trace rows, in file order."""
    n = len(b.lines)
    hashes = pa.array(b.hashes, type=pa.list_(pa.uint64()))
    if not survey.consistent:  # chained row by row: the same ids whatever the batches
        hashes = chain_ids(hashes, namespace=name_key("import", src.name))
    arrival = np.asarray(b.ts, dtype=np.float64) * TIME_UNITS[survey.unit]
    return conform(
        pa.table(
            {
                "request_id": pa.array([f"mc-{i}" for i in range(b.first_row, b.first_row + n)]),
                "arrival_s": arrival - survey.t0,
                "input_tokens": np.asarray(b.inp, dtype=np.int32),
                "output_tokens": np.asarray(b.out, dtype=np.int32),
                "block_hashes": hashes,
                "workload": pa.array([workload or "mooncake"] * n),
                **{k: pa.array(_values(b, k)).cast(t) for k, t in sorted(survey.extra_types.items())},
            }
        )
    )


def _prepare(src, block_size, time_unit, workload, batch_records):
    src = Path(src)
    if (time_unit or "ms") not in TIME_UNITS:
        raise TraceFormatError(f"time unit {time_unit!r} unknown; use one of {', '.join(TIME_UNITS)}")
    survey = _survey(src, block_size, time_unit, batch_records)
    source = {
        "importer": "mooncake",
        "file": src.name,
        "time_unit": survey.unit,
        "time_offset_s": survey.t0,  # arrivals are shifted to start at 0; the exporter adds this back
        "rechained": not survey.consistent,
        "reordered": not survey.in_order,
    }
    return src, survey, new_meta(block_size, source)


def write_mooncake(
    src: Path,
    out: Path,
    block_size: int = 512,
    time_unit: str | None = None,
    workload: str | None = None,
    batch_records: int = BATCH_RECORDS,
) -> int:
    """`read_mooncake` written to `out` batch by batch (validated as it is written); returns the row count.
    Out-of-order timestamps are sorted in memory."""
    src, survey, meta = _prepare(src, block_size, time_unit, workload, batch_records)
    with TraceWriter(out, meta) as writer:
        if survey.in_order:
            for b in _batches(src, time_unit, batch_records):
                writer.write(_table(b, survey, src, workload))
        else:
            writer.write(read_mooncake(src, block_size, time_unit, workload)[0])
    return writer.rows


@dataclass(frozen=True)
class MooncakeOptions:
    block_size: int = block_size_option(512)
    time_unit: str | None = time_unit_option()
    workload: str | None = workload_option()


@importer("mooncake", MooncakeOptions, write=write_mooncake)
def read_mooncake(src: Path, block_size: int = 512, time_unit: str | None = None, workload: str | None = None):
    """Mooncake JSONL (timestamp in ms, 512-token blocks, prefix-chained hash_ids)."""
    src, survey, meta = _prepare(src, block_size, time_unit, workload, BATCH_RECORDS)
    table = pa.concat_tables([_table(b, survey, src, workload) for b in _batches(src, time_unit, BATCH_RECORDS)])
    if not survey.in_order:
        table = table.take(np.argsort(np.asarray(table.column("arrival_s")), kind="stable"))
    return table, meta
