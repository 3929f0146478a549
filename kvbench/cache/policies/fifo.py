"""`fifo`: block FIFO (docs/semantics.md, Policies). Hits found by the prefix rule do not refresh anything. After the
lookup every block of the request that is not cached is inserted, in prompt order (a cached one is skipped and
the walk goes on with the next block); when the cache is full the oldest inserted block is evicted, with no
protection for the current request's blocks, so on a tiny cache a request can push out its own earlier blocks.
This is the FIFO of the kvcache.ai simulator: it reproduces the Mooncake numbers
of docs/semantics.md, Reference figures."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvbench.cache.compiled import SIM_OUT, i4, i8, kernel_fn
from kvbench.cache.policies import SimOutput, policy
from kvbench.cache.reference import PrefixCache


class _FifoReference(PrefixCache):
    def __init__(self, *args):
        super().__init__(*args)
        self.queue: OrderedDict[int, None] = OrderedDict()  # oldest insertion first

    def admit(self, key, pos):
        if key in self.queue:
            return True
        if self.full:
            victim, _ = self.queue.popitem(last=False)
            self.evict(victim)
        self.queue[key] = None
        self.insert(key)
        return True


def reference(trace, capacity, options=None) -> SimOutput:
    return _FifoReference(trace, capacity, options).run()


@kernel_fn(SIM_OUT + "(i4[::1], i8[::1], i4[::1], i4[::1], i8, i8, i8)")
def _fifo(keys, offsets, max_hit, tenant, n_keys, n_tenants, capacity):
    n = offsets.size - 1
    # Nothing ever leaves a FIFO except at its head, so a ring of `capacity` slots holds it exactly: once full,
    # the slot about to be overwritten is the oldest insertion. (No more than n_keys slots are ever used.)
    slots = min(capacity, n_keys)
    ring = np.empty(max(slots, 1), np.int32)
    write, size = 0, 0
    cached = np.zeros(n_keys, np.bool_)
    owner = np.zeros(n_keys, np.int32)
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
        t = tenant[r]
        for j in range(lo, hi):
            k = keys[j]
            if cached[k]:
                continue
            if size >= capacity:
                v = ring[write]
                cached[v] = False
                evictions[r] += 1
                matrix[t, owner[v]] += 1
            else:
                size += 1
                if size >= capacity and filled_at < 0:
                    filled_at = r
            ring[write] = k
            write += 1
            if write == slots:
                write = 0
            cached[k] = True
            owner[k] = t
    return hit_blocks, evictions, matrix, filled_at


@policy("fifo", reference=reference, cache=_FifoReference)
def kernel(trace, capacity, options=None) -> SimOutput:
    """Block FIFO: missing blocks are inserted in order, the oldest insertion is evicted; hits do not refresh."""
    out = _fifo(
        i4(trace.keys),
        i8(trace.offsets),
        i4(trace.max_hit),
        i4(trace.tenant),
        int(trace.n_keys),
        len(trace.tenant_names),
        int(capacity),
    )
    return SimOutput(*out)
