"""One-pass hit-rate-vs-capacity curve of `lru` by LRU stack distances (docs/fidelity.md: why `vllm` has none).

Block LRU references every block of a request in prompt order, so at any time a cache of C blocks holds exactly
the C most recently referenced distinct keys. (`vllm` is not a stack algorithm: its pool holds anonymous blocks
for generated tokens and duplicate copies, so its hit rate at C blocks is not a function of stack depths.)
One pass over the trace gives, for every block of every request, its
*lookup depth*: its position in the LRU stack when the request arrives (1 = most recent; never referenced =
infinite). Block i then hits at capacity C iff blocks 0..i all have depth <= C (the prefix rule) and
i < max_hit. The pass keeps, per block, the running maximum of those depths over blocks 0..i, so the hit
blocks of every request at *every* capacity come from one array; histograms of it give the totals.

Depths come from a Fenwick tree over reference times holding a 1 at each key's last reference: the depth of
a key last referenced at time t is the number of ones in [t, now]. (Depths taken at the lookup, before the
request's own references, equal the usual rule "max stack distance over blocks 0..i <= C".)

The curve is exact: at every capacity its hit blocks per request equal a replay of the `lru` kernel (tests
check this).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbench.cache.compiled import i4, i8, kernel_fn
from kvbench.cache.densify import scratch
from kvbench.cache.prepared import PreparedTrace
from kvbench.trace.stats import DEFAULT_WARMUP

NEVER = np.iinfo(np.int32).max  # depth of a block no capacity holds at the lookup


@kernel_fn()
def fenwick_range(bit, a, b):
    """Sum of positions a..b (1-based, a <= b + 1) of the Fenwick tree: the two prefix walks meet early when
    the range is short, as reuse ranges mostly are."""
    s = 0
    i, j = b, a - 1
    while i != j:
        if i > j:
            s += bit[i]
            i -= i & -i
        else:
            s -= bit[j]
            j -= j & -j
    return s


@kernel_fn()
def fenwick_unmark(bit, t, now):
    """Remove the 1 at time `t` (<= now); nodes above `now` are not read before `fenwick_mark` builds them."""
    while t <= now:
        bit[t] -= 1
        t += t & -t


@kernel_fn()
def fenwick_mark(bit, now):
    """Append a 1 at time `now`: its node covers (now - lowbit(now), now], the mark and its child nodes."""
    s = 1
    low = now - (now & -now)
    c = now - 1
    while c > low:
        s += bit[c]
        c -= c & -c
    bit[now] = s


@kernel_fn("i4[::1](i4[::1], i8[::1], i4[::1], i8, i4[::1], i4[::1])")
def _depths(keys, offsets, max_hit, n_keys, bit, last):
    """For every reference j, the largest lookup depth over the blocks of its request up to j (NEVER when one
    of them is not cached at any capacity, or j >= max_hit). `bit` (int32[m + 1]) and `last` (int32[n_keys])
    are work buffers."""
    n = offsets.size - 1
    m = keys.size
    never = np.int32(NEVER)
    depth = np.empty(m, np.int32)
    last[:] = 0  # time of the key's last reference, 1-based; 0 = never referenced
    bit[0] = 0
    now = 0  # references made so far
    distinct = 0  # keys referenced so far (= ones in the tree)
    for r in range(n):
        lo, hi = offsets[r], offsets[r + 1]
        # lookup: depths before any of this request's references
        pm = 0
        j = lo
        end = lo + max_hit[r]
        while j < end:
            t = last[keys[j]]
            if t == 0:
                break
            d = fenwick_range(bit, t, now)
            if d > pm:
                pm = d
            depth[j] = pm
            j += 1
        for i in range(j, hi):
            depth[i] = never
        # update: reference the blocks in prompt order
        for i in range(lo, hi):
            k = keys[i]
            t = last[k]
            if t > 0:
                fenwick_unmark(bit, t, now)
            else:
                distinct += 1
            now += 1
            fenwick_mark(bit, now)
            last[k] = now
    return depth


@kernel_fn("i8[:, ::1](i4[::1], i8[::1], i4[::1], i8[::1], i8, i8, i8)")
def _histograms(depth, offsets, max_hit, input_tokens, block_size, steady_from, n_keys):
    """Hit blocks and hit tokens by prefix depth, over all requests and over the steady state, cumulated:
    entry C is what a cache of C blocks hits (C = 0..n_keys)."""
    out = np.zeros((4, n_keys + 1), np.int64)  # blocks all, blocks steady, tokens all, tokens steady
    for r in range(offsets.size - 1):
        lo = offsets[r]
        left = input_tokens[r]
        steady = r >= steady_from
        for j in range(lo, lo + max_hit[r]):
            d = depth[j]
            if d > n_keys:
                break
            w = min(block_size, left)  # tokens of this block (the last one may be partial)
            left -= w
            out[0, d] += 1
            out[2, d] += w
            if steady:
                out[1, d] += 1
                out[3, d] += w
    for row in range(4):
        for c in range(1, n_keys + 1):
            out[row, c] += out[row, c - 1]
    return out


@kernel_fn("i4[::1](i4[::1], i8[::1], i4[::1], i8)")
def _hit_blocks_at(depth, offsets, max_hit, capacity):
    n = offsets.size - 1
    out = np.zeros(n, np.int32)
    for r in range(n):
        lo = offsets[r]
        h = 0
        while h < max_hit[r] and depth[lo + h] <= capacity:
            h += 1
        out[r] = h
    return out


@dataclass
class CurvePoints:
    """Totals at an array of capacities (blocks): hit tokens / blocks over all requests and in the steady state,
    with the matching denominators; `rates()` gives the hit rates."""

    capacity_blocks: np.ndarray  # int64[k]
    hit_tokens_all: np.ndarray  # int64[k]
    hit_tokens_steady: np.ndarray
    hit_blocks_all: np.ndarray
    hit_blocks_steady: np.ndarray
    input_tokens_all: int
    input_tokens_steady: int
    blocks_all: int
    blocks_steady: int

    def rates(self) -> dict[str, np.ndarray]:
        def ratio(num, den):
            return num / den if den else np.zeros(num.size)

        return {
            "token_all": ratio(self.hit_tokens_all, self.input_tokens_all),
            "token_steady": ratio(self.hit_tokens_steady, self.input_tokens_steady),
            "block_all": ratio(self.hit_blocks_all, self.blocks_all),
            "block_steady": ratio(self.hit_blocks_steady, self.blocks_steady),
        }


@dataclass
class Curve:
    """Hit blocks of every request at every capacity, from one pass (see the module docstring)."""

    policy: str  # "lru"
    warmup: float
    block_size: int
    n_keys: int
    depth: np.ndarray  # int32[m]: per reference, max lookup depth over its request's blocks so far (or NEVER)
    offsets: np.ndarray
    max_hit: np.ndarray
    cumulative: np.ndarray  # int64[4, n_keys + 1]: hit blocks all/steady, hit tokens all/steady at C = 0..n_keys
    input_tokens_all: int
    input_tokens_steady: int
    blocks_all: int
    blocks_steady: int

    def at(self, capacities) -> CurvePoints:
        """Totals at each capacity in blocks (any non-negative integers; beyond n_keys nothing changes)."""
        caps = np.atleast_1d(np.asarray(capacities, dtype=np.int64))
        if (caps < 0).any():
            raise ValueError("capacities must be >= 0 blocks")
        cols = self.cumulative[:, np.minimum(caps, self.n_keys)]
        return CurvePoints(
            caps,
            cols[2],
            cols[3],
            cols[0],
            cols[1],
            self.input_tokens_all,
            self.input_tokens_steady,
            self.blocks_all,
            self.blocks_steady,
        )

    def hit_rates(self, capacities) -> dict[str, np.ndarray]:
        """token_all / token_steady / block_all / block_steady hit rates at each capacity."""
        return self.at(capacities).rates()

    def hit_blocks(self, capacity: int) -> np.ndarray:
        """int32[n]: leading blocks of each request that hit at this capacity (what a kernel replay gives)."""
        return _hit_blocks_at(i4(self.depth), i8(self.offsets), i4(self.max_hit), int(capacity))

    def hit_tokens(self, capacity: int, input_tokens: np.ndarray) -> np.ndarray:
        return np.minimum(self.hit_blocks(capacity).astype(np.int64) * self.block_size, input_tokens)

    def summary(self, capacities) -> dict:
        """JSON-ready: the capacities and the four hit rates at each (the sim backend's `curve` record)."""
        pts = self.at(capacities)
        return {
            "capacity_blocks": [int(c) for c in pts.capacity_blocks],
            **{k: [float(x) for x in v] for k, v in pts.rates().items()},
        }


def lru_curve(trace: PreparedTrace, warmup: float = DEFAULT_WARMUP) -> Curve:
    """The one-pass curve of `lru` (the hit caps come from `trace.max_hit`)."""
    n = trace.n_requests
    last = scratch("curve.last", trace.n_keys, np.int32)
    bit = scratch("curve.bit", trace.keys.size + 1, np.int32)
    offsets, max_hit, input_tokens = i8(trace.offsets), i4(trace.max_hit), i8(trace.input_tokens)
    block_size, n_keys = int(trace.block_size), int(trace.n_keys)
    depth = _depths(i4(trace.keys), offsets, max_hit, n_keys, bit, last)
    steady_from = int(n * warmup)
    cumulative = _histograms(depth, offsets, max_hit, input_tokens, block_size, steady_from, n_keys)
    n_blocks = trace.n_blocks
    return Curve(
        policy="lru",
        warmup=warmup,
        block_size=trace.block_size,
        n_keys=trace.n_keys,
        depth=depth,
        offsets=trace.offsets,
        max_hit=trace.max_hit,
        cumulative=cumulative,
        input_tokens_all=int(trace.input_tokens.sum()),
        input_tokens_steady=int(trace.input_tokens[steady_from:].sum()),
        blocks_all=int(n_blocks.sum()),
        blocks_steady=int(n_blocks[steady_from:].sum()),
    )
