"""vLLM's block pool (`QuickPool`, pool.py) for the compiled engine loop (compiled_loop.py), one pool per
instance in shared arrays: the same free queue, the same slot numbering, the same order of every change, so
a replay through it gives the Python loop's results bit for bit (tests/backends/enginesim/test_compiled_loop.py).

Layout, instance `i` first in every array:

- `sl[i, FIELD, slot]` (int32): the free queue's links (NXT, PRV; node 0 is the sentinel, node 1 the mark
  standing for the slots never handed out), the key a slot holds (KEY: a trace key, ANON or EMPTY), its
  reference count (REFS), the next slot holding the same key (CNEXT: copies, oldest first, -1 ends) and, on
  the oldest copy, the tenant that cached the key (OWNER). `born[i, slot]`: when the key was cached (oldest copy).
- `hk, hv[i, :]`: cached key -> its oldest slot, an open-addressing table (linear probing, deletion by
  backward shift) sized to twice the slots: numba's typed dict costs several times more per lookup, and
  lookups are most of what the router and the admission check do.
- `pc[i, FRESH | NFREE | MADE]`: slots never handed out, slots in the queue, slots made so far.

Per request (the engine runs a request on one instance at a time): its held slots in block order
`held[hoff[r]:hoff[r] + rq[HELD, r]]`, and `rq[UNHASHED, r]`, its first block not hashed yet.
"""

from __future__ import annotations

from kvbench.cache.compiled import kernel_fn

NXT, PRV, KEY, REFS, CNEXT, OWNER = 0, 1, 2, 3, 4, 5
SLOT_FIELDS = 6
FRESH, NFREE, MADE = 0, 1, 2
EMPTY, ANON, MARK = -2, -1, 1  # (the values of vllm.py's EMPTY_SLOT, ANON_SLOT, FRESH_MARK)

# per-request int fields of `rq` (compiled_loop.py owns the others)
HELD, UNHASHED, KOFF, MAXHIT, FULL, TENANT = 0, 1, 2, 3, 4, 5
HASH_MULT = 2654435761  # Knuth's multiplicative hash: consecutive dense keys spread over the table


@kernel_fn()
def _home(key, mask):
    return ((key * HASH_MULT) & 0xFFFFFFFF) & mask


@kernel_fn()
def cached_slot(hk, hv, i, key):
    """The oldest slot of instance i holding `key`, or -1."""
    mask = hk.shape[1] - 1
    p = _home(key, mask)
    while True:
        k = hk[i, p]
        if k == key:
            return hv[i, p]
        if k == -1:
            return -1
        p = (p + 1) & mask


@kernel_fn()
def _table_set(hk, hv, i, key, slot):
    mask = hk.shape[1] - 1
    p = _home(key, mask)
    while hk[i, p] != -1 and hk[i, p] != key:
        p = (p + 1) & mask
    hk[i, p] = key
    hv[i, p] = slot


@kernel_fn()
def _table_delete(hk, hv, i, key):
    mask = hk.shape[1] - 1
    p = _home(key, mask)
    while hk[i, p] != key:
        p = (p + 1) & mask
    q = p
    while True:  # backward shift: pull later entries of the probe run into the hole
        q = (q + 1) & mask
        k = hk[i, q]
        if k == -1:
            break
        h = _home(k, mask)
        stays = (p < h <= q) if p < q else (h > p or h <= q)  # its home lies after the hole: it may not move
        if not stays:
            hk[i, p] = k
            hv[i, p] = hv[i, q]
            p = q
    hk[i, p] = -1


@kernel_fn()
def _unlink(sl, i, s):
    before, after = sl[i, PRV, s], sl[i, NXT, s]
    sl[i, NXT, before] = after
    sl[i, PRV, after] = before


@kernel_fn()
def init_pool(sl, pc, capacity):
    """Every instance's pool empty: `capacity` blocks, the null block included (vllm.py)."""
    for i in range(sl.shape[0]):
        pc[i, FRESH] = capacity - 1
        if capacity - 1 > 0:  # the mark alone in the queue
            sl[i, NXT, 0] = MARK
            sl[i, PRV, 0] = MARK
            sl[i, NXT, MARK] = 0
            sl[i, PRV, MARK] = 0


@kernel_fn()
def free_blocks(pc, i):
    return pc[i, FRESH] + pc[i, NFREE]


@kernel_fn()
def _hash(sl, born, hk, hv, rq, i, slot, key, r, now):
    """The slot now holds `key` (a full block): cached, as a new key or another copy of one."""
    sl[i, KEY, slot] = key
    if key >= 0:
        s = cached_slot(hk, hv, i, key)
        sl[i, CNEXT, slot] = -1
        if s >= 0:
            while sl[i, CNEXT, s] != -1:
                s = sl[i, CNEXT, s]
            sl[i, CNEXT, s] = slot
        else:
            _table_set(hk, hv, i, key, slot)
            sl[i, OWNER, slot] = rq[TENANT, r]
            born[i, slot] = now


@kernel_fn()
def _drop(sl, born, hk, hv, rq, i, slot, r, now, evictions, matrix, lifetimes, lifetime_of):
    """The slot is reused: the key it held loses a copy, and is evicted with its last (charged to request r)."""
    old = sl[i, KEY, slot]
    sl[i, KEY, slot] = EMPTY
    if old < 0:
        return
    first = cached_slot(hk, hv, i, old)
    if first == slot:
        nxt = sl[i, CNEXT, slot]
        if nxt == -1:
            _table_delete(hk, hv, i, old)
            evictions[r] += 1
            matrix[rq[TENANT, r], sl[i, OWNER, slot]] += 1
            lifetimes.append(now - born[i, slot])
            lifetime_of.append(i)
        else:  # the next copy becomes the oldest: the key's owner and birth move to it
            _table_set(hk, hv, i, old, nxt)
            sl[i, OWNER, nxt] = sl[i, OWNER, slot]
            born[i, nxt] = born[i, slot]
    else:
        s = first
        while sl[i, CNEXT, s] != slot:
            s = sl[i, CNEXT, s]
        sl[i, CNEXT, s] = sl[i, CNEXT, slot]


@kernel_fn()
def _take(sl, pc, born, hk, hv, rq, i, r, now, evictions, matrix, lifetimes, lifetime_of):
    """The free queue's head, held (a never used slot made where the mark stands); 0 when every slot is held."""
    head = sl[i, NXT, 0]
    if head == 0:
        return 0
    if head == MARK:
        slot = 2 + pc[i, MADE]
        pc[i, MADE] += 1
        sl[i, KEY, slot] = EMPTY
        pc[i, FRESH] -= 1
        if pc[i, FRESH] == 0:
            _unlink(sl, i, MARK)
    else:
        slot = head
        _unlink(sl, i, slot)
        pc[i, NFREE] -= 1
        _drop(sl, born, hk, hv, rq, i, slot, r, now, evictions, matrix, lifetimes, lifetime_of)
    sl[i, REFS, slot] = 1
    return slot


@kernel_fn()
def _key_at(keys, rq, r, pos):
    return keys[rq[KOFF, r] + pos] if pos < rq[FULL, r] else ANON


@kernel_fn()
def begin(sl, pc, hk, hv, keys, rq, held, hoff, i, r):
    """Request r is scheduled on instance i: hold its cached prefix; returns the blocks hit."""
    hit, cap, base = 0, rq[MAXHIT, r], rq[KOFF, r]
    while hit < cap and cached_slot(hk, hv, i, keys[base + hit]) >= 0:
        hit += 1
    ho = hoff[r]
    for pos in range(hit):
        slot = cached_slot(hk, hv, i, keys[base + pos])
        if sl[i, REFS, slot] == 0:
            _unlink(sl, i, slot)
            pc[i, NFREE] -= 1
        sl[i, REFS, slot] += 1
        held[ho + pos] = slot
    rq[HELD, r] = hit
    rq[UNHASHED, r] = hit
    return hit


@kernel_fn()
def grow(sl, pc, born, hk, hv, keys, rq, held, hoff, i, r, tokens, bs, now, evictions, matrix, lifetimes, lifetime_of):
    """Request r's KV spans `tokens` tokens: blocks filled since are hashed, slots taken up to ceil(tokens/bs)."""
    pos, n_held, filled, ho = rq[UNHASHED, r], rq[HELD, r], tokens // bs, hoff[r]
    while pos < n_held and pos < filled:
        _hash(sl, born, hk, hv, rq, i, held[ho + pos], _key_at(keys, rq, r, pos), r, now)
        pos += 1
    need = -(-tokens // bs) - n_held
    if n_held + need > hoff[r + 1] - ho:
        raise ValueError("engine-sim: a request grew past the blocks its prompt and output need")
    for _ in range(need):
        slot = _take(sl, pc, born, hk, hv, rq, i, r, now, evictions, matrix, lifetimes, lifetime_of)
        if slot == 0:
            break  # the pool is held by running requests: cache no more of this one
        held[ho + rq[HELD, r]] = slot
        rq[HELD, r] += 1
        if pos < filled:
            _hash(sl, born, hk, hv, rq, i, slot, _key_at(keys, rq, r, pos), r, now)
            pos += 1
    rq[UNHASHED, r] = pos


@kernel_fn()
def end(sl, pc, rq, held, hoff, scratch, i, r):
    """Request r finishes or is preempted: its slots released tail first, hashed ones to the queue's tail,
    unhashed ones to its head (vLLM reuses them first)."""
    ho, freed, n_first = hoff[r], 0, 0
    tail = sl[i, PRV, 0]
    for j in range(rq[HELD, r] - 1, -1, -1):
        slot = held[ho + j]
        sl[i, REFS, slot] -= 1
        if sl[i, REFS, slot] == 0:
            freed += 1
            if sl[i, KEY, slot] == EMPTY:
                scratch[n_first] = slot
                n_first += 1
            else:
                sl[i, NXT, tail] = slot
                sl[i, PRV, slot] = tail
                tail = slot
    sl[i, NXT, tail] = 0
    sl[i, PRV, 0] = tail
    for j in range(n_first - 1, -1, -1):
        slot, head = scratch[j], sl[i, NXT, 0]
        sl[i, NXT, 0] = slot
        sl[i, PRV, slot] = 0
        sl[i, NXT, slot] = head
        sl[i, PRV, head] = slot
    pc[i, NFREE] += freed
    rq[HELD, r] = 0


@kernel_fn()
def admission_need(sl, hk, hv, keys, rq, i, r, tokens, bs):
    """Free slots r needs for `tokens` tokens: the blocks its hit does not cover, and the hit blocks that sit
    in the free queue (holding them takes them off)."""
    hit, evictable, cap, base = 0, 0, rq[MAXHIT, r], rq[KOFF, r]
    while hit < cap:
        slot = cached_slot(hk, hv, i, keys[base + hit])
        if slot < 0:
            break
        if sl[i, REFS, slot] == 0:
            evictable += 1
        hit += 1
    return evictable + max(0, -(-tokens // bs) - hit)


@kernel_fn()
def cached_prefix(hk, hv, keys, rq, i, r, top):
    """The router's estimate of r's cached prefix on instance i: a binary search (a prefix cache keeps
    prefixes), as cluster.py's cache-aware router does."""
    lo, hi, base = 0, top, rq[KOFF, r]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cached_slot(hk, hv, i, keys[base + mid - 1]) >= 0:
            lo = mid
        else:
            hi = mid - 1
    return lo
