"""Agentic coding traces of callanjfox/kv-cache-tester (Claude Code sessions): one JSON file per conversation.

A file is {id, models, block_size (64), hash_id_scope ("local"), tool_tokens, system_tokens, requests}; a
request is {t (s from the conversation start), type ("n"; old traces also "s"), model, in, out, hash_ids,
input_types, output_types, stop, api_time, think_time}; a sub-agent entry is {t, type "subagent", agent_id,
subagent_type, duration_ms, ..., requests} whose requests' t count from the sub-agent's start (sub-agents may
nest). SRC is one file or a directory (every *.json in it, by name).

Mapping: request_id "{id}-{k}" for the k-th request of the main chain and "{id}-{agent_id}-{k}" inside a
sub-agent (k counts requests only); arrival_s = absolute time within the conversation; every conversation
starts at 0, or conversation i (in file-name order) at i * stagger_s; session_id = id; parent_id = previous
request of the same chain (a sub-agent's first request: the request listed just before the sub-agent);
turn = k; think_time_s = think_time; workload "agent". Extra columns: model, has_thinking (output_types has
"thinking"; reasoning_tokens stays null, as the traces do not count them), agent_id, subagent_type,
api_time_s, stop_reason, input_types, output_types.

Block ids. Local hash ids are scoped per conversation (sub-agents share their parent's scope): they are made
globally unique by hashing them with a per-conversation namespace (global scope: one namespace) when they are
already prefix-consistent, and chained with `chain_ids` otherwise (`rechained` lists those conversations).
The traces hash full 64-token blocks only: len(hash_ids) == floor(in / 64) in every released file, so a
prompt whose length is not a multiple of 64 lacks the id of its partial last block. That block gets an id of
its own (`tail_blocks_added` counts them): its content is the start of a block that the next request
completes, so it equals no other block. A list of ceil(in / 64) ids is taken as is; any other length is an
error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvbench.errors import TraceFormatError
from kvbench.options import option
from kvbench.trace.blockhash import chain_ids, content_ids, is_prefix_consistent, mix, name_key
from kvbench.trace.files import new_meta
from kvbench.trace.importers import block_size_option, importer, require, workload_option
from kvbench.trace.schema import conform

REQUEST_TYPES = ("n", "s")  # non-streaming; streaming (older traces, paired with an "n" of the same turn)
SCOPES = ("local", "global")


def _trace_files(src: Path) -> list[Path]:
    if not src.exists():
        raise TraceFormatError(f"{src}: no such file or directory")
    if src.is_dir():
        files = sorted(p for p in src.glob("*.json") if p.is_file())
        if not files:
            raise TraceFormatError(f"{src}: directory has no *.json trace files")
        return files
    return [src]


def _load(path: Path) -> dict:
    if path.stat().st_size == 0:
        raise TraceFormatError(f"{path}: file is empty; expected one kv-cache-tester conversation (a JSON object)")
    try:
        doc = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{path}: line {exc.lineno} column {exc.colno} is not valid JSON ({exc.msg})") from None
    except UnicodeDecodeError:
        raise TraceFormatError(f"{path}: is not UTF-8 JSON text") from None
    if not isinstance(doc, dict):
        raise TraceFormatError(f"{path}: top level is not a JSON object; expected {{id, block_size, requests, ...}}")
    return doc


def _optional(rec: dict, field: str, kind, path: Path, where: str):
    return None if rec.get(field) is None else require(rec, field, kind, path, where)


def _number(rec: dict, field: str, kind, path: Path, where: str, lo: float, optional: bool = False):
    value = _optional(rec, field, kind, path, where) if optional else require(rec, field, kind, path, where)
    if value is not None and (not np.isfinite(value) or value < lo):
        raise TraceFormatError(f"{path}: {where}: field {field!r} must be a finite number >= {lo:g}, got {value!r}")
    return value


def _str_list(rec: dict, field: str, path: Path, where: str):
    value = _optional(rec, field, list, path, where)
    if value is not None and not all(isinstance(v, str) for v in value):
        raise TraceFormatError(f"{path}: {where}: field {field!r} must be a list of strings, got {value!r}")
    return value


def _hash_ids(rec: dict, n_in: int, bs: int, path: Path, where: str) -> tuple[np.ndarray, bool]:
    """The request's local ids, and whether its partial last block lacks an id (floor(in / bs) ids)."""
    ids = require(rec, "hash_ids", list, path, where)
    arr = np.asarray(ids) if ids else np.empty(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or (arr.size and arr.min() < 0):
        raise TraceFormatError(f"{path}: {where}: field 'hash_ids' must be a list of non-negative integers")
    full, ceil = n_in // bs, -(-n_in // bs)
    if arr.size == ceil:
        return arr.astype(np.uint64), False
    if arr.size == full:
        return arr.astype(np.uint64), True
    expect = f"{full}" if full == ceil else f"{full} (full blocks only) or {ceil} (with the partial last block)"
    raise TraceFormatError(
        f"{path}: {where}: field 'hash_ids' has {arr.size} ids but 'in' = {n_in} tokens in blocks of {bs} "
        f"needs {expect}; the ids do not describe this prompt (is the file's block_size right?)"
    )


class _Conversation:
    """Rows of one trace file, filled by walking its (nested) request lists."""

    def __init__(self, doc: dict, path: Path, bs: int):
        self.path, self.bs = path, bs
        self.id = require(doc, "id", str, path, "top level")
        scope = doc.get("hash_id_scope", "local")
        if scope not in SCOPES:
            raise TraceFormatError(f"{path}: top level: field 'hash_id_scope' is {scope!r}; expected one of {SCOPES}")
        self.scope = scope
        self.rows: list[dict] = []
        self.agents: set[str] = set()
        self.walk(require(doc, "requests", list, path, "top level"), "requests", 0.0, self.id, None, None, None)
        if not self.rows:
            raise TraceFormatError(f"{path}: field 'requests' holds no requests; nothing to import")

    def request_row(self, r: dict, w: str, rid: str, arrival: float, parent, k: int, agent, subtype) -> dict:
        """The row of request `r` (the k-th of its chain, listed at `w`); `_ids`/`_tail` are its local ids."""
        path = self.path
        n_in = require(r, "in", int, path, w)
        if n_in < 1:
            raise TraceFormatError(f"{path}: {w}: field 'in' must be >= 1, got {n_in}")
        ids, tail = _hash_ids(r, n_in, self.bs, path, w)
        output_types = _str_list(r, "output_types", path, w)
        return {
            "request_id": rid,
            "arrival_s": arrival,
            "input_tokens": n_in,
            "output_tokens": int(_number(r, "out", int, path, w, lo=0)),
            "session_id": self.id,
            "turn": k,
            "parent_id": parent,
            "think_time_s": _number(r, "think_time", float, path, w, lo=0, optional=True),
            "model": _optional(r, "model", str, path, w),
            "has_thinking": None if output_types is None else "thinking" in output_types,
            "agent_id": agent,
            "subagent_type": subtype,
            "api_time_s": _number(r, "api_time", float, path, w, lo=0, optional=True),
            "stop_reason": _optional(r, "stop", str, path, w),
            "input_types": _str_list(r, "input_types", path, w),
            "output_types": output_types,
            "_ids": ids,
            "_tail": tail,
        }

    def walk(self, reqs: list, where: str, base: float, chain: str, parent, agent, subtype) -> None:
        path, last, k = self.path, parent, 0
        for i, r in enumerate(reqs):
            w = f"{where}[{i}]" + (f" ({agent})" if agent else "")
            if not isinstance(r, dict):
                raise TraceFormatError(f"{path}: {w}: is not a JSON object")
            kind = require(r, "type", str, path, w)
            t = _number(r, "t", float, path, w, lo=0)
            if kind == "subagent":
                aid = require(r, "agent_id", str, path, w)
                if aid in self.agents:
                    raise TraceFormatError(f"{path}: {w}: field 'agent_id' {aid!r} repeats; agent ids must be unique")
                self.agents.add(aid)
                sub = require(r, "requests", list, path, w)
                self.walk(
                    sub,
                    f"{where}[{i}].requests",
                    base + t,
                    f"{self.id}-{aid}",
                    last,
                    aid,
                    _optional(r, "subagent_type", str, path, w),
                )
                continue
            if kind not in REQUEST_TYPES:
                raise TraceFormatError(
                    f"{path}: {w}: field 'type' is {kind!r}; expected 'n', 's' (a request) or 'subagent'"
                )
            rid = f"{chain}-{k}"
            self.rows.append(self.request_row(r, w, rid, base + t, last, k, agent, subtype))
            last, k = rid, k + 1


def _block_ids(rows: list[dict], namespace: np.uint64, tail_key: np.uint64) -> tuple[pa.ListArray, bool, int]:
    """Globally unique, prefix-chained ids for rows that share one local id scope (see the module doc)."""
    lengths = np.fromiter((r["_ids"].size for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate([r["_ids"] for r in rows]) if offsets[-1] else np.empty(0, dtype=np.uint64)
    raw = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, pa.uint64()))
    consistent = is_prefix_consistent(raw)
    if consistent:
        values = np.asarray(mix(namespace, values), dtype=np.uint64).reshape(-1)
    else:
        values = np.asarray(chain_ids(raw, namespace).values)
    need = np.fromiter((r["_tail"] for r in rows), dtype=bool, count=len(rows))
    values = np.insert(values, offsets[1:][need], content_ids(tail_key, np.flatnonzero(need)))
    offsets = offsets + np.concatenate([[0], np.cumsum(need)])
    ids = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, pa.uint64()))
    return ids, not consistent, int(need.sum())


def _read_conversations(src: Path, block_size: int | None) -> tuple[list[_Conversation], int]:
    """Every conversation of SRC, in file-name order, and the block size (the option's, or the files')."""
    convs: list[_Conversation] = []
    first_file: dict[str, Path] = {}
    for path in _trace_files(src):
        doc = _load(path)
        bs = require(doc, "block_size", int, path, "top level")
        if block_size is None:
            block_size = bs
        if bs != block_size:
            raise TraceFormatError(
                f"{path}: top level: field 'block_size' is {bs}, but the import uses block size {block_size} "
                f"(from the option or an earlier file); hash ids cannot be regrouped: import with block size {bs}"
            )
        conv = _Conversation(doc, path, bs)
        if conv.id in first_file:
            raise TraceFormatError(f"{path}: top level: field 'id' {conv.id!r} repeats {first_file[conv.id].name}")
        first_file[conv.id] = path
        convs.append(conv)
    return convs, block_size


def _conversation_block_ids(convs: list[_Conversation]) -> tuple[dict[str, pa.ListArray], list[str], int]:
    """Block ids of each conversation's rows (by id), the conversations rechained, and the tail ids added.
    Ids are made per id scope: each local conversation alone, all global ones together."""
    groups = [[c] for c in convs if c.scope == "local"] + (
        [[c for c in convs if c.scope == "global"]] if any(c.scope == "global" for c in convs) else []
    )
    hashes: dict[str, pa.ListArray] = {}
    rechained, tails = [], 0
    for group in groups:
        rows = [r for c in group for r in c.rows]
        key = group[0].id if group[0].scope == "local" else "global"
        ids, chained, added = _block_ids(
            rows, name_key("kv-cache-tester", key), name_key("kv-cache-tester", key, "tail")
        )
        tails += added
        rechained += [c.id for c in group] if chained else []
        start = 0
        for c in group:
            hashes[c.id] = ids.slice(start, len(c.rows))
            start += len(c.rows)
    return hashes, rechained, tails


def _shift_arrivals(convs: list[_Conversation], stagger_s: float) -> dict[str, float]:
    """Start conversation i at i * stagger_s (in place); the shift of those whose first request was not at 0."""
    offsets = {}
    for i, c in enumerate(convs):
        t0 = min(r["arrival_s"] for r in c.rows)
        if t0:
            offsets[c.id] = t0
        for r in c.rows:
            r["arrival_s"] += i * stagger_s - t0
    return offsets


COLUMN_TYPES = {  # columns whose type pa.array cannot infer (all nulls possible) or that are narrower
    "has_thinking": pa.bool_(),
    "api_time_s": pa.float32(),
    "input_types": pa.list_(pa.string()),
    "output_types": pa.list_(pa.string()),
    "agent_id": pa.string(),
    "subagent_type": pa.string(),
    "stop_reason": pa.string(),
    "model": pa.string(),
    "parent_id": pa.string(),
    "think_time_s": pa.float32(),
}
DICTIONARY_COLUMNS = ("model", "subagent_type", "stop_reason")


def _table(convs: list[_Conversation], hashes: dict[str, pa.ListArray], workload: str | None) -> pa.Table:
    """The rows of every conversation, in file and listing order, as a table (not yet conformed)."""
    rows = [r for c in convs for r in c.rows]
    names = [k for k in rows[0] if not k.startswith("_")]
    columns = {k: [r[k] for r in rows] for k in names}
    columns["block_hashes"] = pa.concat_arrays([hashes[c.id] for c in convs])
    columns["workload"] = [workload or "agent"] * len(rows)
    table = pa.table(
        {k: v if isinstance(v, pa.Array) else pa.array(v, COLUMN_TYPES.get(k)) for k, v in columns.items()}
    )
    for name in DICTIONARY_COLUMNS:
        i = table.column_names.index(name)
        table = table.set_column(i, name, table.column(name).dictionary_encode())
    return table


@dataclass(frozen=True)
class KvCacheTesterOptions:
    block_size: int | None = block_size_option(None, "tokens per hash id, the files' own [default: read from them]")
    workload: str | None = workload_option()
    stagger_s: float = option(
        0.0, "seconds between the starts of consecutive conversations of a directory (0 = all start together)", unit="s"
    )


@importer("kv-cache-tester", KvCacheTesterOptions)
def read_kv_cache_tester(src: Path, block_size: int | None = None, workload: str | None = None, stagger_s: float = 0.0):
    """kv-cache-tester agentic coding traces (JSON per conversation, or a directory; 64-token local hash ids).

    `block_size` must match the files' block_size (the ids cannot be regrouped); by default it is taken from
    them. `stagger_s`: conversation i (in file-name order) starts at i * stagger_s instead of 0.
    """
    src = Path(src)
    if not np.isfinite(stagger_s) or stagger_s < 0:
        raise TraceFormatError(f"stagger {stagger_s!r} must be a finite number of seconds >= 0")
    convs, block_size = _read_conversations(src, block_size)
    hashes, rechained, tails = _conversation_block_ids(convs)
    offsets = _shift_arrivals(convs, stagger_s)
    table = _table(convs, hashes, workload)
    order = np.argsort(np.asarray(table.column("arrival_s")), kind="stable")
    source = {
        "importer": "kv-cache-tester",
        "file": src.name,
        "files": [c.path.name for c in convs],
        "conversations": len(convs),
        "subagents": sum(len(c.agents) for c in convs),
        "hash_id_scope": {s: sum(c.scope == s for c in convs) for s in SCOPES if any(c.scope == s for c in convs)},
        "rechained": rechained,  # conversations whose local ids were not prefix-consistent
        "tail_blocks_added": tails,  # partial last blocks without a source id, given ids of their own
        "stagger_s": stagger_s,
        "time_offsets_s": offsets,  # conversations whose first request was not at t = 0 (shifted)
        "reordered": bool(np.any(order != np.arange(table.num_rows))),
    }
    return conform(table).take(order), new_meta(block_size, source)
