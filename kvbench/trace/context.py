"""Requests against an engine's context (docs/semantics.md, Prompts longer than the context): a request fits
when its prompt plus the output tokens it asks for (`max_tokens`, at least 1) are within the context, the rule
vLLM applies before it schedules a request (HTTP 400 otherwise) and llama.cpp per slot. A replay checks this
before it sends anything; a trace with requests that do not fit is refused unless told to cut them to fit
(keeping their leading whole blocks, which is what requests share, so the reuse structure is kept up to the
cut) or to skip them. A prediction applies the same rule, so live and predicted runs still pair request by
request."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvbench.errors import KvbenchError

FIT_MODES = ("refuse", "truncate", "skip")


class ContextOverflow(KvbenchError):
    """A trace with prompts longer than the engine's context, replayed without --fit-context."""


def asked_output(table: pa.Table) -> np.ndarray:
    """The output tokens each request asks for (its max_tokens): output_tokens, at least 1."""
    return np.maximum(table.column("output_tokens").to_numpy(zero_copy_only=False).astype(np.int64), 1)


def drop_dangling(table: pa.Table) -> pa.Table:
    """parent_id and depends_on that name requests no longer in the table cleared, as if never given."""
    kept = set(table.column("request_id").to_pylist())
    for name in ("parent_id", "depends_on"):
        if name not in table.column_names:
            continue
        values = table.column(name).to_pylist()
        if name == "parent_id":
            values = [p if p in kept else None for p in values]
        else:
            values = [None if ds is None else [d for d in ds if d in kept] for ds in values]
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(name), pa.array(values, table.schema.field(name).type))
    return table


def truncate(table: pa.Table, context: int, block_size: int) -> tuple[pa.Table, int]:
    """Each request that does not fit keeps its first whole blocks, as many as leave room for its output;
    media spans that end past the cut are dropped. Returns the table and how many requests were cut."""
    tokens, out = table.column("input_tokens").to_numpy(zero_copy_only=False).astype(np.int64), asked_output(table)
    room = (context - out) // block_size * block_size
    long = tokens + out > context
    if not long.any():
        return table, 0
    if (room[long] < block_size).any():
        row = int(np.flatnonzero(long & (room < block_size))[0])
        raise ContextOverflow(
            f"trace row {row}: a {context}-token context leaves no whole {block_size}-token block for the prompt "
            f"beside its {int(out[row])} output tokens; lower --max-output-tokens, or use "
            "--fit-context skip"
        )
    cap = np.where(long, room, tokens)
    hashes = table.column("block_hashes").to_pylist()
    columns = {
        "input_tokens": pa.array(cap, table.schema.field("input_tokens").type),
        "block_hashes": pa.array(
            [h[: int(c) // block_size] if cut else h for h, c, cut in zip(hashes, cap, long)],
            table.schema.field("block_hashes").type,
        ),
    }
    if "mm_items" in table.column_names:
        items = table.column("mm_items").to_pylist()
        kept = [
            [m for m in ms if m["offset"] + m["tokens"] <= c] if ms is not None and cut else ms
            for ms, c, cut in zip(items, cap, long)
        ]
        columns["mm_items"] = pa.array(kept, table.schema.field("mm_items").type)
    for name, values in columns.items():
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(name), values)
    return table, int(long.sum())


def fit_to_context(
    table: pa.Table, context: int, block_size: int, mode: str, source: str, context_from: str
) -> tuple[pa.Table, dict]:
    """`table` fitted to a `context`-token context by `mode` (FIT_MODES), and the record of what was done.
    `source` names the trace and `context_from` where the context was read, for the refusal's message;
    `mode` is checked where it is given (`kvbench.run.limits.RequestLimits`)."""
    need = table.column("input_tokens").to_numpy(zero_copy_only=False).astype(np.int64) + asked_output(table)
    over = need > context
    record = {"context_tokens": int(context), "context_from": context_from, "over": int(over.sum())}
    if not over.any():
        return table, record
    longest = int(table.column("input_tokens").to_numpy(zero_copy_only=False)[over].max())
    record["longest_prompt"] = longest
    if mode == "refuse":
        first = int(np.flatnonzero(over)[0])
        raise ContextOverflow(
            f"{source}: {int(over.sum())} of {table.num_rows} requests do not fit the {context}-token context "
            f"({context_from}) with their output tokens (the longest prompt has {longest} tokens; first: row "
            f"{first}); nothing was replayed. Add --fit-context truncate to keep each one's leading whole blocks, or "
            "--fit-context skip to leave them out (a prediction given the same option cuts the same)"
        )
    if mode == "truncate":
        table, record["cut"] = truncate(table, context, block_size)
        return table, record
    table = drop_dangling(table.filter(pa.array(~over)))
    record["skipped"] = int(over.sum())
    return table, record
