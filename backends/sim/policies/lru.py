"""`lru`: classic block LRU. After the lookup every block of the request is referenced in order: a cached
block becomes most recent, a missing one is inserted and evicts the least recent block, which may be an
earlier block of the same request when the capacity is tiny (DESIGN.md section 5)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from numba import njit

from . import SimOutput, policy
from ._reference import PrefixCache


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


@njit(cache=True)
def _lru(keys, offsets, max_hit, tenant, n_keys, n_tenants, capacity):
    n = offsets.size - 1
    # Doubly linked recency list over dense keys; head = least recent. -1 terminates.
    prev = np.full(n_keys, -1, np.int32)
    nxt = np.full(n_keys, -1, np.int32)
    cached = np.zeros(n_keys, np.bool_)
    owner = np.zeros(n_keys, np.int32)
    head, tail, size = -1, -1, 0
    hit_blocks = np.zeros(n, np.int32)
    evictions = np.zeros(n, np.int32)
    matrix = np.zeros((n_tenants, n_tenants), np.int64)
    filled_at = -1
    for r in range(n):
        lo, hi = offsets[r], offsets[r + 1]
        h = 0
        while h < max_hit[r] and cached[keys[lo + h]]:
            h += 1
        hit_blocks[r] = h
        for j in range(lo, hi):
            k = keys[j]
            if cached[k]:
                if k == tail:
                    continue
                # unlink
                p, q = prev[k], nxt[k]
                if p != -1:
                    nxt[p] = q
                else:
                    head = q
                prev[q] = p
            else:
                if size >= capacity:
                    v = head
                    head = nxt[v]
                    if head != -1:
                        prev[head] = -1
                    else:
                        tail = -1
                    cached[v] = False
                    size -= 1
                    evictions[r] += 1
                    matrix[tenant[r], owner[v]] += 1
                cached[k] = True
                owner[k] = tenant[r]
                size += 1
                if size >= capacity and filled_at < 0:
                    filled_at = r
            # link at tail (most recent)
            prev[k] = tail
            nxt[k] = -1
            if tail != -1:
                nxt[tail] = k
            else:
                head = k
            tail = k
    return hit_blocks, evictions, matrix, filled_at


@policy("lru", reference=reference, stack=True)
def kernel(trace, capacity, options=None) -> SimOutput:
    """Classic block LRU: every block of a request is referenced in order."""
    out = _lru(trace.keys, trace.offsets, trace.max_hit, trace.tenant, trace.n_keys,
               len(trace.tenant_names), capacity)
    return SimOutput(*out)
