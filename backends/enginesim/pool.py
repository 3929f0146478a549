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
(tests/unit/enginesim/test_quick_pool.py drives both with the same calls and compares their whole state, and
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
    def lookup(self, r: int) -> int:
        keys, cap = self.keys_of[r], int(self.trace.max_hit[r])
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
        hit = self.lookup(r)
        refs, copies = self.refs, self.copies
        evictable = [refs[copies[key][0]] for key in self.keys_of[r][:hit]].count(0)
        return evictable + max(0, -(-tokens // self.bs) - hit)

    # --- a request's life ---------------------------------------------------------------------------------
    def begin(self, r: int, prompt_slots: bool = True) -> int:
        self.request = r
        keys, cap = self.keys_of[r], int(self.trace.max_hit[r])
        copies, refs = self.copies, self.refs
        hit = 0
        while hit < cap and keys[hit] in copies:
            hit += 1
        self.out.hit_blocks[r] = hit
        mine = self.held[r] = []
        self.unhashed_from[r] = hit
        on_hit = self.on_hit if self._hooked("on_hit") or type(self).on_hit is not PrefixCache.on_hit else None
        for pos in range(hit):
            key = keys[pos]
            if on_hit is not None:
                on_hit(key, pos)
            slot = copies[key][0]
            if refs[slot] == 0:
                self._unlink(slot)
                self.n_free -= 1
            refs[slot] += 1
            mine.append(slot)
        self.grow(r, int(self.trace.input_tokens[r]) if prompt_slots else 0)
        return hit

    def grow(self, r: int, tokens: int) -> None:
        self.request = r
        mine, keys, full, bs = self.held[r], self.keys_of[r], self.full_blocks[r], self.bs
        pos = self.unhashed_from[r]
        while pos < len(mine) and (pos + 1) * bs <= tokens:
            self._hash(mine[pos], keys[pos] if pos < full else ANON_SLOT)
            pos += 1
        if len(mine) * bs < tokens:
            nxt, prv, refs, slot_key, copies = self.nxt, self.prv, self.refs, self.slot_key, self.copies
            plain_take = not self._hooked("take")
            while len(mine) * bs < tokens:
                # take(): the free queue's head, its old hash dropped (an empty queue or the fresh-slot mark:
                # take's own path)
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
                if (pos + 1) * bs <= tokens:
                    key = keys[pos] if pos < full else ANON_SLOT  # _hash
                    slot_key[slot] = key
                    if key >= 0:
                        if key in copies:
                            copies[key].append(slot)
                        else:
                            copies[key] = [slot]
                            self.insert(key)
                    pos += 1
        self.unhashed_from[r] = pos
        if self.out.filled_at < 0 and not self.fresh:
            self.out.filled_at = r

    def end(self, r: int) -> None:
        self.request = r
        refs, slot_key, append = self.refs, self.slot_key, self._append
        first = []  # unhashed: to the head of the free queue, in this order
        self.unhashed_from.pop(r, None)
        freed = 0
        for slot in [*reversed(self.held.pop(r, [])), *self.extra.pop(r, [])]:
            refs[slot] -= 1
            if refs[slot] == 0:
                freed += 1
                if slot_key[slot] == EMPTY_SLOT:
                    first.append(slot)
                else:
                    append(slot)
        for slot in reversed(first):
            self._push_front(slot)
        self.n_free += freed

    # --- bookkeeping (PrefixCache's, with the tenants as a list) ----------------------------------------------
    def insert(self, key: int) -> None:
        self.owner[key] = self.tenants[self.request]
        if self.out.filled_at < 0 and len(self.owner) >= self.capacity:
            self.out.filled_at = self.request

    def evict(self, key: int) -> None:
        """Counted in `out` by flush_evictions, all at once: a numpy element's += per eviction costs more than
        the rest of an eviction."""
        self.evicted_by.append(self.request)
        self.evicted_tenant.append(self.owner.pop(key))

    def flush_evictions(self) -> None:
        """Add the evictions logged since the last flush to `out` (per request, and evictor × victim tenants)."""
        if self.evicted_by:
            rows = np.array(self.evicted_by, dtype=np.int64)
            victims = np.array(self.evicted_tenant, dtype=np.int64)
            np.add.at(self.out.evictions, rows, 1)
            np.add.at(self.out.evict_matrix, (np.asarray(self.tenants, dtype=np.int64)[rows], victims), 1)
            self.evicted_by.clear()
            self.evicted_tenant.clear()
