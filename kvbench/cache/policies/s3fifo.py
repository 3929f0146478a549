"""`s3fifo`: S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23), on blocks.

After the lookup every block of the request is referenced in order, as in `lru`. The rules, as in the
paper's Algorithm 1 and the artifact it was evaluated with (libCacheSim `S3FIFOv0.c`, default parameters):

- three FIFO queues: small S (target `small_fraction` of the capacity, default 10%, at least one block),
  main M (the rest), and a ghost G of evicted keys only (no KV) holding as many keys as M's capacity;
- a cached block referenced again: freq = min(freq + 1, 3);
- a missing block: if its key is in G it leaves G and is inserted into M, otherwise into S, with freq 0.
  Before inserting into a full cache, evict until one block is freed: evict from M when M holds more than
  its capacity or S is empty, else from S;
- evicting from S: take the oldest block; if freq > 1 (referenced at least twice while in S) move it to M
  with freq 0 (libCacheSim re-creates it there) and look at the next oldest, else evict it and put its key
  into G (dropping G's oldest key when G is full);
- evicting from M: take the oldest block; if freq > 0, re-insert it at M's tail with freq - 1, else evict it.

S's size is a target, not a cap: every new block enters S, and evictions come from S while M holds no more
than its capacity, so S holds whatever M does not (as in S3FIFOv0; later libCacheSim versions differ here).
The code is our own; only the rules come from the paper and libCacheSim. Blocks moved or re-inserted keep
the tenant that inserted them (for the evictor x victim matrix).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvbench.cache.compiled import SIM_OUT, i4, i8, kernel_fn
from kvbench.cache.policies import SimOutput, policy
from kvbench.cache.reference import PrefixCache
from kvbench.options import Bounds, option

DEFAULT_SMALL_FRACTION = 0.1


@dataclass(frozen=True)
class S3FifoOptions:
    """S3-FIFO's option (read and checked by `kvbench.cache.policy_options`)."""

    small_fraction: float | None = option(
        None,
        "S3-FIFO: share of the capacity for the small (probation) FIFO (default 0.1)",
        unit="share of the capacity, 0-1",
        bounds=Bounds(above=0, at_most=1),
    )
MAX_FREQ = 3


def _sizes(capacity: int, options: dict | None) -> tuple[int, int]:
    fraction = float((options or {}).get("small_fraction", DEFAULT_SMALL_FRACTION))
    if not 0 < fraction <= 1:
        raise ValueError(f"small_fraction must be in (0, 1], got {fraction}")
    small = min(capacity, max(1, int(capacity * fraction)))
    return small, capacity - small


class _S3FifoReference(PrefixCache):
    def __init__(self, *args):
        super().__init__(*args)
        _, self.main_cap = _sizes(self.capacity, self.options)
        self.small: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.main: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}

    def on_hit(self, key, pos):
        self.freq[key] = min(self.freq[key] + 1, MAX_FREQ)

    def admit(self, key, pos):
        if key in self.owner:
            self.on_hit(key, pos)
            return True
        to_main = key in self.ghost
        if to_main:
            del self.ghost[key]
        while self.full:
            if len(self.main) > self.main_cap or not self.small:
                self._evict_main()
            else:
                self._evict_small()
        (self.main if to_main else self.small)[key] = None
        self.freq[key] = 0
        self.insert(key)
        return True

    def _evict_small(self):
        while self.small:
            key, _ = self.small.popitem(last=False)
            if self.freq[key] > 1:
                self.main[key] = None
                self.freq[key] = 0
                continue
            del self.freq[key]
            self.evict(key)
            if self.main_cap > 0:
                if len(self.ghost) >= self.main_cap:
                    self.ghost.popitem(last=False)
                self.ghost[key] = None
            return

    def _evict_main(self):
        while self.main:
            key, _ = self.main.popitem(last=False)
            if self.freq[key] > 0:
                self.freq[key] -= 1
                self.main[key] = None
                continue
            del self.freq[key]
            self.evict(key)
            return


def reference(trace, capacity, options=None) -> SimOutput:
    return _S3FifoReference(trace, capacity, options).run()


# Where a key is: 0 = nowhere, else the queue holding it.
SMALL, MAIN, GHOST = 1, 2, 3


@kernel_fn(SIM_OUT + "(i4[::1], i8[::1], i4[::1], i4[::1], i8, i8, i8, i8)")
def _s3fifo(keys, offsets, max_hit, tenant, n_keys, n_tenants, capacity, main_cap):
    n = offsets.size - 1
    # S and M only ever lose blocks at their head (a hit just bumps freq), and |S| + |M| <= capacity, so each is
    # a ring of `capacity` slots (n_keys at most). G also loses keys that come back (ghost hits), so it is an
    # append-only log read from its head, where an entry is live while its key is still in G at that position.
    slots = max(min(capacity, n_keys), 1)
    small = np.empty(slots, np.int32)
    main = np.empty(slots, np.int32)
    s_head, s_len, m_head, m_len = 0, 0, 0, 0
    log = np.empty(keys.size + 1, np.int32)
    log_at = np.zeros(n_keys, np.int64)
    g_head, g_tail, g_len = 0, 0, 0
    where = np.zeros(n_keys, np.int8)
    freq = np.zeros(n_keys, np.int8)
    owner = np.zeros(n_keys, np.int32)
    hit_blocks = np.zeros(n, np.int32)
    evictions = np.zeros(n, np.int32)
    matrix = np.zeros((n_tenants, n_tenants), np.int64)
    filled_at = -1
    for r in range(n):
        lo, hi = offsets[r], offsets[r + 1]
        h = 0
        while h < max_hit[r]:
            w = where[keys[lo + h]]
            if w != SMALL and w != MAIN:
                break
            h += 1
        hit_blocks[r] = h
        t = tenant[r]
        for j in range(lo, hi):
            k = keys[j]
            w = where[k]
            if w == SMALL or w == MAIN:
                if freq[k] < 3:
                    freq[k] += 1
                continue
            dest = SMALL
            if w == GHOST:
                where[k] = 0  # its log entry goes stale
                g_len -= 1
                dest = MAIN
            while s_len + m_len >= capacity:
                if m_len > main_cap or s_len == 0:
                    while m_len > 0:  # evict from M: second chances while freq > 0
                        v = main[m_head]
                        m_head = m_head + 1 if m_head + 1 < slots else 0
                        m_len -= 1
                        if freq[v] > 0:
                            freq[v] -= 1
                            i = m_head + m_len
                            main[i - slots if i >= slots else i] = v
                            m_len += 1
                            continue
                        where[v] = 0
                        evictions[r] += 1
                        matrix[t, owner[v]] += 1
                        break
                else:
                    while s_len > 0:  # evict from S: promote blocks referenced twice, ghost the rest
                        v = small[s_head]
                        s_head = s_head + 1 if s_head + 1 < slots else 0
                        s_len -= 1
                        if freq[v] > 1:
                            freq[v] = 0
                            where[v] = MAIN
                            i = m_head + m_len
                            main[i - slots if i >= slots else i] = v
                            m_len += 1
                            continue
                        where[v] = 0
                        evictions[r] += 1
                        matrix[t, owner[v]] += 1
                        if main_cap > 0:
                            if g_len >= main_cap:
                                while True:  # drop the oldest live ghost
                                    g = log[g_head]
                                    g_head += 1
                                    if where[g] == GHOST and log_at[g] == g_head - 1:
                                        where[g] = 0
                                        g_len -= 1
                                        break
                            log[g_tail] = v
                            log_at[v] = g_tail
                            g_tail += 1
                            where[v] = GHOST
                            g_len += 1
                        break
            freq[k] = 0
            owner[k] = t
            where[k] = dest
            if dest == SMALL:
                i = s_head + s_len
                small[i - slots if i >= slots else i] = k
                s_len += 1
            else:
                i = m_head + m_len
                main[i - slots if i >= slots else i] = k
                m_len += 1
            if s_len + m_len >= capacity and filled_at < 0:
                filled_at = r
    return hit_blocks, evictions, matrix, filled_at


@policy(
    "s3fifo",
    reference=reference,
    cache=_S3FifoReference,
    options=S3FifoOptions,
)
def kernel(trace, capacity, options=None) -> SimOutput:
    """S3-FIFO (SOSP'23): small probation FIFO, main FIFO with 2-bit frequency, ghost of evicted keys."""
    _, main_cap = _sizes(int(capacity), options)
    out = _s3fifo(
        i4(trace.keys),
        i8(trace.offsets),
        i4(trace.max_hit),
        i4(trace.tenant),
        int(trace.n_keys),
        len(trace.tenant_names),
        int(capacity),
        int(main_cap),
    )
    return SimOutput(*out)
