"""`vllm`: vLLM's block pool (v1 `BlockPool` / `KVCacheManager`, as in vLLM 0.32), to predict per request the
`cached_tokens` a live vLLM reports, under eviction too (docs/fidelity.md, "the vllm rule").

The capacity is the engine's KV blocks (`num_gpu_blocks`, as vLLM's `cache_config_info` metric reports them);
one of them is the null block, never handed out (so a capacity of 1 caches nothing). The other slots sit in a
free queue (head = evicted next) unless a running request holds them. Per request:

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

The compiled kernel (`_vllm_kernel`) and the reference below implement the same rule (tests compare them on
every sample).
Unlike plain block LRU this is not a stack algorithm (anonymous slots, duplicates), so no one-pass curve.
"""

from __future__ import annotations

from collections import OrderedDict

from kvbench.cache.policies import SimOutput, policy
from kvbench.cache.policies._vllm_kernel import VllmBlockPool
from kvbench.cache.reference import PrefixCache

ANON_SLOT = -1  # a slot hashed with generated tokens: no trace request can hit it
EMPTY_SLOT = -2  # a slot holding no hash (never used yet, or a partly filled block)
FRESH_MARK = 1  # the free queue's mark for the slots never handed out yet (slot 0 is the null block)


class VllmPool(PrefixCache):
    """The readable rule, slot by slot. Requests may overlap (begin / grow / end). Slots are made when first
    handed out (vLLM's initial free queue is every block in id order, behind whatever is put at its head and
    ahead of whatever is appended), so a huge capacity costs nothing."""

    def __init__(self, trace, capacity, options=None):
        super().__init__(trace, capacity, options)
        self.fresh = capacity - 1  # slots never handed out yet: `FRESH_MARK` stands for them in the queue
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys([FRESH_MARK] if self.fresh else [])  # head first
        # slot -> trace key, ANON_SLOT or EMPTY_SLOT (0: null, 1: the mark)
        self.slot_key: list[int] = [EMPTY_SLOT, EMPTY_SLOT]
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
            self._hash(mine[pos], int(t.keys[lo + pos]) if pos < full else ANON_SLOT)
            pos += 1
        while len(mine) * self.bs < tokens:
            slot = self.take()
            if slot is None:
                break  # the pool is held by running requests: cache no more of this one
            mine.append(slot)
            if (pos + 1) * self.bs <= tokens:
                self._hash(slot, int(t.keys[lo + pos]) if pos < full else ANON_SLOT)
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
                if self.slot_key[slot] == EMPTY_SLOT:
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
        return self.fresh + len(self.free) - (FRESH_MARK in self.free)

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
        if slot == FRESH_MARK:
            slot = len(self.slot_key)
            self.slot_key.append(EMPTY_SLOT)
            self.refs.append(0)
            self.fresh -= 1
            if not self.fresh:
                del self.free[FRESH_MARK]
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
                self._claim(slot)
            self.refs[slot] += 1
        else:
            slot = self.take()
            if slot is None:
                return False
            self._hash(slot, key)
        mine.append(slot)
        return True

    def _claim(self, slot: int) -> None:
        """A free slot is held again: out of the free queue (a subclass may keep the queue another way)."""
        del self.free[slot]

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
        self.slot_key[slot] = EMPTY_SLOT
        if key < 0:
            return
        slots = self.copies[key]
        slots.remove(slot)
        if not slots:
            del self.copies[key]
            self.evict(key)


def reference(trace, capacity, options=None) -> SimOutput:
    return VllmPool(trace, capacity, options).run()


@policy("vllm", reference=reference, cache=VllmPool, carry=VllmBlockPool)
def kernel(trace, capacity, options=None) -> SimOutput:
    """vLLM block pool: the null block, blocks for prompt and generated tokens, tail-first release, no dedup."""
    return VllmBlockPool.run(trace, capacity)
