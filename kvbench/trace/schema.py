"""Trace schema v1 (docs/semantics.md, Trace schema): the one Arrow schema every part of kvbench reads and writes."""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = "1"
DEFAULT_PRIORITY = 35  # TensorRT-LLM's default retention priority

# File-level key-value metadata keys.
META_VERSION = "kvbench.schema_version"
META_BLOCK_SIZE = "kvbench.block_size"
META_SOURCE = "kvbench.source"
META_CREATED = "kvbench.created"

MM_ITEM = pa.struct(
    [
        pa.field("hash", pa.uint64()),
        pa.field("modality", pa.string()),
        pa.field("offset", pa.int32()),
        pa.field("tokens", pa.int32()),
    ]
)

_DICT = pa.dictionary(pa.int32(), pa.string())

TRACE_SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("arrival_s", pa.float64(), nullable=False),
        pa.field("input_tokens", pa.int32(), nullable=False),
        pa.field("output_tokens", pa.int32(), nullable=False),
        pa.field("block_hashes", pa.list_(pa.uint64()), nullable=False),
        pa.field("workload", _DICT),
        pa.field("tenant", _DICT),
        pa.field("user_id", pa.string()),
        pa.field("session_id", pa.string()),
        pa.field("turn", pa.int32()),
        pa.field("parent_id", pa.string()),
        pa.field("depends_on", pa.list_(pa.string())),
        pa.field("think_time_s", pa.float32()),
        pa.field("reasoning_tokens", pa.int32()),
        pa.field("mm_items", pa.list_(MM_ITEM)),
        pa.field("lora", _DICT),
        pa.field("cache_salt", pa.string()),
        pa.field("priority", pa.int8()),
        pa.field("slo_ttft_ms", pa.float32()),
        pa.field("slo_tpot_ms", pa.float32()),
    ]
)

REQUIRED_COLUMNS = tuple(f.name for f in TRACE_SCHEMA if not f.nullable)
KNOWN_COLUMNS = tuple(TRACE_SCHEMA.names)


def blocks_for(input_tokens, block_size: int):
    """Number of hash blocks a prompt of `input_tokens` has: ceil(input_tokens / block_size)."""
    return -(-input_tokens // block_size)


def _kind(t: pa.DataType) -> str:
    if pa.types.is_dictionary(t):
        return _kind(t.value_type)
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return "list"
    if pa.types.is_struct(t):
        return "struct"
    return str(t)


# What each kind of schema column accepts: a number of the same kind, or a whole float where integers belong
# (pandas writes integer columns that hold nulls as float64; a fraction is still refused, by the safe cast).
# Never text where numbers belong: "1200" would replay but says the producer wrote the wrong type.
_ACCEPTS = {
    "integer": {"integer", "float"},
    "float": {"integer", "float"},
    "string": {"string", "integer"},  # ids written as integers read the same as their decimal text
}


def type_mismatch(actual: pa.DataType, expected: pa.DataType) -> str | None:
    """Why a column of type `actual` cannot hold values of the schema's `expected` type (None when it can, up to
    a value-by-value safe cast): a different kind of value, here or inside a list or struct."""
    if pa.types.is_null(actual):
        return None  # all null
    want, got = _kind(expected), _kind(actual)
    if want in _ACCEPTS:
        return None if got in _ACCEPTS[want] else f"holds {got} values, the schema's type is {expected}"
    if want != got:
        return f"holds {got} values, the schema's type is {expected}"
    if want == "list":
        inner = type_mismatch(actual.value_type, expected.value_type)
        return f"list items: {inner}" if inner else None
    if want == "struct":
        fields = {f.name: f.type for f in expected}
        for child in actual:
            if child.name in fields:
                inner = type_mismatch(child.type, fields[child.name])
                if inner:
                    return f"field {child.name!r}: {inner}"
    return None


def conform(table: pa.Table) -> pa.Table:
    """Return `table` with every known column present and cast to its schema type, in schema order.

    Missing optional columns become all-null; unknown extra columns are kept after the known ones.
    Raises `pa.ArrowInvalid`/`pa.ArrowTypeError` when a present column cannot be cast safely.
    """
    n = table.num_rows
    columns, fields = [], []
    for field in TRACE_SCHEMA:
        if field.name in table.column_names:
            col = table.column(field.name)
            if not col.type.equals(field.type):
                col = col.cast(field.type, safe=True)
        else:
            col = pa.nulls(n, field.type)
        columns.append(col)
        fields.append(field)
    for name in table.column_names:
        if name not in TRACE_SCHEMA.names:
            columns.append(table.column(name))
            fields.append(table.schema.field(name))
    return pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=table.schema.metadata))


def cap_outputs(table: pa.Table, most: int, least: int = 0) -> pa.Table:
    """output_tokens clipped to [least, most] and reasoning_tokens (a part of them; nulls kept) to at most that,
    as int32: what a live replay with max_tokens capped at `most` generates, written into the trace so that a
    prediction (a policy that keeps generated tokens, the fidelity triangle) sees the same outputs."""
    import numpy as np

    out = np.clip(table["output_tokens"].to_numpy(zero_copy_only=False), least, most).astype(np.int32)
    table = table.set_column(table.schema.get_field_index("output_tokens"), "output_tokens", pa.array(out))
    if "reasoning_tokens" in table.column_names:
        i, col = table.schema.get_field_index("reasoning_tokens"), table["reasoning_tokens"]
        mask = col.is_null().to_numpy(zero_copy_only=False) if col.null_count else None
        capped = np.minimum(col.fill_null(0).to_numpy(zero_copy_only=False), out).astype(np.int32)
        table = table.set_column(i, "reasoning_tokens", pa.array(capped, mask=mask))
    return table
