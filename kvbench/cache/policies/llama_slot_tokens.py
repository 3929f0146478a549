"""The prompts' tokens for `llama-slot` in token mode (`--vocab`): exactly the ids `--backend openai` sends for
each trace row (kvbench.trace.tokens: a draw per block id and position, media spans overlaid), because
llama.cpp reuses a slot's longest common prefix token by token, and two prompts that part inside a block
still share the tokens that happen to be equal there. Block ids are the trace's own, unsalted: llama.cpp has
no cache_salt."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa

from kvbench.cache.prepared import PreparedTrace
from kvbench.errors import KvbenchError
from kvbench.trace.tokens import overlay_media, prompt_tokens_batch


@dataclass
class TokenTrace(PreparedTrace):
    """A prepared trace with each request's prompt tokens: token_ids[token_offsets[r]:token_offsets[r + 1]]."""

    token_ids: np.ndarray | None = None  # int64[sum of input_tokens]
    token_offsets: np.ndarray | None = None  # int64[n + 1]


def with_tokens(table: pa.Table, block_size: int, options: dict, prepared: PreparedTrace) -> PreparedTrace:
    """`prepared` with its prompts' tokens when --vocab is given (the Policy.extend hook), else as it is."""
    vocab = options.get("vocab")
    if vocab is None:
        return prepared
    hashes = table.column("block_hashes").combine_chunks()
    first = hashes.offsets[0].as_py()
    block_offsets = np.asarray(hashes.offsets, dtype=np.int64) - first
    flat = np.asarray(hashes.values.slice(first, int(block_offsets[-1])), dtype=np.uint64)
    inp = prepared.input_tokens
    short = np.diff(block_offsets) < -(-inp // block_size)
    if short.any():
        row = int(np.flatnonzero(short)[0])
        raise KvbenchError(
            f"trace row {row}: block_hashes holds fewer ids than input_tokens needs at block size {block_size}, "
            "so its prompt cannot be synthesised for llama-slot --vocab; check the trace with `kvbench trace validate`"
        )
    tokens, starts = prompt_tokens_batch(flat, block_offsets[:-1], inp, block_size, int(vocab))
    if "mm_items" in table.column_names and table.column("mm_items").null_count < table.num_rows:
        for r, items in enumerate(table.column("mm_items").to_pylist()):
            if items:  # the same overlay the openai backend applies before sending
                overlay_media(tokens[starts[r] : starts[r + 1]], items, int(vocab))
    base = {f.name: getattr(prepared, f.name) for f in fields(PreparedTrace)}
    return TokenTrace(**base, token_ids=tokens, token_offsets=starts)
