"""Prompt tokens drawn from block ids: token i of block j is splitmix64 of the block's id and i, so two requests
carry the same tokens exactly where their block ids are equal (docs/semantics.md, Block ids and prompts), and a
media span (`mm_items`) is the token run drawn from its content hash. The live backend sends these tokens
(kvbench.live.prompts builds requests from them) and `llama-slot` predicts from them, so they live in the trace
layer, below both."""

from __future__ import annotations

import numpy as np

from kvbench.trace.blockhash import mix, splitmix64

RESERVED_TOKENS = 16  # ids below this are left alone: engines' special tokens live there
DEFAULT_VOCAB = 4096  # token ids synthesised prompts stay below unless told (a tiny model's vocabulary fits it)


def _draw(seeds, index, vocab: int) -> np.ndarray:
    """Token ids (int64) in [RESERVED_TOKENS, vocab) drawn from (seed, index) pairs."""
    draws = splitmix64(mix(seeds, index))
    return (draws % np.uint64(vocab - RESERVED_TOKENS) + np.uint64(RESERVED_TOKENS)).astype(np.int64)


def _token_run(seed: np.uint64, n: int, vocab: int) -> np.ndarray:
    return _draw(seed, np.arange(n, dtype=np.uint64), vocab)


def prompt_tokens(
    block_hashes: np.ndarray, input_tokens: int, block_size: int, vocab: int, mm_items: list[dict] | None = None
) -> np.ndarray:
    """Token ids (int64) of one request's prompt: `input_tokens` ids in [RESERVED_TOKENS, vocab)."""
    n = len(block_hashes)
    ids = np.asarray(block_hashes, dtype=np.uint64)
    # block j, token i -> mix(id_j, i): one vectorised draw for the whole prompt
    block = np.repeat(ids, block_size)[:input_tokens]
    pos = np.tile(np.arange(block_size, dtype=np.uint64), n)[:input_tokens]
    return overlay_media(_draw(block, pos, vocab), mm_items, vocab)


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
    return _draw(ids, (t % block_size).astype(np.uint64), vocab), starts


def overlay_media(tokens: np.ndarray, mm_items: list[dict] | None, vocab: int) -> np.ndarray:
    """Media spans of one prompt overwritten with the run drawn from each item's content hash."""
    for item in mm_items or ():
        lo = max(0, int(item["offset"]))
        hi = min(tokens.size, lo + int(item["tokens"]))
        if hi > lo:
            tokens[lo:hi] = _token_run(np.uint64(item["hash"]), hi - lo, vocab)
    return tokens
