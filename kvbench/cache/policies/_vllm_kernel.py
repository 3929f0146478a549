"""The compiled form of the `vllm` policy (its rule: `vllm.py`), resumable across chunks of a trace."""

from __future__ import annotations

import numpy as np

from kvbench.cache.compiled import SIM_OUT, i4, i8, kernel_fn
from kvbench.cache.policies import FILLED_AT, FIRST_REQUEST, SIZE, STARTED, TAIL, Carry, SimOutput

_NIL = np.int32(-1)
_SLOTS_MADE = TAIL  # state field (this policy has no other use for it): slots handed out at least once so far


@kernel_fn(
    SIM_OUT + "(i4[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8, i4[::1], i8, i8, i4[::1], i4[::1], i4[::1], "
    "i4[::1], i4[::1], i4[::1], i4[::1], i8[:])"
)
def _vllm(
    keys,
    offsets,
    max_hit,
    input_tokens,
    kv_tokens,
    block_size,
    tenant,
    n_tenants,
    capacity,
    head,
    nxt,
    prv,
    slot_key,
    copy_next,
    owner,
    taken,
    state,
):
    """The free queue is a circular doubly linked list over slot ids: node 0 (vLLM's null block) is its sentinel
    (nxt[0] = head, prv[0] = tail), node 1 the mark that stands for the slots never handed out (they come after
    anything put at the head, before anything appended); real slots are 2, 3, ... as made. prv[s] = -1 while
    slot s is held. `slot_key[s]`: the key it holds, -1 anonymous-hashed, -2 unhashed. `head[k]`: the oldest
    slot holding key k (-1: not cached); `copy_next[s]`: the next copy of the same key. `owner[s]`: tenant
    whose request first cached the key. `taken`: the running request's slots, in block order. The slot arrays
    hold `nxt.size` nodes: the kernel stops before a request that could need more and the caller grows them;
    `state` (STATE_FIELDS) carries the pool across calls, so a trace can also be fed in chunks."""
    n = offsets.size - 1
    room = nxt.size
    if state[STARTED] == 0:
        head[:] = _NIL
        nxt[0], prv[0], nxt[1], prv[1] = 1, 1, 0, 0
        state[STARTED], state[FILLED_AT], state[_SLOTS_MADE] = 1, -1, 0
    made = state[_SLOTS_MADE]
    size = state[SIZE]  # keys cached
    filled_at = state[FILLED_AT]
    base = state[FIRST_REQUEST]
    slots = capacity - 1
    n_free = slots - made  # the never-used ones
    c = nxt[0]
    while c != 0:
        if c != 1:
            n_free += 1
        c = nxt[c]
    if made == slots and prv[1] != _NIL:  # no slot left to make: the mark leaves the queue
        nxt[prv[1]] = nxt[1]
        prv[nxt[1]] = prv[1]
        prv[1] = _NIL
    multi = n_tenants > 1
    hit_blocks = np.zeros(n, np.int32)
    evictions = np.zeros(n, np.int32)
    matrix = np.zeros((n_tenants, n_tenants), np.int64)
    total_evictions = 0
    done = n
    for r in range(n):
        lo, hi = offsets[r], offsets[r + 1]
        need = (kv_tokens[r] + block_size - 1) // block_size
        if made < slots and made + 2 + min(need, slots - made) > room:
            done = r  # the slot arrays could overflow: the caller grows them and calls again from here
            break
        full = min(hi - lo, input_tokens[r] // block_size)
        t = tenant[r]
        h = 0
        while h < max_hit[r] and head[keys[lo + h]] != _NIL:
            h += 1
        hit_blocks[r] = h
        n_taken = 0
        for j in range(h):  # hold the oldest copy of each hit block
            s = head[keys[lo + j]]
            if prv[s] != _NIL:
                nxt[prv[s]] = nxt[s]
                prv[nxt[s]] = prv[s]
                prv[s] = _NIL
                n_free -= 1
            taken[n_taken] = s
            n_taken += 1
        hashed = kv_tokens[r] // block_size
        ev = 0
        while n_taken < need and n_free > 0:
            s = nxt[0]  # the head of the free queue
            if s == 1:  # the mark: make a new slot, behind whatever was put at the head
                made += 1
                s = made + 1
                copy_next[s] = _NIL
                slot_key[s] = -2
                if made == slots:  # the last one: the mark leaves the queue
                    nxt[0] = nxt[1]
                    prv[nxt[1]] = 0
                    prv[1] = _NIL
            else:
                nxt[0] = nxt[s]
                prv[nxt[s]] = 0
            prv[s] = _NIL
            n_free -= 1
            old = slot_key[s]
            if old >= 0:  # evict this copy; the key stays cached while another copy exists
                if head[old] == s:
                    head[old] = copy_next[s]
                else:
                    c = head[old]
                    while copy_next[c] != s:
                        c = copy_next[c]
                    copy_next[c] = copy_next[s]
                if head[old] == _NIL:
                    size -= 1
                    ev += 1
                    if multi:
                        matrix[t, owner[s]] += 1
            slot_key[s] = -2
            copy_next[s] = _NIL
            pos = n_taken
            if pos < hashed:
                if pos < full:
                    k = keys[lo + pos]
                    slot_key[s] = k
                    if head[k] == _NIL:
                        head[k] = s
                        size += 1
                        owner[s] = t
                    else:  # a duplicate (the newest copy goes last) keeps the key's first tenant
                        c = head[k]
                        while copy_next[c] != _NIL:
                            c = copy_next[c]
                        copy_next[c] = s
                        owner[s] = owner[head[k]]
                else:
                    slot_key[s] = -1
            taken[n_taken] = s
            n_taken += 1
        if filled_at < 0 and made == slots:  # every slot has been used: from now on taking one evicts
            filled_at = base + r
        evictions[r] = ev
        total_evictions += ev
        # release tail-first: hashed slots to the tail (block 0 last, the most recently released), unhashed ones
        # to the head (the one released first ends up at the head)
        for i in range(n_taken - 1, -1, -1):
            s = taken[i]
            if slot_key[s] == -2:
                first = nxt[0]
                nxt[0] = s
                prv[s] = 0
                nxt[s] = first
                prv[first] = s
            else:
                last = prv[0]
                nxt[last] = s
                prv[s] = last
                nxt[s] = 0
                prv[0] = s
            n_free += 1
    if n_tenants == 1:
        matrix[0, 0] = total_evictions
    state[SIZE], state[FILLED_AT], state[FIRST_REQUEST] = size, filled_at, base + done
    state[_SLOTS_MADE] = made
    return hit_blocks[:done].copy(), evictions[:done].copy(), matrix, filled_at


class VllmBlockPool(Carry):
    INITIAL_SLOTS = 1 << 16  # node arrays grow (doubling) as slots are made, up to the capacity

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head = self.buffer("vllm.head", self.n_ids, np.int32)
        nodes = int(min(self.capacity + 1, self.INITIAL_SLOTS))
        self.nxt, self.prv, self.slot_key, self.copy_next, self.owner, self.taken = (
            np.empty(nodes, np.int32) for _ in range(6)
        )

    def cached(self) -> np.ndarray:
        return self.head[: self.n_ids] != _NIL

    def _grow(self, at_least: int) -> None:
        nodes = int(min(self.capacity + 1, max(2 * self.nxt.size, at_least)))
        for name in ("nxt", "prv", "slot_key", "copy_next", "owner", "taken"):
            old = getattr(self, name)
            new = np.empty(nodes, np.int32)
            new[: old.size] = old
            setattr(self, name, new)

    def feed(self, chunk) -> SimOutput:
        offsets, max_hit, input_tokens = i8(chunk.offsets), i4(chunk.max_hit), i8(chunk.input_tokens)
        kv_tokens, tenant, keys = i8(chunk.kv_tokens()), i4(chunk.tenant), i4(chunk.keys)
        hits, evictions, matrix = [], [], np.zeros((self.n_tenants, self.n_tenants), np.int64)
        start, n = 0, int(input_tokens.size)
        while True:
            first = int(self.state[FIRST_REQUEST])
            h, e, m, filled_at = _vllm(
                keys, offsets[start:], max_hit[start:], input_tokens[start:], kv_tokens[start:],
                int(chunk.block_size), tenant[start:], self.n_tenants, int(self.capacity),
                self.head, self.nxt, self.prv, self.slot_key, self.copy_next, self.owner, self.taken, self.state,
            )  # fmt: skip
            hits.append(h)
            evictions.append(e)
            matrix += m
            start += int(self.state[FIRST_REQUEST]) - first
            if start >= n:
                break
            made = int(self.state[_SLOTS_MADE])
            need = -(-int(kv_tokens[start]) // int(chunk.block_size))
            self._grow(made + 2 + min(need, int(self.capacity) - 1 - made))
        if self.n_tenants == 1:
            matrix[0, 0] = sum(int(x.sum()) for x in evictions)
        return SimOutput(np.concatenate(hits), np.concatenate(evictions), matrix, filled_at)
