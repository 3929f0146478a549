"""A trace turned into what cache policies consume: dense block keys with isolation folded in.

Keys fold `cache_salt` and `lora` into the content ids the way vLLM chains its extra keys, so isolation is a
property of the key and never of a policy: two salted tenants cannot share a key, adapters do not share KV
unless `share_lora` is set. Keys are then renumbered 0..U-1 in order of first appearance, so that policies
can keep their state in flat arrays.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from kvbench.cache.densify import Numbering, densify, flat_ids, next_request_use
from kvbench.trace.blockhash import mix, name_key
from kvbench.trace.compute import call, dictionary_encode, fill_null, to_text
from kvbench.trace.hitsums import NO_LABEL
from kvbench.trace.schema import DEFAULT_PRIORITY


@dataclass
class PreparedTrace:
    """Flat, dense view of a trace. Request i references keys[offsets[i]:offsets[i+1]] in prompt order."""

    block_size: int
    offsets: np.ndarray  # int64[n+1]
    keys: np.ndarray  # int32[m], dense key of each block reference
    parent: np.ndarray  # int32[U], key of the block before this one in its prompt, -1 for a first block
    input_tokens: np.ndarray  # int64[n]
    max_hit: np.ndarray  # int32[n], most blocks a request may hit (vLLM caps it below the whole prompt)
    tenant: np.ndarray  # int32[n], index into tenant_names (0 = "(none)" when the trace has no tenants)
    tenant_names: list[str]
    priority: np.ndarray  # int8[n], retention priority 0-100 (TensorRT-LLM semantics)
    arrival_s: np.ndarray | None = None  # float64[n], seconds since trace start (time-based policy options)
    output_tokens: np.ndarray | None = None  # int64[n], decode length (the vllm pool holds blocks for it)
    _next_use: np.ndarray | None = field(default=None, repr=False)

    @property
    def n_requests(self) -> int:
        return self.input_tokens.size

    @property
    def n_keys(self) -> int:
        return self.parent.size

    @property
    def n_blocks(self) -> np.ndarray:
        return np.diff(self.offsets)

    def kv_tokens(self) -> np.ndarray:
        """int64[n]: tokens whose KV an engine computes for each request, the prompt and every generated token
        but the last (sampled, never run through the model); the prompt alone when outputs are unknown."""
        if self.output_tokens is None:
            return self.input_tokens
        return self.input_tokens + np.maximum(self.output_tokens, 1) - 1

    @property
    def next_use_known(self) -> bool:
        """Whether `next_use` was computed (or loaded with the rest from the trace cache)."""
        return self._next_use is not None

    def next_use(self) -> np.ndarray:
        """int32[m]: index of the next request that references the same key after this reference's request
        (n_requests + 1 when never), the future knowledge Belady needs. Computed once, on demand."""
        if self._next_use is None:
            self._next_use = next_request_use(self.keys, self.offsets, self.n_keys)
        return self._next_use


def _column_or_none(table: pa.Table, name: str):
    if name not in table.column_names or table.column(name).null_count == table.num_rows:
        return None
    col = table.column(name)
    return to_text(col)


def fold_isolation(table: pa.Table, use_salt: bool = True, share_lora: bool = False) -> pa.ListArray:
    """Block ids with salt and LoRA adapter folded into every key (content ids are unchanged when a request
    has neither). Folding every block (not only the first, as vLLM does) gives the same equalities, since
    the ids are already prefix-chained."""
    return _fold(table.column("block_hashes").combine_chunks(), table, use_salt, share_lora)


def folded_chunks(table: pa.Table, use_salt: bool = True, share_lora: bool = False) -> Iterator[pa.ListArray]:
    """`fold_isolation`, one chunk of block_hashes at a time: a trace read by row group is never copied whole
    (8 bytes a block reference)."""
    start = 0
    for chunk in table.column("block_hashes").chunks:
        yield _fold(chunk, table.slice(start, len(chunk)), use_salt, share_lora)
        start += len(chunk)


def _fold(hashes: pa.ListArray, table: pa.Table, use_salt: bool, share_lora: bool) -> pa.ListArray:
    """`hashes` (the block_hashes of `table`) with the rows' salt and adapter folded in."""
    extras = []
    if use_salt and (salt := _column_or_none(table, "cache_salt")) is not None:
        extras.append(("salt", salt))
    if not share_lora and (lora := _column_or_none(table, "lora")) is not None:
        extras.append(("lora", lora))
    if not extras:
        return hashes
    extra_key = np.zeros(table.num_rows, dtype=np.uint64)
    for label, col in extras:
        encoded = dictionary_encode(col).combine_chunks()
        names = np.array([name_key(label, v) for v in encoded.dictionary.to_pylist()] + [0], dtype=np.uint64)
        digest = names[fill_null(encoded.indices, len(names) - 1).to_numpy(zero_copy_only=False)]
        # a null mixes nothing in, so a request's key does not depend on which other columns the trace has
        extra_key = np.where(digest != 0, mix(extra_key, digest), extra_key)
    lengths = call("list_value_length", hashes).to_numpy(zero_copy_only=False)
    flat = np.asarray(call("list_flatten", hashes))
    per_ref = np.repeat(extra_key, lengths)
    folded = np.where(per_ref != 0, mix(flat, per_ref), flat)
    offsets = np.asarray(hashes.offsets) - hashes.offsets[0].as_py()
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(folded, pa.uint64()))


def prepare(
    table: pa.Table, block_size: int, *, use_salt: bool = True, share_lora: bool = False, vllm_cap: bool = False
) -> PreparedTrace:
    hashes = table.column("block_hashes")
    if hashes.num_chunks <= 1:  # densify's faster paths for imported ids need them whole
        whole = hashes.chunk(0) if hashes.num_chunks else hashes.combine_chunks()  # (combining copies)
        ids, offsets = flat_ids(_fold(whole, table, use_salt, share_lora))
        keys, parent = densify(ids, offsets)
        n_blocks = np.diff(offsets)
    else:  # numbered chunk by chunk into one array of keys
        keys = np.empty(sum(c.offsets[-1].as_py() - c.offsets[0].as_py() for c in hashes.chunks), np.int32)
        n_blocks = np.empty(table.num_rows, np.int64)
        numbering, row, done = Numbering(), 0, 0
        for chunk in folded_chunks(table, use_salt, share_lora):
            ids, offsets = flat_ids(chunk)
            keys[done : done + ids.size] = numbering.add(ids, offsets)
            n_blocks[row : row + len(chunk)] = np.diff(offsets)
            row, done = row + len(chunk), done + ids.size
        parent = numbering.parent()
        numbering.close()
    prepared = prepare_requests(table, block_size, n_blocks, vllm_cap=vllm_cap)
    prepared.keys, prepared.parent = keys, parent
    return prepared


def prepare_requests(
    table: pa.Table, block_size: int, n_blocks: np.ndarray, *, vllm_cap: bool, tenant_names: list[str] | None = None
) -> PreparedTrace:
    """The per-request arrays of a trace or of a chunk of one (no keys yet). `tenant_names`: every tenant of
    the trace, for a chunk (codes index it, so they agree across chunks); otherwise the table's own."""
    n_blocks = np.asarray(n_blocks, dtype=np.int64)
    offsets = np.zeros(n_blocks.size + 1, np.int64)
    np.cumsum(n_blocks, out=offsets[1:])
    input_tokens = table.column("input_tokens").to_numpy().astype(np.int64)
    # vLLM recomputes at least the last prompt token, so a hit never covers the whole prompt.
    max_hit = np.minimum(n_blocks, (input_tokens - 1) // block_size) if vllm_cap else n_blocks
    tenant, names = tenant_codes(table, tenant_names)
    prio_col = table.column("priority") if "priority" in table.column_names else None
    priority = (
        fill_null(prio_col, DEFAULT_PRIORITY).to_numpy().astype(np.int8)
        if prio_col is not None
        else np.full(table.num_rows, DEFAULT_PRIORITY, dtype=np.int8)
    )
    return PreparedTrace(
        block_size=block_size,
        offsets=offsets,
        keys=np.empty(0, np.int32),
        parent=np.empty(0, np.int32),
        input_tokens=input_tokens,
        arrival_s=table.column("arrival_s").to_numpy().astype(np.float64),
        output_tokens=table.column("output_tokens").to_numpy().astype(np.int64),
        max_hit=max_hit.astype(np.int32),
        tenant=tenant,
        tenant_names=names,
        priority=priority,
    )


def tenant_codes(table: pa.Table, names: list[str] | None) -> tuple[np.ndarray, list[str]]:
    """Tenant index of each request, and the names indexed ("(none)" for a null), in order of appearance."""
    col = _column_or_none(table, "tenant")
    if col is None:  # (in a chunk, "(none)" need not be the trace's first tenant)
        names = names or [NO_LABEL]
        return np.full(table.num_rows, names.index(NO_LABEL), dtype=np.int32), names
    encoded = dictionary_encode(fill_null(col, NO_LABEL)).combine_chunks()
    codes = np.asarray(encoded.indices, dtype=np.int32)
    if names is None:
        return codes, encoded.dictionary.to_pylist()
    index = {name: i for i, name in enumerate(names)}
    return np.array([index[v] for v in encoded.dictionary.to_pylist()], np.int32)[codes], names
