"""`lfu`: least-frequently-used blocks, least recently used first among equal frequency.

After the lookup every block of the request is referenced in order, as in `lru`: a cached block's frequency
goes up by one, a missing block is inserted with frequency 1 after evicting the block of lowest frequency that
was referenced longest ago (possibly an earlier block of the same request on a tiny cache). Frequency counts
references while the block is cached and starts again from 1 after an eviction (no history is kept).

Kernel: the O(1) LFU of Shah, Mitra and Matani (2010): one doubly linked list per frequency, each in order
of the last reference (a reference moves the block to the tail of the next list), and the lowest non-empty
frequency kept as a running minimum, which can only drop back to 1 when a block is inserted.
Reference: a heap of (frequency, last reference tick, key) with lazy invalidation: an entry is stale once its
key was referenced again or evicted, and is skipped when popped. Both evict the minimum of
(frequency, last reference tick), so they agree exactly.
"""

from __future__ import annotations

import heapq

import numpy as np

from kvbench.cache.compiled import SIM_OUT, i4, i8, kernel_fn
from kvbench.cache.policies import SimOutput, policy
from kvbench.cache.reference import PrefixCache


class _LfuReference(PrefixCache):
    def __init__(self, *args):
        super().__init__(*args)
        self.freq: dict[int, int] = {}
        self.last: dict[int, int] = {}  # key -> tick of its last reference
        self.heap: list[tuple[int, int, int]] = []
        self.tick = 0

    def _reference(self, key):
        self.tick += 1
        self.freq[key] = self.freq.get(key, 0) + 1
        self.last[key] = self.tick
        heapq.heappush(self.heap, (self.freq[key], self.tick, key))

    def on_hit(self, key, pos):
        self._reference(key)

    def admit(self, key, pos):
        if key not in self.owner and self.full:
            while True:
                f, tick, victim = heapq.heappop(self.heap)
                if self.last.get(victim) == tick:  # the entry of the victim's current state
                    break
            del self.freq[victim], self.last[victim]
            self.evict(victim)
        if key not in self.owner:
            self.insert(key)
        self._reference(key)
        return True


def reference(trace, capacity, options=None) -> SimOutput:
    return _LfuReference(trace, capacity, options).run()


@kernel_fn(SIM_OUT + "(i4[::1], i8[::1], i4[::1], i4[::1], i8, i8, i8, i8)")
def _lfu(keys, offsets, max_hit, tenant, n_keys, n_tenants, capacity, max_freq):
    n = offsets.size - 1
    prev = np.full(n_keys, -1, np.int32)
    nxt = np.full(n_keys, -1, np.int32)
    freq = np.zeros(n_keys, np.int32)  # 0 = not cached
    owner = np.zeros(n_keys, np.int32)
    # bucket f: blocks of frequency f, head = least recently referenced
    bhead = np.full(max_freq + 2, -1, np.int32)
    btail = np.full(max_freq + 2, -1, np.int32)
    min_freq, size = 1, 0
    hit_blocks = np.zeros(n, np.int32)
    evictions = np.zeros(n, np.int32)
    matrix = np.zeros((n_tenants, n_tenants), np.int64)
    filled_at = -1
    for r in range(n):
        lo, hi = offsets[r], offsets[r + 1]
        h = 0
        while h < max_hit[r] and freq[keys[lo + h]] > 0:
            h += 1
        hit_blocks[r] = h
        t = tenant[r]
        for j in range(lo, hi):
            k = keys[j]
            f = freq[k]
            if f > 0:
                # unlink from bucket f
                p, q = prev[k], nxt[k]
                if p != -1:
                    nxt[p] = q
                else:
                    bhead[f] = q
                if q != -1:
                    prev[q] = p
                else:
                    btail[f] = p
                if bhead[f] == -1 and min_freq == f:
                    min_freq = f + 1
                f += 1
            else:
                if size >= capacity:
                    v = bhead[min_freq]
                    q = nxt[v]
                    bhead[min_freq] = q
                    if q != -1:
                        prev[q] = -1
                    else:
                        btail[min_freq] = -1
                    freq[v] = 0
                    evictions[r] += 1
                    matrix[t, owner[v]] += 1
                else:
                    size += 1
                    if size >= capacity and filled_at < 0:
                        filled_at = r
                owner[k] = t
                f = 1
                min_freq = 1
            freq[k] = f
            # append at the tail of bucket f (most recent of that frequency)
            p = btail[f]
            prev[k] = p
            nxt[k] = -1
            if p != -1:
                nxt[p] = k
            else:
                bhead[f] = k
            btail[f] = k
    return hit_blocks, evictions, matrix, filled_at


@policy("lfu", reference=reference, cache=_LfuReference)
def kernel(trace, capacity, options=None) -> SimOutput:
    """Least-frequently-used blocks (LRU among equal frequency); every block of a request is referenced."""
    # a block's frequency never exceeds the number of references to its key
    max_freq = int(np.bincount(trace.keys).max()) if trace.keys.size else 1
    out = _lfu(
        i4(trace.keys),
        i8(trace.offsets),
        i4(trace.max_hit),
        i4(trace.tenant),
        int(trace.n_keys),
        len(trace.tenant_names),
        int(capacity),
        int(max_freq),
    )
    return SimOutput(*out)
