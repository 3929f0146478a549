"""Prompts synthesised from block ids, for backends that need real tokens (live engines, real attention).

A trace stores block ids, not text. Token i of block j is drawn from the block's id alone (splitmix64 of id and
i), so two requests get the same tokens exactly where their block ids are equal, which is where the trace
says they share content: an engine's prefix cache sees the sharing the trace describes, and nothing else
(DESIGN.md section 3). Multimodal spans (`mm_items`) are then overwritten with a token run drawn from the
item's content hash, so the same image, video or audio clip is the same tokens wherever it appears; that is
how a text-only engine sees media (it cannot reuse an encoder output, only a prefix).

Engines cache by their own block size, usually smaller than the trace's. `rebase_blocks` re-cuts a trace's
block ids at a block size that divides the trace's, so that a simulator fed the re-cut trace predicts what
the engine can hit (sub-block s of block j has id mix(id_j, s): equal exactly when the parent ids are).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .blockhash import mix, splitmix64

RESERVED_TOKENS = 16  # ids below this are left alone: engines' special tokens live there


def _token_run(seed: np.uint64, n: int, vocab: int) -> np.ndarray:
    draws = splitmix64(mix(seed, np.arange(n, dtype=np.uint64)))
    return (draws % np.uint64(vocab - RESERVED_TOKENS) + np.uint64(RESERVED_TOKENS)).astype(np.int64)


def prompt_tokens(
    block_hashes: np.ndarray, input_tokens: int, block_size: int, vocab: int, mm_items: list[dict] | None = None
) -> np.ndarray:
    """Token ids (int64) of one request's prompt: `input_tokens` ids in [RESERVED_TOKENS, vocab)."""
    n = len(block_hashes)
    ids = np.asarray(block_hashes, dtype=np.uint64)
    # block j, token i -> mix(id_j, i): one vectorised draw for the whole prompt
    block = np.repeat(ids, block_size)[:input_tokens]
    pos = np.tile(np.arange(block_size, dtype=np.uint64), n)[:input_tokens]
    tokens = (splitmix64(mix(block, pos)) % np.uint64(vocab - RESERVED_TOKENS) + np.uint64(RESERVED_TOKENS)).astype(
        np.int64
    )
    return overlay_media(tokens, mm_items, vocab)


def prompt_tokens_batch(
    flat_hashes: np.ndarray, block_offsets: np.ndarray, input_tokens: np.ndarray, block_size: int, vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """`prompt_tokens` of many requests in one vectorised pass (no media spans): request r's tokens are
    tokens[starts[r]:starts[r + 1]]. `block_offsets[r]` is the index of r's first block in `flat_hashes`."""
    inp = np.asarray(input_tokens, dtype=np.int64)
    starts = np.zeros(inp.size + 1, np.int64)
    np.cumsum(inp, out=starts[1:])
    row = np.repeat(np.arange(inp.size), inp)
    t = np.arange(starts[-1], dtype=np.int64) - starts[row]
    ids = flat_hashes[np.asarray(block_offsets, dtype=np.int64)[row] + t // block_size]
    draws = splitmix64(mix(ids, (t % block_size).astype(np.uint64)))
    tokens = (draws % np.uint64(vocab - RESERVED_TOKENS) + np.uint64(RESERVED_TOKENS)).astype(np.int64)
    return tokens, starts


def overlay_media(tokens: np.ndarray, mm_items: list[dict] | None, vocab: int) -> np.ndarray:
    """Media spans of one prompt overwritten with the run drawn from each item's content hash."""
    for item in mm_items or ():
        lo = max(0, int(item["offset"]))
        hi = min(tokens.size, lo + int(item["tokens"]))
        if hi > lo:
            tokens[lo:hi] = _token_run(np.uint64(item["hash"]), hi - lo, vocab)
    return tokens


def words(tokens) -> str:
    """The prompt as text for engines whose tokenizer has one token per word `w<id>` (kvbench's tiny model);
    with any other tokenizer the token count will differ, so use token-id prompts there."""
    return " ".join(f"w{t}" for t in np.asarray(tokens).tolist())


def rebase_blocks(table: pa.Table, block_size: int, engine_block_size: int) -> pa.ListArray:
    """block_hashes re-cut at `engine_block_size` (which must divide `block_size`): ceil(input_tokens /
    engine_block_size) ids per request, prefix-consistent like the original."""
    if engine_block_size == block_size:
        return table.column("block_hashes").combine_chunks()
    if engine_block_size <= 0 or block_size % engine_block_size:
        raise ValueError(
            f"engine block size {engine_block_size} must divide the trace's block size {block_size}; "
            f"re-generate or re-import the trace with --block-size {engine_block_size}"
        )
    per = block_size // engine_block_size
    hashes = table.column("block_hashes").combine_chunks()
    flat = np.asarray(hashes.flatten())
    inp = table.column("input_tokens").to_numpy().astype(np.int64)
    counts = -(-inp // engine_block_size)
    sub = mix(np.repeat(flat, per), np.tile(np.arange(per, dtype=np.uint64), flat.size))
    # keep the first `counts[r]` sub-blocks of request r (its last trace block may be partial)
    lengths = pc.list_value_length(hashes).to_numpy(zero_copy_only=False).astype(np.int64)
    start = np.repeat(np.concatenate([[0], np.cumsum(lengths * per)[:-1]]), counts)
    within = np.arange(counts.sum()) - np.repeat(np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    values = sub[start + within]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.uint64()))
