"""Content-addressed, prefix-chained block ids, computed vectorised.

A prompt is described as a sequence of *segments*: runs of tokens whose content is fully determined by a
64-bit content id (a system prompt, a user message, an answer, a tool output, an image by its content hash).
Token j of a segment is "token j of content id c". The prompt is cut into blocks of `block_size` tokens;
cutting splits segments into *pieces*, and a block's id is a hash of every piece from the start of the
prompt to the end of that block. Hence equal id <=> same token content up to and including that block
(docs/semantics.md, Block ids and prompts), for any generator that describes equal content with equal segments.

All hashing is deterministic across processes and machines (splitmix64 and blake2b, never `hash()`).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# Multiplier of the polynomial prefix hash over pieces; odd so that it is invertible mod 2**64.
_RADIX = np.uint64(0xD6E8FEB86659FD93)
_MAX_PIECES = 1 << 16


def _powers(n: int) -> np.ndarray:
    """_RADIX**i mod 2**64 for i < n, by doubling: R**(m+i) = R**i * R**m, so log2(n) vector products instead
    of n scalar ones (which took 40-90 ms of every kvbench start-up)."""
    out = np.empty(n, dtype=np.uint64)
    out[0] = 1
    m = 1
    with np.errstate(over="ignore"):
        while m < n:
            k = min(m, n - m)
            out[m : m + k] = out[:k] * (out[m - 1] * _RADIX)
            m += k
    return out


_POW = _powers(_MAX_PIECES)


def splitmix64(x) -> np.ndarray:
    """The splitmix64 finaliser, element-wise on uint64 (wrapping arithmetic); in place on a fresh copy."""
    z = np.array(x, dtype=np.uint64, copy=True, ndmin=1)
    with np.errstate(over="ignore"):
        z += _GOLDEN
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z if np.ndim(x) else z[0]


def mix(*parts) -> np.ndarray:
    """Order-sensitive hash of several uint64 arrays (or scalars), element-wise."""
    acc = np.uint64(0x243F6A8885A308D3)
    for p in parts:
        acc = splitmix64(acc ^ np.asarray(p, dtype=np.uint64))
    return acc


def name_key(*names: object) -> np.uint64:
    """A stable 64-bit key for a namespace such as ("chat", seed, "system")."""
    digest = hashlib.blake2b("\x1f".join(map(str, names)).encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def content_ids(namespace: np.uint64, index) -> np.ndarray:
    """Content ids for items `index` (ints) in a namespace: equal (namespace, index) => equal content."""
    return mix(namespace, np.asarray(index, dtype=np.int64).astype(np.uint64))


# Requests hashed per pass: bounds the piece arrays (several int64 arrays per piece) to a few hundred MB.
CHUNK_REQUESTS = 131_072


def prompt_block_ids(
    seg_request: np.ndarray,
    seg_content: np.ndarray,
    seg_tokens: np.ndarray,
    n_requests: int,
    block_size: int,
) -> tuple[np.ndarray, pa.ListArray]:
    """Block ids for many prompts at once.

    seg_request: request index of each segment (non-decreasing, values in [0, n_requests));
    seg_content: uint64 content id of each segment; seg_tokens: its length in tokens (>= 0).
    Returns (input_tokens per request as int64, list<uint64> block ids per request).
    """
    seg_request = np.asarray(seg_request, dtype=np.int64)
    seg_content = np.asarray(seg_content, dtype=np.uint64)
    seg_tokens = np.asarray(seg_tokens, dtype=np.int64)
    if seg_request.size and np.any(np.diff(seg_request) < 0):
        raise ValueError("segments must be grouped by request in order")
    if n_requests <= CHUNK_REQUESTS:
        return _prompt_block_ids(seg_request, seg_content, seg_tokens, n_requests, block_size)
    tokens, lists = [], []
    for lo in range(0, n_requests, CHUNK_REQUESTS):
        hi = min(lo + CHUNK_REQUESTS, n_requests)
        a, b = np.searchsorted(seg_request, [lo, hi])
        t, ids = _prompt_block_ids(seg_request[a:b] - lo, seg_content[a:b], seg_tokens[a:b], hi - lo, block_size)
        tokens.append(t)
        lists.append(ids)
    return np.concatenate(tokens), pa.concat_arrays(lists)


def _prompt_block_ids(seg_request, seg_content, seg_tokens, n_requests: int, block_size: int):
    keep = seg_tokens > 0
    seg_request, seg_content, seg_tokens = seg_request[keep], seg_content[keep], seg_tokens[keep]

    input_tokens = np.bincount(seg_request, weights=seg_tokens, minlength=n_requests).astype(np.int64)
    n_blocks = -(-input_tokens // block_size)
    offsets = np.zeros(n_requests + 1, dtype=np.int32)
    np.cumsum(n_blocks, out=offsets[1:])
    if seg_request.size == 0:
        return input_tokens, pa.ListArray.from_arrays(offsets, pa.array([], pa.uint64()))

    # Token span of each segment inside its prompt.
    end = np.cumsum(seg_tokens)
    req_base = np.zeros(n_requests + 1, dtype=np.int64)
    np.cumsum(input_tokens, out=req_base[1:])
    end -= req_base[seg_request]
    start = end - seg_tokens

    # Split segments at block boundaries into pieces.
    first_block = start // block_size
    n_pieces = (end - 1) // block_size - first_block + 1
    piece_seg = np.repeat(np.arange(seg_tokens.size), n_pieces)
    piece_first = np.cumsum(n_pieces) - n_pieces
    piece_k = np.arange(piece_seg.size) - np.repeat(piece_first, n_pieces)
    piece_block = first_block[piece_seg] + piece_k
    p_start = np.maximum(start[piece_seg], piece_block * block_size)
    p_end = np.minimum(end[piece_seg], (piece_block + 1) * block_size)
    # One mixing round suffices here: content ids are already random 64-bit values, and the prefix hash
    # below is mixed again before it becomes an id.
    with np.errstate(over="ignore"):
        piece_key = seg_content[piece_seg]
        piece_key += (p_start - start[piece_seg]).astype(np.uint64) * _M1
        piece_key += (p_end - p_start).astype(np.uint64) * _M2
    piece_hash = splitmix64(piece_key)

    # Polynomial prefix hash over the pieces of each request: P_j = sum_{i<=j} h_i * R**i (mod 2**64).
    piece_req = seg_request[piece_seg]
    req_first_piece = np.searchsorted(piece_req, np.arange(n_requests))
    piece_idx = np.arange(piece_req.size) - req_first_piece[piece_req]
    if piece_idx.size and piece_idx.max() >= _MAX_PIECES:
        raise ValueError(f"a prompt has more than {_MAX_PIECES} pieces; use a larger block size")
    with np.errstate(over="ignore"):
        running = np.cumsum(piece_hash * _POW[piece_idx], dtype=np.uint64)
        before = np.where(req_first_piece[piece_req] > 0, running[req_first_piece[piece_req] - 1], 0)
        prefix = running - before.astype(np.uint64)

    # A block's id is the prefix hash at its last piece.
    last = np.ones(piece_req.size, dtype=bool)
    last[:-1] = (piece_req[1:] != piece_req[:-1]) | (piece_block[1:] != piece_block[:-1])
    ids = splitmix64(prefix[last])
    return input_tokens, pa.ListArray.from_arrays(offsets, pa.array(ids, pa.uint64()))


def chain_ids(raw: pa.ListArray, namespace: np.uint64 | int = 0) -> pa.ListArray:
    """Turn per-block content ids (not prefix-chained) into prefix-chained ids: id_i = H(id_{i-1}, raw_i)."""
    offsets = np.asarray(raw.offsets)
    values = np.asarray(raw.values.cast(pa.uint64()))
    lengths = np.diff(offsets)
    pos = np.arange(values.size) - np.repeat(offsets[:-1], lengths)
    if pos.size and pos.max() >= _MAX_PIECES:
        raise ValueError(f"a prompt has more than {_MAX_PIECES} blocks")
    h = mix(namespace, values)
    with np.errstate(over="ignore"):
        running = np.cumsum(h * _POW[pos], dtype=np.uint64)
        first = np.repeat(offsets[:-1], lengths)
        before = np.where(first > 0, running[np.maximum(first - 1, 0)], 0).astype(np.uint64)
        prefix = running - before
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(splitmix64(prefix), pa.uint64()))


def is_prefix_consistent(raw: pa.ListArray) -> bool:
    """True when raw ids already behave as prefix-chained ids: each id always follows the same id at the
    same position (then equal id <=> equal prefix, as far as the data can tell)."""
    offsets = np.asarray(raw.offsets)
    values = np.asarray(raw.values.cast(pa.uint64()))
    if values.size == 0:
        return True
    lengths = np.diff(offsets)
    pos = np.arange(values.size) - np.repeat(offsets[:-1], lengths)
    prev = np.empty_like(values)
    prev[1:] = values[:-1]
    prev[pos == 0] = np.uint64(0xFFFFFFFFFFFFFFFF)
    order = np.argsort(values, kind="stable")
    v, p, q = values[order], prev[order], pos[order]
    same = v[1:] == v[:-1]
    return not bool(np.any(same & ((p[1:] != p[:-1]) | (q[1:] != q[:-1]))))
