"""`tenant-quota`: per-tenant caps on the prefix trie (docs/semantics.md, Policies).

A block is owned by the tenant whose request inserted it (a hit by another tenant changes nothing), and a
tenant's cached blocks never exceed its quota. Otherwise it is `radix-lru` (leaf-first LRU, the running
request's blocks protected, a block inserted only below a cached parent). To insert a block for tenant T:
- T at its quota evicts its own least recently used leaf; with none evictable, this request stops;
- else, if the cache is full, the victim is the LRU leaf among the tenants at (or over) their quota, the
  ones that have used up their share; with none of theirs evictable, the global LRU leaf;
- with no evictable leaf at all, this request stops.
Option `quota`: tenant name -> a share of the capacity (a float in [0, 1]) or a number of blocks (an int,
or a whole float above 1); "*" gives the quota of every tenant not listed; unlisted tenants are limited by
the capacity only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbench.cache.compiled import SIM_OUT, i4, i8, kernel_fn
from kvbench.cache.policies import SimOutput, policy
from kvbench.cache.policies.radix_lru import RadixLruReference
from kvbench.cache.trie import (
    CODE,
    NCHILD,
    NONE,
    OWNER,
    PARENT,
    PROT,
    STAMP,
    heap_compact,
    heap_push,
    new_nodes,
    sift_down,
)
from kvbench.options import option


@dataclass(frozen=True)
class QuotaOptions:
    """tenant-quota's option (read and checked by `kvbench.cache.policy_options`)."""

    quota: str | dict | None = option(
        None,
        "tenant name -> share of the capacity (float 0..1) or blocks (int); '*' for tenants not listed "
        "(default: no cap below the capacity)",
        unit="share of the capacity 0-1, or blocks",
    )


def _blocks(value, capacity: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or value < 0:
        raise ValueError(f"a quota is a share in [0, 1] or a number of blocks >= 0, not {value!r}")
    if isinstance(value, (float, np.floating)) and value <= 1:
        return int(np.floor(value * capacity))
    if int(value) != value:
        raise ValueError(f"a quota above 1 is a number of blocks and must be whole, not {value!r}")
    return int(value)


def quotas(trace, capacity: int, options) -> np.ndarray:
    """int64[T]: the cap of every tenant of the trace, in blocks."""
    spec = dict((options or {}).get("quota") or {})
    unknown = sorted(set(spec) - set(trace.tenant_names) - {"*"})
    if unknown:
        raise ValueError(f"quota for tenants not in the trace: {', '.join(unknown)}")
    default = spec.get("*")
    out = np.full(len(trace.tenant_names), capacity, np.int64)
    for t, name in enumerate(trace.tenant_names):
        value = spec.get(name, default)
        if value is not None:
            out[t] = _blocks(value, capacity)
    return out


class _TenantQuotaReference(RadixLruReference):
    """radix-lru's recency, with leaves grouped by the tenant that owns them."""

    def __init__(self, *args):
        super().__init__(*args)
        self.quota = quotas(self.trace, self.capacity, self.options).tolist()
        self.used = [0] * len(self.quota)

    def group(self, key):
        return self.owner[key]

    def insert(self, key):
        super().insert(key)
        self.used[self.owner[key]] += 1

    def evict(self, key):
        self.used[self.owner[key]] -= 1
        super().evict(key)

    def at_quota(self, t: int) -> bool:
        return self.used[t] >= self.quota[t]

    def must_evict(self, key):
        return self.full or self.at_quota(int(self.trace.tenant[self.request]))

    def choose_victim(self, key, pos):
        me = int(self.trace.tenant[self.request])
        if self.at_quota(me):
            return self.top(me)
        for tenants in ([t for t in range(len(self.quota)) if self.at_quota(t)], range(len(self.quota))):
            leaves = [v for v in map(self.top, tenants) if v is not None]
            if leaves:
                return min(leaves, key=self.stamp.__getitem__)
        return None


def reference(trace, capacity, options=None) -> SimOutput:
    return _TenantQuotaReference(trace, capacity, options).run()


# Per-tenant heaps are segments of one arena (hp, hk): tenant t's heap is hp[start[t]:start[t] + cnt[t]], with
# room for cap[t] entries; a full segment that compaction cannot free doubles, and the arena is repacked.


@kernel_fn()
def _top(hp, hk, start, cnt, t, nodes, r, stash_p, stash_k, ns):
    """Tenant t's LRU unprotected leaf (left on its heap) or -1; protected leaves are hidden in the stash."""
    s, n = start[t], cnt[t]
    v = -1
    while n > 0:
        k = hk[s]
        if nodes[k, CODE] == hp[s]:
            if nodes[k, PROT] != r:
                v = k
                break
            stash_p[ns] = hp[s]
            stash_k[ns] = k
            ns += 1
            nodes[k, CODE] = -3 - hp[s]
        n -= 1
        sift_down(hp, hk, n, hp[s + n], hk[s + n], s)
    cnt[t] = n
    return v, ns


@kernel_fn()
def _push(hp, hk, start, cap, cnt, nodes, p, k):
    """Push (p, k) on the heap of k's owner. Returns the arena, which is new when a segment had to grow."""
    t = nodes[k, OWNER]
    if cnt[t] == cap[t]:
        s = start[t]
        cnt[t] = heap_compact(hp, hk, cnt[t], nodes, s)
        if 2 * cnt[t] > cap[t]:
            cap[t] *= 2
            total = 0
            for u in range(cap.size):
                total += cap[u]
            hp2 = np.empty(total, np.int64)
            hk2 = np.empty(total, np.int32)
            at = 0
            for u in range(cap.size):
                for i in range(cnt[u]):
                    hp2[at + i] = hp[start[u] + i]
                    hk2[at + i] = hk[start[u] + i]
                start[u] = at
                at += cap[u]
            hp, hk = hp2, hk2
    s = start[t]
    cnt[t] = heap_push(hp, hk, cnt[t], p, k, s)
    return hp, hk


@kernel_fn(SIM_OUT + "(i4[::1], i4[::1], i8[::1], i4[::1], i4[::1], i8, i8, i8[::1])")
def _tenant_quota(parent, keys, offsets, max_hit, tenant, n_tenants, capacity, quota):
    n = offsets.size - 1
    nodes = new_nodes(parent)
    cap = np.full(n_tenants, 16, np.int64)
    start = np.arange(n_tenants) * 16
    cnt = np.zeros(n_tenants, np.int64)
    hp = np.empty(16 * n_tenants, np.int64)
    hk = np.empty(16 * n_tenants, np.int32)
    used = np.zeros(n_tenants, np.int64)
    longest = 1
    for r in range(n):
        longest = max(longest, offsets[r + 1] - offsets[r])
    stash_p = np.empty(2 * longest + 2, np.int64)
    stash_k = np.empty(2 * longest + 2, np.int32)
    clock, size = 0, 0
    hit_blocks = np.zeros(n, np.int32)
    evictions = np.zeros(n, np.int32)
    matrix = np.zeros((n_tenants, n_tenants), np.int64)
    filled_at = -1
    for r in range(n):
        lo, hi, me = offsets[r], offsets[r + 1], np.int64(tenant[r])
        h = 0
        while h < max_hit[r] and nodes[keys[lo + h], NCHILD] >= 0:
            h += 1
        hit_blocks[r] = h
        for j in range(lo, hi):
            nodes[keys[j], PROT] = r
        ns = 0
        stop = False
        for j in range(lo, hi):
            k = keys[j]
            if j >= lo + h:
                if nodes[k, NCHILD] >= 0:
                    continue
                p = nodes[k, PARENT]
                if p >= 0 and nodes[p, NCHILD] < 0:
                    break
                while size >= capacity or used[me] >= quota[me]:
                    v = -1
                    if used[me] >= quota[me]:
                        v, ns = _top(hp, hk, start, cnt, me, nodes, r, stash_p, stash_k, ns)
                    else:  # the LRU leaf of the tenants at quota, else the global LRU leaf
                        for attempt in range(2):
                            for t in range(n_tenants):
                                if attempt == 0 and used[t] < quota[t]:
                                    continue
                                w, ns = _top(hp, hk, start, cnt, t, nodes, r, stash_p, stash_k, ns)
                                if w >= 0 and (v < 0 or nodes[w, STAMP] < nodes[v, STAMP]):
                                    v = w
                            if v >= 0:
                                break
                    if v < 0:
                        stop = True
                        break
                    o = nodes[v, OWNER]
                    nodes[v, NCHILD] = -1
                    nodes[v, CODE] = NONE
                    size -= 1
                    used[o] -= 1
                    evictions[r] += 1
                    matrix[me, o] += 1
                    s = start[o]
                    cnt[o] -= 1
                    sift_down(hp, hk, cnt[o], hp[s + cnt[o]], hk[s + cnt[o]], s)
                    u = nodes[v, PARENT]
                    if u >= 0:
                        nodes[u, NCHILD] -= 1
                        if nodes[u, NCHILD] == 0 and nodes[u, PROT] != r:
                            nodes[u, CODE] = nodes[u, STAMP]
                            hp, hk = _push(hp, hk, start, cap, cnt, nodes, nodes[u, STAMP], np.int64(u))
                if stop:
                    break
                nodes[k, NCHILD] = 0
                nodes[k, OWNER] = me
                used[me] += 1
                size += 1
                if size >= capacity and filled_at < 0:
                    filled_at = r
                if p >= 0:
                    nodes[p, NCHILD] += 1
                    nodes[p, CODE] = NONE
            nodes[k, CODE] = NONE  # protected until the request is done
            clock += 1
            nodes[k, STAMP] = clock
        for i in range(ns):
            k = stash_k[i]
            if nodes[k, CODE] == -3 - stash_p[i]:
                nodes[k, CODE] = stash_p[i]
                hp, hk = _push(hp, hk, start, cap, cnt, nodes, stash_p[i], np.int64(k))
        for j in range(lo, hi):
            k = keys[j]
            if nodes[k, NCHILD] == 0 and nodes[k, CODE] == NONE:
                nodes[k, CODE] = nodes[k, STAMP]
                hp, hk = _push(hp, hk, start, cap, cnt, nodes, nodes[k, STAMP], np.int64(k))
    return hit_blocks, evictions, matrix, filled_at


@policy("tenant-quota", reference=reference, cache=_TenantQuotaReference, needs=("tenant",), options=QuotaOptions)
def kernel(trace, capacity, options=None) -> SimOutput:
    """Per-tenant caps: a tenant at its quota evicts its own LRU leaf, else tenants at quota give way first."""
    out = _tenant_quota(
        i4(trace.parent),
        i4(trace.keys),
        i8(trace.offsets),
        i4(trace.max_hit),
        i4(trace.tenant),
        len(trace.tenant_names),
        int(capacity),
        i8(quotas(trace, capacity, options)),
    )
    return SimOutput(*out)
