"""`lru`: classic block LRU. After the lookup every block of the request is referenced in order: a cached
block becomes most recent, a missing one is inserted and evicts the least recent block, which may be an
earlier block of the same request when the capacity is tiny (docs/semantics.md, Policies)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvbench.cache.compiled import SIM_OUT, i4, i8, kernel_fn
from kvbench.cache.policies import FILLED_AT, FIRST_REQUEST, SIZE, STARTED, TAIL, UNCACHED, Carry, SimOutput, policy
from kvbench.cache.reference import PrefixCache


class _LruReference(PrefixCache):
    def __init__(self, *args):
        super().__init__(*args)
        self.order: OrderedDict[int, None] = OrderedDict()  # least recent first

    def on_hit(self, key, pos):
        self.order.move_to_end(key)

    def admit(self, key, pos):
        if key in self.order:
            self.order.move_to_end(key)
            return True
        if self.full:
            victim, _ = self.order.popitem(last=False)
            self.evict(victim)
        self.order[key] = None
        self.insert(key)
        return True


def reference(trace, capacity, options=None) -> SimOutput:
    return _LruReference(trace, capacity, options).run()


_NONE = UNCACHED


@kernel_fn(SIM_OUT + "(u4[::1], i8[::1], i4[::1], i4[::1], i8, i8, i8, u4[::1], i4[::1], i8[:])")
def _lru(keys, offsets, max_hit, tenant, n_keys, n_tenants, capacity, link, owner, state):
    """`keys` viewed as uint32 and `link` (uint32[2 * n_keys + 2], work buffer): the recency list, prev of key
    k at 2k and next at 2k+1, prev = _NONE when k is not cached. Node S = n_keys is the sentinel of the
    circular list (its next is the least recent key, the head), so linking and unlinking never branch on the
    ends; the most recent key, the tail, is kept in a local. Indices are unsigned so that numba emits no
    negative-index fix-ups. `owner` (int32[n_keys], work buffer) is used only with several tenants.
    `state` (STATE_FIELDS) carries the cache across calls, so that a trace can be fed in chunks."""
    n = offsets.size - 1
    one, two = np.uint64(1), np.uint64(2)
    S = np.uint64(n_keys)
    s32 = np.uint32(n_keys)
    if state[STARTED] == 0:
        link[: 2 * n_keys] = _NONE
        link[two * S] = s32
        link[two * S + one] = s32
        state[STARTED], state[TAIL], state[FILLED_AT] = 1, n_keys, -1
    tail = np.uint64(state[TAIL])
    size = state[SIZE]
    filled_at = state[FILLED_AT]
    base = state[FIRST_REQUEST]
    multi = n_tenants > 1
    hit_blocks = np.zeros(n, np.int32)
    evictions = np.zeros(n, np.int32)
    matrix = np.zeros((n_tenants, n_tenants), np.int64)
    total_evictions = 0
    for r in range(n):
        lo, hi = offsets[r], offsets[r + 1]
        # The lookup is folded into the update: while every earlier block hit, nothing was evicted, so the
        # cache holds exactly what the lookup saw.
        prefix_end = lo + max_hit[r]
        h = lo
        ev = 0
        t = tenant[r]
        for j in range(lo, hi):
            k = np.uint64(keys[j])
            p = link[two * k]
            if p != _NONE:  # cached: unlink (nothing to do for the most recent key)
                if h == j and j < prefix_end:
                    h += 1
                if k == tail:
                    continue
                q = link[two * k + one]
                link[two * np.uint64(p) + one] = q
                link[two * np.uint64(q)] = p
            else:
                if size >= capacity:  # evict the head (least recent)
                    v = np.uint64(link[two * S + one])
                    q = link[two * v + one]
                    link[two * S + one] = q
                    link[two * np.uint64(q)] = s32
                    link[two * v] = _NONE
                    if q == s32:
                        tail = S
                    ev += 1
                    if multi:
                        matrix[t, owner[v]] += 1
                else:
                    size += 1
                    if size >= capacity and filled_at < 0:
                        filled_at = base + r
                if multi:
                    owner[k] = t
            # link at the tail (most recent)
            link[two * k] = np.uint32(tail)
            link[two * k + one] = s32
            link[two * tail + one] = np.uint32(k)
            tail = k
        hit_blocks[r] = h - lo
        evictions[r] = ev
        total_evictions += ev
    if not multi and n_tenants == 1:
        matrix[0, 0] = total_evictions
    state[TAIL], state[SIZE], state[FILLED_AT], state[FIRST_REQUEST] = tail, size, filled_at, base + n
    return hit_blocks, evictions, matrix, filled_at


class LruCache(Carry):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.link = self.buffer("lru.link", 2 * self.n_ids + 2, np.uint32)
        self.owner = self.buffer("lru.owner", self.n_ids if self.n_tenants > 1 else 0, np.int32)

    def feed(self, chunk) -> SimOutput:
        out = _lru(
            np.ascontiguousarray(chunk.keys, dtype=np.int32).view(np.uint32),
            i8(chunk.offsets),
            i4(chunk.max_hit),
            i4(chunk.tenant),
            self.n_ids,
            self.n_tenants,
            int(self.capacity),
            self.link,
            self.owner,
            self.state,
        )
        return SimOutput(*out)


@policy("lru", reference=reference, cache=_LruReference, stack=True, carry=LruCache)
def kernel(trace, capacity, options=None) -> SimOutput:
    """Classic block LRU: every block of a request is referenced in order."""
    return LruCache.run(trace, capacity)
