"""`vllm`: vLLM's block pool (v1 `BlockPool` / `KVCacheManager`, as in vLLM 0.32), to predict per request the
`cached_tokens` a live vLLM reports, under eviction too (docs/fidelity.md, "the vllm rule").

The capacity is the engine's KV blocks (`num_gpu_blocks`, as vLLM's `cache_config_info` metric reports them); one
of them is the null block, never handed out (so a capacity of 1 caches nothing). The other slots sit in a free queue (head = evicted next) unless a
running request holds them. Per request:

1. lookup: the longest cached prefix, capped at `trace.max_hit` (vLLM recomputes at least the last prompt token);
2. the hit blocks are held (taken off the free queue). Where duplicates exist, the oldest copy is the one taken;
3. the request's other blocks are taken from the head of the free queue, evicting what they held: enough for
   every token whose KV the engine computes, `input_tokens + output_tokens - 1` (the last sampled token is never
   run through the model). Full prompt blocks get the prompt's keys (a block already cached beyond the hit
   prefix, e.g. the last one of a prompt that is a whole number of blocks, is computed again into a new slot:
   vLLM does not deduplicate); full blocks that hold generated tokens are hashed too, with content no trace
   request can ask for; the last, partly filled block is not hashed;
4. at the end all blocks are released tail-first (`reversed`): hashed blocks are appended to the free queue
   (last block first, so block 0 is the most recently released), unhashed ones are put at its head (vLLM reuses
   them first).

Requests that overlap in time (engine-sim) call `begin` when scheduled, `grow` as their KV grows and `end`
when they finish; `run` (the sim backend) does the three at once per request, which is vLLM at concurrency 1.
A request that needs more blocks than are free caches what fits (an engine would queue or preempt it).

The compiled kernel and the reference below implement the same rule (tests compare them on every sample).
Unlike plain block LRU this is not a stack algorithm (anonymous slots, duplicates), so no one-pass curve.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .._compiled import SIM_OUT, i4, i8, kernel_fn
from . import FILLED_AT, FIRST_REQUEST, SIZE, STARTED, TAIL, Carry, SimOutput, policy
from ._reference import PrefixCache

_ANON = -1  # a slot hashed with generated tokens: no trace request can hit it
_EMPTY = -2  # a slot holding no hash (never used yet, or a partly filled block)
_FRESH = 1  # the free queue's mark for the slots never handed out yet (slot 0 is the null block)


class VllmPool(PrefixCache):
    """The readable rule, slot by slot. Requests may overlap (begin / grow / end). Slots are made when first
    handed out (vLLM's initial free queue is every block in id order, behind whatever is put at its head and
    ahead of whatever is appended), so a huge capacity costs nothing."""

    def __init__(self, trace, capacity, options=None):
        super().__init__(trace, capacity, options)
        self.fresh = capacity - 1  # slots never handed out yet: the `_FRESH` mark stands for them in the queue
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys([_FRESH] if self.fresh else [])  # head first
        self.slot_key: list[int] = [_EMPTY, _EMPTY]  # slot -> trace key, _ANON or _EMPTY (0: null, 1: the mark)
        self.copies: dict[int, list[int]] = {}  # cached key -> its slots, oldest first
        self.refs: list[int] = [0, 0]
        self.held: dict[int, list[int]] = {}  # running request -> its slots, in block order
        self.unhashed_from: dict[int, int] = {}  # running request -> its first block not hashed yet
        self.extra: dict[int, list[int]] = {}  # running request -> slots it holds for keys outside its prompt
        self.bs = trace.block_size
        self.full_blocks = (trace.input_tokens // trace.block_size).tolist()

    def contains(self, key: int) -> bool:
        return key in self.copies

    def begin(self, r: int, prompt_slots: bool = True) -> int:
        """Request r is scheduled: hold its hit prefix and take slots for its whole prompt (or, without
        `prompt_slots`, leave that to `grow` as its chunks are scheduled)."""
        self.request = r
        t = self.trace
        keys = t.keys[t.offsets[r] : t.offsets[r + 1]].tolist()
        hit = 0
        while hit < t.max_hit[r] and keys[hit] in self.copies:
            hit += 1
        self.out.hit_blocks[r] = hit
        mine = self.held[r] = []
        self.unhashed_from[r] = hit
        for pos, key in enumerate(keys[:hit]):  # (a prompt's keys are distinct: they are prefix-chained)
            self.on_hit(key, pos)
            slot = self.copies[key][0]
            if self.refs[slot] == 0:
                del self.free[slot]
            self.refs[slot] += 1
            mine.append(slot)
        self.grow(r, int(t.input_tokens[r]) if prompt_slots else 0)
        return hit

    def grow(self, r: int, tokens: int) -> None:
        """Request r's KV now spans `tokens` tokens: take slots up to ceil(tokens / block_size); a block is hashed
        once full (its key if it is a full prompt block, an anonymous hash once it holds generated tokens)."""
        self.request = r
        mine = self.held[r]
        t = self.trace
        lo = int(t.offsets[r])
        full = self.full_blocks[r]
        # a partly filled block taken before is hashed once full
        pos = self.unhashed_from[r]
        while pos < len(mine) and (pos + 1) * self.bs <= tokens:
            self._hash(mine[pos], int(t.keys[lo + pos]) if pos < full else _ANON)
            pos += 1
        while len(mine) * self.bs < tokens:
            slot = self.take()
            if slot is None:
                break  # the pool is held by running requests: cache no more of this one
            mine.append(slot)
            if (pos + 1) * self.bs <= tokens:
                self._hash(slot, int(t.keys[lo + pos]) if pos < full else _ANON)
                pos += 1
        self.unhashed_from[r] = pos
        if self.out.filled_at < 0 and not self.fresh:  # every slot has been used: from now on taking one evicts
            self.out.filled_at = r

    def end(self, r: int) -> None:
        self.request = r
        first = []  # unhashed: to the head of the free queue, in this order
        self.unhashed_from.pop(r, None)
        for slot in [*reversed(self.held.pop(r, [])), *self.extra.pop(r, [])]:
            self.refs[slot] -= 1
            if self.refs[slot] == 0:
                if self.slot_key[slot] == _EMPTY:
                    first.append(slot)
                else:
                    self.free[slot] = None
        for slot in reversed(first):
            self.free[slot] = None
            self.free.move_to_end(slot, last=False)

    def run(self):
        kv_tokens = self.trace.kv_tokens().tolist()
        for r in range(self.trace.n_requests):
            self.begin(r)
            self.grow(r, kv_tokens[r])
            self.end(r)
        return self.out

    def free_blocks(self) -> int:
        """Slots no running request holds (cached or never used): what vLLM counts as free."""
        return self.fresh + len(self.free) - (_FRESH in self.free)

    def admission_need(self, r: int, tokens: int) -> int:
        """Free slots request r needs to hold `tokens` tokens of KV, as vLLM's admission counts them: the blocks
        its hit does not cover, and the hit blocks that sit in the free queue (holding them takes them off)."""
        t = self.trace
        hit = self.lookup(r)
        keys = t.keys[t.offsets[r] : t.offsets[r] + hit].tolist()
        evictable = sum(1 for key in keys if self.refs[self.copies[key][0]] == 0)
        return evictable + max(0, -(-tokens // self.bs) - hit)

    # --- slots, also for keys outside the trace (engine-sim's LoRA delta pages) --------------------------------
    def take(self) -> int | None:
        """The head of the free queue, held, with the hash it held evicted; None when every slot is held."""
        if not self.free:
            return None
        slot = next(iter(self.free))
        if slot == _FRESH:
            slot = len(self.slot_key)
            self.slot_key.append(_EMPTY)
            self.refs.append(0)
            self.fresh -= 1
            if not self.fresh:
                del self.free[_FRESH]
        else:
            del self.free[slot]
            self._drop(slot)
        self.refs[slot] = 1
        return slot

    def hold_key(self, r: int, key: int) -> bool:
        """Hold a slot holding `key`, a key outside request r's prompt, while r runs (its oldest copy when cached,
        else a new slot that then holds it); False when none is free. Released after the request's own blocks."""
        mine = self.extra.setdefault(r, [])
        if key in self.copies:
            slot = self.copies[key][0]
            if slot in mine or slot in self.held.get(r, ()):
                return True
            if self.refs[slot] == 0:
                del self.free[slot]
            self.refs[slot] += 1
        else:
            slot = self.take()
            if slot is None:
                return False
            self._hash(slot, key)
        mine.append(slot)
        return True

    def _hash(self, slot: int, key: int) -> None:
        self.slot_key[slot] = key
        if key >= 0:
            if key in self.copies:
                self.copies[key].append(slot)
            else:
                self.copies[key] = [slot]
                self.insert(key)

    def _drop(self, slot: int) -> None:
        """The slot is reused: the hash it held is evicted (the key stays cached while another copy exists)."""
        key = self.slot_key[slot]
        self.slot_key[slot] = _EMPTY
        if key < 0:
            return
        slots = self.copies[key]
        slots.remove(slot)
        if not slots:
            del self.copies[key]
            self.evict(key)


def reference(trace, capacity, options=None) -> SimOutput:
    return VllmPool(trace, capacity, options).run()


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
            self._grow(made + 2 + min(-(-int(kv_tokens[start]) // int(chunk.block_size)), int(self.capacity) - 1 - made))
        if self.n_tenants == 1:
            matrix[0, 0] = sum(int(x.sum()) for x in evictions)
        return SimOutput(np.concatenate(hits), np.concatenate(evictions), matrix, filled_at)


@policy("vllm", reference=reference, cache=VllmPool, carry=VllmBlockPool)
def kernel(trace, capacity, options=None) -> SimOutput:
    """vLLM block pool: the null block, blocks for prompt and generated tokens, tail-first release, no dedup."""
    return VllmBlockPool.run(trace, capacity)
