"""Block-id handling shared by the importers: keep, chain or invent ids so they are prefix-chained."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..blockhash import chain_ids, content_ids, is_prefix_consistent, name_key, prompt_block_ids
from ..errors import TraceFormatError


def suggest_block_size(lengths: np.ndarray, n_blocks: np.ndarray) -> str:
    """A hint naming a block size that fits every row, when the user passed the wrong one."""
    for bs in (16, 32, 64, 128, 256, 512, 1024, 2048):
        if np.array_equal(-(-lengths // bs), n_blocks):
            return f"; the hash_ids fit --block-size {bs}"
    return ""


def prefix_chained(hashes: pa.ListArray, label: str) -> tuple[pa.ListArray, bool]:
    """Keep source ids that already behave as prefix-chained ids (so exports round-trip), else chain them."""
    if is_prefix_consistent(hashes):
        return hashes.cast(pa.list_(pa.uint64())), False
    return chain_ids(hashes, namespace=name_key("import", label)), True


def unique_block_ids(namespace: np.uint64, row: np.ndarray, input_tokens: np.ndarray, block_size: int) -> pa.ListArray:
    """Block ids that no other request shares: one content id per request (by its source row), chained."""
    n = input_tokens.size
    _, ids = prompt_block_ids(np.arange(n), content_ids(namespace, row), input_tokens, n, block_size)
    return ids


def check_block_counts(src, lines: list[int], input_tokens: np.ndarray, hashes: list[list], block_size: int) -> None:
    """Every record needs ceil(input / block_size) ids; the error names the line and a block size that fits."""
    n_blocks = np.fromiter((len(h) for h in hashes), dtype=np.int64, count=len(hashes))
    bad = np.flatnonzero(n_blocks != -(-input_tokens // block_size))
    if bad.size:
        row = int(bad[0])
        raise TraceFormatError(
            f"{src}: line {lines[row]}: field 'hash_ids' has {n_blocks[row]} ids but input_length "
            f"{input_tokens[row]} needs ceil({input_tokens[row]}/{block_size}) = {-(-input_tokens[row] // block_size)} "
            f"({bad.size} rows differ){suggest_block_size(input_tokens, n_blocks)}"
        )
