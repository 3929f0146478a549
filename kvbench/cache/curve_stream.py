"""The one-pass `lru` curve (`kvbench.cache.curve`) of a trace given chunk by chunk, in memory that grows with
the deepest capacity asked for, not with the trace.

`curve.lru_curve` keeps every key's last reference time and a Fenwick tree over all reference times: 12 bytes
a block reference. But a lookup depth only matters up to the largest capacity sampled, `depth`: a key deeper
than that misses at every sampled capacity, whatever its exact depth. So this pass keeps only the `depth` most
recently referenced keys (exactly what an LRU cache of `depth` blocks holds):

- a hash table (linear probing, deletion by backward shift) from each of them to its last reference time;
- a Fenwick tree with a 1 at each of those times, over a time axis of 2 x `depth` steps that is compacted
  (the live times renumbered 1..live, in order) when it fills, so times never outgrow it;
- on a reference that makes the window hold `depth` + 1 keys, the oldest one is dropped (a pointer walks the
  time axis to it: marks only go away behind it).

Depths within the window are then the in-memory ones (every key more recent than a windowed key is in the
window), and a key outside it is deeper than `depth`. The prefix rule needs no per-reference array either:
a request's block j hits at capacity C iff the running maximum of its depths over blocks 0..j is <= C, so
each block adds its weight (1 block, its tokens) to the histogram bucket of the smallest sampled capacity at
or above that running maximum; cumulated, the buckets are the hits at each sampled capacity.

Memory: 12 bytes a hash slot (1.5-3 slots a windowed key) and 8 bytes a step of the time axis: at most
`BYTES_PER_DEPTH` a unit of depth, plus one chunk.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa

from kvbench.cache.compiled import i8, kernel_fn
from kvbench.cache.curve import fenwick_mark, fenwick_range, fenwick_unmark
from kvbench.cache.densify import mix64
from kvbench.cache.prepared import fold_isolation
from kvbench.trace.outofcore import InfiniteCacheStream

BYTES_PER_DEPTH = 3 * 12 + 2 * 8  # hash slots at their sparsest, and the time axis (Fenwick tree, slot of a time)
MEMORY_SHARE = 0.5  # of the memory available when the replay starts: what the window may take
_NOW, _LIVE, _OLDEST = 0, 1, 2  # the kernel's counters: time of the last reference, windowed keys, oldest mark


@kernel_fn()
def _slot(x, slot_key, slot_time, mask):
    """The slot holding key `x`, or the empty slot where it would go (slot_time 0 = empty)."""
    h = mix64(x) & mask
    while slot_time[h] != 0 and slot_key[h] != x:
        h = (h + np.uint64(1)) & mask
    return h


@kernel_fn()
def _delete(i, slot_key, slot_time, slot_at, mask):
    """Empty slot `i`, shifting back the entries after it that probed past it (no tombstones), and move the
    time axis' pointers to the slots they moved to."""
    j = i
    while True:
        j = (j + np.uint64(1)) & mask
        if slot_time[j] == 0:
            break
        home = mix64(slot_key[j]) & mask
        # the entry at j may fill i unless its home lies cyclically in (i, j]
        if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
            slot_key[i], slot_time[i] = slot_key[j], slot_time[j]
            slot_at[slot_time[i]] = np.int32(i)
            i = j
    slot_time[i] = 0


@kernel_fn()
def _compact(slot_time, bit, slot_at, st):
    """Renumber the live marks 1..live in time order (the time axis is full)."""
    i = 0
    for t in range(st[_OLDEST], st[_NOW] + 1):
        s = slot_at[t]
        if s >= 0:
            i += 1
            slot_at[i] = s
            slot_time[s] = i
    for t in range(1, i + 1):
        bit[t] = t & -t  # a tree of all ones
    st[_NOW], st[_OLDEST] = i, 1


_FEED = (
    "void(u8[::1], i8[::1], i8[::1], i8, i8, i8, i8, i8[::1], u8[::1], i4[::1], i4[::1], i4[::1], i8[:, ::1], i8[::1])"
)


@kernel_fn(_FEED)
def _feed(keys, offsets, input_tokens, first_row, steady_from, block_size, depth, grid, slot_key, slot_time, bit,
          slot_at, hist, st):  # fmt: skip
    """The chunk's requests (rows first_row, …): hit blocks/tokens, all and steady, into `hist`'s buckets
    (bucket b: running max depth in (grid[b-1], grid[b]]), then their references into the window."""
    mask = np.uint64(slot_key.size - 1)
    axis = bit.size - 1
    for r in range(offsets.size - 1):
        lo, hi = offsets[r], offsets[r + 1]
        steady = first_row + r >= steady_from
        now = st[_NOW]
        pm = 0
        left = input_tokens[r]
        for j in range(lo, hi):  # lookup: depths before the request's own references
            s = _slot(keys[j], slot_key, slot_time, mask)
            if slot_time[s] == 0:
                break  # deeper than `depth`, or never referenced: misses at every sampled capacity
            pm = max(pm, fenwick_range(bit, slot_time[s], now))
            b = np.searchsorted(grid, pm)
            w = min(block_size, left)  # tokens of this block (the last one may be partial)
            left -= w
            hist[0, b] += 1
            hist[2, b] += w
            if steady:
                hist[1, b] += 1
                hist[3, b] += w
        for i in range(lo, hi):  # update: reference the blocks in prompt order
            x = keys[i]
            s = _slot(x, slot_key, slot_time, mask)
            t = slot_time[s]
            if t > 0:
                fenwick_unmark(bit, t, st[_NOW])
                slot_at[t] = -1
            else:
                slot_key[s] = x
                st[_LIVE] += 1
            if st[_NOW] == axis:
                _compact(slot_time, bit, slot_at, st)
            now = st[_NOW] + 1
            st[_NOW] = now
            fenwick_mark(bit, now)
            slot_at[now] = np.int32(s)
            slot_time[s] = now
            if st[_LIVE] > depth:  # drop the least recently referenced key
                o = st[_OLDEST]
                while slot_at[o] < 0:
                    o += 1
                fenwick_unmark(bit, o, now)
                _delete(np.uint64(slot_at[o]), slot_key, slot_time, slot_at, mask)
                slot_at[o] = -1
                st[_OLDEST] = o + 1
                st[_LIVE] -= 1


class StreamCurve:
    """Hit blocks and tokens of `lru` at the capacities `grid` (ascending, blocks) no larger than `depth`, over a
    trace fed chunk by chunk in row order (see the module docstring). `n_requests` and `warmup` place the
    steady state as `curve.lru_curve` does."""

    def __init__(self, grid, depth: int, *, n_requests: int, warmup: float, block_size: int, use_salt: bool,
                 share_lora: bool):  # fmt: skip
        self.grid = i8(grid)[i8(grid) <= depth]
        self.depth = int(self.grid[-1]) if self.grid.size else 0  # nothing deeper is ever looked at
        self.block_size, self.use_salt, self.share_lora = int(block_size), use_salt, share_lora
        self.steady_from = int(n_requests * warmup)
        slots = 1 << max(4, int(1.5 * (depth + 1)).bit_length())
        self.slot_key = np.zeros(slots, np.uint64)
        self.slot_time = np.zeros(slots, np.int32)
        axis = 2 * (self.depth + 1)
        self.bit = np.zeros(axis + 1, np.int32)
        self.slot_at = np.full(axis + 1, -1, np.int32)
        self.hist = np.zeros((4, max(self.grid.size, 1)), np.int64)
        self.st = np.array([0, 0, 1], np.int64)
        self.rows = 0
        # denominators: input tokens, blocks; all and steady
        self.totals = np.zeros(4, np.int64)

    def feed(self, chunk: pa.RecordBatch) -> None:
        table = pa.Table.from_batches([chunk])
        hashes = fold_isolation(table, use_salt=self.use_salt, share_lora=self.share_lora)
        offsets = i8(hashes.offsets)
        offsets = offsets - offsets[0]
        tokens = i8(table.column("input_tokens").to_numpy())
        if self.grid.size:
            keys = np.ascontiguousarray(hashes.flatten(), np.uint64)
            _feed(keys, offsets, tokens, self.rows, self.steady_from, self.block_size, self.depth, self.grid,
                  self.slot_key, self.slot_time, self.bit, self.slot_at, self.hist, self.st)  # fmt: skip
        steady = slice(max(self.steady_from - self.rows, 0), None)
        n_blocks = np.diff(offsets)
        self.totals += [tokens.sum(), tokens[steady].sum(), n_blocks.sum(), n_blocks[steady].sum()]
        self.rows += table.num_rows

    def summary(self) -> dict:
        """As `curve.Curve.summary` at the capacities up to `depth`."""
        hits = np.cumsum(self.hist[:, : self.grid.size], axis=1)
        tok_all, tok_steady, blk_all, blk_steady = (int(x) for x in self.totals)

        def ratio(num, den):
            return num / den if den else np.zeros(num.size)

        rates = {
            "token_all": ratio(hits[2], tok_all),
            "token_steady": ratio(hits[3], tok_steady),
            "block_all": ratio(hits[0], blk_all),
            "block_steady": ratio(hits[1], blk_steady),
        }
        return {
            "capacity_blocks": [int(c) for c in self.grid],
            **{k: [float(x) for x in v] for k, v in rates.items()},
        }


def memory_budget() -> int:
    """Bytes the window may take: `MEMORY_SHARE` of the available memory (MemAvailable, which counts the page
    cache a streamed read fills as free; elsewhere, the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(avail * MEMORY_SHARE)


def distinct_keys(scanned, use_salt: bool, share_lora: bool) -> int:
    """Distinct blocks of a scanned trace with isolation folded in (the in-memory `n_keys`, which places the
    curve's capacities): the scan's count when nothing is folded, else one more pass, out of core."""
    folds = (use_salt and "cache_salt" in scanned.filled) or (not share_lora and "lora" in scanned.filled)
    if not folds:
        return int(scanned.unique_blocks)
    with InfiniteCacheStream() as stream:
        for chunk in scanned.chunks(columns=("cache_salt", "lora")):
            stream.add(fold_isolation(pa.Table.from_batches([chunk]), use_salt=use_salt, share_lora=share_lora))
        return int(stream.finish(dtype=np.int32)[1])
