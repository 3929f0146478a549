"""Anonymizing a trace for publication (docs/semantics.md, Anonymizing a trace): every identifier is replaced
by a keyed one, so the result can be shared while its cache behaviour stays exactly the same.

What a simulator or a live replay can observe of a trace is equality: which requests share a block, a media
item, a salt, an adapter, a tenant, and which request a child names as its parent. Every replacement here is a
keyed function of the original value, so equal stays equal and (64-bit digests, checked) different stays
different; the hit tokens of every request at every capacity are therefore unchanged. Without the key no
original value can be confirmed by guessing it, and the same key gives the same pseudonyms across traces, so
two traces anonymized together still share what they shared.

What is kept as it is: token counts, turns, think times, priorities, SLOs, media modality and spans, and the
`workload` label (a kind of traffic, such as "chat", not an identity). Columns outside the schema are dropped
(an importer may keep a source's extra fields there, such as an external parent id). The file's provenance is
reduced to what says how the trace was made (generator or importer name, parameters), never a file name, a
time origin or a fingerprint of the original.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench import __version__
from kvbench.errors import KvbenchError
from kvbench.trace.files import TraceMeta, new_meta
from kvbench.trace.keyed import DIGEST, hash_key, rekey
from kvbench.trace.schema import MM_ITEM, TRACE_SCHEMA, conform

ANON_KEY_ENV = "KVBENCH_ANON_KEY"

# column -> pseudonym prefix. Columns that name each other share a domain: parent_id and depends_on hold
# request ids, so they are hashed under the request domain and still point at the same (renamed) request.
NAME_COLUMNS = {
    "request_id": "req",
    "parent_id": "req",
    "user_id": "user",
    "session_id": "session",
    "tenant": "tenant",
    "lora": "lora",
    "cache_salt": "salt",
}
LIST_NAME_COLUMNS = {"depends_on": "req"}

# Provenance that says how a trace was made and cannot point at where it came from. Anything else (file names,
# time origins, fingerprints of the original, keys a future importer adds) is dropped: an allow-list, so a new
# key is private until someone decides otherwise.
SAFE_SOURCE_KEYS = frozenset(
    {
        "generator",
        "importer",
        "params",
        "n",
        "seed",
        "kvbench",
        "numpy",
        "time_unit",
        "rechained",
        "reordered",
        "prefix_identity",
        "rebased_block_size",
    }
)
# a kept text value must look like a name or a parameter list ("chat=0.4,agent=0.2"), not a path or an address
_PLAIN_TEXT = re.compile(r"^[\w.,=:+\- ]{0,200}$")


@dataclass
class Anonymized:
    table: pa.Table
    meta: TraceMeta
    pseudonymized: list[str] = field(default_factory=list)  # the identifier columns that held values
    dropped_columns: list[str] = field(default_factory=list)
    dropped_source_keys: list[str] = field(default_factory=list)


def anon_key(env: str = ANON_KEY_ENV, environ=os.environ) -> bytes:
    """The anonymizing secret from the variable `env`. Derived once more from the keyed-hashing key so that a
    secret reused for both recording and anonymizing still gives unrelated ids in the two roles."""
    if not environ.get(env, ""):
        raise KvbenchError(
            f"set {env} to a secret to anonymize with (e.g. export {env}=$(openssl rand -hex 32)), or name "
            "another variable with --key-env; it is never stored, and the same secret gives the same pseudonyms"
        )
    return hashlib.blake2b(b"kvbench anonymize v1", key=hash_key(env, environ), digest_size=64).digest()


def pseudonym(value: str, domain: str, key: bytes) -> str:
    """`domain`-<16 hex digits>: a keyed hash of `value`, the same for the same value, domain and key."""
    digest = hashlib.blake2b(domain.encode() + b"\0" + value.encode(), key=key, digest_size=DIGEST).hexdigest()
    return f"{domain}-{digest}"


def _as_strings(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(pa.string())
    return arr.cast(pa.string())  # ids written as integers read as their decimal text (the schema allows it)


def _rename(values: pa.Array, domain: str, key: bytes, column: str) -> pa.Array:
    """Every value of a string array replaced by its pseudonym, nulls kept. Each distinct value is hashed once."""
    encoded = pc.dictionary_encode(values)
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks()
    names = encoded.dictionary.to_pylist()
    new = [pseudonym(v, domain, key) for v in names]
    if len(set(new)) != len(new):  # 64-bit digests: never seen, but a merge of two ids must not pass silently
        raise KvbenchError(f"column {column}: two values got the same pseudonym; anonymize with another key")
    return pa.DictionaryArray.from_arrays(encoded.indices, pa.array(new, pa.string())).cast(pa.string())


def _list_parts(arr: pa.ListArray) -> tuple[pa.Array, pa.Array, pa.Array | None]:
    """(offsets from 0, values, null mask) of a list array, whatever slice of a larger one it is."""
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    values = arr.values.slice(offsets[0], offsets[-1] - offsets[0])
    mask = arr.is_null() if arr.null_count else None
    return pa.array(offsets - offsets[0], pa.int32()), values, mask


def _rename_lists(col: pa.ChunkedArray, domain: str, key: bytes, column: str) -> pa.Array:
    arr = col.combine_chunks()
    offsets, values, mask = _list_parts(arr)
    renamed = _rename(_as_strings(values), domain, key, column)
    return pa.ListArray.from_arrays(offsets, renamed, mask=mask)


def _rekey_ids(table: pa.Table, key: bytes) -> dict[str, pa.Array]:
    """block_hashes and the media items' content hashes, re-keyed together: one id namespace, so an equality
    between the two columns (if a producer made one) survives as well as those within each."""
    blocks = table.column("block_hashes").combine_chunks()
    b_offsets, b_values, b_mask = _list_parts(blocks)
    block_ids = np.asarray(b_values.cast(pa.uint64()), dtype=np.uint64)
    media = table.column("mm_items").combine_chunks()
    m_offsets, items, m_mask = _list_parts(media)
    media_ids = np.asarray(pc.struct_field(items, "hash").fill_null(0), dtype=np.uint64)
    new = rekey(np.concatenate([block_ids, media_ids]), key)
    out = {"block_hashes": pa.ListArray.from_arrays(b_offsets, pa.array(new[: block_ids.size]), mask=b_mask)}
    if len(items):
        hashes = pa.array(new[block_ids.size :], pa.uint64(), mask=np.asarray(pc.struct_field(items, "hash").is_null()))
        fields = [hashes] + [pc.struct_field(items, f.name) for f in list(MM_ITEM)[1:]]
        item_mask = items.is_null() if items.null_count else None
        new_items = pa.StructArray.from_arrays(fields, fields=list(MM_ITEM), mask=item_mask)
        out["mm_items"] = pa.ListArray.from_arrays(m_offsets, new_items, mask=m_mask)
    return out


def round_arrivals(arrival: np.ndarray, grid_s: float) -> np.ndarray:
    """Arrival times rounded to the nearest multiple of `grid_s` seconds. Rounding is monotone, so a trace in
    arrival order stays in it, and requests that fall on one grid point keep their row order (the replay's
    order for equal times)."""
    if not (grid_s > 0 and math.isfinite(grid_s)):
        raise KvbenchError(f"--round-s must be a positive number of seconds, got {grid_s}")
    return np.round(arrival / grid_s) * grid_s


def scrub_source(source: dict) -> tuple[dict, list[str]]:
    """The provenance entries that cannot identify the source, and the names of those dropped."""
    kept, dropped = {}, []
    for k, v in source.items():
        clean = _plain(v) if k in SAFE_SOURCE_KEYS else None
        if clean is None:
            dropped.append(k)
        else:
            kept[k] = clean
    return kept, sorted(dropped)


def _plain(value):
    """`value` if it holds only numbers, flags and plain names (recursively for a dict), else None."""
    if isinstance(value, bool | int | float) or value is None:
        return value
    if isinstance(value, str):
        return value if _PLAIN_TEXT.match(value) and "/" not in value else None
    if isinstance(value, dict):
        return {k: c for k, v in value.items() if (c := _plain(v)) is not None or v is None}
    return None


def anonymize(table: pa.Table, meta: TraceMeta, key: bytes, round_s: float | None = None) -> Anonymized:
    """`table` (a valid trace, read with `meta`) with every identifier replaced (see the module's text).
    Returns the new table and metadata; the caller validates and writes them."""
    dropped_columns = [c for c in table.column_names if c not in TRACE_SCHEMA.names]
    # cast to the schema (a file from another writer may hold ids as integers, lists as large lists), every
    # column present; a fresh table, without the original's schema metadata (its provenance, pandas' index)
    typed = conform(table)
    columns = {name: typed.column(name) for name in TRACE_SCHEMA.names}
    base = pa.table(columns)

    new = dict(columns)
    for name in new:  # a dictionary column can hold values no row uses (a filtered trace's old names): re-encode
        if pa.types.is_dictionary(new[name].type):
            new[name] = new[name].cast(pa.string())
    new.update(_rekey_ids(base.select(["block_hashes", "mm_items"]), key))
    pseudonymized = []
    for name, domain in NAME_COLUMNS.items():
        col = base.column(name)
        if col.null_count < base.num_rows:
            new[name] = _rename(_as_strings(col), domain, key, name)
            pseudonymized.append(name)
        else:
            new[name] = pa.nulls(base.num_rows, pa.string())
    for name, domain in LIST_NAME_COLUMNS.items():
        col = base.column(name)
        if col.null_count < base.num_rows:
            new[name] = _rename_lists(col, domain, key, name)
            pseudonymized.append(name)
        else:
            new[name] = pa.nulls(base.num_rows, TRACE_SCHEMA.field(name).type)
    if round_s is not None:
        arrival = np.asarray(base.column("arrival_s").cast(pa.float64()), dtype=np.float64)
        new["arrival_s"] = pa.array(round_arrivals(arrival, round_s), pa.float64())

    kept, dropped_keys = scrub_source(meta.source)
    done = {
        "kvbench": __version__,
        "block_ids": "re-keyed with a secret that is not stored (keyed BLAKE2b); equal ids stay equal",
        "pseudonymized": pseudonymized,
        "dropped_columns": dropped_columns,
        "dropped_source_keys": dropped_keys,
        "arrival_round_s": round_s,
    }
    source = {**kept, "anonymized": True, "anonymization": done}
    out = pa.table([new[n] for n in TRACE_SCHEMA.names], names=list(TRACE_SCHEMA.names))
    return Anonymized(out, new_meta(meta.block_size, source), pseudonymized, dropped_columns, dropped_keys)
