"""`vllm`: vLLM's block pool (v1 `KVCacheManager` / `BlockPool`), to predict what a live vLLM will hit.

Per request, in arrival order (one request runs at a time):

1. lookup: the longest cached prefix, capped at `trace.max_hit` (the sim backend prepares this policy's trace
   with `vllm_cap=True`, so the cap `(input_tokens - 1) // block_size` is already there: vLLM recomputes at
   least the last prompt token);
2. the hit blocks are held (pinned: taken off the free queue, never evicted while the request runs);
3. the remaining *full* blocks, in prompt order: one that happens to be cached beyond the hit prefix is
   reused (held, as if touched; a live vLLM would compute a duplicate instead); a missing one takes the head
   of the free queue (the least recently released block) and evicts whatever was cached there, which may be
   a block of this request not reached yet (it is then inserted again when reached, as in vLLM, which never
   looks past the first miss). If the free queue is empty (the request has more full blocks than the
   capacity) the rest of the request is not cached;
4. the request's held blocks are released tail-first: the last one is appended to the free queue first, so it
   is evicted before the earlier blocks of the same request, and block 0 is the most recently released.

A partial last block (`input_tokens % block_size != 0`) is never cached and takes no slot here: vLLM only
hashes full blocks. (A live vLLM also holds a slot for it, and for the decode blocks, while the request runs;
that slot comes back to the free queue empty. The model leaves both out: they hold no reusable prefix, and
leaving them out keeps the policy a stack algorithm.)

Equivalently, and this is what the one-pass curve relies on (`stack=True`): the cache *content* after each
request is that of LRU where, after the lookup, the request's full blocks are re-referenced in reverse order
(last full block first, block 0 last), with hits capped by `max_hit`. Steps 2-4 leave the request's first
min(full blocks, capacity) blocks cached with block 0 most recent, then the most recently released other
blocks, which is exactly the top of that LRU stack. Only the eviction counts can differ from such an LRU run,
since pinning keeps the request's own blocks from being evicted and re-inserted.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .._compiled import SIM_OUT, i4, i8, kernel_fn
from . import SimOutput, policy
from ._reference import PrefixCache


class _VllmReference(PrefixCache):
    def __init__(self, *args):
        super().__init__(*args)
        self.free: OrderedDict[int, None] = OrderedDict()  # cached, not held; head = least recently released
        self.held: list[int] = []  # blocks of the running request, in the order they were taken

    def _hold(self, key):
        if key in self.free:
            del self.free[key]
            self.held.append(key)
        # a key already held (repeated in the prompt) stays where it is

    def _full_blocks(self):
        return self.trace.input_tokens[self.request] // self.trace.block_size

    def on_hit(self, key, pos):
        if pos < self._full_blocks():  # (a partial block can only hit on a trace prepared without the cap)
            self._hold(key)

    def admit(self, key, pos):
        if pos >= self._full_blocks():
            return False  # the partial last block: vLLM does not cache it
        if key in self.owner:
            self._hold(key)
            return True
        if self.full:
            if not self.free:
                return False  # every slot is held by this request: cache no more of it
            victim, _ = self.free.popitem(last=False)
            self.evict(victim)
        self.insert(key)
        self.held.append(key)
        return True

    def after_request(self, keys):
        for key in reversed(self.held):  # tail-first: block 0 ends up most recently released
            self.free[key] = None
        self.held = []


def reference(trace, capacity, options=None) -> SimOutput:
    return _VllmReference(trace, capacity, options).run()


@kernel_fn(SIM_OUT + "(i4[::1], i8[::1], i4[::1], i8[::1], i8, i4[::1], i8, i8, i8, i8)")
def _vllm(keys, offsets, max_hit, input_tokens, block_size, tenant, n_keys, n_tenants, capacity, longest):
    n = offsets.size - 1
    # The free queue is a circular doubly linked list over dense keys: prev of key k at link[2k], next at
    # link[2k+1]; node S = n_keys is the sentinel (its next is the head, the block evicted next; its prev the
    # tail, the most recently released). prev also says a key's state: -1 not cached, -2 held by the running
    # request, >= 0 cached and free.
    S = n_keys
    link = np.empty(2 * n_keys + 2, np.int32)
    link[: 2 * n_keys] = -1
    link[2 * S] = S
    link[2 * S + 1] = S
    owner = np.zeros(n_keys, np.int32)
    taken = np.empty(max(longest, 1), np.int32)  # held blocks of the running request, in the order taken
    size = 0
    hit_blocks = np.zeros(n, np.int32)
    evictions = np.zeros(n, np.int32)
    matrix = np.zeros((n_tenants, n_tenants), np.int64)
    filled_at = -1
    for r in range(n):
        lo, hi = offsets[r], offsets[r + 1]
        h = 0
        while h < max_hit[r] and link[2 * keys[lo + h]] != -1:
            h += 1
        hit_blocks[r] = h
        full_end = lo + min(hi - lo, input_tokens[r] // block_size)
        t = tenant[r]
        n_taken = 0
        for j in range(lo, full_end):
            k = keys[j]
            p = link[2 * k]
            if p == -2:
                continue  # already held (a key repeated in the prompt)
            if p >= 0:  # cached and free: take it off the free queue
                q = link[2 * k + 1]
                link[2 * p + 1] = q
                link[2 * q] = p
            else:
                if size >= capacity:
                    v = link[2 * S + 1]
                    if v == S:
                        break  # every slot is held by this request: cache no more of it
                    q = link[2 * v + 1]
                    link[2 * S + 1] = q
                    link[2 * q] = S
                    link[2 * v] = -1
                    evictions[r] += 1
                    matrix[t, owner[v]] += 1
                else:
                    size += 1
                    if size >= capacity and filled_at < 0:
                        filled_at = r
                owner[k] = t
            link[2 * k] = -2
            taken[n_taken] = k
            n_taken += 1
        # release tail-first: the last block taken is appended first, block 0 last (most recently released)
        tail = link[2 * S]
        for i in range(n_taken - 1, -1, -1):
            k = taken[i]
            link[2 * k] = tail
            link[2 * tail + 1] = k
            tail = k
        link[2 * tail + 1] = S
        link[2 * S] = tail
    return hit_blocks, evictions, matrix, filled_at


@policy("vllm", reference=reference, stack=True)
def kernel(trace, capacity, options=None) -> SimOutput:
    """vLLM block pool: blocks held while a request runs, released tail-first, least recently released evicted."""
    if capacity <= 0:
        raise ValueError("capacity must be > 0 blocks")
    longest = int(trace.n_blocks.max()) if trace.n_requests else 0
    out = _vllm(
        i4(trace.keys),
        i8(trace.offsets),
        i4(trace.max_hit),
        i8(trace.input_tokens),
        int(trace.block_size),
        i4(trace.tenant),
        int(trace.n_keys),
        len(trace.tenant_names),
        int(capacity),
        longest,
    )
    return SimOutput(*out)
