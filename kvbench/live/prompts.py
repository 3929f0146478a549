"""Prompts synthesised from block ids, for backends that need real tokens (live engines, real attention).

A trace stores block ids, not text. `kvbench.trace.tokens` draws the tokens: token i of block j from the block's id
alone (splitmix64 of id and i), so two requests get the same tokens exactly where their block ids are equal, which
is where the trace says they share content: an engine's prefix cache sees the sharing the trace describes, and
nothing else (docs/semantics.md, Block ids and prompts). Multimodal spans (`mm_items`) are then overwritten with a token
run drawn from the item's content hash, so the same image, video or audio clip is the same tokens wherever it
appears; that is how a text-only engine sees media (it cannot reuse an encoder output, only a prefix).

Engines cache by their own block size, usually smaller than the trace's. `rebase_blocks` gives a trace the
block ids of another block size from the tokens synthesised here (not from the trace's ids): equal id exactly
where the prompts have equal tokens from their start to the end of that block, as an engine that hashes token
blocks sees them, so that a simulator fed the re-cut trace predicts what the engine can hit.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.trace.blockhash import splitmix64


def words(tokens) -> str:
    """The prompt as text for engines whose tokenizer has one token per word `w<id>` (kvbench's tiny model);
    with any other tokenizer the token count will differ, so use token-id prompts there."""
    return " ".join(f"w{t}" for t in np.asarray(tokens).tolist())


# --- rebase: block ids at an engine's block size, from the tokens that prompts are made of ---------------------

# Multiplier of the polynomial prefix hash over a prompt's runs; odd, so that it is invertible mod 2**64.
_RUN_RADIX = np.uint64(0x9FB21C651E98DF25)
# Odd 64-bit factors that place a piece's index and length in its hash key (those of splitmix64).
_INDEX_FACTOR = np.uint64(0xBF58476D1CE4E5B9)
_LENGTH_FACTOR = np.uint64(0x94D049BB133111EB)
# Pieces hashed per pass: a pass's dozen 8-byte arrays then stay in the CPU caches (measured: 2-4x faster
# than passes of a million pieces), and a rebase's working memory stays small for any trace.
_PIECES_PER_PASS = 65_536
_radix_powers_table = np.ones(1, dtype=np.uint64)


def _radix_powers(n: int) -> np.ndarray:
    """_RUN_RADIX**i mod 2**64 for i < n (at least), grown by doubling and kept for the next call."""
    global _radix_powers_table
    table = _radix_powers_table
    with np.errstate(over="ignore"):
        while table.size < n:
            table = np.concatenate([table, table * (table[-1] * _RUN_RADIX)])
    _radix_powers_table = table
    return table


def rebase_blocks(table: pa.Table, block_size: int, engine_block_size: int) -> pa.ListArray:
    """block_hashes at `engine_block_size` tokens a block (ceil(input_tokens / engine_block_size) ids per
    request), such that equal id <=> equal tokens from the start of the prompt to the end of that block, the
    tokens being those `prompt_tokens` synthesises from the trace (what a live replay sends). A simulator fed
    these ids then predicts the hits of an engine that caches by hashing token blocks of that size.

    Every synthesised token is the draw splitmix64(mix(seed, index)) of one (seed, index) pair: (id of trace
    block j, position in the block) for text, (item hash, position in the item) inside a media span, the later
    item winning where items overlap. Cut at the engine's block boundaries, a prompt is a sequence of pieces,
    each a maximal stretch of tokens whose seed stays the same while the index goes up by one, so that two
    prompts have the same tokens up to a block boundary exactly when they have the same pieces up to it (short
    of two different pairs drawing the same 64 bits). Block b's id hashes the pieces up to its end. Deriving
    the ids from the trace's ids instead would split a block that lies inside a shared image but whose trace
    block goes on into different text; the engine sees the same tokens there and hits. Any engine block size
    works, not only one that divides the trace's.
    """
    if engine_block_size <= 0:
        raise ValueError(f"the engine block size must be a positive number of tokens, got {engine_block_size}")
    hashes = table.column("block_hashes").combine_chunks()
    first_id = hashes.offsets[0].as_py()
    # index, in `trace_ids`, of each request's first trace block (and one past the last request's last)
    block_start = np.asarray(hashes.offsets, dtype=np.int64) - first_id
    trace_ids = np.asarray(hashes.values.slice(first_id, int(block_start[-1])), dtype=np.uint64)
    input_tokens = table.column("input_tokens").to_numpy().astype(np.int64)
    short = np.diff(block_start) < -(-input_tokens // block_size)
    if short.any():
        raise ValueError(
            f"row {int(np.flatnonzero(short)[0])} has fewer block ids than its input_tokens need at block size "
            f"{block_size}: its prompt cannot be synthesised"
        )
    media = _media_spans(table, input_tokens)
    # Text is cut where either block size has a boundary; pieces are merged back within an engine block.
    grid = math.gcd(block_size, engine_block_size)

    # requests in passes of about _PIECES_PER_PASS pieces (a request has up to L / grid + 2 per media span + 1)
    estimate = np.cumsum(input_tokens // grid + 2 * np.bincount(media.request, minlength=input_tokens.size) + 2)
    ids, counts = [], []
    lo = 0
    while lo < input_tokens.size:
        done = estimate[lo - 1] if lo else 0
        hi = max(int(np.searchsorted(estimate, done + _PIECES_PER_PASS, side="right")), lo + 1)
        pass_ids, pass_counts = _rebase_requests(
            lo, hi, input_tokens, block_start, trace_ids, media, block_size, engine_block_size, grid
        )
        ids.append(pass_ids)
        counts.append(pass_counts)
        lo = hi
    counts = np.concatenate(counts) if counts else np.zeros(0, np.int64)
    offsets = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"{offsets[-1]:,} blocks at block size {engine_block_size} overflow a list<uint64> column")
    values = np.concatenate(ids) if ids else np.zeros(0, np.uint64)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, pa.uint64()))


class _MediaSpans:
    """Token spans of media, one request after another, each in position order and disjoint: tokens
    [start, end) of `request`'s prompt are draws (seed, first_index + k), k = 0, 1, ..."""

    def __init__(self, request, start, end, seed, first_index):
        self.request = np.asarray(request, dtype=np.int64)
        self.start = np.asarray(start, dtype=np.int64)
        self.end = np.asarray(end, dtype=np.int64)
        self.seed = np.asarray(seed, dtype=np.uint64)
        self.first_index = np.asarray(first_index, dtype=np.int64)


def _media_spans(table: pa.Table, input_tokens: np.ndarray) -> _MediaSpans:
    """The spans `overlay_media` writes, with its clipping (to the prompt) and precedence (a later item of the
    list overwrites an earlier one where they overlap)."""
    none = _MediaSpans(*([],) * 5)
    if "mm_items" not in table.column_names or table.column("mm_items").null_count == table.num_rows:
        return none
    lists = table.column("mm_items").combine_chunks()
    items = pc.list_flatten(lists)
    if len(items) == 0:
        return none
    owner = np.asarray(pc.list_parent_indices(lists), dtype=np.int64)

    def field(name, dtype):
        return pc.struct_field(items, name).fill_null(0).to_numpy(zero_copy_only=False).astype(dtype)

    seed, offset, length = field("hash", np.uint64), field("offset", np.int64), field("tokens", np.int64)
    start = np.maximum(offset, 0)  # an item's run starts at its index 0 wherever the clipped span starts
    end = np.minimum(input_tokens[owner], start + length)
    keep = end > start
    owner, start, end, seed = owner[keep], start[keep], end[keep], seed[keep]
    first_index = np.zeros(owner.size, dtype=np.int64)

    order = np.lexsort((start, owner))
    s_owner, s_start, s_end = owner[order], start[order], end[order]
    # sorted by position, a request's spans overlap somewhere exactly when two neighbours do
    overlap = (s_owner[1:] == s_owner[:-1]) & (s_start[1:] < s_end[:-1])
    if not overlap.any():
        return _MediaSpans(s_owner, s_start, s_end, seed[order], first_index)

    # Overlapping items (no generator makes them) are resolved request by request, in list order.
    tangled = np.isin(owner, s_owner[1:][overlap])
    parts = [(owner[~tangled], start[~tangled], end[~tangled], seed[~tangled], first_index[~tangled])]
    for r in np.unique(owner[tangled]):
        mine = np.flatnonzero(owner == r)
        cuts = np.unique(np.concatenate([start[mine], end[mine]]))
        for a, b in zip(cuts[:-1], cuts[1:]):
            covering = mine[(start[mine] <= a) & (end[mine] >= b)]
            if covering.size:
                top = covering[-1]  # the last item in the list is the one overlay_media wrote last
                parts.append(([r], [a], [b], [seed[top]], [a - start[top]]))
    owner, start, end, seed, first_index = (np.concatenate([np.asarray(p[i]) for p in parts]) for i in range(5))
    order = np.lexsort((start, owner))
    return _MediaSpans(owner[order], start[order], end[order], seed[order], first_index[order])


def _rebase_requests(
    lo: int,
    hi: int,
    input_tokens: np.ndarray,
    block_start: np.ndarray,
    trace_ids: np.ndarray,
    media: _MediaSpans,
    block_size: int,
    engine_block_size: int,
    grid: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Engine-size block ids of requests lo..hi-1 (request-local numbering below), and their counts."""
    n = hi - lo
    length = input_tokens[lo:hi]
    a, b = np.searchsorted(media.request, [lo, hi])
    m_req = media.request[a:b] - lo
    m_start, m_end = media.start[a:b], media.end[a:b]

    # Runs in prompt order: the media spans, and the text around them (before each span, and after the last).
    after_previous = np.zeros(m_req.size, dtype=np.int64)
    same = np.flatnonzero(m_req[1:] == m_req[:-1]) + 1
    after_previous[same] = m_end[same - 1]
    last_end = np.zeros(n, dtype=np.int64)
    is_last = np.ones(m_req.size, dtype=bool)
    is_last[:-1] = m_req[1:] != m_req[:-1]
    last_end[m_req[is_last]] = m_end[is_last]
    run_req = np.concatenate([m_req, m_req, np.arange(n)])
    run_start = np.concatenate([m_start, after_previous, last_end])
    run_end = np.concatenate([m_end, m_start, length])
    run_media = np.concatenate([np.ones(m_req.size, bool), np.zeros(m_req.size + n, bool)])
    run_seed = np.concatenate([media.seed[a:b], np.zeros(m_req.size + n, np.uint64)])
    run_index = np.concatenate([media.first_index[a:b], np.zeros(m_req.size + n, np.int64)])
    keep = run_end > run_start
    order = np.flatnonzero(keep)[np.lexsort((run_start[keep], run_req[keep]))]
    run_req, run_start, run_end = run_req[order], run_start[order], run_end[order]
    run_media, run_seed, run_index = run_media[order], run_seed[order], run_index[order]

    # Runs cut into pieces on the grid of both block sizes: a piece lies in one trace block (one seed for
    # text) and in one engine block.
    first_cell = run_start // grid
    per_run = (run_end - 1) // grid - first_cell + 1
    piece_run = np.repeat(np.arange(run_req.size), per_run)
    cell = np.arange(piece_run.size) - np.repeat(np.cumsum(per_run) - per_run - first_cell, per_run)
    p_start = np.maximum(run_start[piece_run], cell * grid)
    p_len = np.minimum(run_end[piece_run], cell * grid + grid) - p_start
    req = run_req[piece_run]
    block = cell // (engine_block_size // grid)
    trace_block = cell // (block_size // grid)
    seed = trace_ids[block_start[lo:hi][req] + trace_block]  # text; media pieces are overwritten next
    index = p_start - trace_block * block_size
    if m_req.size:
        media_piece = np.flatnonzero(run_media[piece_run])
        of_run = piece_run[media_piece]
        seed[media_piece] = run_seed[of_run]
        index[media_piece] = run_index[of_run] + p_start[media_piece] - run_start[of_run]

    # Merge neighbours that continue each other inside an engine block: the same tokens then always give
    # the same pieces, however the trace's blocks and items happen to cut them. (Without media and with an
    # engine block inside one trace block, every piece is a whole engine block already.)
    one_piece_a_block = not m_req.size and grid == engine_block_size
    if not one_piece_a_block:
        continues = (req[1:] == req[:-1]) & (block[1:] == block[:-1]) & (seed[1:] == seed[:-1])
        continues &= index[1:] == index[:-1] + p_len[:-1]
        if continues.any():
            head = np.flatnonzero(np.concatenate([[True], ~continues]))
            p_len = np.add.reduceat(p_len, head)
            req, block, seed, index = req[head], block[head], seed[head], index[head]

    # Polynomial prefix hash over each request's pieces; a block's id is the hash at its last piece.
    if req.size == 0:
        return np.zeros(0, np.uint64), np.zeros(n, np.int64)
    # One mixing round per piece, as for the trace's own ids (blockhash): seeds are 64-bit hashes already.
    with np.errstate(over="ignore"):
        piece_key = seed + index.astype(np.uint64) * _INDEX_FACTOR
        piece_key += p_len.astype(np.uint64) * _LENGTH_FACTOR
    piece_hash = splitmix64(piece_key)
    req_first = np.searchsorted(req, np.arange(n))
    position = np.arange(req.size) - req_first[req]
    powers = _radix_powers(int(position.max()) + 1)
    with np.errstate(over="ignore"):
        running = np.cumsum(piece_hash * powers[position], dtype=np.uint64)
        before = running[np.maximum(req_first - 1, 0)]
        before[req_first == 0] = 0
        prefix = running - before[req]
    if one_piece_a_block:
        return prefix, np.bincount(req, minlength=n)
    last = np.ones(req.size, dtype=bool)
    last[:-1] = (req[1:] != req[:-1]) | (block[1:] != block[:-1])
    # (prefix hashes are ids as they are: a final mixing round, a bijection, would change no equality)
    return prefix[last], np.bincount(req[last], minlength=n)
