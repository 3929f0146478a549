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
from . import FILLED_AT, FIRST_REQUEST, SIZE, STARTED, UNCACHED, Carry, SimOutput, policy
from ._reference import PrefixCache


class _VllmReference(PrefixCache):
    def __init__(self, *args):
        super().__init__(*args)
        self.free: OrderedDict[int, None] = OrderedDict()  # cached, not held; head = least recently released
        self.refs: dict[int, int] = {}  # held key -> running requests that hold it (overlapping requests)
        self.held: dict[int, dict[int, None]] = {}  # running request -> its held keys, in the order taken
        self.full_blocks = (self.trace.input_tokens // self.trace.block_size).tolist()

    def _hold(self, key):
        mine = self.held.get(self.request)
        if mine is None:
            mine = self.held[self.request] = {}
        elif key in mine:
            return  # a key repeated in the prompt stays where it is
        if key in self.free:
            del self.free[key]
        self.refs[key] = self.refs.get(key, 0) + 1
        mine[key] = None

    def on_hit(self, key, pos):
        if pos < self.full_blocks[self.request]:  # (a partial block can only hit on a trace prepared without the cap)
            self._hold(key)

    def admit(self, key, pos):
        if pos >= self.full_blocks[self.request]:
            return False  # the partial last block: vLLM does not cache it
        if key in self.owner:
            self._hold(key)
            return True
        if self.full:
            if not self.free:
                return False  # every slot is held by running requests: cache no more of this one
            victim, _ = self.free.popitem(last=False)
            self.evict(victim)
        self.insert(key)
        self._hold(key)
        return True

    def after_request(self, keys):
        for key in reversed(self.held.pop(self.request, {})):  # tail-first: block 0 is the most recently released
            self.refs[key] -= 1
            if not self.refs[key]:
                del self.refs[key]
                self.free[key] = None


def reference(trace, capacity, options=None) -> SimOutput:
    return _VllmReference(trace, capacity, options).run()


_NONE = UNCACHED  # prev of a key that is not cached
_HELD = np.uint32(0xFFFFFFFE)  # prev of a key held by the running request


@kernel_fn(SIM_OUT + "(u4[::1], i8[::1], i4[::1], i8[::1], i8, i4[::1], i8, i8, i8, u4[::1], i4[::1], u4[::1], i8[:])")
def _vllm(
    keys, offsets, max_hit, input_tokens, block_size, tenant, n_keys, n_tenants, capacity, link, owner, taken, state
):
    """`keys` viewed as uint32; `link` (uint32[2 * n_keys + 2], work buffer) is the free queue, a circular doubly
    linked list over dense keys: prev of key k at 2k, next at 2k+1; node S = n_keys is the sentinel (its next
    is the head, the block evicted next; its prev the tail, the most recently released). prev also says a
    key's state: _NONE not cached, _HELD held by the running request, otherwise cached and free. Indices are
    unsigned so that numba emits no negative-index fix-ups. `owner` (int32[n_keys], work buffer) is used only
    with several tenants; `taken` (uint32[longest request], work buffer) lists the held blocks of the running
    request in the order they were taken. `state` (STATE_FIELDS) carries the cache across calls, so that a
    trace can be fed in chunks."""
    n = offsets.size - 1
    one, two = np.uint64(1), np.uint64(2)
    S = np.uint64(n_keys)
    s32 = np.uint32(n_keys)
    if state[STARTED] == 0:
        link[: 2 * n_keys] = _NONE
        link[two * S] = s32
        link[two * S + one] = s32
        state[STARTED], state[FILLED_AT] = 1, -1
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
        prefix_end = lo + max_hit[r]
        full_end = lo + min(hi - lo, input_tokens[r] // block_size)
        t = tenant[r]
        # The lookup is folded into the update: while every earlier block hit, nothing was evicted, so the
        # cache holds exactly what the lookup saw (a held key, repeated in the prompt, is cached too).
        h = lo
        ev = 0
        n_taken = 0
        for j in range(lo, full_end):
            k = np.uint64(keys[j])
            p = link[two * k]
            if p != _NONE:
                if h == j and j < prefix_end:
                    h += 1
                if p == _HELD:
                    continue  # already held (a key repeated in the prompt)
                # cached and free: take it off the free queue
                q = link[two * k + one]
                link[two * np.uint64(p) + one] = q
                link[two * np.uint64(q)] = p
            else:
                if size >= capacity:
                    v = np.uint64(link[two * S + one])
                    if v == S:
                        break  # every slot is held by this request: cache no more of it
                    q = link[two * v + one]
                    link[two * S + one] = q
                    link[two * np.uint64(q)] = s32
                    link[two * v] = _NONE
                    ev += 1
                    if multi:
                        matrix[t, owner[v]] += 1
                else:
                    size += 1
                    if size >= capacity and filled_at < 0:
                        filled_at = base + r
                if multi:
                    owner[k] = t
            link[two * k] = _HELD
            taken[n_taken] = np.uint32(k)
            n_taken += 1
        if h == full_end:  # no miss among the full blocks: nothing was evicted, the lookup may go on
            while h < prefix_end and link[two * np.uint64(keys[h])] != _NONE:
                h += 1
        hit_blocks[r] = h - lo
        evictions[r] = ev
        total_evictions += ev
        # release tail-first: the last block taken is appended first, block 0 last (most recently released)
        tail = np.uint64(link[two * S])
        for i in range(n_taken - 1, -1, -1):
            k = np.uint64(taken[i])
            link[two * k] = np.uint32(tail)
            link[two * tail + one] = np.uint32(k)
            tail = k
        link[two * tail + one] = s32
        link[two * S] = np.uint32(tail)
    if not multi and n_tenants == 1:
        matrix[0, 0] = total_evictions
    state[SIZE], state[FILLED_AT], state[FIRST_REQUEST] = size, filled_at, base + n
    return hit_blocks, evictions, matrix, filled_at


class VllmBlockPool(Carry):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.link = self.buffer("vllm.link", 2 * self.n_ids + 2, np.uint32)
        self.owner = self.buffer("vllm.owner", self.n_ids if self.n_tenants > 1 else 0, np.int32)
        self.taken = self.buffer("vllm.taken", self.longest, np.uint32)

    def feed(self, chunk) -> SimOutput:
        out = _vllm(
            np.ascontiguousarray(chunk.keys, dtype=np.int32).view(np.uint32),
            i8(chunk.offsets),
            i4(chunk.max_hit),
            i8(chunk.input_tokens),
            int(chunk.block_size),
            i4(chunk.tenant),
            self.n_ids,
            self.n_tenants,
            int(self.capacity),
            self.link,
            self.owner,
            self.taken,
            self.state,
        )
        return SimOutput(*out)


@policy("vllm", reference=reference, cache=_VllmReference, stack=True, carry=VllmBlockPool)
def kernel(trace, capacity, options=None) -> SimOutput:
    """vLLM block pool: blocks held while a request runs, released tail-first, least recently released evicted."""
    return VllmBlockPool.run(trace, capacity)
