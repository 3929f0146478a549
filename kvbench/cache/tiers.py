"""KV tiers below HBM: host DRAM and local SSD per instance, and a global KV store shared by every instance
(Mooncake Store / LMCache style).

HBM is the prefix cache of a `sim` policy (its reference class, driven request by request). With write-back a
block reaches DRAM when HBM evicts it, and SSD when DRAM evicts it; with write-through every block HBM admits
is also written to DRAM at once (more traffic, nothing lost on eviction).

The global store is not a victim cache: with `put_on="prefill"` (the default, as Mooncake and LMCache do) an
instance puts every block its HBM admits into the store at once, so KV that still sits in one instance's HBM
is already visible to all the others; with `put_on="evict"` a block is put only when it leaves the instance
(evicted from its lowest local tier, or from HBM when it has none). HBM admits a request's blocks when it is
scheduled (engine.py's approximation of "once computed"), so a put on prefill is visible from that moment.
The store has its own capacity and its own eviction policy (LRU or FIFO over block keys). After the HBM prefix,
the blocks that follow are looked up in the instance's own DRAM, then SSD, then the store; the ones found are
loaded (costed at the tier's bandwidth) instead of computed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvbench.errors import KvbenchError

STORE_POLICIES = ("lru", "fifo")  # eviction policies of the global store
STORE_PUTS = ("prefill", "evict")  # when an instance puts a block into the global store


def check_store_options(policy: str, put_on: str) -> None:
    """The global store's eviction policy and put moment are among the supported ones (else a clear error)."""
    if policy not in STORE_POLICIES:
        raise KvbenchError(
            f"--pool-policy {policy!r}: the global store supports {', '.join(STORE_POLICIES)} "
            "(the other sim policies are prefix-cache policies, driven request by request, not block stores)"
        )
    if put_on not in STORE_PUTS:
        raise KvbenchError(f"--pool-put {put_on!r}: choose from {', '.join(STORE_PUTS)}")


@dataclass
class Tier:
    """One instance's DRAM or SSD: a block-key LRU."""

    name: str
    capacity: int  # blocks; 0 = the tier is off
    bandwidth: float  # bytes/s for loads into HBM
    blocks: OrderedDict = field(default_factory=OrderedDict)  # key -> None, least recent first
    written: int = 0  # blocks written into this tier
    loaded: int = 0  # blocks loaded from this tier into HBM
    evictions: int = 0  # blocks dropped to make room

    def __contains__(self, key: int) -> bool:
        return key in self.blocks

    def touch(self, key: int) -> None:
        """A block was used: it becomes the most recent."""
        self.blocks.move_to_end(key)

    def put(self, key: int) -> int | None:
        """Store `key`; returns the key it evicted to make room, if any (the key itself when the tier is off)."""
        if self.capacity <= 0:
            return key
        if key in self.blocks:
            self.touch(key)
            return None
        self.written += 1
        self.blocks[key] = None
        if len(self.blocks) > self.capacity:
            self.evictions += 1
            return self.blocks.popitem(last=False)[0]
        return None


@dataclass
class GlobalStore(Tier):
    """The store every instance shares. LRU: a lookup hit or a repeated put makes a block the most recent;
    FIFO: blocks leave in the order they were first put, whatever uses them since."""

    policy: str = "lru"
    put_on: str = "prefill"

    def __post_init__(self):
        check_store_options(self.policy, self.put_on)

    def touch(self, key: int) -> None:
        if self.policy == "lru":
            self.blocks.move_to_end(key)

    def summary(self, kv_bytes_block: float) -> dict:
        return {
            "policy": self.policy,
            "put_on": self.put_on,
            "capacity_blocks": self.capacity,
            "bandwidth_gbps": self.bandwidth / 1e9,
            "resident_blocks": len(self.blocks),
            "written_blocks": self.written,
            "loaded_blocks": self.loaded,
            "evicted_blocks": self.evictions,
            "written_bytes": self.written * kv_bytes_block,
        }


class TierStack:
    """DRAM and SSD of one instance, above an optional global store shared with the other instances."""

    def __init__(self, dram: Tier, ssd: Tier, store: GlobalStore | None, write_through: bool):
        self.dram, self.ssd, self.write_through = dram, ssd, write_through
        self.store = store if store is not None and store.capacity > 0 else None
        self.local = [t for t in (dram, ssd) if t.capacity > 0]
        # the lookup order below HBM: this instance's own tiers first, the shared store last
        self.lower = self.local + ([self.store] if self.store else [])

    def admitted(self, key: int) -> None:
        """HBM admitted a block (computed or loaded)."""
        if self.write_through and self.dram.capacity > 0:
            self._spill(self.dram.put(key), level=0)
        if self.store and self.store.put_on == "prefill":
            # write-through to the store; a block loaded from it is already there and only counts as a use
            self.store.put(key)

    def evicted(self, key: int) -> None:
        """HBM evicted a block: write-back keeps it one tier down (write-through already has it there)."""
        if self.write_through and key in self.dram:
            return
        if self.local:
            self._spill(self.local[0].put(key), level=0)
        else:
            self._left(key)

    def _spill(self, key: int | None, level: int) -> None:
        """`key` fell out of self.local[level]: keep it in the next local tier, or let it leave the instance."""
        while key is not None and level + 1 < len(self.local):
            level += 1
            key = self.local[level].put(key)
        if key is not None:
            self._left(key)

    def _left(self, key: int) -> None:
        """A block left this instance entirely; put-on-evict stores it now (put-on-prefill stored it before)."""
        if self.store and self.store.put_on == "evict":
            self.store.put(key)

    def find(self, keys: list[int], start: int, stop: int) -> list[Tier]:
        """The tier of each block keys[start:stop] found contiguously below HBM (stops at the first miss)."""
        found = []
        for pos in range(start, stop):
            tier = next((t for t in self.lower if keys[pos] in t), None)
            if tier is None:
                break
            tier.touch(keys[pos])
            tier.loaded += 1
            found.append(tier)
        return found
