"""The compiled form of the `vllm` policy (its rule: `vllm.py`), resumable across chunks of a trace."""

from __future__ import annotations

import numpy as np

from kvbench.cache.compiled import SIM_OUT, i4, i8, kernel_fn
from kvbench.cache.policies import FILLED_AT, FIRST_REQUEST, SIZE, STARTED, TAIL, Carry, SimOutput

_NIL = np.uint32(0xFFFFFFFF)  # no slot (a `head` entry of a key not cached; a held slot's prev)
_ANON = np.uint32(0xFFFFFFFF)  # slot key: hashed with generated tokens, which no trace request can ask for
_EMPTY = np.uint32(0xFFFFFFFE)  # slot key: holds no hash (never used yet, or a partly filled block)
_SLOTS_MADE = TAIL  # state field (this policy has no other use for it): slots handed out at least once so far


@kernel_fn()
def _put_after(node, at, s):
    """Link slot `s` into the free queue right after node `at` (0, the sentinel: at the head)."""
    four, u1 = np.uint64(4), np.uint64(1)
    a, b = four * at, four * s
    nxt = np.uint64(node[a + u1])
    node[b] = np.uint32(at)
    node[b + u1] = np.uint32(nxt)
    node[a + u1] = np.uint32(s)
    node[four * nxt] = np.uint32(s)


@kernel_fn(
    SIM_OUT + "(u4[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8, i4[::1], i8, i8, u4[::1], u4[::1], i4[::1], i8[:])"
)
def _vllm(keys, offsets, max_hit, input_tokens, kv_tokens, block_size, tenant, n_tenants, capacity, head, node,
          owner, state):  # fmt: skip
    """The free queue is a circular doubly linked list over slot ids: node 0 (vLLM's null block) is its sentinel
    (its next is the head, its prev the tail), node 1 the mark that stands for the slots never handed out (they
    come after anything put at the head, before anything appended); real slots are 2, 3, ... as made.

    Slot s is the record node[4s:4s+4]: prev and next in the free queue (the mark's prev is _NIL once it has
    left the queue), the key it holds (or _ANON / _EMPTY), and the next copy of that key. One record per slot
    keeps a slot's fields in one cache line, and unsigned indices spare numba's negative-index fix-ups (as in
    `lru`). `head[k]`: the oldest slot holding key k (_NIL: not cached). `owner[s]`: the tenant whose request
    first cached the key (kept with several tenants only). The records hold `node.size // 4` slots: the
    kernel stops before a request that could need more and the caller grows them; `state` (STATE_FIELDS)
    carries the pool across calls, so a trace can also be fed in chunks.

    vLLM holds a request's blocks and releases them at its end, last block first, hashed ones to the tail
    (so block 0 ends up the most recent) and unhashed ones to the head. Here each hashed block is put back as
    soon as it is held, right after `anchor` (the tail when the request started): the blocks after the
    anchor are then exactly the request's, already in their released order, and the head is never one of
    them while `n_free` counts only the others. That spares a second pass over the request's blocks. The one
    unhashed block (a last, partly filled one) is the last taken and goes to the head at the end."""
    n = offsets.size - 1
    room = np.int64(node.size // 4)
    u1, u2, u3, four = np.uint64(1), np.uint64(2), np.uint64(3), np.uint64(4)
    z = np.uint64(0)
    if state[STARTED] == 0:
        head[:] = _NIL
        node[0], node[1], node[4], node[5] = 1, 1, 0, 0
        state[STARTED], state[FILLED_AT], state[_SLOTS_MADE] = 1, -1, 0
    made = state[_SLOTS_MADE]
    size = state[SIZE]
    filled_at = state[FILLED_AT]
    base = state[FIRST_REQUEST]
    slots = capacity - 1
    n_free = slots - made
    c = np.uint64(node[1])
    while c != z:
        if c != u1:
            n_free += 1
        c = np.uint64(node[four * c + u1])
    if made == slots and node[4] != _NIL:  # the mark leaves the queue
        p, q = np.uint64(node[4]), np.uint64(node[5])
        node[four * p + u1] = np.uint32(q)
        node[four * q] = np.uint32(p)
        node[4] = _NIL
    multi = n_tenants > 1
    hit_blocks = np.zeros(n, np.int32)
    evictions = np.zeros(n, np.int32)
    matrix = np.zeros((n_tenants, n_tenants), np.int64)
    total_evictions = 0
    done = n
    bs = block_size
    for r in range(n):
        lo, hi = offsets[r], offsets[r + 1]
        need = (kv_tokens[r] + bs - 1) // bs
        if made < slots and made + 2 + min(need, slots - made) > room:
            done = r
            break
        full = min(hi - lo, input_tokens[r] // bs)
        t = tenant[r]
        h = 0
        mh = max_hit[r]
        n_taken = 0
        anchor = np.uint64(node[0])  # the tail when the request starts
        unhashed = z
        while h < mh:
            s = np.uint64(head[np.uint64(keys[lo + h])])
            if s == np.uint64(_NIL):
                break
            b = four * s
            p = np.uint64(node[b])
            q = np.uint64(node[b + u1])
            n_free -= 1
            if s == anchor:
                anchor = p
            if p != anchor:  # (right after the anchor already, in the common case of a conversation's next turn)
                node[four * p + u1] = np.uint32(q)
                node[four * q] = np.uint32(p)
                _put_after(node, anchor, s)  # held, and already where its release puts it
            n_taken += 1
            h += 1
        hit_blocks[r] = h
        hashed = kv_tokens[r] // bs
        full = min(full, hashed)  # a guard: kv_tokens covers the prompt, so every full prompt block is hashed
        ev = 0
        while n_taken < need and n_free > 0:
            s = np.uint64(node[1])  # head of the free queue
            if s == u1:  # the mark: make a new slot
                made += 1
                s = np.uint64(made + 1)
                b = four * s
                node[b + u3] = _NIL
                node[b + u2] = _EMPTY
                if made == slots:
                    q = np.uint64(node[5])
                    node[1] = np.uint32(q)
                    node[four * q] = 0
                    node[4] = _NIL
                    if anchor == u1:
                        anchor = z
            else:
                b = four * s
                q = np.uint64(node[b + u1])
                node[1] = np.uint32(q)
                node[four * q] = 0
                if s == anchor:
                    anchor = z
            n_free -= 1
            old = node[b + u2]
            if old < _EMPTY:  # a trace key: evict this copy
                ko = np.uint64(old)
                if np.uint64(head[ko]) == s:
                    head[ko] = node[b + u3]
                else:
                    c = np.uint64(head[ko])
                    while np.uint64(node[four * c + u3]) != s:
                        c = np.uint64(node[four * c + u3])
                    node[four * c + u3] = node[b + u3]
                if head[ko] == _NIL:
                    size -= 1
                    ev += 1
                    if multi:
                        matrix[t, owner[s]] += 1
            node[b + u3] = _NIL
            pos = n_taken
            if pos < full:
                k = keys[lo + pos]
                kk = np.uint64(k)
                node[b + u2] = np.uint32(k)
                if head[kk] == _NIL:
                    head[kk] = np.uint32(s)
                    size += 1
                    if multi:
                        owner[s] = t
                else:
                    c = np.uint64(head[kk])
                    while node[four * c + u3] != _NIL:
                        c = np.uint64(node[four * c + u3])
                    node[four * c + u3] = np.uint32(s)
                    if multi:
                        owner[s] = owner[np.uint64(head[kk])]
                _put_after(node, anchor, s)  # held, and already where its release puts it
            elif pos < hashed:  # hashed with generated tokens
                node[b + u2] = _ANON
                _put_after(node, anchor, s)
            else:  # unhashed (the last one taken): to the head at the end
                node[b + u2] = _EMPTY
                unhashed = s
            n_taken += 1
        if filled_at < 0 and made == slots:
            filled_at = base + r
        evictions[r] = ev
        total_evictions += ev
        if unhashed != z:
            _put_after(node, z, unhashed)
        n_free += n_taken
    if n_tenants == 1:
        matrix[0, 0] = total_evictions
    state[SIZE], state[FILLED_AT], state[FIRST_REQUEST] = size, filled_at, base + done
    state[_SLOTS_MADE] = made
    return hit_blocks[:done].copy(), evictions[:done].copy(), matrix, filled_at


class VllmBlockPool(Carry):
    INITIAL_SLOTS = 1 << 16  # slot records grow (doubling) as slots are made, up to the capacity

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head = self.buffer("vllm.head", self.n_ids, np.uint32)
        self._slot_arrays(int(min(self.capacity + 1, self.INITIAL_SLOTS)))

    def _slot_arrays(self, slots: int) -> None:
        """(Re)allocate the per-slot arrays for `slots` slots, keeping what the old ones held. The first ones come
        from the scratch pool when the run may reuse buffers (fresh ones cost page faults at every call)."""
        for name, width, dtype in (("node", 4, np.uint32), ("owner", 1, np.int32)):
            old = getattr(self, name, None)
            if old is None:
                new = self.buffer(f"vllm.{name}", width * slots, dtype)
            else:
                new = np.empty(width * slots, dtype)
                new[: old.size] = old
            setattr(self, name, new)

    def cached(self) -> np.ndarray:
        return self.head[: self.n_ids] != _NIL

    def feed(self, chunk) -> SimOutput:
        offsets, max_hit, input_tokens = i8(chunk.offsets), i4(chunk.max_hit), i8(chunk.input_tokens)
        kv_tokens, tenant, keys = i8(chunk.kv_tokens()), i4(chunk.tenant), i4(chunk.keys).view(np.uint32)
        hits, evictions, matrix = [], [], np.zeros((self.n_tenants, self.n_tenants), np.int64)
        start, n = 0, int(input_tokens.size)
        while True:
            first = int(self.state[FIRST_REQUEST])
            h, e, m, filled_at = _vllm(
                keys, offsets[start:], max_hit[start:], input_tokens[start:], kv_tokens[start:],
                int(chunk.block_size), tenant[start:], self.n_tenants, int(self.capacity),
                self.head, self.node, self.owner, self.state,
            )  # fmt: skip
            hits.append(h)
            evictions.append(e)
            matrix += m
            start += int(self.state[FIRST_REQUEST]) - first
            if start >= n:
                break
            made = int(self.state[_SLOTS_MADE])
            need = -(-int(kv_tokens[start]) // int(chunk.block_size))
            at_least = made + 2 + min(need, int(self.capacity) - 1 - made)
            self._slot_arrays(int(min(self.capacity + 1, max(2 * self.owner.size, at_least))))
        if self.n_tenants == 1:
            matrix[0, 0] = sum(int(x.sum()) for x in evictions)
        return SimOutput(np.concatenate(hits), np.concatenate(evictions), matrix, filled_at)
