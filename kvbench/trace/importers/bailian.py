"""Alibaba Bailian (Qwen) KVCache usage traces (USENIX ATC'25, alibaba-edu/qwen-bailian-usagetraces-anon).

JSONL, one request a line: {chat_id, parent_chat_id (-1 for a root), timestamp (s), input_length,
output_length, type (text/search/image/file), turn, hash_ids (16-token blocks)}; the field names are those
of the release README and of the official replayer (blitz-serving/trace-replayer, `BailianDataItem`).

Mapping: chat_id -> request_id, parent_chat_id -> parent_id, session_id = the oldest ancestor id named in the
file (following parent_chat_id; a parent missing from the file ends the walk and its id is the session),
turn -> turn, type -> workload. A parent that is not in the file would dangle: parent_id is left null, the
value is kept in the extra column `external_parent_id`, and the count is recorded as `missing_parents`.
hash_ids are per-block content hashes (salted SipHash, remapped to integers); they are kept when they already
behave as prefix-chained ids and chained otherwise (`rechained` in the metadata), as for Mooncake.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvbench.errors import TraceFormatError
from kvbench.trace.files import new_meta
from kvbench.trace.importers import block_size_option, importer, read_jsonl, require, time_unit_option, workload_option
from kvbench.trace.importers._ids import check_block_counts, prefix_chained
from kvbench.trace.schema import conform

KNOWN_FIELDS = ("chat_id", "parent_chat_id", "timestamp", "input_length", "output_length", "type", "turn", "hash_ids")
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
NO_PARENT = -1


def _sessions(chat: list[int], parent: list[int], lines: list[int], src: Path) -> tuple[list[int], int]:
    """Root id of each request's parent chain, and how many requests name a parent absent from the file."""
    parent_of = dict(zip(chat, parent))
    root: dict[int, int] = {}
    for c, line in zip(chat, lines):
        path, on_path, node = [], set(), c
        while node not in root:  # every node visited here is in the file
            if node in on_path:
                raise TraceFormatError(
                    f"{src}: line {line}: field 'parent_chat_id' forms a cycle (chat_id {c} is its own "
                    "ancestor); fix the parent_chat_id values"
                )
            path.append(node)
            on_path.add(node)
            p = parent_of[node]
            if p == NO_PARENT or p not in parent_of:  # a root, or a parent missing from the file: its id
                top = node if p == NO_PARENT else p
                break
            node = p
        else:
            top = root[node]
        for x in path:
            root[x] = top
    missing = sum(1 for p in parent if p != NO_PARENT and p not in parent_of)
    return [root[c] for c in chat], missing


def _extra_column(name: str, values: list, src: Path, lines: list[int]) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        kinds = {type(v).__name__ for v in values if v is not None}
        raise TraceFormatError(
            f"{src}: extra field {name!r} has values of mixed types ({', '.join(sorted(kinds))}), first at line "
            f"{next(line for line, v in zip(lines, values) if v is not None)}; make the field one type or remove it"
        ) from None


class _Rows:
    """The file's records, field by field, in file order (`lines`: each record's line number)."""

    def __init__(self):
        self.lines, self.chat, self.parent, self.ts, self.inp, self.out = [], [], [], [], [], []
        self.kind, self.turn, self.hashes, self.extra = [], [], [], []
        self.session: list[int] = []  # filled once every record is read (see _sessions)


def _parse_record(rec: dict, src: Path, where: str) -> tuple[int, int, float, int, int, str, int, list]:
    """One record's known fields, checked: (chat_id, parent_chat_id, timestamp, input_length, output_length,
    type, turn, hash_ids)."""
    c = require(rec, "chat_id", int, src, where)
    p = require(rec, "parent_chat_id", int, src, where)
    if p == c:
        raise TraceFormatError(f"{src}: {where}: field 'parent_chat_id' equals chat_id {c}; use -1 for a root")
    t = require(rec, "timestamp", float, src, where)
    if not np.isfinite(t) or t < 0:
        raise TraceFormatError(f"{src}: {where}: field 'timestamp' must be a finite number >= 0, got {t}")
    n_in = require(rec, "input_length", int, src, where)
    if n_in < 1:
        raise TraceFormatError(f"{src}: {where}: field 'input_length' must be >= 1, got {n_in}")
    n_out = require(rec, "output_length", int, src, where)
    if n_out < 0:
        raise TraceFormatError(f"{src}: {where}: field 'output_length' must be >= 0, got {n_out}")
    k = require(rec, "turn", int, src, where)
    if k < 0:
        raise TraceFormatError(f"{src}: {where}: field 'turn' must be >= 0, got {k}")
    ids = require(rec, "hash_ids", list, src, where)
    if not all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**64 for h in ids):
        raise TraceFormatError(f"{src}: {where}: field 'hash_ids' must be a list of non-negative integers")
    return c, p, t, n_in, n_out, require(rec, "type", str, src, where), k, ids


def _parse_rows(src: Path) -> _Rows:
    """Every record of the file, checked field by field; chat ids must be unique."""
    rows = _Rows()
    first_line: dict[int, int] = {}
    for lineno, rec in read_jsonl(src):
        where = f"line {lineno}"
        c = require(rec, "chat_id", int, src, where)
        if c in first_line:
            raise TraceFormatError(
                f"{src}: {where}: field 'chat_id' {c} repeats line {first_line[c]}; chat ids must be unique"
            )
        first_line[c] = lineno
        _, p, t, n_in, n_out, kind, k, ids = _parse_record(rec, src, where)
        rows.lines.append(lineno)
        rows.chat.append(c)
        rows.parent.append(p)
        rows.ts.append(t)
        rows.inp.append(n_in)
        rows.out.append(n_out)
        rows.kind.append(kind)
        rows.turn.append(k)
        rows.hashes.append(ids)
        rows.extra.append({key: v for key, v in rec.items() if key not in KNOWN_FIELDS})
    return rows


def _columns(rows: _Rows, src: Path, arrival: np.ndarray, block_hashes, workload: str | None) -> dict:
    """The table's columns in file order: the mapped fields, then the source's extra fields."""
    chat, parent, session = rows.chat, rows.parent, rows.session
    present = set(chat)
    columns = {
        "request_id": pa.array([str(c) for c in chat]),
        "arrival_s": arrival,
        "input_tokens": np.asarray(rows.inp, dtype=np.int64).astype(np.int32),
        "output_tokens": np.asarray(rows.out, dtype=np.int32),
        "block_hashes": block_hashes,
        "workload": pa.array([workload] * len(chat) if workload else rows.kind),
        "session_id": pa.array([str(s) for s in session]),
        "turn": np.asarray(rows.turn, dtype=np.int32),
        "parent_id": pa.array([str(p) if p in present else None for p in parent], pa.string()),
        "external_parent_id": pa.array(
            [str(p) if p != NO_PARENT and p not in present else None for p in parent], pa.string()
        ),
    }
    if workload:  # the label replaces type as workload; keep type itself
        columns["type"] = pa.array(rows.kind).dictionary_encode()
    for key in sorted({k for r in rows.extra for k in r}):
        if key in columns:
            raise TraceFormatError(f"{src}: extra field {key!r} clashes with a kvbench column; rename it in the source")
        columns[key] = _extra_column(key, [r.get(key) for r in rows.extra], src, rows.lines)
    return columns


@dataclass(frozen=True)
class BailianOptions:
    block_size: int = block_size_option(16)
    time_unit: str | None = time_unit_option()
    workload: str | None = workload_option()


@importer("bailian", BailianOptions)
def read_bailian(src: Path, block_size: int = 16, time_unit: str | None = None, workload: str | None = None):
    """Alibaba Bailian (Qwen) JSONL (timestamp s, 16-token blocks, chat_id/parent_chat_id sessions)."""
    src = Path(src)
    unit = time_unit or "s"
    if unit not in TIME_UNITS:
        raise TraceFormatError(f"time unit {unit!r} unknown; use one of {', '.join(TIME_UNITS)}")
    rows = _parse_rows(src)
    check_block_counts(src, rows.lines, np.asarray(rows.inp, dtype=np.int64), rows.hashes, block_size)
    rows.session, missing = _sessions(rows.chat, rows.parent, rows.lines, src)
    block_hashes, rechained = prefix_chained(pa.array(rows.hashes, type=pa.list_(pa.uint64())), src.name)
    arrival = np.asarray(rows.ts, dtype=np.float64) * TIME_UNITS[unit]
    t0 = float(arrival.min())
    arrival -= t0
    columns = _columns(rows, src, arrival, block_hashes, workload)

    pos = {c: i for i, c in enumerate(rows.chat)}
    order = np.argsort(arrival, kind="stable")
    source = {
        "importer": "bailian",
        "file": src.name,
        "time_unit": unit,
        "time_offset_s": t0,  # arrivals are shifted to start at 0; the exporter adds this back
        "rechained": rechained,
        "missing_parents": missing,  # parent_chat_id not in the file: kept in external_parent_id
        "parent_after_child": sum(1 for i, p in enumerate(rows.parent) if p in pos and arrival[pos[p]] > arrival[i]),
        "reordered": bool(np.any(order != np.arange(len(rows.chat)))),
    }
    return conform(pa.table(columns)).take(order), new_meta(block_size, source)
