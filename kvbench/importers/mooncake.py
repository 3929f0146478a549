"""Mooncake traces (FAST'25 release): JSONL of {timestamp ms, input_length, output_length, hash_ids}."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from ..errors import TraceFormatError
from ..schema import conform
from ..traceio import new_meta
from . import importer, read_jsonl, require
from ._ids import check_block_counts, prefix_chained

KNOWN_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
TIME_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}


@importer("mooncake")
def read_mooncake(src: Path, block_size: int = 512, time_unit: str | None = None, workload: str | None = None):
    """Mooncake JSONL (timestamp in ms, 512-token blocks, prefix-chained hash_ids)."""
    src = Path(src)
    unit = time_unit or "ms"
    if unit not in TIME_UNITS:
        raise TraceFormatError(f"time unit {unit!r} unknown; use one of {', '.join(TIME_UNITS)}")
    lines, ts, inp, out, hashes, extra_rows = [], [], [], [], [], []
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
        lines.append(lineno)
        ts.append(t)
        inp.append(require(rec, "input_length", int, src, where))
        out.append(require(rec, "output_length", int, src, where))
        hashes.append(ids)
        extra_rows.append({k: v for k, v in rec.items() if k not in KNOWN_FIELDS})

    arrival = np.asarray(ts, dtype=np.float64) * TIME_UNITS[unit]
    inp_a, out_a = np.asarray(inp, dtype=np.int64), np.asarray(out, dtype=np.int64)
    for name, values, lo in (("input_length", inp_a, 1), ("output_length", out_a, 0)):
        bad = np.flatnonzero(values < lo)
        if bad.size:
            raise TraceFormatError(f"{src}: line {lines[bad[0]]}: field {name!r} must be >= {lo}, got {values[bad[0]]}")
    check_block_counts(src, lines, inp_a, hashes, block_size)

    block_hashes, rechained = prefix_chained(pa.array(hashes, type=pa.list_(pa.uint64())), src.name)
    extra_keys = sorted({k for r in extra_rows for k in r})
    n, t0 = len(ts), float(arrival.min())
    table = pa.table(
        {
            "request_id": pa.array([f"mc-{i}" for i in range(n)]),
            "arrival_s": arrival - t0,
            "input_tokens": inp_a.astype(np.int32),
            "output_tokens": out_a.astype(np.int32),
            "block_hashes": block_hashes,
            "workload": pa.array([workload or "mooncake"] * n),
            **{k: pa.array([r.get(k) for r in extra_rows]) for k in extra_keys},
        }
    )
    order = np.argsort(arrival, kind="stable")
    source = {
        "importer": "mooncake",
        "file": src.name,
        "time_unit": unit,
        "time_offset_s": t0,  # arrivals are shifted to start at 0; the exporter adds this back
        "rechained": rechained,
        "reordered": bool(np.any(order != np.arange(n))),
    }
    return conform(table).take(order), new_meta(block_size, source)
