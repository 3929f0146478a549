"""vLLM's block pool as engine-sim drives it, with the per-block work made cheap.

`QuickPool` is `VllmPool` (kvbench.cache.policies.vllm, the readable rule) with its hot methods written for
speed. Engine-sim calls them for every block of every request (begin, grow, end, and the admission check of
each iteration that looks at the queue), which is most of a long replay's time. What differs:

- each request's keys are Python lists made once (the reference slices the trace's numpy array and converts
  every key it reads), a tenant is read from a list, and taking a slot, hashing it and dropping the hash it
  held are inlined;
- the free queue is a doubly linked list over slot ids (`nxt` / `prv`; slot 0, the null block, is its
  sentinel) instead of an OrderedDict: under the churn of a long replay an OrderedDict's head lookups and
  deletions cost microseconds each, the lists a few list reads. The fresh-slot mark keeps its place in the
  queue as node 1 (`FRESH_MARK`, never a real slot);
- evictions are logged in two int lists and added to `out` at the end (`flush_evictions`): a numpy
  element's += per eviction cost more than the rest of an eviction.

The same order of every change and of every call a scenario may hook (`contains`, `lookup`, `on_hit`,
`insert`, `evict`, `take` through instance attributes), so the results are the reference's, bit for bit
(tests/backends/enginesim/test_quick_pool.py drives both with the same calls and compares their whole state, and
replays traces through engine-sim with each).
"""

from __future__ import annotations

import numpy as np

from kvbench.cache.policies.vllm import ANON_SLOT, EMPTY_SLOT, FRESH_MARK, VllmPool
from kvbench.cache.reference import PrefixCache


class QuickPool(VllmPool):
    def __init__(self, trace, capacity, options=None, keys: list[list[int]] | None = None):
        """`keys`: each request's keys as a list (engine-sim's requests hold the same lists), else made here."""
        super().__init__(trace, capacity, options)
        if keys is None:
            off = trace.offsets.tolist()
            flat = trace.keys.tolist()
            keys = [flat[off[r] : off[r + 1]] for r in range(trace.n_requests)]
        self.keys_of = keys
        self.tenants = trace.tenant.tolist()
        del self.free  # (the reference's OrderedDict: every method that used it is replaced below)
        self.nxt, self.prv = [0, 0], [0, 0]  # free queue links per slot; nxt[0]: head, prv[0]: tail
        self.n_free = 0  # slots in the queue (the fresh mark not counted)
        if self.fresh:
            self._append(FRESH_MARK)
        # per eviction, the request that evicted and the victim's tenant (ints in lists: no object per eviction)
        self.evicted_by: list[int] = []
        self.evicted_tenant: list[int] = []
        self.max_hit = trace.max_hit.tolist()
        self.input_tokens = trace.input_tokens.tolist()
        # engine-sim's record of each cached block's life (track): None until an instance asks for it
        self.clock = self.born = self.lifetimes = self.admitted = self.left = None
        self.plain = False  # tracked with nothing below HBM: grow does insert's and evict's work inline
        # admission_need's last scan, (request, `changes` then, its hit), for the begin that usually follows;
        # `changes` counts the calls that may change what is cached (grow, take)
        self.scanned, self.changes = (-1, -1, 0), 0

    def track(self, clock, born: dict, lifetimes: list, admitted=None, left=None) -> None:
        """Time each block's life in HBM (`born[key]` = clock.now when inserted, `lifetimes` gets its age when
        evicted) and tell the tiers below (`admitted(key)`, `left(key)`), in insert and evict themselves: the
        wrappers engine-sim put around them cost two calls per block."""
        self.clock, self.born, self.lifetimes, self.admitted, self.left = clock, born, lifetimes, admitted, left
        self.plain = admitted is None and left is None and type(self) is QuickPool

    # --- the free queue --------------------------------------------------------------------------------------
    def _append(self, slot: int) -> None:
        nxt, prv = self.nxt, self.prv
        tail = prv[0]
        nxt[tail], prv[slot], nxt[slot], prv[0] = slot, tail, 0, slot

    def _push_front(self, slot: int) -> None:
        nxt, prv = self.nxt, self.prv
        head = nxt[0]
        nxt[0], prv[slot], nxt[slot], prv[head] = slot, 0, head, slot

    def _unlink(self, slot: int) -> None:
        nxt, prv = self.nxt, self.prv
        before, after = prv[slot], nxt[slot]
        nxt[before], prv[after] = after, before

    def free_queue(self) -> list[int]:
        """The free queue, head first (the reference's `list(free)`), for tests."""
        out, slot = [], self.nxt[0]
        while slot:
            out.append(slot)
            slot = self.nxt[slot]
        return out

    def free_blocks(self) -> int:
        return self.fresh + self.n_free

    def take(self) -> int | None:
        self.changes += 1
        head = self.nxt[0]
        if not head:
            return None
        if head == FRESH_MARK:
            slot = len(self.slot_key)
            self.slot_key.append(EMPTY_SLOT)
            self.refs.append(0)
            self.nxt.append(0)
            self.prv.append(0)
            self.fresh -= 1
            if not self.fresh:
                self._unlink(FRESH_MARK)
        else:
            slot = head
            self._unlink(slot)
            self.n_free -= 1
            self._drop(slot)
        self.refs[slot] = 1
        return slot

    def _claim(self, slot: int) -> None:
        self._unlink(slot)
        self.n_free -= 1

    def _hooked(self, name: str) -> bool:
        """Whether a scenario replaced method `name` on this object (then it is called as the reference does)."""
        return name in vars(self)

    # --- lookups -----------------------------------------------------------------------------------------
    def _cap(self, r: int) -> int:
        """The trace's max_hit of r: from a list, unless a scenario wraps the lookups (user-kv caps a hit by
        changing the trace's array while its begin runs)."""
        d = vars(self)
        if "begin" in d or "lookup" in d or "contains" in d:
            return int(self.trace.max_hit[r])
        return self.max_hit[r]

    def lookup(self, r: int) -> int:
        keys, cap = self.keys_of[r], self._cap(r)
        hit = 0
        if self._hooked("contains"):
            contains = self.contains
            while hit < cap and contains(keys[hit]):
                hit += 1
        else:
            copies = self.copies
            while hit < cap and keys[hit] in copies:
                hit += 1
        return hit

    def admission_need(self, r: int, tokens: int) -> int:
        refs, copies, keys = self.refs, self.copies, self.keys_of[r]
        if self._hooked("lookup") or self._hooked("contains"):
            hit = self.lookup(r)
            evictable = [refs[copies[key][0]] for key in keys[:hit]].count(0)
        else:  # lookup's scan and the count of hit blocks in the free queue, in one pass
            cap, hit, evictable = self._cap(r), 0, 0
            while hit < cap:
                slots = copies.get(keys[hit])
                if slots is None:
                    break
                if not refs[slots[0]]:
                    evictable += 1
                hit += 1
            self.scanned = (r, self.changes, hit)
        return evictable + max(0, -(-tokens // self.bs) - hit)

    # --- a request's life ---------------------------------------------------------------------------------
    def begin(self, r: int, prompt_slots: bool = True) -> int:
        self.request = r
        keys, copies, refs = self.keys_of[r], self.copies, self.refs
        row, changes, hit = self.scanned
        if row != r or changes != self.changes or self._hooked("begin"):  # (else admission_need's scan holds)
            cap, hit = self._cap(r), 0
            while hit < cap and keys[hit] in copies:
                hit += 1
        self.out.hit_blocks[r] = hit
        mine = self.held[r] = []
        self.unhashed_from[r] = hit
        on_hit = self.on_hit if self._hooked("on_hit") or type(self).on_hit is not PrefixCache.on_hit else None
        if on_hit is not None:
            for pos in range(hit):
                on_hit(keys[pos], pos)
                self._hold(copies[keys[pos]][0], mine)
        else:
            nxt, prv, claimed = self.nxt, self.prv, 0
            for key in keys[:hit]:
                slot = copies[key][0]
                if refs[slot] == 0:
                    before, after = prv[slot], nxt[slot]  # _unlink
                    nxt[before], prv[after] = after, before
                    claimed += 1
                refs[slot] += 1
                mine.append(slot)
            self.n_free -= claimed
        self.grow(r, self.input_tokens[r] if prompt_slots else 0)
        return hit

    def _hold(self, slot: int, mine: list) -> None:
        if self.refs[slot] == 0:
            self._unlink(slot)
            self.n_free -= 1
        self.refs[slot] += 1
        mine.append(slot)

    def grow(self, r: int, tokens: int) -> None:
        self.request = r
        self.changes += 1
        mine, bs = self.held[r], self.bs
        pos, held = self.unhashed_from[r], len(mine)
        filled = tokens // bs  # blocks `tokens` fill: each is hashed ((pos + 1) * bs <= tokens is pos < filled)
        if pos < held and pos < filled:
            keys, full = self.keys_of[r], self.full_blocks[r]
            while pos < held and pos < filled:
                self._hash(mine[pos], keys[pos] if pos < full else ANON_SLOT)
                pos += 1
        need = -(-tokens // bs) - held
        if need > 0:
            plain = self.plain and not ("insert" in vars(self) or "evict" in vars(self) or "take" in vars(self))
            pos = (self._take_plain if plain else self._take_hooked)(r, mine, need, pos, filled)
        self.unhashed_from[r] = pos
        if self.out.filled_at < 0 and not self.fresh:
            self.out.filled_at = r

    def _take_hooked(self, r: int, mine: list, need: int, pos: int, filled: int) -> int:
        """`need` more slots for request r, each hashed while pos < filled; returns the new pos. take(),
        _drop, _hash, insert and evict inlined where nobody hooked them."""
        keys, full = self.keys_of[r], self.full_blocks[r]
        nxt, prv, refs, slot_key, copies = self.nxt, self.prv, self.refs, self.slot_key, self.copies
        plain_take = not self._hooked("take")
        for _ in range(need):
            # take(): the free queue's head, its old hash dropped (an empty queue or the fresh-slot mark: take's
            # own path)
            slot = nxt[0] if plain_take else 0
            if slot == 0 or slot == FRESH_MARK:
                slot = self.take()
                if slot is None:
                    break  # the pool is held by running requests: cache no more of this one
            else:
                after = nxt[slot]  # (unlinked from the head)
                nxt[0], prv[after] = after, 0
                self.n_free -= 1
                old = slot_key[slot]  # _drop
                slot_key[slot] = EMPTY_SLOT
                if old >= 0:
                    slots = copies[old]
                    slots.remove(slot)
                    if not slots:
                        del copies[old]
                        self.evict(old)
                refs[slot] = 1
            mine.append(slot)
            if pos < filled:
                key = keys[pos] if pos < full else ANON_SLOT  # _hash
                slot_key[slot] = key
                if key >= 0:
                    if key in copies:
                        copies[key].append(slot)
                    else:
                        copies[key] = [slot]
                        self.insert(key)
                pos += 1
        return pos

    def _take_plain(self, r: int, mine: list, need: int, pos: int, filled: int) -> int:
        """_take_hooked where insert, evict and take are this class's own and tracked with no tier below: their
        work done here, in the same order (what most of a long replay's blocks go through)."""
        keys, full = self.keys_of[r], self.full_blocks[r]
        nxt, prv, refs, slot_key, copies = self.nxt, self.prv, self.refs, self.slot_key, self.copies
        owner, born, lifetimes, tenant = self.owner, self.born, self.lifetimes, self.tenants[r]
        evicted_by, evicted_tenant, now, out = self.evicted_by, self.evicted_tenant, self.clock.now, self.out
        taken = 0  # off the queue's head here (take() counts its own)
        for _ in range(need):
            slot = nxt[0]
            if slot == 0 or slot == FRESH_MARK:
                self.n_free -= taken  # (take reads and writes it)
                taken = 0
                slot = self.take()
                if slot is None:
                    break
            else:
                after = nxt[slot]
                nxt[0], prv[after] = after, 0
                taken += 1
                old = slot_key[slot]
                if old >= 0:
                    slots = copies[old]
                    if len(slots) == 1:  # (the slot holds the key: the last copy goes, the key is evicted)
                        del copies[old]
                        evicted_by.append(r)
                        evicted_tenant.append(owner.pop(old))
                        lifetimes.append(now - born.pop(old, now))
                    else:
                        slots.remove(slot)
                slot_key[slot] = EMPTY_SLOT
                refs[slot] = 1
            mine.append(slot)
            if pos < filled:
                key = keys[pos] if pos < full else ANON_SLOT
                slot_key[slot] = key
                if key >= 0:
                    slots = copies.get(key)
                    if slots is None:
                        copies[key] = [slot]
                        owner[key] = tenant
                        if out.filled_at < 0 and len(owner) >= self.capacity:
                            out.filled_at = r
                        born[key] = now
                    else:
                        slots.append(slot)
                pos += 1
        self.n_free -= taken
        return pos

    def end(self, r: int) -> None:
        self.request = r
        refs, slot_key, nxt, prv = self.refs, self.slot_key, self.nxt, self.prv
        first = []  # unhashed: to the head of the free queue, in this order
        self.unhashed_from.pop(r, None)
        freed, tail = 0, prv[0]
        extra = self.extra.pop(r, None)
        held = self.held.pop(r, [])
        for slot in reversed(held) if not extra else [*reversed(held), *extra]:
            refs[slot] -= 1
            if refs[slot] == 0:
                freed += 1
                if slot_key[slot] == EMPTY_SLOT:
                    first.append(slot)
                else:  # _append, the links of the last one closed after the loop
                    nxt[tail], prv[slot] = slot, tail
                    tail = slot
        nxt[tail], prv[0] = 0, tail
        for slot in reversed(first):
            self._push_front(slot)
        self.n_free += freed

    # --- bookkeeping (PrefixCache's, with the tenants as a list; and track's) ----------------------------------
    def insert(self, key: int) -> None:
        self.owner[key] = self.tenants[self.request]
        if self.out.filled_at < 0 and len(self.owner) >= self.capacity:
            self.out.filled_at = self.request
        if self.clock is not None:
            self.born[key] = self.clock.now
            if self.admitted is not None:
                self.admitted(key)

    def evict(self, key: int) -> None:
        """Counted in `out` by flush_evictions, all at once: a numpy element's += per eviction costs more than
        the rest of an eviction."""
        self.evicted_by.append(self.request)
        self.evicted_tenant.append(self.owner.pop(key))
        if self.clock is not None:
            now = self.clock.now
            self.lifetimes.append(now - self.born.pop(key, now))
            if self.left is not None:
                self.left(key)

    def flush_evictions(self) -> None:
        """Add the evictions logged since the last flush to `out` (per request, and evictor × victim tenants)."""
        if self.evicted_by:
            rows = np.array(self.evicted_by, dtype=np.int64)
            victims = np.array(self.evicted_tenant, dtype=np.int64)
            np.add.at(self.out.evictions, rows, 1)
            np.add.at(self.out.evict_matrix, (np.asarray(self.tenants, dtype=np.int64)[rows], victims), 1)
            self.evicted_by.clear()
            self.evicted_tenant.clear()
