"""The tiered block store: which block key sits in which slot of which tier, and what data each request
makes move.

The bookkeeping is the simulators' own: the HBM tier is a `sim` policy's reference cache (begin/end per
request, unchanged), the tiers below are engine-sim's `TierStack` (write-back or write-through, DRAM → SSD
spills, contiguous lookup after the HBM prefix). This module only adds slots and data: every time a policy
inserts or evicts a key, or a lower tier stores or drops one, the key gets or gives back a slot, and the event
is logged. After the request's lookup the log says which slots must be filled and from where.

Slots are handed out first-freed first-reused, from a pool `slack` slots larger than the tier's capacity. A
slot freed during a request is therefore never reused by the same request, so every slot that held data when
the request began still holds it until the request's moves are done: the moves can be batched in any order
(loads, then compute, then write-backs) without one overwriting another's source.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvbench.cache.tiers import Tier, TierStack

HBM = "hbm"


class SlotMap:
    def __init__(self, capacity: int, slack: int):
        self.free = deque(range(capacity + slack))
        self.slot: dict[int, int] = {}

    @property
    def physical(self) -> int:
        return len(self.free) + len(self.slot)

    def take(self, key: int) -> int:
        s = self.slot[key] = self.free.popleft()
        return s

    def release(self, key: int) -> int:
        s = self.slot.pop(key)
        self.free.append(s)
        return s


@dataclass
class Event:
    tier: str
    key: int
    slot: int
    arrived: bool  # True: the key was stored in this slot; False: it left it


class SlottedTier(Tier):
    """engine-sim's LRU tier, with a slot for each key it holds and a log of what came and went."""

    def __init__(self, name: str, capacity: int, slack: int, log: list):
        super().__init__(name, capacity, 0.0)
        self.slots = SlotMap(capacity, slack) if capacity > 0 else None
        self.log = log

    def put(self, key: int) -> int | None:
        had = key in self.blocks
        victim = super().put(key)
        if self.capacity <= 0 or had:
            return victim
        if victim is not None:
            self.log.append(Event(self.name, victim, self.slots.release(victim), False))
        self.log.append(Event(self.name, key, self.slots.take(key), True))
        return victim


@dataclass
class Plan:
    """The data a request moves. A source is (tier, slot): where the block's data was when the request began
    (or, below HBM, was written earlier in this request's plan)."""

    table: list[int | None] = field(default_factory=list)  # HBM slot per prompt block; None: not kept (scratch)
    loads: list[tuple[int, tuple[str, int]]] = field(default_factory=list)  # (position, source) found below HBM
    refresh: list[tuple[int, tuple[str, int]]] = field(default_factory=list)  # (new HBM slot, source): a hit
    # block the admission evicted and took back, whose data must follow it
    produce: dict[int, int] = field(default_factory=dict)  # key -> HBM slot it is computed (or filled) in
    writes: dict[str, list[tuple[int, int, tuple[str, int]]]] = field(default_factory=dict)  # tier -> copies
    found: list[str] = field(default_factory=list)  # tier of each block found below HBM after the prefix


class BlockStore:
    def __init__(self, cache, capacity: int, dram: int, ssd: int, write_through: bool, slack: int):
        self.cache, self.log = cache, []
        self._kv_tokens = None  # (per request: tokens of KV an engine computes, for pools that hold them all)
        self.hbm = SlotMap(capacity, slack)
        self.dram = SlottedTier("dram", dram, 2 * slack, self.log)
        self.ssd = SlottedTier("ssd", ssd, 2 * slack, self.log)
        self.tiers = TierStack(self.dram, self.ssd, None, write_through)
        self.lower = {t.name: t for t in (self.dram, self.ssd)}
        insert, evict = cache.insert, cache.evict

        def inserted(key):
            insert(key)
            self.log.append(Event(HBM, key, self.hbm.take(key), True))
            self.tiers.admitted(key)

        def evicted(key):
            evict(key)
            self.log.append(Event(HBM, key, self.hbm.release(key), False))
            self.tiers.evicted(key)

        cache.insert, cache.evict = inserted, evicted

    def begin(self, r: int, keys: list[int], max_hit: int) -> tuple[int, Plan]:
        """Run request r's lookup and admission through the policy and the tiers; returns its HBM hit blocks
        and the moves that make the store's data match its bookkeeping. The tiers below are searched before
        the admission evicts anything into them, as an engine looks up its offload store before it allocates:
        a request never "finds" below HBM a block that it pushed there itself."""
        self.log.clear()
        prefix = self.cache.lookup(r)
        found = [t.name for t in self.tiers.find(keys, prefix, max_hit)] if self.tiers.lower else []
        hit_slots = [self.hbm.slot[k] for k in keys[:prefix]]  # intact all request, even if evicted (FIFO)
        hit = self.cache.begin(r)
        assert hit == prefix, "the policy's lookup disagrees with its contains()"
        return hit, self._plan(keys, hit_slots, found)

    def end(self, r: int) -> None:
        if hasattr(self.cache, "grow"):  # vLLM's pool holds the blocks of generated tokens too, until the end
            if self._kv_tokens is None:
                self._kv_tokens = self.cache.trace.kv_tokens()
            self.cache.grow(r, int(self._kv_tokens[r]))
        self.cache.end(r)

    def _slots(self) -> dict[str, dict[int, int]]:
        return {
            HBM: self.hbm.slot,
            **{name: t.slots.slot if t.slots else {} for name, t in self.lower.items()},
        }

    def _plan(self, keys: list[int], hit_slots: list[int], found: list[str]) -> Plan:
        first_left: dict[int, tuple[str, int]] = {}  # key -> where it was when the request began, if it moved
        seen: set[int] = set()
        fresh: dict[str, dict[int, int]] = {HBM: {}, "dram": {}, "ssd": {}}  # arrivals still there
        for ev in self.log:
            if ev.key not in seen:
                seen.add(ev.key)
                if not ev.arrived:
                    first_left[ev.key] = (ev.tier, ev.slot)
            if ev.arrived:
                fresh[ev.tier][ev.key] = ev.slot
        plan = Plan(found=found)

        def origin(key):
            if key in first_left:
                return first_left[key]
            for name, where in self._slots().items():
                if key in where and key not in fresh[name]:
                    return (name, where[key])
            return None

        hit, reach = len(hit_slots), len(hit_slots) + len(found)
        plan.table = hit_slots + [fresh[HBM].get(k) for k in keys[hit:]]
        plan.loads = [(pos, origin(keys[pos])) for pos in range(hit, reach)]
        for pos, key in enumerate(keys):
            slot = fresh[HBM].get(key)
            if slot is None:
                continue
            if pos < hit:
                plan.refresh.append((slot, origin(key)))
            elif pos >= reach:
                plan.produce[key] = slot
            # between: loaded straight into this slot (plan.table)
        for name in ("ssd", "dram"):
            copies = []
            for key, slot in fresh[name].items():
                if key not in self.lower[name].blocks:
                    continue  # passed through this tier during the request: nothing to write
                src = origin(key)
                if src is None:  # new in this request: copy it down from HBM once computed
                    src = (HBM, fresh[HBM][key])
                copies.append((key, slot, src))
            if copies:
                plan.writes[name] = copies
        return plan
