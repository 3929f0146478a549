"""What the trie policies (radix-lru, belady, priority-lru, tenant-quota) share.

Keys are prefix-chained, so every key is a node of one prefix trie and `trace.parent[key]` its parent. The
cached set stays closed under parents: a block is inserted only when its parent is cached, and only leaves
(cached nodes without cached children) are evicted, never a block of the running request.

A policy gives every evictable leaf a rank (smaller is evicted first, unique, so the victim is well defined)
and says how a hit or an insertion changes it. The reference keeps ranks in a dict and heapq heaps; the
kernels keep them in lazily invalidated binary heaps over arrays: `nodes[key, CODE]` holds the key's rank
while it is an evictable leaf and NONE otherwise, so a heap entry is valid iff it matches. The kernels write
the heap entries of a request's blocks only once it is done (they are protected until then, and most stop
being leaves as the request goes on); a protected leaf met at the top of a heap is hidden until then.
"""

from __future__ import annotations

import heapq

import numpy as np

from kvbench.cache.compiled import SIM_OUT, i4, i8, kernel_fn
from kvbench.cache.densify import scratch
from kvbench.cache.policies import SimOutput
from kvbench.cache.reference import PrefixCache

NONE = -1  # code of a key that is not an evictable leaf; every real rank is >= 0; -2: kept during
# compaction; below: a hidden rank c, stored as -3 - c

# Per-key state, one 64-byte row per key so that evicting a cold leaf touches one cache line per node (a
# record dtype would read better, but numba refcounts record views passed to helpers):
CODE, STAMP, PARENT, NCHILD, OWNER, PROT, PRIO, USED_BY = range(8)
# CODE: as above; STAMP: time of last use (Belady: next use); NCHILD: cached children, -1 when not cached;
# OWNER: the tenant that inserted it; PROT: the last request using it; PRIO, USED_BY: priority-lru's
# retention priority and the request that set it.


@kernel_fn()
def init_nodes(nodes, parent):
    """Every key not cached, in `nodes` (int64[n_keys, 8], contents undefined: a reused work buffer)."""
    for k in range(parent.size):
        nodes[k, CODE] = NONE
        nodes[k, STAMP] = 0
        nodes[k, PARENT] = parent[k]
        nodes[k, NCHILD] = -1
        nodes[k, OWNER] = 0
        nodes[k, PROT] = -1
        nodes[k, PRIO] = 0
        nodes[k, USED_BY] = 0


@kernel_fn()
def new_nodes(parent):
    nodes = np.empty((parent.size, 8), np.int64)
    init_nodes(nodes, parent)
    return nodes


# --- binary heaps over (rank int64, key int32); b offsets a heap inside a larger array ------------------


def heap_size(candidates: int) -> int:
    """Room for a heap of at most `candidates` valid entries at a time (stale ones are compacted away)."""
    size = 64
    while size < 2 * candidates + 64:
        size *= 2
    return size


@kernel_fn()
def heap_push(hp, hk, n, p, k, b=0):
    """Push (p, k) on the heap hp[b:b + n], hk[b:b + n] (room assumed). Returns the new size."""
    i = n
    while i > 0:
        up = (i - 1) >> 1
        if hp[b + up] <= p:
            break
        hp[b + i] = hp[b + up]
        hk[b + i] = hk[b + up]
        i = up
    hp[b + i] = p
    hk[b + i] = k
    return n + 1


@kernel_fn()
def sift_down(hp, hk, n, p, k, b=0, i=0):
    """Put (p, k) at slot i of the heap hp[b:b + n], hk[b:b + n] and sift it down: replaces the top by default."""
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and hp[b + c + 1] < hp[b + c]:
            c += 1
        if hp[b + c] >= p:
            break
        hp[b + i] = hp[b + c]
        hk[b + i] = hk[b + c]
        i = c
    hp[b + i] = p
    hk[b + i] = k


@kernel_fn()
def heap_compact(hp, hk, n, nodes, b=0):
    """Drop stale and duplicate entries of the heap hp[b:b + n] in place. Returns the new size."""
    m = 0
    for i in range(n):
        k = hk[b + i]
        if nodes[k, CODE] == hp[b + i]:
            nodes[k, CODE] = -2  # kept: a duplicate of the same valid entry is dropped
            hp[b + m] = hp[b + i]
            hk[b + m] = k
            m += 1
    for i in range(m):
        nodes[hk[b + i], CODE] = hp[b + i]
    for i in range(m // 2 - 1, -1, -1):
        sift_down(hp, hk, m, hp[b + i], hk[b + i], b, i)
    return m


@kernel_fn()
def heap_add(hp, hk, n, nodes, p, k):
    """Push (p, k), compacting first when full (a heap of `heap_size` for all candidates then always has
    room). Returns the new size."""
    if n == hp.size:
        n = heap_compact(hp, hk, n, nodes)
    return heap_push(hp, hk, n, p, k)


@kernel_fn()
def heap_restore(hp, hk, n, nodes, stash_p, stash_k, ns):
    """Put back the protected leaves hidden during a request (unless they stopped being leaves)."""
    for i in range(ns):
        k = stash_k[i]
        if nodes[k, CODE] == -3 - stash_p[i]:
            nodes[k, CODE] = stash_p[i]
            n = heap_add(hp, hk, n, nodes, stash_p[i], k)
    return n


# --- compiled request path shared by radix-lru, belady and priority-lru --------------------------------

RADIX_LRU, BELADY, PRIORITY_LRU = 0, 1, 2
_FAR = np.int64(1) << 62


@kernel_fn()
def _rank(mode, nodes, k):
    if mode == BELADY:  # farthest next use (kept in stamp) first, then the larger key
        return _FAR - ((nodes[k, STAMP] << 31) | k)
    if mode == PRIORITY_LRU:  # lowest priority first, then least recent
        return (nodes[k, PRIO] << 40) | nodes[k, STAMP]
    return nodes[k, STAMP]


@kernel_fn(
    SIM_OUT + "(i8, i4[::1], i4[::1], i8[::1], i4[::1], i4[::1], i8, i8, i4[::1], i8[::1], i8[::1], i8, i8[:, ::1],"
    " i8[::1], i4[::1])"
)
def leaf_kernel(
    mode, parent, keys, offsets, max_hit, tenant, n_tenants, capacity, next_use, priority, expire_at, default_prio,
    nodes, hp, hk,
):  # fmt: skip
    """One pass of a leaf-first trie policy. A path's blocks are protected while their request runs, so their
    heap entries are written only when it is done (most of them have stopped being leaves by then). `nodes`
    (int64[n_keys, 8]) and the heap's arrays `hp`, `hk` (heap_size(min(capacity, n_keys))) are work buffers."""
    n = offsets.size - 1
    init_nodes(nodes, parent)
    # priority-lru: uses that set a non-default priority, in order of use, hence of expiry
    q_key = np.empty(keys.size + 1 if mode == PRIORITY_LRU else 1, np.int32)
    q_stamp = np.empty(q_key.size, np.int64)
    q_head, q_tail = 0, 0
    longest = 1
    for r in range(n):
        longest = max(longest, offsets[r + 1] - offsets[r])
    stash_p = np.empty(2 * longest + 2, np.int64)  # a key is hidden at most twice per request
    stash_k = np.empty(2 * longest + 2, np.int32)
    hn = 0
    clock = 0
    size = 0
    hit_blocks = np.zeros(n, np.int32)
    evictions = np.zeros(n, np.int32)
    matrix = np.zeros((n_tenants, n_tenants), np.int64)
    filled_at = -1
    for r in range(n):
        lo, hi = offsets[r], offsets[r + 1]
        if mode == PRIORITY_LRU:  # an expired priority reverts to the default, as if the block were used now
            while q_head < q_tail:
                k = q_key[q_head]
                if nodes[k, NCHILD] >= 0 and nodes[k, STAMP] == q_stamp[q_head]:
                    if expire_at[nodes[k, USED_BY]] > r:
                        break
                    nodes[k, PRIO] = default_prio
                    clock += 1
                    nodes[k, STAMP] = clock
                    if nodes[k, CODE] >= 0:
                        nodes[k, CODE] = _rank(mode, nodes, k)
                        hn = heap_add(hp, hk, hn, nodes, nodes[k, CODE], k)
                q_head += 1
        h = 0
        while h < max_hit[r] and nodes[keys[lo + h], NCHILD] >= 0:
            h += 1
        hit_blocks[r] = h
        for j in range(lo, hi):
            nodes[keys[j], PROT] = r
        ns = 0
        for j in range(lo, hi):
            k = keys[j]
            if j >= lo + h:
                if nodes[k, NCHILD] >= 0:  # beyond the hit prefix (hit cap): skipped; Belady learns its next use
                    if mode == BELADY:
                        nodes[k, STAMP] = next_use[j]
                        nodes[k, CODE] = NONE
                    continue
                p = nodes[k, PARENT]
                if p >= 0 and nodes[p, NCHILD] < 0:
                    break
                if size >= capacity:
                    # the heap's top, once stale entries are dropped and protected leaves hidden, is the victim
                    # (inline: as a helper returning a tuple, numba's refcounting of its arrays doubled the time)
                    v = -1
                    while hn > 0:
                        v = hk[0]
                        if nodes[v, CODE] == hp[0]:
                            if nodes[v, PROT] != r:
                                break
                            stash_p[ns] = hp[0]
                            stash_k[ns] = v
                            ns += 1
                            nodes[v, CODE] = -3 - hp[0]  # hidden until the request is done
                        v = -1
                        hn -= 1
                        sift_down(hp, hk, hn, hp[hn], hk[hn])
                    if v < 0 or (mode == BELADY and nodes[v, STAMP] <= next_use[j]):
                        break
                    nodes[v, NCHILD] = -1
                    nodes[v, CODE] = NONE
                    size -= 1
                    evictions[r] += 1
                    matrix[tenant[r], nodes[v, OWNER]] += 1
                    u = nodes[v, PARENT]
                    if u >= 0:
                        nodes[u, NCHILD] -= 1
                    if u >= 0 and nodes[u, NCHILD] == 0 and nodes[u, PROT] != r:
                        nodes[u, CODE] = _rank(mode, nodes, u)  # the parent often is the next victim
                        sift_down(hp, hk, hn, nodes[u, CODE], u)
                    else:
                        hn -= 1
                        sift_down(hp, hk, hn, hp[hn], hk[hn])
                nodes[k, NCHILD] = 0
                nodes[k, OWNER] = tenant[r]
                size += 1
                if size >= capacity and filled_at < 0:
                    filled_at = r
                if p >= 0:
                    nodes[p, NCHILD] += 1
                    nodes[p, CODE] = NONE
            # a hit or an insertion: request r uses the block
            nodes[k, CODE] = NONE  # protected until the request is done
            if mode == BELADY:
                nodes[k, STAMP] = next_use[j]
            else:
                clock += 1
                nodes[k, STAMP] = clock
            if mode == PRIORITY_LRU:
                nodes[k, PRIO] = priority[r]
                nodes[k, USED_BY] = r
                if nodes[k, PRIO] != default_prio:
                    q_key[q_tail] = k
                    q_stamp[q_tail] = clock
                    q_tail += 1
        hn = heap_restore(hp, hk, hn, nodes, stash_p, stash_k, ns)
        for j in range(lo, hi):
            k = keys[j]
            if nodes[k, NCHILD] == 0 and nodes[k, CODE] == NONE:
                nodes[k, CODE] = _rank(mode, nodes, k)
                hn = heap_add(hp, hk, hn, nodes, nodes[k, CODE], k)
    return hit_blocks, evictions, matrix, filled_at


def run_leaf_kernel(mode, trace, capacity, next_use=None, priority=None, expire_at=None, default_prio=0):
    dummy32, dummy64 = np.zeros(1, np.int32), np.zeros(1, np.int64)
    # Work buffers reused from call to call (a sweep's points, one after another on a thread): fresh ones of
    # this size (64 bytes a key) cost about as much in page faults as the whole simulation.
    n_keys, room = trace.n_keys, heap_size(min(int(capacity), trace.n_keys))
    nodes = scratch("trie.nodes", 8 * n_keys, np.int64).reshape(n_keys, 8)
    hp, hk = scratch("trie.heap_ranks", room, np.int64), scratch("trie.heap_keys", room, np.int32)
    out = leaf_kernel(
        int(mode),
        i4(trace.parent),
        i4(trace.keys),
        i8(trace.offsets),
        i4(trace.max_hit),
        i4(trace.tenant),
        len(trace.tenant_names),
        int(capacity),
        dummy32 if next_use is None else i4(next_use),
        dummy64 if priority is None else i8(priority),
        dummy64 if expire_at is None else i8(expire_at),
        int(default_prio),
        nodes,
        hp,
        hk,
    )
    return SimOutput(*out)


# --- pure-Python reference ---------------------------------------------------------------------------


class TrieReference(PrefixCache):
    """Leaf-first eviction on the prefix trie, readable. A policy defines `rank(key)` (smaller is evicted
    first, unique per key), updates its own state in `touch` (a hit) and `on_insert`, and overrides
    `choose_victim` when it wants more than the lowest-ranked unprotected leaf."""

    def __init__(self, trace, capacity, options=None):
        super().__init__(trace, capacity, options)
        self.children = [0] * trace.n_keys  # cached children per key
        self.parent = trace.parent.tolist()
        self.ranks: dict[int, int] = {}  # evictable leaf -> its rank in the heap
        self.heaps: dict[int, list] = {}  # group (tenant for tenant-quota, else 0) -> [(rank, key)]
        self.protected: set[int] = set()
        self.hidden: dict[int, int] = {}  # protected leaves taken off the heaps until the request ends
        self._begun = -1

    # --- what a policy implements ----------------------------------------------------------------
    def rank(self, key: int) -> int:
        raise NotImplementedError

    def group(self, key: int) -> int:
        return 0

    def begin_request(self) -> None:
        """Called once per request, before its first block is handled."""

    def touch(self, key: int, pos: int) -> None:
        """A block of the hit prefix was used: update the policy state, then `refresh(key)`."""

    def on_insert(self, key: int, pos: int) -> None:
        """Set the policy state of a block just inserted (its rank is taken right after)."""

    def on_skip(self, key: int, pos: int) -> None:
        """A cached block beyond the hit prefix (only under a hit cap): not touched by default."""

    def must_evict(self, key: int) -> bool:
        return self.full

    def choose_victim(self, key: int, pos: int) -> int | None:
        """The leaf to evict so that `key` can be inserted, or None to stop this request."""
        return self.top(0)

    # --- leaf bookkeeping ------------------------------------------------------------------------
    def refresh(self, key: int) -> None:
        """Re-rank `key` after its state changed; it joins its heap if it is an evictable leaf."""
        if self.hidden:
            self.hidden.pop(key, None)
        if self.children[key] == 0 and key in self.owner:
            r = self.ranks[key] = self.rank(key)
            heapq.heappush(self.heaps.setdefault(self.group(key), []), (r, key))
        else:
            self.ranks.pop(key, None)

    def top(self, group: int) -> int | None:
        """The lowest-ranked unprotected leaf of `group` (left on its heap), or None."""
        heap = self.heaps.get(group, [])
        while heap:
            r, k = heap[0]
            if self.ranks.get(k) != r:
                heapq.heappop(heap)
            elif k in self.protected:
                heapq.heappop(heap)
                self.hidden[k] = self.ranks.pop(k)
            else:
                return k
        return None

    def _begin(self) -> None:
        if self._begun != self.request:
            self._begun = self.request
            t = self.trace
            self.protected = set(t.keys[t.offsets[self.request] : t.offsets[self.request + 1]].tolist())
            self.begin_request()

    # --- the request path ------------------------------------------------------------------------
    def on_hit(self, key, pos):
        self._begin()
        self.touch(key, pos)

    def admit(self, key, pos):
        self._begin()
        if key in self.owner:
            self.on_skip(key, pos)
            return True
        p = self.parent[key]
        if p >= 0 and p not in self.owner:
            return False
        while self.must_evict(key):
            victim = self.choose_victim(key, pos)
            if victim is None:
                return False
            self.evict_leaf(victim)
        self.insert(key)
        if p >= 0:
            self.children[p] += 1
            self.ranks.pop(p, None)  # no longer a leaf
            self.hidden.pop(p, None)
        self.on_insert(key, pos)
        self.refresh(key)
        return True

    def evict_leaf(self, key: int) -> None:
        assert self.children[key] == 0 and key not in self.protected
        del self.ranks[key]
        self.evict(key)
        p = self.parent[key]
        if p >= 0:
            self.children[p] -= 1
            if self.children[p] == 0:
                self.refresh(p)  # it became a leaf

    def after_request(self, keys):
        for k, r in self.hidden.items():
            self.ranks[k] = r
            heapq.heappush(self.heaps.setdefault(self.group(k), []), (r, k))
        self.hidden = {}
