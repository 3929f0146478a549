"""The compiled form of the `vllm` policy (its rule: `vllm.py`), resumable across chunks of a trace."""

from __future__ import annotations

import numpy as np

from kvbench.cache.compiled import SIM_OUT, i4, i8, kernel_fn
from kvbench.cache.policies import FILLED_AT, FIRST_REQUEST, STARTED, TAIL, Carry, SimOutput

_NIL = np.uint32(0xFFFFFFFF)  # no slot (a `head` entry of a key not cached; a held slot's prev)
_ANON = np.uint32(0xFFFFFFFF)  # slot key: hashed with generated tokens, which no trace request can ask for
_EMPTY = np.uint32(0xFFFFFFFE)  # slot key: holds no hash (never used yet, or a partly filled block)
_SLOTS_MADE = TAIL  # state field (this policy has no other use for it): slots handed out at least once so far
# a slot's key with this bit set: a younger copy (head[key] is another slot). Evicting the oldest copy, the
# common case, then writes head[key] without reading it first (a read that missed the caches on large traces)
_COPY = np.uint32(0x80000000)


@kernel_fn()
def _put_between(node, at, nxt, s):
    """`_put_after` where the caller knows `at`'s next (`nxt`): no load waits on the previous put's store."""
    four, u1 = np.uint64(4), np.uint64(1)
    b = four * s
    node[b] = np.uint32(at)
    node[b + u1] = np.uint32(nxt)
    node[four * at + u1] = np.uint32(s)
    node[four * nxt] = np.uint32(s)
    return s


@kernel_fn()
def _put_after(node, at, s):
    """Link slot `s` into the free queue right after node `at` (0, the sentinel: at the head)."""
    _put_between(node, at, np.uint64(node[np.uint64(4) * at + np.uint64(1)]), s)


@kernel_fn(
    SIM_OUT + "(u4[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8, i4[::1], i8, i8, u4[::1], u4[::1], i4[::1], i8[:])"
)
def _vllm(keys, offsets, max_hit, input_tokens, output_tokens, block_size, tenant, n_tenants, capacity, head, node,
          owner, state):  # fmt: skip
    """The free queue is a circular doubly linked list over slot ids: node 0 (vLLM's null block) is its sentinel
    (its next is the head, its prev the tail), node 1 the mark that stands for the slots never handed out (they
    come after anything put at the head, before anything appended); real slots are 2, 3, ... as made.

    Slot s is the record node[4s:4s+4]: prev and next in the free queue (the mark's prev is _NIL once it has
    left the queue), the key it holds (or _ANON / _EMPTY; with _COPY set on a younger copy: keys are dense ids
    below 2**31 - 2), and the next copy of that key. One record per slot
    keeps a slot's fields in one cache line, and unsigned indices spare numba's negative-index fix-ups (as in
    `lru`). `head[k]`: the oldest slot holding key k (_NIL: not cached). `owner[s]`: the tenant whose request
    first cached the key (kept with several tenants only). The records hold `node.size // 4` slots: the
    kernel stops before a request that could need more and the caller grows them; `state` (STATE_FIELDS)
    carries the pool across calls, so a trace can also be fed in chunks. `output_tokens` is empty when the trace
    has none (the KV is then the prompt's alone).

    vLLM holds a request's blocks and releases them at its end, last block first, hashed ones to the tail
    (so block 0 ends up the most recent) and unhashed ones to the head. Here each hashed block is put back as
    soon as it is held, right after `anchor` (the tail when the request started): the blocks after the
    anchor are then exactly the request's, already in their released order, and the head is never one of
    them while slots remain that the request does not hold. That spares a second pass over the request's
    blocks. The one unhashed block (a last, partly filled one) is the last taken and goes to the head at the end.

    Requests run one at a time, so every slot is free when one starts and it can take slots until it holds
    `slots` of them. While slots are taken, the queue's head and the anchor's next stay in locals and the head
    is written back once (the anchor, when it is taken itself, at once): each load of the next slot then waits
    on one load, not on the store before it."""
    n = offsets.size - 1
    room = np.int64(node.size // 4)
    u1, u2, u3, four = np.uint64(1), np.uint64(2), np.uint64(3), np.uint64(4)
    z = np.uint64(0)
    if state[STARTED] == 0:
        head[:] = _NIL
        node[0], node[1], node[4], node[5] = 1, 1, 0, 0
        state[STARTED], state[FILLED_AT], state[_SLOTS_MADE] = 1, -1, 0
    made = state[_SLOTS_MADE]
    filled_at = state[FILLED_AT]
    base = state[FIRST_REQUEST]
    slots = capacity - 1
    if made == slots and node[4] != _NIL:  # the mark leaves the queue
        p, q = np.uint64(node[4]), np.uint64(node[5])
        node[four * p + u1] = np.uint32(q)
        node[four * q] = np.uint32(p)
        node[4] = _NIL
    multi = n_tenants > 1
    hit_blocks = np.zeros(n, np.int32)
    evictions = np.zeros(n, np.int32)
    matrix = np.zeros((n_tenants, n_tenants), np.int64)
    done = n
    bs = block_size
    outputs = output_tokens.size > 0
    for r in range(n):
        lo, hi = offsets[r], offsets[r + 1]
        kv = input_tokens[r]  # tokens whose KV the engine computes: not the last sampled one
        if outputs:
            kv += max(output_tokens[r], 1) - 1
        need = (kv + bs - 1) // bs
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
            s = np.uint64(head[np.uint64(keys[np.uint64(lo + h)])])
            if s == np.uint64(_NIL):
                break
            b = four * s
            p = np.uint64(node[b])
            q = np.uint64(node[b + u1])
            if s == anchor:
                anchor = p
            if p != anchor:  # (right after the anchor already, in the common case of a conversation's next turn)
                node[four * p + u1] = np.uint32(q)
                node[four * q] = np.uint32(p)
                _put_after(node, anchor, s)  # held, and already where its release puts it
            n_taken += 1
            h += 1
        hit_blocks[r] = h
        hashed = kv // bs
        full = min(full, hashed)  # a guard: kv_tokens covers the prompt, so every full prompt block is hashed
        ev = 0
        an = np.uint64(node[four * anchor + u1])  # the anchor's next
        hd = np.uint64(node[1])  # the head of the free queue
        written = False  # whether node[1] holds hd already
        while n_taken < min(need, slots):
            s = hd
            if s == u1:  # the mark: make a new slot
                made += 1
                s = np.uint64(made + 1)
                b = four * s
                node[b + u3] = _NIL
                node[b + u2] = _EMPTY
                if made == slots:  # the mark leaves the queue
                    hd = np.uint64(node[5])
                    node[4] = _NIL
                    if anchor == u1:
                        node[1], node[four * hd] = np.uint32(hd), 0
                        written = True
                        anchor, an = z, hd
            else:
                b = four * s
                hd = np.uint64(node[b + u1])
                if s == anchor:  # the queue now holds the request's blocks only: they go after the sentinel
                    node[1], node[four * hd] = np.uint32(hd), 0
                    written = True
                    anchor, an = z, hd
            old = node[b + u2]
            if old < _EMPTY:  # a trace key: evict this copy
                later = node[b + u3]  # the next copy of that key
                if old < _COPY:  # the oldest copy
                    head[np.uint64(old)] = later
                    if later == _NIL:  # the last copy: the key leaves the cache
                        ev += 1
                        if multi:
                            matrix[t, owner[s]] += 1
                    else:
                        node[four * np.uint64(later) + u2] = old  # now the oldest: its key without the bit
                else:  # a younger copy: unlink it, the key stays cached
                    c = np.uint64(head[np.uint64(old ^ _COPY)])
                    while np.uint64(node[four * c + u3]) != s:
                        c = np.uint64(node[four * c + u3])
                    node[four * c + u3] = later
            node[b + u3] = _NIL
            pos = n_taken
            if pos < full:
                k = keys[np.uint64(lo + pos)]
                kk = np.uint64(k)
                if head[kk] == _NIL:
                    node[b + u2] = np.uint32(k)
                    head[kk] = np.uint32(s)
                    if multi:
                        owner[s] = t
                else:
                    node[b + u2] = np.uint32(k) | _COPY
                    c = np.uint64(head[kk])
                    while node[four * c + u3] != _NIL:
                        c = np.uint64(node[four * c + u3])
                    node[four * c + u3] = np.uint32(s)
                    if multi:
                        owner[s] = owner[np.uint64(head[kk])]
                an = _put_between(node, anchor, an, s)  # held, and already where its release puts it
            elif pos < hashed:  # hashed with generated tokens
                node[b + u2] = _ANON
                an = _put_between(node, anchor, an, s)
            else:  # unhashed (the last one taken): to the head at the end
                node[b + u2] = _EMPTY
                unhashed = s
            n_taken += 1
        if not written:
            node[1], node[four * hd] = np.uint32(hd), 0
        if filled_at < 0 and made == slots:
            filled_at = base + r
        evictions[r] = ev
        if unhashed != z:
            _put_after(node, z, unhashed)
    state[FILLED_AT], state[FIRST_REQUEST], state[_SLOTS_MADE] = filled_at, base + done, made
    if done < n:  # stopped for more slot records
        return hit_blocks[:done].copy(), evictions[:done].copy(), matrix, filled_at
    return hit_blocks, evictions, matrix, filled_at  # (evict_matrix: with one tenant, the caller sums evictions)


class VllmBlockPool(Carry):
    INITIAL_SLOTS = 1 << 16  # slot records grow (doubling) as slots are made, up to the capacity

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.n_ids > 0x7FFFFFFE:  # _COPY takes a key's top bit
            raise ValueError(f"{self.n_ids} block ids: the vllm kernel holds at most 2**31 - 2")
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
        tenant, keys = i4(chunk.tenant), i4(chunk.keys).view(np.uint32)
        outputs = np.empty(0, np.int64) if chunk.output_tokens is None else i8(chunk.output_tokens)
        hits, evictions, matrix = [], [], np.zeros((self.n_tenants, self.n_tenants), np.int64)
        start, n = 0, int(input_tokens.size)
        while True:
            first = int(self.state[FIRST_REQUEST])
            h, e, m, filled_at = _vllm(
                keys, offsets[start:], max_hit[start:], input_tokens[start:], outputs[start:],
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
            need = -(-int(chunk.kv_tokens()[start]) // int(chunk.block_size))
            at_least = made + 2 + min(need, int(self.capacity) - 1 - made)
            self._slot_arrays(int(min(self.capacity + 1, max(2 * self.owner.size, at_least))))
        if self.n_tenants == 1:
            matrix[0, 0] = sum(int(x.sum()) for x in evictions)
        return SimOutput(np.concatenate(hits), np.concatenate(evictions), matrix, filled_at)
